"""The operating system's side: shared-memory segments, descriptors kept from forks, the
hooks that run at a fork (and their order), the calling process's own settings (CPU
yield, scheduling policy, parent-death signal), and the typed wrapper over the C helper
(atomic slot flags, the parent-death signal's prctl).
"""
