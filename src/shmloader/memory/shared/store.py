"""The anonymous segment that holds one shared structure, mapped read-only.

It is written once, by :func:`create`, then sealed (memfd: no process can write, shrink or
grow it again) and mapped read-only: nothing in any process writes its pages, so a forked
child reads the parent's pages and copies none. A :class:`Store` travels to a process
being started (spawn, forkserver: pickled with the process) as its descriptor, through
multiprocessing's own descriptor passing: the child maps the same pages.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import weakref
from multiprocessing import context, reduction
from typing import Any

import numpy as np

import shmloader.memory.shared.layout as L
from shmloader.errors import CorruptDataError, ShmSpaceError
from shmloader.system import limits, segment

# The stores mapped in this process, by token: a segment that arrives twice (two pickles
# through one process start) is mapped once.
_stores: weakref.WeakValueDictionary[str, Store] = weakref.WeakValueDictionary()


class Store:
    """One mapped segment: its descriptor, its read-only mapping, its size, its token, and
    what this process's readers have decoded from it once for all reads (``tables``)."""

    __slots__ = ("__weakref__", "_dtypes", "fd", "heights", "mm", "record_keys", "size", "tables", "token")

    def __init__(self, fd: int, size: int, token: str, *, populate: bool) -> None:
        self.fd = -1  # the caller closes ``fd`` where mapping it fails
        flags = mmap.MAP_SHARED
        if populate and hasattr(mmap, "MAP_POPULATE"):
            # The creator maps every page now: a child's pages are then shared with it
            # (counted once, in nobody's USS) rather than private to the only reader.
            flags |= mmap.MAP_POPULATE
        self.mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        self.fd = fd
        self.size = size
        self.token = token
        self._dtypes: dict[bytes, np.dtype] = {}  # one per dtype description: a few
        # The key tables readers in this process have decoded, by offset (see views).
        self.tables: dict[int, Any] = {}
        # The keys of each key table, by offset, for the C reader (views' _build).
        self.record_keys: dict[int, tuple] = {}
        # How deep containers nest below a node, by offset: measured only where a read of
        # a whole structure ran out of recursion (see nesting).
        self.heights: dict[int, int] = {}

    def dtype(self, description: bytes) -> np.dtype:
        """The dtype a description in this segment names (parsed once)."""
        found = self._dtypes.get(description)
        if found is None:
            try:
                found = L.dtype_from_description(description)
            except Exception as exc:  # any text share() did not write: none is a dtype
                raise CorruptDataError(
                    f"a shared structure's segment is corrupt: {description[:80]!r} is not "
                    f"a dtype ({type(exc).__name__}: {exc})."
                ) from exc
            self._dtypes[description] = found
        return found

    def __del__(self) -> None:
        # The mapping outlives the descriptor where numpy arrays still view it.
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __reduce__(self) -> tuple[Any, ...]:
        if context.get_spawning_popen() is None:
            raise TypeError(
                "a shared structure's segment is pickled only into a process being started "
                "(multiprocessing passes its descriptor); shmloader's views pickle as plain "
                "copies elsewhere, so this pickle was made by hand: pickle the view instead."
            )
        return (_attach, (reduction.DupFd(self.fd), self.size, self.token))


def _attach(dupfd: Any, size: int, token: str) -> Store:
    """Map a segment received with a process start (see :meth:`Store.__reduce__`)."""
    fd = dupfd.detach()
    found = _stores.get(token)
    if found is not None:
        if fd != found.fd:  # (under spawn the same number comes again: it is found's)
            os.close(fd)
        return found
    try:
        store = Store(fd, size, token, populate=False)
    except BaseException:
        os.close(fd)
        raise
    _stores[token] = store
    return store


def create(data: bytes | bytearray, backend: str = "auto") -> Store:
    """A new sealed segment holding ``data``, mapped read-only. A ShmSpaceError naming the
    limit and the remedy where the memory is not there."""
    size = len(data)
    kind = segment.resolve_backend(backend)
    budget = limits.budget(kind)
    if budget.bytes is not None and size > budget.bytes:
        raise _space_error(budget, size)
    fd, kind = segment.create(kind, explicit=backend == "memfd")
    try:
        view = memoryview(data)
        done = 0
        try:
            while done < size:
                done += os.pwrite(fd, view[done:], done)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            raise _space_error(limits.budget(kind), size) from exc
        if kind == "memfd":
            # Sealed as written: no process holding the descriptor (a child it was passed
            # to) can change a byte under another's reads, nor shrink it (a SIGBUS there).
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        else:
            # No seals on /dev/shm: the descriptor every process gets (this one's, a forked
            # child's copy, a spawned child's duplicate) is read-only instead.
            fd = segment.read_only(fd)
        token = secrets.token_hex(8)
        store = Store(fd, size, token, populate=True)
    except BaseException:
        os.close(fd)
        raise
    _stores[token] = store
    return store


def _space_error(budget: limits.Budget, size: int) -> ShmSpaceError:
    have = "an unknown amount" if budget.bytes is None else limits.mib(budget.bytes)
    return ShmSpaceError(
        f"{limits.sentence(budget.cause())} leaves {have} for a shared structure of "
        f"{size} bytes ({limits.mib(size)}, shmloader.share(), backend {budget.backend!r}). "
        "Share a smaller structure (e.g. the paths only, with labels as a numpy array), or "
        "free memory: a shared structure is stored once, outside every process's heap."
    )
