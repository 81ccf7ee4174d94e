"""The operating system's side: shared-memory segments, descriptors kept from forks, and the
typed wrapper over the C helper (atomic slot flags, the parent-death signal).
"""
