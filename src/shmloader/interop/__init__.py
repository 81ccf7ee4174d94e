"""torch where torch is in use: its types, its samplers, pinned memory."""
