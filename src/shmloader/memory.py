"""How much shared memory a ring may take now, and which limit binds.

A ring's pages are charged to the memory cgroup of the process that reserves them
(memfd and /dev/shm alike), they come out of the machine's memory, and a ring kept in
/dev/shm (the ``posix`` backend) must also fit that tmpfs. :func:`budget` reads all three:

- the machine: ``MemAvailable`` from /proc/meminfo;
- the cgroup: the least headroom (limit minus the memory in use that cannot be reclaimed)
  over this process's memory cgroup and its ancestors, cgroup v2 (``memory.max``,
  ``memory.current``) or v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``);
- /dev/shm's free space (``posix`` only).

Reserving past a cgroup's limit does not fail cleanly: the kernel's OOM killer takes
the largest process in the cgroup (often the consumer). So a ring is reserved only
when the budget has room for it (:mod:`shmloader.ring`), and a loader's default bound
is half of the budget (:mod:`shmloader.leases`).

This module imports nothing from the package: the ring, the leases and doctor use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 2**60  # v1 writes "no limit" as a page-rounded LONG_MAX (9223372036854771712)
SHM_DIR = "/dev/shm"


def mib(n: float) -> str:
    """``n`` bytes as MiB with one decimal, for messages."""
    return f"{n / 2**20:.1f} MiB"


# --- the machine ----------------------------------------------------------------------------


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The machine's ``MemAvailable`` in bytes, or None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes in /dev/shm, or None where it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# --- the cgroup -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupLimit:
    """The memory limit of one cgroup (this process's or an ancestor's)."""

    version: int  # 1 or 2
    path: str  # the cgroup, as /proc/self/cgroup names it ("/" for the root)
    limit: int  # bytes
    usage: int  # bytes charged now (v1 usage_in_bytes, v2 memory.current)
    reclaimable: int  # inactive file cache in that usage, which the kernel frees first

    @property
    def headroom(self) -> int:
        """Bytes this cgroup can still be charged before its limit bites."""
        return max(0, self.limit - max(0, self.usage - self.reclaimable))

    def describe(self) -> str:
        """E.g. ``cgroup v2 /docker/ab: memory.max 512.0 MiB, 430.2 MiB in use``."""
        knob = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        return (
            f"cgroup v{self.version} {self.path}: {knob} {mib(self.limit)}, "
            f"{mib(self.usage - self.reclaimable)} in use"
        )


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _own_cgroups(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v1 memory cgroup path, v2 unified path) of this process, None where absent."""
    v1 = v2 = None
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _ancestors(path: str) -> list[str]:
    """``path`` and each of its parents up to "/", the cgroup's own first."""
    out = []
    path = "/" + path.strip("/")
    while True:
        out.append(path)
        if path == "/":
            return out
        path = os.path.dirname(path)


def cgroup_v2_limit(root: str, path: str) -> CgroupLimit | None:
    """The tightest ``memory.max`` over cgroup ``path`` (unified hierarchy mounted at
    ``root``) and its ancestors: the one with the least headroom; None where none is set."""
    tightest = None
    for cg in _ancestors(path):
        d = os.path.join(root, cg.lstrip("/"))
        limit = _read_int(os.path.join(d, "memory.max"))
        if limit is None:  # "max", absent (the root has none) or unreadable
            continue
        usage = _read_int(os.path.join(d, "memory.current")) or 0
        found = CgroupLimit(2, cg, limit, usage, _stat_value(os.path.join(d, "memory.stat"), "inactive_file"))
        if tightest is None or found.headroom < tightest.headroom:
            tightest = found
    return tightest


def cgroup_v1_limit(root: str, path: str) -> CgroupLimit | None:
    """The tightest ``memory.limit_in_bytes`` over cgroup ``path`` (the v1 memory
    controller mounted at ``root``) and its ancestors; None where none is set. (A
    parent's limit binds its children: memory.stat's ``hierarchical_memory_limit``.)"""
    tightest = None
    for cg in _ancestors(path):
        d = os.path.join(root, cg.lstrip("/"))
        limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
        if limit is None:
            continue
        usage = _read_int(os.path.join(d, "memory.usage_in_bytes")) or 0
        stat = os.path.join(d, "memory.stat")
        found = CgroupLimit(1, cg, limit, usage, _stat_value(stat, "total_inactive_file"))
        if tightest is None or found.headroom < tightest.headroom:
            tightest = found
    return tightest


def cgroup_limit(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> CgroupLimit | None:
    """This process's binding cgroup memory limit (v1 memory controller where it is
    mounted, else v2), or None where no limit applies or none can be read."""
    v1, v2 = _own_cgroups(proc_cgroup)
    v1_root = os.path.join(root, "memory")
    if v1 is not None and os.path.isdir(v1_root):
        return cgroup_v1_limit(v1_root, v1)
    if v2 is not None:
        return cgroup_v2_limit(root, v2)
    return None


# --- the budget -----------------------------------------------------------------------------

CGROUP, MACHINE, SHM = "cgroup", "machine", "/dev/shm"


@dataclass(frozen=True)
class Budget:
    """What a backend can give now (``bytes``) and the limit that binds (``limit``: one of
    ``"cgroup"``, ``"machine"``, ``"/dev/shm"``, or None where nothing could be read)."""

    backend: str
    bytes: int | None
    limit: str | None
    cgroup: CgroupLimit | None
    mem_available: int | None
    shm_free: int | None

    def cause(self) -> str:
        """The binding limit in words, its figures first: what an error leads with."""
        if self.limit == CGROUP and self.cgroup is not None:
            return f"the memory limit of this process's cgroup ({self.cgroup.describe()})"
        if self.limit == SHM:
            return f"/dev/shm's free space ({mib(self.shm_free or 0)}; the 'posix' backend keeps rings there)"
        if self.limit == MACHINE:
            return f"the machine's available memory (MemAvailable {mib(self.mem_available or 0)})"
        return "the memory available"

    def remedy(self) -> str:
        """What to do when a ring does not fit this budget."""
        fewer = "use a smaller batch_size or fewer num_workers"
        if self.limit == SHM:
            return (
                f"give the container more shared memory (docker run --shm-size=2g or --ipc=host; "
                f"Kubernetes: an emptyDir with medium: Memory on /dev/shm), use "
                f"shm_backend='memfd' (Linux: rings then live outside /dev/shm), or {fewer}"
            )
        if self.limit == CGROUP:
            return (
                f"{fewer}, or raise the container's memory limit (docker run --memory, "
                "Kubernetes resources.limits.memory)"
            )
        return f"{fewer}, or free memory on this machine"


def budget(backend: str) -> Budget:
    """The bytes a ring of ``backend`` (``"memfd"`` or ``"posix"``) can take now: the
    least of the machine's available memory, the cgroup's headroom and (posix) /dev/shm's
    free space, with the limit that binds."""
    cg = cgroup_limit()
    avail = mem_available()
    shm = shm_free_bytes() if backend == "posix" else None
    candidates = []
    if cg is not None:
        candidates.append((cg.headroom, CGROUP))
    if avail is not None:
        candidates.append((avail, MACHINE))
    if shm is not None:
        candidates.append((shm, SHM))
    if not candidates:
        return Budget(backend, None, None, cg, avail, shm)
    size, limit = min(candidates)
    return Budget(backend, size, limit, cg, avail, shm)
