"""Shared memory of a loader: its rings of slots, their leases, and how big they may grow."""
