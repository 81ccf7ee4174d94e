"""The messages between the consumer and a worker: a fixed header and a small payload.

Each worker has one socket pair with the consumer. Tasks go one way, results the other;
both are framed as ``multiprocessing.Connection`` frames them (a 4-byte big-endian length,
then the message), never pickles in the common case: a task is the slot number, the
batch's sequence number and its sample indices as int64 bytes; a result is the slot
number. The same socket is the worker's lifeline: when the consumer dies the kernel closes
its end, and the worker's blocking read returns EOF.

The per-batch messages bypass ``Connection``'s Python framing: :func:`send_frame` writes a
framed message with one system call, and :class:`FrameReader` reads whatever has arrived in
one call and splits it into messages (two results that arrived together cost one read).
Rare messages still use ``Connection.send_bytes``, whose frames are the same. A descriptor
(a new ring for a worker, a one-off segment for the consumer) travels attached to its
frame (:func:`send_frame_with_fd`); both sides read with ``recvmsg``, so none is lost.
"""

from __future__ import annotations

import os
import struct
from collections import deque

from shmloader import _slots

HEADER = struct.Struct("<Bxxxiq")  # kind, slot (-1: none), batch sequence number
HEADER_BYTES = HEADER.size

# consumer -> worker
TASK_INDICES = 1  # payload: int64 sample indices
TASK_KEYS = 2  # payload: pickled list of sample keys (a sampler yielding non-int keys)
TASK_ITER = 3  # iterable dataset: produce the next batch; no payload
TASK_EPOCH = 4  # persistent workers, new epoch: payload int64 [base_seed]
TASK_STOP = 5
TASK_RING = 6  # payload: int64 [num_slots, slot_bytes]; the ring's descriptor comes with it

# worker -> consumer
RES_SEGMENT = 10  # payload: int64 [slot_bytes]; the batch is in slot 0 of a one-off segment
# (a 1-slot ring) whose descriptor comes with this frame: a batch that had no slot (the
# first, which sizes the ring) or outgrew it, delivered without a copy.
RES_READY = 11  # the batch is in the slot
RES_PICKLED = 12  # payload: int64 bytes the batch needs in a slot, then the pickled batch
# (only when a one-off segment cannot be made, e.g. /dev/shm is full)
RES_ERROR = 13  # payload: pickled WorkerFailure
RES_ITER_END = 14  # iterable dataset exhausted in this worker
RES_INIT_ERROR = 15  # payload: pickled WorkerFailure; the worker exits after sending it
RES_SHARD_STATE = 16  # payload: pickled dataset.state_dict() after batch `seq` (before its result)
RES_STATS = 17  # payload: pickled {name: increase} of the dataset's stats() counters
# The consumer checks kinds >= RES_INIT_ERROR with one comparison, off the per-batch path:
# give a new rare kind a number above these and handle it in that branch.

NO_SLOT = -1


def pack(kind: int, slot: int = NO_SLOT, seq: int = 0, payload: bytes = b"") -> bytes:
    """One frame: header then payload."""
    return HEADER.pack(kind, slot, seq) + payload


_LEN = struct.Struct("!i")  # Connection's frame length; -1: an 8-byte length follows
_LEN64 = struct.Struct("!Q")
_READ_CHUNK = 1 << 16


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

    :meth:`read` blocks for one read of whatever has arrived, completes a message cut off
    at the end of it (its rest is on its way: the peer writes frames whole), and returns
    every message it holds. A descriptor arrives with the first bytes of its frame, so it
    is in :meth:`take_fd`'s queue by the time its frame is returned; descriptors queue in
    the order of their frames.
    """

    __slots__ = ("_fds", "_receiver", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._receiver = _slots.Receiver(_READ_CHUNK)
        self._fds: deque[int] = deque()

    def read(self) -> list[bytes] | None:
        """The messages now available (at least one); None at EOF, or when the peer died
        part way through a message."""
        data, fd = self._receiver.recv(self.fd)
        if fd >= 0:
            self._fds.append(fd)
        if not data:
            return None
        try:
            return self._split(data)
        except EOFError:
            return None

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
        """The messages in ``data``, the last one completed from the socket if cut off."""
        messages: list[bytes] = []
        pos, end = 0, len(data)
        while pos < end:
            if end - pos < 4:  # the length itself is cut off
                data, pos, end = data[pos:] + self._read_exact(4 - (end - pos)), 0, 4
            size = _LEN.unpack_from(data, pos)[0]
            start = pos + 4
            if size == -1:  # an 8-byte length follows
                if end - start < 8:
                    data, start, end = data[start:] + self._read_exact(8 - (end - start)), 0, 8
                size = _LEN64.unpack_from(data, start)[0]
                start += 8
            have = end - start
            if have < size:  # the rest of this message is still arriving: wait for it
                message = bytearray(size)
                message[:have] = data[start:end]
                self._read_into(memoryview(message)[have:])
                messages.append(message)  # type: ignore[arg-type]  # bytes-like; not copied again
                return messages
            pos = start + size
            messages.append(data[start:pos])
        return messages

    def _read_into(self, view: memoryview) -> None:
        """Fill ``view`` (blocking); EOFError if the peer closes first."""
        got, want = 0, len(view)
        while got < want:
            n, fd = self._receiver.recv_into(self.fd, view[got:])
            if fd >= 0:
                self._fds.append(fd)
            if n == 0:
                raise EOFError("the peer closed the socket part way through a message")
            got += n

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return bytes(buf)


def send_frame_with_fd(sock: int, framed: bytes, fd: int) -> None:
    """Write ``framed`` (see :func:`frame`) to ``sock`` with the descriptor ``fd`` (a
    duplicate of it goes to the peer; ``fd`` stays open here)."""
    _slots.send_with_fd(sock, framed, fd)
