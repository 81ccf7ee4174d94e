"""An epoch's iterators (in the consumer's process or with workers), their plan and resume."""
