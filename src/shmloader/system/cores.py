"""The cores this process may use: the one answer the tuner, the time report and the doctor
share.

Three limits apply, and the smallest counts: the CPUs of this process's affinity mask
(``taskset``, a cpuset), the machine's CPU count where a system has no affinity, and a
container's CPU quota (cgroup v2 ``cpu.max``, or cgroup v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``): a container limited to 2 CPUs on a 64-core host has 64 CPUs in its
affinity mask, and workers beyond 2 only take turns.
"""

from __future__ import annotations

import os

_CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 mounts the cpu controller under one of these names.
_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def usable_cores() -> int:
    """The cores this process may keep busy at once (at least 1): its affinity mask (the
    machine's CPU count where the system has none), bounded by its cgroup's CPU quota
    rounded down (never below 1)."""
    cores = len(affinity_cpus()) or os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def affinity_cpus() -> set[int]:
    """The ids of the CPUs this process may run on; empty where the system has no
    affinity masks (macOS)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set()


def cpu_quota(root: str = _CGROUP_ROOT) -> float | None:
    """The CPUs' worth of time the cgroup quota allows this process (e.g. 2.5), or None
    where there is no quota or it cannot be read. ``root``: where cgroups are mounted."""
    text = _read(os.path.join(root, "cpu.max"))  # cgroup v2: "max 100000" or "200000 100000"
    if text is not None:
        parts = text.split()
        if len(parts) != 2 or parts[0] == "max":
            return None
        return _ratio(parts[0], parts[1])
    for name in _V1_CPU_DIRS:
        quota = _read(os.path.join(root, name, "cpu.cfs_quota_us"))  # -1: no quota
        period = _read(os.path.join(root, name, "cpu.cfs_period_us"))
        if quota is not None and period is not None:
            return _ratio(quota, period)
    return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None
