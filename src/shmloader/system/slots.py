"""Typed wrapper over the C helper (``shmloader._native``).

The rest of the package never touches ``lib`` or ``ffi`` directly: it goes through the
functions here, which check every return code and turn failures into exceptions.
"""

from __future__ import annotations

import enum
import errno
import functools
import os
import signal
from typing import Any

from shmloader._native import ffi, lib

# Slot states. A slot moves FREE -> ASSIGNED (consumer picked it for a batch) -> READY
# (worker wrote the batch and published it) -> HELD (consumer handed out views) -> FREE
# (the last view died). Only the owner of the current state moves it on.
FREE = 0
ASSIGNED = 1
READY = 2
HELD = 3

# Whether this build can sleep on a word of shared memory until another process wakes it
# (Linux futexes). Where it cannot, the loader's waits block on sockets instead.
HAS_FUTEX = bool(lib.sl_has_futex())


class Mapping:
    """One shared mapping of a descriptor, unmapped when nothing refers to it any more.

    :attr:`owner` is a buffer over the whole mapping that owns it (the memory is unmapped
    when the owner dies), and every buffer :meth:`buffer` returns is a memoryview of the
    owner: every object reachable from a view (numpy ``.base`` chains included) keeps the
    memory mapped, and it is unmapped as soon as nothing refers to it.
    """

    __slots__ = ("__weakref__", "_ptr", "_view", "owner", "size")

    def __init__(self, fd: int, size: int, *, populate: bool = True) -> None:
        """Map ``size`` bytes of ``fd`` (shared, read-write); ``populate`` pre-faults them."""
        ptr = lib.sl_map(fd, size, 1 if populate else 0)
        if ptr == ffi.NULL:
            err = ffi.errno
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        # The buffer keeps the ffi.gc pointer alive, which unmaps when it dies; weakref
        # callbacks on the owner (pinning's unregister) run before that. The function is
        # bound now: a batch kept in a module global dies at interpreter exit, after this
        # module's globals are gone.
        unmap = lib.sl_unmap
        self.owner = ffi.buffer(ffi.gc(ptr, lambda p: unmap(p, size), size=size), size)
        self._ptr = ptr  # not owning: for addresses and typed pointers
        self._view = memoryview(self.owner)
        self.size = size

    @property
    def address(self) -> int:
        """The start address of the mapping in this process."""
        return int(ffi.cast("uintptr_t", self._ptr))

    def buffer(self, offset: int, length: int) -> memoryview:
        """A writable buffer over ``length`` bytes at ``offset`` (it keeps the mapping)."""
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"range {offset}+{length} is outside the {self.size}-byte mapping")
        return self._view[offset : offset + length]

    def pointer(self, offset: int, ctype: str) -> Any:
        """A ``ctype`` pointer to byte ``offset`` (does not own the mapping: keep this
        object alive while it is used)."""
        return ffi.cast(ctype, ffi.cast("char *", self._ptr) + offset)


class StateArray:
    """The slot-state words of one ring, viewed through the C helper's atomics.

    Its operations are the C functions themselves, bound to the words (no Python frame:
    the consumer calls several per batch):

    - ``load(index)``: the state of slot ``index`` (acquire order);
    - ``store(index, value)``: set it (release order);
    - ``cas(index, expected, desired)``: move it from ``expected`` to ``desired``; 0 (false)
      if it was not ``expected``;
    - ``claim(start, expected, desired)``: claim the first slot at or after ``start``
      (wrapping) in state ``expected``; its index, or -1 if none is;
    - ``count(value)``: how many slots are in state ``value`` now (a snapshot, for
      statistics); ``count_ready()``: how many are READY.
    """

    __slots__ = ("_mapping", "_ptr", "cas", "claim", "count", "count_ready", "load", "store")

    def __init__(self, mapping: Mapping, offset: int, count: int) -> None:
        """View ``count`` 32-bit words at byte ``offset`` (4-aligned) of ``mapping``."""
        if offset % 4:
            raise ValueError(f"state words must be 4-byte aligned, offset {offset} is not")
        self._mapping = mapping  # keeps the memory mapped while the states are in use
        mapping.buffer(offset, 4 * count)  # checks the range
        self._ptr = ptr = mapping.pointer(offset, "uint32_t *")
        partial = functools.partial
        self.load = partial(lib.sl_load, ptr)
        self.store = partial(lib.sl_store, ptr)
        self.cas = partial(lib.sl_cas, ptr)
        self.claim = partial(lib.sl_find_and_claim, ptr, count)
        self.count = partial(lib.sl_count, ptr, count)
        self.count_ready = partial(lib.sl_count, ptr, count, READY)

    def setter(self, index: int, value: int) -> Any:
        """A callable of no arguments that does ``store(index, value)``."""
        return functools.partial(lib.sl_store, self._ptr, index, value)


def send_with_fd(sock: int, data: bytes, fd: int) -> None:
    """Write all of ``data`` to the (blocking) stream socket ``sock``, ``fd`` attached to
    its start."""
    n = send_with_fd_once(sock, data, fd)
    if n < len(data):  # the descriptor went with the first part
        view = memoryview(data)
        while n < len(data):
            n += os.write(sock, view[n:])


def send_with_fd_once(sock: int, data: Any, fd: int) -> int:
    """One write of up to ``len(data)`` bytes (any buffer) to the stream socket ``sock``,
    ``fd`` attached to the first of them; returns the bytes written. On a non-blocking
    socket that is full, raises BlockingIOError (nothing written, the descriptor not
    sent)."""
    buf = ffi.from_buffer(data)
    while True:
        n = lib.sl_send_fd(sock, buf, len(data), fd)
        if n != -errno.EINTR:
            break
    if n < 0:
        raise OSError(-n, f"sending a descriptor failed: {os.strerror(-n)}")
    return n


class Receiver:
    """Reads from a stream socket, collecting any descriptor sent with the bytes (see
    :func:`send_with_fd`)."""

    __slots__ = ("_buf", "_fdp", "_size")

    def __init__(self, size: int) -> None:
        self._size = size
        self._buf = ffi.new("char[]", size)  # reused by every recv()
        self._fdp = ffi.new("int *")

    def recv(self, sock: int) -> tuple[bytes, int]:
        """Block for one read of up to the buffer's size; returns the bytes (empty at EOF)
        and the descriptor that came with them, or -1."""
        n = self._call(sock, self._buf, self._size)
        return ffi.buffer(self._buf, n)[:], self._fdp[0]

    def recv_into(self, sock: int, view: memoryview) -> tuple[int, int]:
        """Block for one read into the writable ``view``; returns the byte count (0 at EOF)
        and the descriptor that came with the bytes, or -1."""
        return self._call(sock, ffi.from_buffer(view, require_writable=True), len(view)), self._fdp[0]

    def _call(self, sock: int, buf: Any, size: int) -> int:
        while True:
            n = lib.sl_recv(sock, buf, size, self._fdp)
            if n != -errno.EINTR:  # EINTR: Python's signal handlers run, then read again
                break
        if n < 0:
            raise OSError(-n, f"reading a socket failed: {os.strerror(-n)}")
        return n


def set_parent_death_signal(signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent thread exits."""
    err = lib.sl_set_pdeathsig(signum)
    if err:
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")


class Wait(enum.IntEnum):
    """How :meth:`FutexWord.wait` ended."""

    WOKEN = 0  # a wake() came (or the kernel woke it for no reason: look again)
    TIMEOUT = 1  # the time given passed
    CHANGED = 2  # the word did not hold the value expected: nothing was waited for
    INTERRUPTED = 3  # a signal came (Python's handlers run as the call returns)


class FutexWord:
    """A 32-bit word of a shared mapping that processes sleep on and wake each other
    through (a futex, shared between processes: never FUTEX_PRIVATE_FLAG). Needs
    :data:`HAS_FUTEX`. The calls release the GIL while they run (cffi's API mode), so a
    thread sleeping here leaves the process's other threads running."""

    __slots__ = ("_mapping", "_ptr")

    def __init__(self, mapping: Mapping, offset: int) -> None:
        """The word at byte ``offset`` (4-aligned) of ``mapping``."""
        if not HAS_FUTEX:
            raise OSError(errno.ENOSYS, "this build of shmloader has no futex (Linux only)")
        if offset % 4:
            raise ValueError(f"a futex word must be 4-byte aligned, offset {offset} is not")
        mapping.buffer(offset, 4)  # checks the range
        self._mapping = mapping  # keeps the memory mapped while the word is used
        self._ptr = mapping.pointer(offset, "uint32_t *")

    def load(self) -> int:
        """The word's value (acquire order)."""
        return lib.sl_load(self._ptr, 0)

    def store(self, value: int) -> None:
        """Set the word (release order); wakes nobody."""
        lib.sl_store(self._ptr, 0, value)

    def wait(self, expected: int, timeout_ns: int = -1) -> Wait:
        """Sleep while the word holds ``expected``, until :meth:`wake` or ``timeout_ns``
        (negative: no limit). The kernel compares and sleeps atomically: a store and wake
        that come first make it return at once (CHANGED)."""
        code = lib.sl_futex_wait(self._ptr, expected, timeout_ns)
        if code < 0:
            raise OSError(-code, f"futex wait failed: {os.strerror(-code)}")
        return Wait(code)

    def wake(self, count: int = 1) -> int:
        """Wake up to ``count`` processes sleeping on the word; how many woke."""
        woke = lib.sl_futex_wake(self._ptr, count)
        if woke < 0:
            raise OSError(-woke, f"futex wake failed: {os.strerror(-woke)}")
        return woke
