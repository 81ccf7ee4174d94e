"""The ring: one POSIX shared-memory segment cut into fixed-size slots.

Layout of the segment (all offsets from its start)::

    [states: uint32 x num_slots][headers: int64 x 8 x num_slots] (padded to a page; wire.SlotHeader)
    [slot 0 data][slot 1 data]...                                  (each padded to 64 bytes)

The segment is created with a random name, ``O_EXCL`` and mode 0600, then unlinked at
once: no name is ever left in /dev/shm, whatever happens to the processes, and the
memory is freed by the kernel when the last descriptor and mapping are gone. Space is
reserved with ``posix_fallocate`` so that a too-small /dev/shm is an error here, not a
SIGBUS on some later write.
"""

from __future__ import annotations

import errno
import os
import secrets
from multiprocessing import reduction
from typing import Any

import numpy as np
import posix_ipc

from shmloader import fdguard
from shmloader._slots import Mapping, StateArray
from shmloader.errors import ShmSpaceError
from shmloader.wire import HEADER_WORDS  # the slot header's words (see wire.SlotHeader)

PAGE_BYTES = 4096
SLOT_ALIGN_BYTES = 64  # slots start on cache lines: no false sharing between workers,
# and a ring of tiny batches does not spend a page on each
_NAME_ATTEMPTS = 16
_SHM_DIR = "/dev/shm"


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, or None where it cannot be read."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _control_bytes(num_slots: int) -> int:
    return _round_up(num_slots * (4 + 8 * HEADER_WORDS), PAGE_BYTES)


def ring_bytes(num_slots: int, slot_bytes: int) -> int:
    """Size of the segment of a ring of ``num_slots`` slots of ``slot_bytes``."""
    return _round_up(
        _control_bytes(num_slots) + num_slots * _round_up(slot_bytes, SLOT_ALIGN_BYTES), PAGE_BYTES
    )


class Ring:
    """A shared-memory ring of ``num_slots`` slots of ``slot_bytes`` each.

    Create one with :meth:`create`. Pickling a ring (only while a worker process is
    being started) passes a duplicate of its descriptor; the worker maps the same memory.
    """

    def __init__(self, fd: int, num_slots: int, slot_bytes: int, *, populate: bool) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.slot_stride = _round_up(slot_bytes, SLOT_ALIGN_BYTES)
        self.control_bytes = _control_bytes(num_slots)
        self.total_bytes = ring_bytes(num_slots, slot_bytes)
        self._fd: int | None = fd
        self.mapping = Mapping(fd, self.total_bytes, populate=populate)
        self.states = StateArray(self.mapping, 0, num_slots)
        headers_off = _round_up(4 * num_slots, 8)
        self.headers = np.frombuffer(
            self.mapping.buffer(headers_off, 8 * HEADER_WORDS * num_slots), dtype=np.int64
        ).reshape(num_slots, HEADER_WORDS)
        # One buffer object per slot, made once: a consumer's batch roots are fresh numpy
        # arrays over these (see loader), a worker's writes go through slot_array().
        self._slot_buffers = [
            self.mapping.buffer(self.slot_offset(i), self.slot_bytes) for i in range(num_slots)
        ]
        self._slot_arrays: list[np.ndarray | None] = [None] * num_slots
        self.lease_table: Any = None  # the consumer's slot leases (leases.lease)

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int, *, populate: bool = False) -> Ring:
        """Create, reserve, unlink and map a new ring; ``populate`` pre-faults the mapping
        (for a writer about to fill it).

        Raises :class:`ShmSpaceError` when /dev/shm cannot hold it.
        """
        if num_slots < 1:
            raise ValueError(f"a ring needs at least one slot, got num_slots={num_slots}")
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        total = ring_bytes(num_slots, slot_bytes)
        fd = _create_unlinked_segment()
        try:
            _reserve(fd, total, num_slots, slot_bytes)
            # The consumer only reads slots: its pages fault in on first use, and pre-faulting
            # them all here would delay the batch that sized the ring (66 ms for 92 MiB).
            ring = cls(fd, num_slots, slot_bytes, populate=populate)
        except BaseException:
            os.close(fd)
            raise
        fdguard.register(ring, fd, closer="close_fd")
        return ring

    def slot_offset(self, index: int) -> int:
        """Byte offset of slot ``index``'s data in the segment."""
        return self.control_bytes + index * self.slot_stride

    def slot_buffer(self, index: int) -> Any:
        """The (cached) buffer object over slot ``index``'s data."""
        return self._slot_buffers[index]

    def slot_array(self, index: int) -> np.ndarray:
        """A cached uint8 array over slot ``index``'s data, for writers."""
        arr = self._slot_arrays[index]
        if arr is None:
            arr = self._slot_arrays[index] = np.frombuffer(self._slot_buffers[index], np.uint8)
        return arr

    def contains(self, array: np.ndarray) -> bool:
        """True when ``array``'s memory lies inside this ring's mapping."""
        start = array.__array_interface__["data"][0]
        base = self.mapping.address
        return base <= start < base + self.mapping.size

    @property
    def fd(self) -> int | None:
        """The ring's descriptor in this process, or None once closed."""
        return self._fd

    def close_fd(self) -> None:
        """Close the descriptor. The memory stays mapped until nothing refers to it."""
        if self._fd is not None:
            fdguard.unregister(self._fd)
            os.close(self._fd)
            self._fd = None

    def __reduce__(self) -> tuple[Any, ...]:
        if self._fd is None:
            raise RuntimeError("this ring's descriptor is closed; it cannot be sent to a worker")
        # DupFd hands the descriptor to the process being started (spawn: inherited by
        # number; forkserver: sent over the server's socket). Only valid during start().
        return (_attach, (reduction.DupFd(self._fd), self.num_slots, self.slot_bytes))

    def __del__(self) -> None:
        try:
            self.close_fd()
        except OSError:
            pass


def _attach(dup: Any, num_slots: int, slot_bytes: int) -> Ring:
    """Map a ring in a worker from a descriptor passed at process start."""
    return attach_fd(dup.detach(), num_slots, slot_bytes)


def attach_fd(fd: int, num_slots: int, slot_bytes: int, *, populate: bool = False) -> Ring:
    """Map a ring from a descriptor this process received, and close the descriptor.
    ``populate`` pre-faults the whole mapping. Workers do not: pages are mapped per
    process (~2 us a page here), so a worker maps only the slots it writes, on its first
    write into each (it writes into its own share of the slots first: see
    multiprocess._claim_slot); the consumer's reads fault pages in 16 at a time."""
    try:
        ring = Ring(fd, num_slots, slot_bytes, populate=populate)
    except BaseException:
        os.close(fd)
        raise
    ring.close_fd()  # the mapping is all this process needs
    return ring


def _create_unlinked_segment() -> int:
    """Create a new segment with a fresh random name (O_EXCL, 0600) and unlink it at once."""
    for _ in range(_NAME_ATTEMPTS):
        name = f"/shmloader-{os.getpid()}-{secrets.token_hex(8)}"
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


def _reserve(fd: int, total: int, num_slots: int, slot_bytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = shm_free_bytes()
        free_text = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
        raise ShmSpaceError(
            f"/dev/shm cannot hold the loader's shared-memory ring: it needs {total} bytes "
            f"({total / 2**20:.1f} MiB: {num_slots} slots of {slot_bytes} bytes) and has "
            f"{free_text}. Give the container more shared memory (docker run --shm-size=2g "
            "or --ipc=host), or ask for a smaller ring with a lower num_slots, "
            "prefetch_factor or num_workers."
        ) from exc
