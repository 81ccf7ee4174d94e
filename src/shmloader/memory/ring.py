"""The ring: one shared-memory segment cut into fixed-size slots.

Layout of the segment (all offsets from its start)::

    [states: uint32 x num_slots][headers: int64 x 8 x num_slots] (padded to a page; wire.SlotHeader)
    [slot 0 data][slot 1 data]...                                  (each padded to 64 bytes)

The segment comes from one of two backends (:mod:`shmloader.system.segment`: ``memfd``, the
default on Linux, or ``posix``); neither ever has a name anyone else can open, and the
kernel frees its memory when the last descriptor and mapping are gone.

A ring is made only after checking that the memory is there
(:mod:`shmloader.system.limits`: reserving past a cgroup's limit would wake the OOM killer), and
its pages are reserved before anything writes to them, so running short is an error,
never a SIGBUS or a kill on a later write:

- where the kernel has ``MADV_POPULATE_WRITE`` (Linux 5.14+), a ring is made with only its
  control area reserved (a sparse segment: cheap whatever its size), and each process
  that writes a slot reserves and maps that slot's pages in one call the first time it
  asks for it (:meth:`Ring.slot_array`: workers write their own share of the slots, in
  parallel): the bytes its batch needs (in a memfd, where a writer does not say: the
  batch the slot was sized for, as a page past that cannot SIGBUS there). The kernel
  answers a failure with an error (ENOMEM, EFAULT), which becomes
  :class:`ShmSpaceError`, not a SIGBUS. Slots nothing writes (the reserve for
  batches the consumer holds, in a short epoch) take no memory. Reserving a big ring up
  front keeps the consumer busy before the workers start (a ring is made before they
  fork), and it would move the cost more than save it: mapping a slot already reserved
  costs a worker under half of reserving and mapping it in one call, and reserving it
  costs the consumer most of the rest (benchmarks/HISTORY.md has the figures);
- elsewhere (and for rings page-locked for a GPU, which lock every page at once) the
  whole segment is reserved with ``posix_fallocate`` when it is made.

The descriptor travels to workers the same way for both backends.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from multiprocessing import reduction
from typing import Any

import numpy as np

from shmloader.errors import ShmSpaceError
from shmloader.system import fdguard, segment
from shmloader.system import limits as memory
from shmloader.system.slots import FREE, Mapping, StateArray

PAGE_BYTES = 4096
HEADER_WORDS = 8  # int64 words per slot in a ring's header area (what they hold: wire.SlotHeader)
NO_SLOT = -1  # the slot number that names no slot (a frame about no slot, no ring made yet)
# A ring's slots hold its first batch x SLOT_HEADROOM + SLOT_SLACK_BYTES (see sizing):
SLOT_HEADROOM = 1.25  # so batches that vary a little fit
SLOT_SLACK_BYTES = 4096  # the layout, its numbers and small object leaves
SLOT_ALIGN_BYTES = 64  # slots start on cache lines: no false sharing between workers,
# and a ring of tiny batches does not spend a page on each

# madvise(2) advice (linux/mman.h): reserve and map a range's pages now, as writes would,
# and return an error (not a SIGBUS) where they cannot be had. Linux 5.14+.
_MADV_POPULATE_WRITE = 23
_MADV_REMOVE = 9  # free a shared range's pages (a hole punched in the segment)
_libc: Any = None
_populate_works: bool | None = None  # found out once per process (a forked child inherits it)
DEFER_ENV = "SHMLOADER_RESERVE_SLOTS_LAZILY"  # "0": reserve every ring whole when made


def _madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) over [address, address + length) rounded out to pages: 0, or the errno."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        _libc = libc
    start = address // PAGE_BYTES * PAGE_BYTES
    end = _round_up(address + length, PAGE_BYTES)
    while True:
        if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0:
            return 0
        err = ctypes.get_errno()
        if err != errno.EINTR:
            return err


def expected_fill(slot_bytes: int) -> int:
    """The bytes of a slot of ``slot_bytes`` the batch it was sized for fills (the inverse
    of sizing.slot_bytes_for): what a writer reserves of it when it does not say."""
    return max(0, int((slot_bytes - SLOT_SLACK_BYTES) / SLOT_HEADROOM))


def _is_memfd(fd: int) -> bool:
    """True where ``fd`` is a memfd (F_GET_SEALS cannot tell: /dev/shm files answer it)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False  # no /proc: taken for posix (whole slots reserved)


def _tail_may_fault(in_memfd: bool) -> bool:
    """True where a page of a segment first written without being reserved cannot raise
    SIGBUS: a memfd (its mount has no size limit: running out of memory there is the OOM
    killer's, as it is for a reservation) unless the kernel counts every shared page
    against a strict commit limit (vm.overcommit_memory=2: ENOSPC, a SIGBUS on a write
    fault). Not posix segments: /dev/shm's size would raise SIGBUS."""
    global _strict_commit
    if not in_memfd:
        return False
    if _strict_commit is None:
        try:
            with open("/proc/sys/vm/overcommit_memory") as f:
                _strict_commit = f.read().strip() == "2"
        except OSError:
            _strict_commit = True  # unknown: reserve whole slots
    return not _strict_commit


_strict_commit: bool | None = None


def populate_supported() -> bool:
    """True where ``madvise(MADV_POPULATE_WRITE)`` works (Linux 5.14+): rings then reserve
    each slot's pages when a process first writes it, instead of all at once when made."""
    global _populate_works
    if _populate_works is None:
        works = False
        if sys.platform.startswith("linux") and os.environ.get(DEFER_ENV, "1") != "0":
            import mmap

            try:
                probe = mmap.mmap(-1, PAGE_BYTES)
            except OSError:
                probe = None
            if probe is not None:
                address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
                try:
                    works = _madvise(address, PAGE_BYTES, _MADV_POPULATE_WRITE) == 0
                except (OSError, AttributeError):  # no libc symbol: not Linux as we know it
                    works = False
                probe.close()
        _populate_works = works
    return _populate_works


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


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
        # Slots this process reserves and maps on its first write (see slot_array): all of
        # them unless the whole mapping was populated when it was made. _populated: the
        # bytes of each slot reserved and mapped in this process so far.
        self._populate_slots = not populate and populate_supported()
        self._populated = [0 if self._populate_slots else slot_bytes] * num_slots
        # What a writer that does not say how much it writes reserves of a slot: the bytes
        # of the batch the slot was sized for where a page past them cannot SIGBUS when
        # first written (a memfd), else the whole slot.
        self._unsaid = slot_bytes
        self._in_memfd = self._populate_slots and _is_memfd(fd)
        if self._populate_slots and _tail_may_fault(self._in_memfd):
            self._unsaid = min(slot_bytes, _round_up(expected_fill(slot_bytes) + 1, PAGE_BYTES))
        self.lease_table: Any = None  # the consumer's slot leases (leases.lease)

    backend = ""  # "memfd" or "posix" for a ring this process created (create())
    reserved_whole = True  # False: a ring made sparse, whose writers reserve their slots

    @classmethod
    def create(
        cls,
        num_slots: int,
        slot_bytes: int,
        *,
        populate: bool = False,
        backend: str = "auto",
        whole: bool = False,
        budget: memory.Budget | None = None,
    ) -> Ring:
        """Create and map a new ring (``backend``: ``"auto"``, ``"memfd"`` or ``"posix"``,
        see :func:`segment.resolve_backend`); ``populate`` reserves and maps every page now (for
        a writer about to fill it). Otherwise the control area is reserved now and each
        slot by the first process that writes it (:meth:`slot_array`), where the kernel
        allows that (:func:`populate_supported`); ``whole`` (or a kernel without it)
        reserves every page now (a ring that is page-locked at once).

        Raises :class:`ShmSpaceError` when the memory is not there (the cgroup's limit,
        the machine's memory, or /dev/shm for posix), before reserving anything: by
        ``budget`` where given (the backend's, read just now by the caller).
        """
        if num_slots < 1:
            raise ValueError(f"a ring needs at least one slot, got num_slots={num_slots}")
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        total = ring_bytes(num_slots, slot_bytes)
        kind = segment.resolve_backend(backend)
        segment.check_room(kind, total, num_slots, slot_bytes, budget)
        fd, kind = segment.create(kind, explicit=kind == backend)
        sparse = not whole and populate_supported()
        try:
            if sparse:
                # Only the control area now: each slot is reserved by its first writer.
                os.ftruncate(fd, total)
                segment.reserve(fd, _control_bytes(num_slots), num_slots, slot_bytes, kind, size=total)
            else:
                segment.reserve(fd, total, num_slots, slot_bytes, kind)
            # The consumer only reads slots: its pages fault in on first use, and pre-faulting
            # them all here would delay the batch that sized the ring.
            ring = cls(fd, num_slots, slot_bytes, populate=populate and not sparse)
            if populate and sparse:
                ring._populate(0, total, kind)  # reserve and map every page, in one call
                ring._populate_slots = False
        except BaseException:
            os.close(fd)
            raise
        ring.backend = kind
        ring.reserved_whole = not sparse
        fdguard.register(ring, fd, closer="close_fd")
        return ring

    def slot_offset(self, index: int) -> int:
        """Byte offset of slot ``index``'s data in the segment."""
        return self.control_bytes + index * self.slot_stride

    def slot_buffer(self, index: int) -> Any:
        """The (cached) buffer object over slot ``index``'s data."""
        return self._slot_buffers[index]

    def slot_array(self, index: int, need: int | None = None) -> np.ndarray:
        """A cached uint8 array over slot ``index``'s data, for writers, who then write its
        first ``need`` bytes (None: unknown).

        In a process that writes a slot, its pages are reserved and mapped before the
        first write, in one call (MADV_POPULATE_WRITE, where the kernel has it): instead
        of a page fault per 4 KiB page, and a sparse ring reserves nothing else for them.
        Only the first ``need`` bytes (a batch smaller than its slot leaves the rest
        untouched: slots are sized 1.25x the first batch), more when a later call needs
        more. Unsaid: the bytes of the batch the slot was sized for in a memfd (a page
        past them is reserved by the write that first touches it, which cannot SIGBUS
        there: see _tail_may_fault), the whole slot elsewhere; a later call without a
        size reserves nothing more. (Reserving whole slots would make a cold epoch pay for
        pages its batches never write.) Raises
        :class:`ShmSpaceError` where the memory is not there."""
        arr = self._slot_arrays[index]
        if arr is None or (need is not None and need > self._populated[index]):
            arr = self._first_use(index, need)
        return arr

    def _first_use(self, index: int, need: int | None) -> np.ndarray:
        done = self._populated[index]
        want = self._unsaid if need is None else min(need, self.slot_bytes)
        if need is None and done:
            want = done  # a write into what an earlier call reserved (e.g. the header)
        if want > done:
            self._populate(self.slot_offset(index) + done, want - done)
            self._populated[index] = want
        arr = self._slot_arrays[index]
        if arr is None:
            arr = self._slot_arrays[index] = np.frombuffer(self._slot_buffers[index], np.uint8)
        return arr

    def _populate(self, offset: int, length: int, backend: str = "") -> None:
        """Reserve and map ``length`` bytes at ``offset`` of the segment in this process
        (``backend``: the segment's where known, else this ring's)."""
        err = _madvise(self.mapping.address + offset, length, _MADV_POPULATE_WRITE)
        if err:
            memfd = backend == "memfd" or (not backend and self._in_memfd)
            where = "" if memfd else "/dev/shm is full or "
            raise ShmSpaceError(
                f"could not reserve {memory.mib(length)} of the loader's shared-memory ring "
                f"(madvise MADV_POPULATE_WRITE: {errno.errorcode.get(err, err)}, "
                f"{os.strerror(err)}): {where}the memory ran out after the ring was sized. "
                "Free memory, use a smaller batch_size or fewer num_workers, or raise the "
                "memory limit (docker run --memory, --shm-size for /dev/shm)."
            )

    def release_free_slots(self) -> int:
        """Give the memory of this ring's FREE slots back to the system (a retired ring:
        nothing claims its slots again, so a FREE slot is never written again); the
        slots still in use keep theirs until the ring is unmapped. Returns the bytes
        released (0 where the system refuses: they are then freed with the ring)."""
        load, free = self.states.load, FREE
        released = 0
        index = 0
        while index < self.num_slots:
            if load(index) != free:
                index += 1
                continue
            end = index + 1
            while end < self.num_slots and load(end) == free:
                end += 1
            # Whole pages inside the run only: a page shared with a slot in use stays.
            start = _round_up(self.mapping.address + self.slot_offset(index), PAGE_BYTES)
            stop = (self.mapping.address + self.slot_offset(end)) // PAGE_BYTES * PAGE_BYTES
            if end == self.num_slots:
                stop = self.mapping.address + self.total_bytes
            if stop > start and _madvise(start, stop - start, _MADV_REMOVE) == 0:
                released += stop - start
            index = end
        return released

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
        except Exception:  # (at interpreter exit the modules it needs may be gone: the exit closes it)
            pass


def _attach(dup: Any, num_slots: int, slot_bytes: int) -> Ring:
    """Map a ring in a worker from a descriptor passed at process start."""
    return attach_fd(dup.detach(), num_slots, slot_bytes)


def attach_fd(fd: int, num_slots: int, slot_bytes: int, *, populate: bool = False) -> Ring:
    """Map a ring from a descriptor this process received, and close the descriptor.
    ``populate`` pre-faults the whole mapping. Workers do not: pages are mapped per
    process, at a cost per page, so a worker maps only the slots it writes, on its first
    write into each (it writes into its own share of the slots first: see
    rings.RingKeeper.claim); the consumer's reads fault pages in 16 at a time."""
    try:
        ring = Ring(fd, num_slots, slot_bytes, populate=populate)
    except BaseException:
        os.close(fd)
        raise
    ring.close_fd()  # the mapping is all this process needs
    return ring
