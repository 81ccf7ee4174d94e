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
when the budget has room for it (:mod:`shmloader.memory.ring`), and a loader's default bound
is half of the budget (:mod:`shmloader.memory.leases`).

This module imports nothing from the package: the ring, the leases and doctor use it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 2**60  # v1 writes "no limit" as a page-rounded LONG_MAX (9223372036854771712)
SHM_DIR = "/dev/shm"


def mib(n: float) -> str:
    """``n`` bytes as MiB with one decimal for messages (as bytes below 1 MiB)."""
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{int(n)} bytes"


def sentence(text: str) -> str:
    """``text`` (a limit in words) as a sentence's start: capitalized, unless it starts
    with a name (``max_shm_bytes=...``, ``/dev/shm``)."""
    return text if text.startswith(("max_shm_bytes", "/")) else text[0].upper() + text[1:]


def _read(path: str) -> str | None:
    """The text of a small /proc or cgroup file, or None where it cannot be read. (Raw
    reads: a text-mode open() costs more than the read itself, and a budget reads up to
    eight files while a fresh loader waits for its ring.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


# --- the machine ----------------------------------------------------------------------------


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The machine's ``MemAvailable`` in bytes, or None where it cannot be read."""
    text = _read(meminfo)
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (ValueError, IndexError):
                return None
    return None


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes in /dev/shm, or None where it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def shm_size_bytes(path: str = SHM_DIR) -> int | None:
    """/dev/shm's size in bytes (what docker --shm-size sets), or None where it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def shm_problem(path: str = SHM_DIR) -> str | None:
    """Why the posix backend cannot put a segment in /dev/shm here, in words ("there is
    no /dev/shm here", "/dev/shm is mounted read-only"), or None where nothing is wrong
    that can be seen. (Linux only: elsewhere shm_open does not live in /dev/shm.)"""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        st = os.statvfs(path)
    except FileNotFoundError:
        return f"there is no {path} here (nothing is mounted there)"
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return f"{path} is mounted read-only"
    return None


# --- the cgroup -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupLimit:
    """The memory limit of one cgroup (this process's or an ancestor's)."""

    version: int  # 1 or 2
    path: str  # the cgroup, as /proc/self/cgroup names it ("/" for the root)
    limit: int  # bytes
    usage: int  # bytes charged now (v1 usage_in_bytes, v2 memory.current)
    reclaimable: int  # file cache in that usage no process maps: the kernel frees it first
    oom_kills: int = 0  # processes the kernel's OOM killer ended in this cgroup so far

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
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _stat_values(path: str) -> dict[str, int]:
    out = {}
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[name] = int(value)
    return out


def _reclaimable(stat: dict[str, int], prefix: str, mapped_key: str) -> int:
    """File cache the kernel can drop before it OOM-kills: the file LRU lists less the
    pages processes map (their code, which would only be read back). Shared memory
    (memfd, tmpfs) is not on the file lists: it is never counted here."""
    inactive = stat.get(prefix + "inactive_file", 0)
    unmapped = inactive + stat.get(prefix + "active_file", 0) - stat.get(mapped_key, 0)
    return max(inactive, unmapped)


def own_cgroups(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v1 memory cgroup path, v2 unified path) of this process, None where absent."""
    v1 = v2 = None
    text = _read(proc_cgroup)
    if text is None:
        return None, None
    for line in text.splitlines():
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


def _dirs(mount: str, mount_root: str, path: str) -> list[tuple[str, str]]:
    """(cgroup path, its directory) for ``path`` and each ancestor visible under a
    hierarchy mounted at ``mount`` whose root is the cgroup ``mount_root`` (a container
    sees its own cgroup as the mount's root, e.g. /docker/ID bind-mounted on
    /sys/fs/cgroup/memory: the ancestors above it cannot be read from inside)."""
    mount_root = "/" + mount_root.strip("/")
    out = []
    for cg in _ancestors(path):
        if mount_root == "/":
            rel = cg
        elif cg == mount_root or cg.startswith(mount_root + "/"):
            rel = cg[len(mount_root) :]
        else:
            continue
        out.append((cg, os.path.join(mount, rel.lstrip("/"))))
    if not out:  # a path outside the mount (another namespace's view): the mount is ours
        out.append((path, mount))
    return out


def _tightest(version: int, dirs: list[tuple[str, str]]) -> CgroupLimit | None:
    limit_file, usage_file, prefix, mapped_key = (
        ("memory.max", "memory.current", "", "file_mapped")
        if version == 2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_", "total_mapped_file")
    )
    tightest = None
    for cg, d in dirs:
        limit = _read_int(os.path.join(d, limit_file))
        if limit is None:  # "max", no limit, absent (the v2 root has none) or unreadable
            continue
        usage = _read_int(os.path.join(d, usage_file)) or 0
        stat = _stat_values(os.path.join(d, "memory.stat"))
        # v2 memory.events and v1 memory.oom_control both have an "oom_kill N" line.
        events = _stat_values(os.path.join(d, "memory.events" if version == 2 else "memory.oom_control"))
        found = CgroupLimit(
            version, cg, limit, usage, _reclaimable(stat, prefix, mapped_key), events.get("oom_kill", 0)
        )
        if tightest is None or found.headroom < tightest.headroom:
            tightest = found
    return tightest


def cgroup_v2_limit(mount: str, path: str, mount_root: str = "/") -> CgroupLimit | None:
    """The tightest ``memory.max`` over cgroup ``path`` (the unified hierarchy mounted at
    ``mount``, whose root is cgroup ``mount_root``) and its visible ancestors: the one
    with the least headroom; None where none is set."""
    return _tightest(2, _dirs(mount, mount_root, path))


def cgroup_v1_limit(mount: str, path: str, mount_root: str = "/") -> CgroupLimit | None:
    """The tightest ``memory.limit_in_bytes`` over cgroup ``path`` (the v1 memory
    controller mounted at ``mount``) and its visible ancestors; None where none is set.
    (A parent's limit binds its children, as memory.stat's ``hierarchical_memory_limit``
    says; walking up also gives the parent's usage, which its other children share.)"""
    return _tightest(1, _dirs(mount, mount_root, path))


_mounts_seen: dict[tuple[int, str], tuple] = {}  # (pid, mountinfo) -> its answer: mounts
# do not move under a running process, and reading mountinfo is a third of budget()'s time


def _cgroup_mounts(mountinfo: str) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """((mount point, root) of the v1 memory controller, the same of cgroup2), from
    /proc/self/mountinfo; None where absent."""
    if mountinfo != "/proc/self/mountinfo":  # a test's file: read it each time
        return _read_cgroup_mounts(mountinfo)
    key = (os.getpid(), mountinfo)
    if key not in _mounts_seen:
        _mounts_seen.clear()
        _mounts_seen[key] = _read_cgroup_mounts(mountinfo)
    return _mounts_seen[key]


def _read_cgroup_mounts(mountinfo: str) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    v1 = v2 = None
    text = _read(mountinfo)
    if text is None:
        return None, None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3].replace("\\040", " "), fields[4].replace("\\040", " ")
        if tail[0] == "cgroup" and "memory" in tail[2].split(",") and v1 is None:
            v1 = (point, root)
        elif tail[0] == "cgroup2" and v2 is None:
            v2 = (point, root)
    return v1, v2


def cgroup_limit(
    root: str | None = None,
    proc_cgroup: str = "/proc/self/cgroup",
    mountinfo: str = "/proc/self/mountinfo",
) -> CgroupLimit | None:
    """This process's binding cgroup memory limit (v1 memory controller where it is
    mounted, else v2), or None where no limit applies or none can be read. The
    hierarchies are found in ``mountinfo``; ``root`` instead says they are mounted at
    ``root/memory`` (v1) and ``root`` (v2), each rooted at "/" (tests, odd systems)."""
    v1, v2 = own_cgroups(proc_cgroup)
    if root is not None:
        m1 = (os.path.join(root, "memory"), "/") if os.path.isdir(os.path.join(root, "memory")) else None
        m2: tuple[str, str] | None = (root, "/")
    else:
        m1, m2 = _cgroup_mounts(mountinfo)
        if m1 is None and m2 is None:  # no mountinfo: the usual places
            m1 = (os.path.join(CGROUP_ROOT, "memory"), "/")
            m2 = (CGROUP_ROOT, "/")
    if v1 is not None and m1 is not None and os.path.isdir(m1[0]):
        return cgroup_v1_limit(m1[0], v1, m1[1])
    if v2 is not None and m2 is not None:
        return cgroup_v2_limit(m2[0], v2, m2[1])
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
    shm_size: int | None = None

    def cause(self) -> str:
        """The binding limit in words, its figures first: what an error leads with."""
        if self.limit == CGROUP and self.cgroup is not None:
            return f"the memory limit of this process's cgroup ({self.cgroup.describe()})"
        if self.limit == SHM:
            size = "size unknown" if self.shm_size is None else mib(self.shm_size)
            return f"/dev/shm ({size}, {mib(self.shm_free or 0)} free; the 'posix' backend keeps rings there)"
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


MARGIN_FRACTION = 4  # rings leave at least a quarter of what is there to the processes
MARGIN_FLOOR_BYTES = 32 * 2**20  # and, where RAM or a cgroup binds, this beside what the
# workers allocate while they make their next batches (``reserve``)


def ring_room(budget: Budget, reserve: int = 0) -> int | None:
    """Of what ``budget`` says is there, the bytes a new ring may take: all but a margin
    for what the processes allocate after the ring is made. Past a cgroup's limit the
    OOM killer ends a process, so where the machine's memory or a cgroup binds the margin
    is ``reserve`` (the leases': a batch per worker, which holds its samples while it
    collates) plus 32 MiB, or a quarter if that is more; where
    /dev/shm binds, a quarter. None where nothing could be read. (Under a cgroup limit
    the peak is the usage when the ring was made, plus the ring, plus one batch per
    worker: a margin of a quarter alone does not cover that for big batches.)"""
    if budget.bytes is None:
        return None
    margin = budget.bytes // MARGIN_FRACTION
    if budget.limit in (CGROUP, MACHINE):
        margin = max(margin, MARGIN_FLOOR_BYTES + reserve)
    return max(0, budget.bytes - margin)


def budget(backend: str) -> Budget:
    """The bytes a ring of ``backend`` (``"memfd"`` or ``"posix"``) can take now: the
    least of the machine's available memory, the cgroup's headroom and (posix) /dev/shm's
    free space, with the limit that binds."""
    cg = cgroup_limit()
    avail = mem_available()
    shm = shm_free_bytes() if backend == "posix" else None
    shm_size = shm_size_bytes() if backend == "posix" else None
    candidates = []
    if cg is not None:
        candidates.append((cg.headroom, CGROUP))
    if avail is not None:
        candidates.append((avail, MACHINE))
    if shm is not None:
        candidates.append((shm, SHM))
    if not candidates:
        return Budget(backend, None, None, cg, avail, shm, shm_size)
    size, limit = min(candidates)
    return Budget(backend, size, limit, cg, avail, shm, shm_size)
