"""One batch: samples to leaves (collation), their layout in a slot, and the hand-out of views."""
