"""The wire between the consumer and a worker, defined once: frames and the slot header.

**Frames.** Each worker has one socket pair with the consumer, framed as
``multiprocessing.Connection`` frames (a 4-byte big-endian length, then the message). A
message is a fixed :data:`HEADER` (kind, slot, batch sequence number) and a payload. The
per-batch tasks and results do not use it: they go through the worker's queues in shared
memory (:mod:`shmloader.transport.channel`, sent as the first frame, TASK_CHANNEL), and the socket
carries a wake-up (TASK_WAKE, RES_WAKE) only to a side that sleeps. Frames carry the rest:
new rings and epochs, tasks the queue cannot take (huge lists of keys),
errors, shard states, stats, batches in one-off segments. The kinds are :class:`Kind`;
the module-level constants are their plain int values, for the per-batch path. The same
socket is the worker's lifeline: when the consumer dies the kernel closes its end, and
the worker's read returns EOF.

Frames bypass ``Connection``'s Python framing: :func:`send_frame` writes one with one
system call, and :class:`FrameReader` reads whatever has arrived in one call and splits it
into messages. The consumer writes through a :class:`FrameWriter` (non-blocking, queued):
no write of any size blocks its loop. A descriptor (a new ring for a worker, a one-off
segment for the consumer) travels attached to its frame's first byte; both sides read
with ``recvmsg``, so none is lost.

**The slot header.** The worker writes a batch's arrays into a slot, then after them its
encoded layout skeleton, the layout's int64 numbers (8-aligned) and its pickled object
leaves (:class:`SlotContent`); then the slot's header words (:class:`SlotHeader`, written
by :func:`write_header`, read by :func:`read_header`), then publishes the slot READY.
"""

from __future__ import annotations

import enum
import os
import pickle
import struct
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from shmloader.errors import CorruptDataError
from shmloader.memory.ring import HEADER_WORDS, NO_SLOT
from shmloader.system import fdguard
from shmloader.system import slots as _slots

HEADER = struct.Struct("<Bxxxiq")  # kind, slot (-1: none), batch sequence number
HEADER_BYTES = HEADER.size


class Kind(enum.IntEnum):
    """Every kind of frame. Tasks (consumer -> worker) are below 10, results above."""

    TASK_INDICES = 1  # payload: int64 sample indices (a batch of one plain int; see task_payload)
    TASK_KEYS = 2  # payload: the batch's sample keys pickled as the sampler gave them, zero-padded
    TASK_ITER = 3  # iterable dataset: produce the next batch; no payload
    TASK_EPOCH = 4  # persistent workers, new epoch: payload uint64 x4 (epoch_frame)
    TASK_STOP = 5
    TASK_RING = 6  # payload: int64 [num_slots, slot_bytes] (ring_frame); the ring's descriptor comes with it
    TASK_WAKE = 7  # no payload: a task is in the worker's queue and it was asleep (see channel.py)
    TASK_CHANNEL = 8  # the first frame: the worker's channel's descriptor comes with it (see channel.py)
    TASK_SCALARS = 9  # payload: int64 [numpy type char, count], then the keys' bytes (see task_payload)
    RES_SEGMENT = 10  # payload: int64 [slot_bytes]; the batch is in slot 0 of a one-off segment
    # (a 1-slot ring) whose descriptor comes with this frame: a batch that had no slot (the
    # first, which sizes the ring) or outgrew it, delivered without a copy.
    RES_READY = 11  # the batch is in the slot; payload: int64 [fetch_ns, collate_ns, idle_ns],
    # the worker's clocks since its last report (see timing.py and ready_frame)
    RES_PICKLED = 12  # payload: int64 bytes the batch needs in a slot, then the pickled batch
    # (only when a one-off segment cannot be made, e.g. /dev/shm is full)
    RES_ERROR = 13  # payload: pickled WorkerFailure
    RES_ITER_END = 14  # iterable dataset exhausted in this worker
    RES_INIT_ERROR = 15  # payload: pickled WorkerFailure; the worker exits after sending it
    RES_SHARD_STATE = (
        16  # payload: pickled dataset.shmloader_state_dict() after batch `seq` (before its result)
    )
    RES_STATS = 17  # payload: pickled {name: increase} of the dataset's shmloader_stats() counters
    RES_WAKE = 18  # no payload: a result is in the worker's queue and the consumer was asleep
    # The consumer checks kinds >= RES_INIT_ERROR with one comparison, off the per-batch
    # path: give a new rare kind a number above these and handle it in that branch.


# Plain ints of the kinds (an enum member costs an attribute lookup per use on the hot path).
TASK_INDICES = int(Kind.TASK_INDICES)
TASK_KEYS = int(Kind.TASK_KEYS)
TASK_ITER = int(Kind.TASK_ITER)
TASK_EPOCH = int(Kind.TASK_EPOCH)
TASK_STOP = int(Kind.TASK_STOP)
TASK_RING = int(Kind.TASK_RING)
RES_SEGMENT = int(Kind.RES_SEGMENT)
RES_READY = int(Kind.RES_READY)
RES_PICKLED = int(Kind.RES_PICKLED)
RES_ERROR = int(Kind.RES_ERROR)
RES_ITER_END = int(Kind.RES_ITER_END)
RES_INIT_ERROR = int(Kind.RES_INIT_ERROR)
RES_SHARD_STATE = int(Kind.RES_SHARD_STATE)
RES_STATS = int(Kind.RES_STATS)
RES_WAKE = int(Kind.RES_WAKE)
TASK_WAKE = int(Kind.TASK_WAKE)
TASK_CHANNEL = int(Kind.TASK_CHANNEL)
TASK_SCALARS = int(Kind.TASK_SCALARS)

_I64 = struct.Struct("<q")
_KEYS_PROTOCOL = pickle.HIGHEST_PROTOCOL
_I64X2 = struct.Struct("<qq")
_EPOCH = struct.Struct("<QQQQ")  # worker seed, flags, epoch seed, shared seed
_RESEED, _HAS_EPOCH_SEED, _HAS_SHARED_SEED = 1, 2, 4


def pack(kind: int, slot: int = NO_SLOT, seq: int = 0, payload: bytes = b"") -> bytes:
    """One message: header then payload (frame it with :func:`frame`)."""
    return HEADER.pack(kind, slot, seq) + payload


def _short(message: Any, what: str, exc: Exception) -> CorruptDataError:
    """The error for a message too short (or odd) for what its kind says it holds."""
    return CorruptDataError(
        f"a message of {len(message)} bytes is too short for {what} ({exc}): the peer wrote "
        "something else than a frame of this wire"
    )


def unpack(message: Any) -> tuple[int, int, int]:
    """A message's (kind, slot, seq); its payload is ``body(message)``."""
    try:
        return HEADER.unpack_from(message)
    except struct.error as exc:
        raise _short(message, "a header", exc) from exc


def body(message: Any) -> Any:
    """A message's payload (after the header)."""
    return message[HEADER_BYTES:]


# A RES_READY frame whole: Connection's length (big-endian), then the header and the clocks.
_READY_LEN = struct.Struct("!i")
_READY_BODY = struct.Struct("<Bxxxiqqqq")
_READY_LEN_BYTES = _READY_LEN.pack(_READY_BODY.size)
_CLOCKS = struct.Struct("<qqq")


def ready_frame(slot: int, seq: int, fetch_ns: int, collate_ns: int, idle_ns: int) -> bytes:
    """The framed RES_READY message of batch ``seq`` in ``slot``, with the worker's clocks
    since its last report (see :mod:`shmloader.tuning.timing`)."""
    return _READY_LEN_BYTES + _READY_BODY.pack(RES_READY, slot, seq, fetch_ns, collate_ns, idle_ns)


def ready_clocks(message: Any) -> tuple[int, int, int]:
    """A RES_READY message's (fetch_ns, collate_ns, idle_ns)."""
    try:
        return _CLOCKS.unpack_from(message, HEADER_BYTES)
    except struct.error as exc:
        raise _short(message, "a batch's clocks", exc) from exc


def task_wake_frame() -> bytes:
    """The framed TASK_WAKE message."""
    return frame(pack(TASK_WAKE))


def result_wake_frame() -> bytes:
    """The framed RES_WAKE message."""
    return frame(pack(RES_WAKE))


def channel_frame(offset: int, size: int) -> bytes:
    """The framed TASK_CHANNEL message: the queues start at ``offset`` of the ``size``
    bytes of the segment whose descriptor comes with it."""
    return frame(pack(TASK_CHANNEL, payload=_I64X2.pack(offset, size)))


def channel_info(message: Any) -> tuple[int, int]:
    """A TASK_CHANNEL message's (offset, size)."""
    try:
        return _I64X2.unpack_from(message, HEADER_BYTES)
    except struct.error as exc:
        raise _short(message, "a channel's place", exc) from exc


def ring_frame(num_slots: int, slot_bytes: int) -> bytes:
    """The framed TASK_RING message (send it with the ring's descriptor)."""
    return frame(pack(TASK_RING, payload=_I64X2.pack(num_slots, slot_bytes)))


def ring_info(message: Any) -> tuple[int, int]:
    """A TASK_RING message's (num_slots, slot_bytes)."""
    try:
        return _I64X2.unpack_from(message, HEADER_BYTES)
    except struct.error as exc:
        raise _short(message, "a ring's size", exc) from exc


def epoch_frame(
    seed: int, reseed: bool = True, epoch_seed: int | None = None, shared_seed: int | None = None
) -> bytes:
    """The framed TASK_EPOCH message: a new epoch whose worker seed is ``seed`` (a
    non-negative int below 2**64); ``reseed``: the worker seeds its RNGs with it (False:
    they go on, as a persistent torch worker's do); ``epoch_seed`` (what ``sample_rng``
    draws from) and ``shared_seed`` (a DataPipe's) where they are not the worker's seed
    minus its id."""
    flags = (
        (_RESEED if reseed else 0)
        | (_HAS_EPOCH_SEED if epoch_seed is not None else 0)
        | (_HAS_SHARED_SEED if shared_seed is not None else 0)
    )
    payload = _EPOCH.pack(seed, flags, epoch_seed or 0, shared_seed or 0)
    return frame(pack(TASK_EPOCH, payload=payload))


def epoch_info(message: Any) -> tuple[int, bool, int | None, int | None]:
    """A TASK_EPOCH message's ``(seed, reseed, epoch_seed, shared_seed)`` (see epoch_frame)."""
    try:
        seed, flags, epoch, shared = _EPOCH.unpack_from(message, HEADER_BYTES)
    except struct.error as exc:
        raise _short(message, "an epoch's seeds", exc) from exc
    return (
        seed,
        bool(flags & _RESEED),
        epoch if flags & _HAS_EPOCH_SEED else None,
        shared if flags & _HAS_SHARED_SEED else None,
    )


def epoch_seed(message: Any) -> int:
    """A TASK_EPOCH message's worker seed."""
    return epoch_info(message)[0]


def size_payload(slot_bytes: int, rest: bytes = b"") -> bytes:
    """The payload of RES_SEGMENT / RES_PICKLED: the bytes the batch needs in a slot, then ``rest``."""
    return _I64.pack(slot_bytes) + rest


def needed_bytes(payload: Any) -> int:
    """The slot bytes a RES_SEGMENT / RES_PICKLED payload says its batch needs."""
    try:
        return _I64.unpack_from(payload)[0]
    except struct.error as exc:
        raise _short(payload, "a batch's size", exc) from exc


def pickled_batch(payload: Any) -> Any:
    """The pickled batch of a RES_PICKLED payload."""
    return payload[_I64.size :]


# --- the slot header ----------------------------------------------------------------------


class SlotHeader(NamedTuple):
    """A slot's header words (int64, the first ``len(SlotHeader._fields)`` of
    HEADER_WORDS), written by the worker before it publishes the slot READY."""

    data_end: int  # bytes of array data (from the slot start)
    layout_off: int  # where the encoded layout skeleton starts
    layout_len: int
    objects_off: int  # pickled non-array leaves (str, objects), when the batch has any
    objects_len: int
    seq: int  # the batch's sequence number, checked against the message naming the slot
    numbers: int  # how many int64 layout numbers follow the skeleton (8-aligned)


HEADER_USED = len(SlotHeader._fields)
assert HEADER_USED <= HEADER_WORDS
# Per batch: struct reads/writes the words in place (faster than numpy's slicing), and
# tuple.__new__ makes the record without NamedTuple's Python-level __new__.
_HEADER_STRUCT = struct.Struct(f"={HEADER_USED}q")
_ROW_BYTES = 8 * HEADER_WORDS
_new_header = tuple.__new__
_pack_header = _HEADER_STRUCT.pack_into


def numbers_offset(layout_off: int, layout_len: int) -> int:
    """Where a slot's layout numbers start: 8-aligned, right after the encoded layout."""
    return (layout_off + layout_len + 7) & ~7


def numbers_struct(count: int) -> struct.Struct:
    """The struct of ``count`` layout numbers (int64, read in place from a slot)."""
    return struct.Struct(f"={count}q")


class SlotContent:
    """What a batch puts in its slot after the arrays: the encoded skeleton of its layout,
    the layout's numbers (int64, 8-aligned), its object leaves; worked out once per batch
    structure by a worker (see placement.py), all but the batch's number."""

    __slots__ = ("_count", "_words", "data_bytes", "objects", "total", "trailer")

    def __init__(self, data_bytes: int, skeleton: bytes, numbers: bytes, objects: bytes) -> None:
        self.data_bytes = data_bytes
        at = numbers_offset(data_bytes, len(skeleton))
        end = at + len(numbers)
        self.total = end + len(objects)  # bytes the batch needs in a slot
        self.trailer = b"".join((skeleton, bytes(at - data_bytes - len(skeleton)), numbers))
        self.objects = objects  # (written apart: no copy of a batch's pickled objects)
        self._words = (data_bytes, data_bytes, len(skeleton), end, len(objects))
        self._count = len(numbers) >> 3

    def write(self, ring: Any, slot: int, seq: int) -> None:
        """Write this content after the arrays of ``slot`` in ``ring``, and its header for
        batch ``seq`` (before the slot is published READY)."""
        # (Slice assignments of bytes to the slot's memoryview: a fraction of numpy's.)
        dst = ring.slot_buffer(slot)
        end = self._words[3]
        dst[self.data_bytes : end] = self.trailer
        if self.objects:
            dst[end : self.total] = self.objects
        write_header(ring, slot, *self._words, seq, self._count)


def write_header(ring: Any, slot: int, *words: int) -> None:
    """Write ``slot``'s header in ``ring``: ``words`` are a :class:`SlotHeader`'s fields, in
    its order (``write_header(ring, slot, *header)``). Before the slot is published READY."""
    _pack_header(ring.headers, slot * _ROW_BYTES, *words)


def read_header(ring: Any, slot: int) -> SlotHeader:
    """``slot``'s header in ``ring``, as :func:`write_header` wrote it (after READY was
    acquire-loaded)."""
    return _new_header(SlotHeader, _HEADER_STRUCT.unpack_from(ring.headers, slot * _ROW_BYTES))


# --- framing ------------------------------------------------------------------------------

_LEN = struct.Struct("!i")  # Connection's frame length; -1: an 8-byte length follows
_LEN64 = struct.Struct("!Q")
_READ_CHUNK = 1 << 16
# A message's buffer is made whole up to this size, then doubled as its bytes arrive: a
# length read from stray bytes costs no more memory than the bytes that came.
_GROW_FROM = 1 << 26


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 1 << 48


# No frame is longer than the machine's memory: a longer length is stray bytes, not a frame.
MAX_FRAME = _memory_bytes()


def frame(message: bytes) -> bytes:
    """``message`` framed as ``Connection.send_bytes`` frames it."""
    n = len(message)
    if n > 0x7FFFFFFF:
        return _LEN.pack(-1) + _LEN64.pack(n) + message
    return _LEN.pack(n) + message


def send_frame(fd: int, framed: bytes) -> None:
    """Write ``framed`` (see :func:`frame`) to ``fd`` completely (blocking)."""
    sent = os.write(fd, framed)
    if sent < len(framed):  # a large frame, or a signal arrived mid-write
        view = memoryview(framed)
        while sent < len(framed):
            sent += os.write(fd, view[sent:])


class FrameReader:
    """Messages from one stream socket whose peer writes whole frames (see :func:`frame`),
    and the descriptors sent with them (see :func:`send_frame_with_fd`).

    :meth:`read` makes one read of whatever has arrived (blocking only when the socket
    does) and returns every message that is now complete. A message cut off at the end of
    a read is kept and completed by later reads, straight into its own buffer: the reader
    never waits for the rest of a message, so a consumer that reads only when ``poll``
    says so never blocks here, whatever the size of the peer's frames. A descriptor
    arrives with the first bytes of its frame, so it is in :meth:`take_fd`'s queue by the
    time its frame is returned; descriptors queue in the order of their frames.
    """

    __slots__ = ("_error", "_fds", "_got", "_head", "_partial", "_receiver", "_size", "fd", "peer")

    def __init__(self, fd: int, peer: str = "the peer") -> None:
        """``peer``: who writes to ``fd`` ("worker 3"), named by a protocol error."""
        self.fd = fd
        self.peer = peer
        self._error: CorruptDataError | None = None  # the stream's protocol error, once found
        self._receiver = _slots.Receiver(_READ_CHUNK)
        self._fds: deque[int] = deque()
        self._head = b""  # the start of a frame whose length is cut off
        self._partial: bytearray | None = None  # a message being completed
        self._got = 0  # its bytes received so far
        self._size = 0  # its length: its buffer grows to it as bytes arrive (see _GROW_FROM)

    def read(self) -> list[bytes] | None:
        """The messages completed by one read (an empty list when it brought only part of
        one, or nothing on a non-blocking socket); None at EOF, or when the peer died part
        way through a message. A :class:`~shmloader.errors.CorruptDataError` naming the
        peer where a frame's length is impossible (negative, or more than the machine's
        memory): bytes that are no frame, after which the stream cannot be followed (every
        later read raises it again)."""
        if self._error is not None:
            raise self._error
        if self._partial is not None:
            return self._continue()
        try:
            data, fd = self._receiver.recv(self.fd)
        except BlockingIOError:
            return []
        if fd >= 0:
            self._fds.append(fd)
        if not data:
            return None  # EOF (part of a frame left unread: the peer died mid-frame)
        if self._head:
            data, self._head = self._head + data, b""
        return self._split(data)

    def take_fd(self) -> int:
        """The oldest descriptor received and not yet taken (the caller owns it now)."""
        if not self._fds:
            raise OSError("a message said a descriptor came with it, but none did")
        return self._fds.popleft()

    def close(self) -> None:
        """Close descriptors received and never taken."""
        while self._fds:
            os.close(self._fds.popleft())

    def _split(self, data: bytes) -> list[bytes]:
        """The complete messages in ``data``; a cut-off one is kept for the next reads."""
        messages: list[bytes] = []
        pos, end = 0, len(data)
        while pos < end:
            start = pos + 4
            if start > end:  # the length itself is cut off
                self._head = data[pos:]
                break
            size = _LEN.unpack_from(data, pos)[0]
            if size == -1:  # an 8-byte length follows
                if start + 8 > end:
                    self._head = data[pos:]
                    break
                size = _LEN64.unpack_from(data, start)[0]
                start += 8
            if not 0 <= size <= MAX_FRAME:
                self._error = self._bad_length(size)
                raise self._error
            have = end - start
            if have < size:  # the rest of this message is still on its way
                self._partial = message = bytearray(min(size, max(have, _GROW_FROM)))
                self._size = size
                message[:have] = data[start:end]
                self._got = have
                break
            pos = start + size
            messages.append(data[start:pos])
        return messages

    def _bad_length(self, size: int) -> CorruptDataError:
        return CorruptDataError(
            f"{self.peer} sent bytes that are not a frame on its socket (descriptor {self.fd}): "
            f"a frame of {size} bytes (a length is 0 to {MAX_FRAME}, the machine's memory). "
            "Something else wrote to the socket (a library of the dataset writing to an "
            "inherited descriptor?); the stream cannot be followed from here."
        )

    def _continue(self) -> list[bytes] | None:
        """Read more of the cut-off message, into its buffer; it alone when complete."""
        message = self._partial
        assert message is not None
        if self._got == len(message):  # its buffer is full, the message is not: double it
            message += bytes(min(len(message), self._size - len(message)))
        try:
            n, fd = self._receiver.recv_into(self.fd, memoryview(message)[self._got :])
        except BlockingIOError:
            return []
        if fd >= 0:
            self._fds.append(fd)
        if n == 0:
            return None  # the peer closed the socket part way through a message
        self._got += n
        if self._got < self._size:
            return []
        self._partial = None
        return [message]  # type: ignore[list-item]  # bytes-like; not copied again


class FrameWriter:
    """Writes frames to a non-blocking stream socket without ever blocking: what the
    socket does not take now is queued, in order, and written by :meth:`flush` when
    ``poll`` reports the socket writable (POLLOUT). The consumer's side of a worker's
    socket: a worker busy writing a big result back is never waited for, so frames of
    any size flow both ways at once (issue 12: a 512 KiB task against a big error).

    :meth:`send` costs one ``write`` when nothing is queued (the common case). A frame
    with a descriptor keeps a duplicate of it until the frame's first byte is written,
    with the descriptor attached; the duplicate is closed then, or by :meth:`close`.
    """

    __slots__ = ("__weakref__", "_queue", "broken", "fd")

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        # (the rest of a frame, a descriptor to attach to its first byte or -1)
        self._queue: deque[tuple[memoryview, int]] = deque()
        self.broken = False  # the peer is gone (EPIPE...): nothing is written any more

    @property
    def pending(self) -> bool:
        """Whether bytes wait for the socket to become writable."""
        return bool(self._queue)

    def send(self, framed: bytes, fd: int = -1) -> bool:
        """Write ``framed`` (see :func:`frame`), with the descriptor ``fd`` (>= 0; it stays
        open here) attached to its first byte; what the socket does not take now is
        queued. True when all of it was written; False when some is queued (flush it on
        POLLOUT) or the peer is gone (its death is reported elsewhere: its sentinel)."""
        if self._queue or self.broken:
            if not self.broken:
                self._enqueue(memoryview(framed), fd)
            return False
        try:
            n = os.write(self.fd, framed) if fd < 0 else _slots.send_with_fd_once(self.fd, framed, fd)
        except BlockingIOError:
            n = 0
        except OSError:
            self._break()
            return False
        if n == len(framed):
            return True
        self._enqueue(memoryview(framed)[n:], fd if n == 0 else -1)
        return False

    def flush(self) -> bool:
        """Write queued bytes until the socket takes no more; True when none is left."""
        queue = self._queue
        while queue:
            view, fd = queue[0]
            try:
                n = self._write(view, fd)
            except OSError:
                self._break()
                return True
            if n and fd >= 0:
                self._close_fd(fd)  # it went with the frame's first byte
                fd = -1
            if n < len(view):
                queue[0] = (view[n:], fd)
                return False
            queue.popleft()
        return True

    def close(self) -> None:
        """Drop what is queued, closing the descriptors it holds (the socket is the
        caller's to close)."""
        while self._queue:
            _, fd = self._queue.popleft()
            if fd >= 0:
                self._close_fd(fd)

    def _write(self, view: memoryview, fd: int) -> int:
        """One non-blocking write; the bytes written (0: the socket is full)."""
        try:
            if fd >= 0:
                return _slots.send_with_fd_once(self.fd, view, fd)
            return os.write(self.fd, view)
        except BlockingIOError:
            return 0

    def _enqueue(self, view: memoryview, fd: int) -> None:
        if fd >= 0:
            fd = os.dup(fd)  # the caller may close its own (a retiring ring's) meanwhile
            fdguard.register(self, fd, closer="close")
        self._queue.append((view, fd))

    def _close_fd(self, fd: int) -> None:
        fdguard.unregister(fd)
        os.close(fd)

    def _break(self) -> None:
        self.broken = True
        self.close()


def send_frame_with_fd(sock: int, framed: bytes, fd: int) -> None:
    """Write ``framed`` (see :func:`frame`) to ``sock`` with the descriptor ``fd`` (a
    duplicate of it goes to the peer; ``fd`` stays open here)."""
    _slots.send_with_fd(sock, framed, fd)


# numpy's bool and integer scalar types, and the type chars they come back as when
# pickled (how torch sends them to its workers: np.longlong, a type of its own beside
# np.int64 here, comes back as np.int64).
_SCALAR_CHARS = {np.dtype(c).type: ord(pickle.loads(pickle.dumps(np.dtype(c))).char) for c in "?bBhHiIlLqQ"}
_SCALAR_CHAR_SET = frozenset(map(chr, _SCALAR_CHARS.values()))


def task_payload(indices: Any) -> tuple[int, bytes]:
    """A batch's sample keys as a task's payload, a whole number of 8-byte words (the task
    queue's unit), from which the worker rebuilds them as they were given, as torch's
    workers receive them (torch pickles each batch of keys to its worker): numpy ints and
    bools stay themselves, a batch sampler's tuple or array stays a tuple or an array.

    A list of one plain ``int`` (``batch_size=1``, ``batch_size=None``: the path whose
    cost is per batch) goes as that int64 (TASK_INDICES); a list of numpy scalars of one
    integer or bool type as their bytes and the type's char (TASK_SCALARS: each numpy
    scalar pickles with its dtype, slowly); anything else is pickled as it is (TASK_KEYS,
    zero-padded: unpickling ignores bytes past the pickle), a list of plain ints too
    (pickling them costs less than checking each key's type to send int64)."""
    if type(indices) is list and indices:
        first = type(indices[0])
        if first is int:
            if len(indices) == 1:
                try:
                    return TASK_INDICES, _I64.pack(indices[0])
                except struct.error:  # beyond int64: pickled below
                    pass
        elif first in _SCALAR_CHARS and set(map(type, indices)) == {first}:
            n = len(indices)
            data = np.fromiter(indices, first, n).tobytes()
            return TASK_SCALARS, _I64X2.pack(_SCALAR_CHARS[first], n) + data + bytes(-len(data) & 7)
    try:
        data = pickle.dumps(indices, _KEYS_PROTOCOL)
    except TypeError:
        if type(indices) is list:
            raise
        # Keys in a container that does not pickle (a generator): its items, in a list.
        data = pickle.dumps(list(indices), _KEYS_PROTOCOL)
    pad = -len(data) & 7
    return TASK_KEYS, data + bytes(pad) if pad else data


def task_keys(kind: int, payload: Any) -> Any:
    """The sample keys of a TASK_SCALARS or TASK_KEYS payload, as :func:`task_payload`
    was given them."""
    if kind == TASK_SCALARS:
        try:
            char, n = _I64X2.unpack_from(payload)
            dtype = np.dtype(chr(char))
            if dtype.char not in _SCALAR_CHAR_SET:
                raise ValueError(f"{dtype} is no integer or bool type")
            return list(np.frombuffer(payload, dtype, n, 16))
        except (struct.error, ValueError, TypeError, OverflowError) as exc:
            raise _short(payload, "a batch's keys", exc) from exc
    return pickle.loads(payload)
