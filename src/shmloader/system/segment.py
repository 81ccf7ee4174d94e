"""Anonymous shared-memory segments: the two backends that make one, and its reservation.

Neither backend ever gives a segment a name anyone else can open, and the kernel frees
its memory when the last descriptor and mapping are gone, whatever happens to the
processes:

- ``memfd`` (the default on Linux): ``memfd_create`` (close-on-exec), anonymous from
  birth, sealed against shrinking and growing once reserved (:func:`reserve`), so no
  process can cut it under a mapping. Its pages are charged to the process's memory
  cgroup, not to the /dev/shm mount: a 64 MB /dev/shm (Docker's default) limits nothing.
- ``posix``: a file in /dev/shm that never has a name where the kernel allows it (Linux:
  ``O_TMPFILE``), else ``shm_open`` (posix_ipc) with a name that says which process made
  it (``shmloader-PID-RANDOM``), ``O_EXCL`` and mode 0600, unlinked at once; it lives in
  /dev/shm and must fit there. A process killed between ``shm_open`` and the unlink
  leaves an empty file: the first posix segment of every process removes those whose
  maker is dead (:func:`sweep`). Other systems use it, and Linux where ``memfd_create``
  is refused (a seccomp profile: ENOSYS, EPERM), once per process.

A segment is made only after :func:`check_room` found the memory there
(:mod:`shmloader.system.limits`: reserving past a cgroup's limit would wake the OOM killer).
:mod:`shmloader.memory.ring` lays slots out in it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import re
import secrets
import sys
import time
from typing import Any

try:
    import posix_ipc  # the posix backend's shm_open
except ImportError:  # pragma: no cover - a system without it uses memfd only
    posix_ipc = None

from shmloader.errors import ShmBackendError, ShmSpaceError
from shmloader.system import limits as memory

_NAME_ATTEMPTS = 16
_SHM_DIR = "/dev/shm"
NAME_PREFIX = "shmloader-"  # then the pid of the process that made it, "-", 16 hex digits
_OUR_NAME = re.compile(r"shmloader-(\d+)-[0-9a-f]{16}")
# A leftover is swept only this long after it was made: a process of another pid
# namespace sharing /dev/shm (its pid not visible here) is between create and unlink for
# microseconds, never a second.
SWEEP_MIN_AGE_S = 2.0
# O_TMPFILE refused by /dev/shm's filesystem in this process (an old kernel): named
# segments, swept, from then on.
_tmpfile_refused = not (hasattr(os, "O_TMPFILE") and sys.platform.startswith("linux"))
_swept = False

BACKENDS = ("auto", "memfd", "posix")
BACKEND_ENV = "SHMLOADER_SHM_BACKEND"  # what "auto" means, where set
# memfd_create refused in this process (ENOSYS, EPERM from a seccomp profile): "auto"
# then means posix for the rest of the process (a forked child inherits it).
_memfd_refused: OSError | None = None


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, or None where it cannot be read."""
    return memory.shm_free_bytes(_SHM_DIR)


def check_backend(name: Any, what: str = "shm_backend") -> str:
    """``name`` if it is a backend's name, else a ValueError naming ``what`` and the choices."""
    if name not in BACKENDS:
        raise ValueError(
            f"{what} should be one of {', '.join(map(repr, BACKENDS))} (got {name!r}): 'memfd' "
            "keeps rings outside /dev/shm (Linux), 'posix' in /dev/shm (shm_open), 'auto' "
            "picks memfd where the system allows it."
        )
    return name


def resolve_backend(name: str = "auto") -> str:
    """The backend ``name`` stands for in this process: ``"memfd"`` or ``"posix"``.
    ``"auto"`` follows $SHMLOADER_SHM_BACKEND where set, else memfd where this system has
    it and has not refused it, else posix."""
    check_backend(name)
    if name == "auto":
        env = os.environ.get(BACKEND_ENV, "").strip()
        if env:
            name = check_backend(env, f"${BACKEND_ENV}")
    if name == "auto":
        return "memfd" if memfd_usable() else "posix"
    return name


def memfd_usable() -> bool:
    """True where ``memfd_create`` exists and has not been refused in this process."""
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux") and _memfd_refused is None


def memfd_refusal() -> OSError | None:
    """The error ``memfd_create`` was refused with in this process, or None."""
    return _memfd_refused


def small_memfd(name: str) -> int | None:
    """A new close-on-exec memfd labelled ``name``, neither sealable nor reserved (the
    caller sizes it), or None where memfd is not usable here or the system refuses it now.
    A refusal here is not remembered: rings find it out, and fall back, on their own."""
    if not memfd_usable():
        return None
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError:
        return None


def check_usable(backend: str = "auto") -> str:
    """The backend a ring of ``backend`` would use here (``"memfd"`` or ``"posix"``),
    checked now: memfd_create is tried (a refusal is remembered, as a ring's would be) and
    /dev/shm is looked at for posix. Raises :class:`ShmBackendError` naming the cause and
    the remedy where neither can work, so a loader can say so when it is made."""
    kind = resolve_backend(backend)
    if kind == "memfd":
        fd = _open_memfd(explicit=backend == "memfd")
        if fd is not None:
            os.close(fd)
            return "memfd"
    _check_posix()
    return "posix"


def _open_memfd(*, explicit: bool) -> int | None:
    """A new sealable memfd, or None where the system refuses memfd_create (remembered
    for the process: "auto" then means posix); a ShmBackendError instead where memfd was
    asked for by name (``explicit``)."""
    global _memfd_refused
    try:
        # The name is only a label (/proc/PID/fd, /proc/PID/maps): nobody can open a
        # memfd by it. Unique, as the posix names are, so a ring can be told apart.
        name = f"shmloader-{os.getpid()}-{secrets.token_hex(8)}"
        return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as exc:
        refused = exc if isinstance(exc, OSError) else OSError(errno.ENOSYS, str(exc))
        if refused.errno not in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL):
            raise
        _memfd_refused = refused
        if explicit:
            raise ShmBackendError(
                f"memfd_create was refused ({errno.errorcode.get(refused.errno, refused.errno)}: "
                f"{refused.strerror}; a seccomp profile or an old kernel forbids it) and "
                "shm_backend='memfd' was asked for. Use shm_backend='auto' (falls back to "
                "/dev/shm) or 'posix', or allow memfd_create in the container's seccomp profile."
            ) from refused
        return None


def _check_posix() -> None:
    """Raise a ShmBackendError where /dev/shm cannot take a posix segment (absent, read-only)."""
    problem = memory.shm_problem(_SHM_DIR)
    if problem is not None:
        refused = ""
        if _memfd_refused is not None:
            refused = f"memfd_create was refused ({_memfd_refused.strerror}), and "
        raise ShmBackendError(
            f"{refused}{problem}, so the 'posix' shared-memory backend has nowhere to put "
            "the loader's ring. Use shm_backend='memfd' (the default on Linux, which needs no "
            "/dev/shm), or mount a writable tmpfs on /dev/shm (docker run --shm-size=2g or "
            "--ipc=host)."
        )


def create(kind: str, *, explicit: bool) -> tuple[int, str]:
    """A new anonymous segment of backend ``kind``: (descriptor, the backend used). A
    memfd refused by the system falls back to posix (remembered for the process) unless
    memfd was asked for by name (``explicit``)."""
    if kind == "memfd":
        fd = _open_memfd(explicit=explicit)
        if fd is not None:
            return fd, "memfd"
    _check_posix()
    return _create_unlinked_segment(), "posix"


def _create_unlinked_segment() -> int:
    """A new POSIX segment that has no name: made without one where the kernel allows it,
    else with a fresh name (O_EXCL, 0600) unlinked at once."""
    global _swept
    if not _swept:
        _swept = True
        sweep()
    fd = _unnamed_segment()
    if fd is not None:
        return fd
    if posix_ipc is None:
        raise ShmBackendError(
            "the posix shared-memory backend needs the posix_ipc package, which is not "
            "installed: pip install posix_ipc, or use shm_backend='memfd' (Linux)."
        )
    for _ in range(_NAME_ATTEMPTS):
        name = f"/{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            continue  # someone holds this name: never reuse theirs, draw another
        try:
            shm.unlink()
            fd = os.dup(shm.fd)
        finally:
            shm.close_fd()
        return fd
    raise FileExistsError(
        f"could not create a shared-memory segment: {_NAME_ATTEMPTS} random names were all "
        "taken. Something is filling /dev/shm with names; inspect it."
    )


def _unnamed_segment() -> int | None:
    """A file in /dev/shm made without a name (``O_TMPFILE``, mode 0600): no process can
    be killed between its creation and its unlink, since there is none. None where the
    kernel or /dev/shm's filesystem refuses it (remembered for the process)."""
    global _tmpfile_refused
    if _tmpfile_refused:
        return None
    try:
        return os.open(_SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            raise
        _tmpfile_refused = True
        return None


def sweep(min_age_s: float = SWEEP_MIN_AGE_S) -> list[str]:
    """Remove the named segments shmloader left in /dev/shm whose maker is dead (killed
    between creating one and unlinking it): names of this user's made by a pid that no
    longer runs, at least ``min_age_s`` old. Never a live process's (a pid that runs
    again as another process keeps its names until that one ends). The names removed."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return []
    removed = []
    uid, now = os.geteuid(), time.time()
    for name in names:
        found = _OUR_NAME.fullmatch(name)
        if found is None or _alive(int(found.group(1))):
            continue
        path = os.path.join(_SHM_DIR, name)
        try:
            st = os.lstat(path)
            if st.st_uid != uid or now - st.st_mtime < min_age_s:
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's: alive
        return True
    return True


def read_only(fd: int) -> int:
    """A read-only descriptor of the posix segment ``fd``, which is closed: the segment's
    mode becomes 0400, then it is opened again read-only through /proc. A process holding
    only the new descriptor cannot write it, shrink it (a SIGBUS in every reader) or map
    it writable, nor (root aside) open it for writing again through /proc/PID/fd. Where
    there is no /proc, ``fd`` itself (still writable)."""
    os.fchmod(fd, 0o400)
    try:
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return fd
    os.close(fd)
    return ro


def _space_error(budget: memory.Budget, total: int, num_slots: int, slot_bytes: int) -> ShmSpaceError:
    have = "an unknown amount" if budget.bytes is None else memory.mib(budget.bytes)
    return ShmSpaceError(
        f"{memory.sentence(budget.cause())} leaves {have} for the loader's "
        f"shared-memory ring, which needs {total} bytes ({memory.mib(total)}: {num_slots} "
        f"slots of {slot_bytes} bytes, backend {budget.backend!r}). To fix it: {budget.remedy()}; "
        "or ask for a smaller ring with a lower num_slots or prefetch_factor."
    )


def check_room(
    kind: str, total: int, num_slots: int, slot_bytes: int, budget: memory.Budget | None = None
) -> None:
    """Refuse a ring the memory is not there for, before reserving it: past a cgroup's
    limit, posix_fallocate does not fail, the OOM killer ends a process of the cgroup.
    ``budget``: ``memory.budget(kind)`` read just now by the caller (None: read here)."""
    if budget is None:
        budget = memory.budget(kind)
    if budget.bytes is not None and total > budget.bytes:
        raise _space_error(budget, total, num_slots, slot_bytes)


def reserve(
    fd: int, total: int, num_slots: int, slot_bytes: int, kind: str = "posix", *, size: int | None = None
) -> None:
    """Reserve the first ``total`` bytes of the segment (``size``: its whole size, where
    more than that: the rest is reserved by the slots' writers), then seal a memfd."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        # ENOSPC from a memfd is the memory (machine or cgroup), from posix /dev/shm's size.
        budget = memory.budget(kind)
        if kind == "posix" and budget.limit != memory.SHM and budget.shm_free is not None:
            budget = dataclasses.replace(budget, bytes=budget.shm_free, limit=memory.SHM)
        raise _space_error(budget, size or total, num_slots, slot_bytes) from exc
    if kind == "memfd":
        # Sealed at its reserved size: no process holding the descriptor can shrink it
        # under another's mapping (a SIGBUS there), nor grow it, nor remove the seals.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
