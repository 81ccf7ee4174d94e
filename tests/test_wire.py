"""The wire: FrameReader against Connection's own frames, FrameWriter, the slot header."""

from __future__ import annotations

import os
import random
import select
import socket
import threading
from multiprocessing.connection import Connection

import pytest

from shmloader.memory.ring import NO_SLOT
from shmloader.transport import wire

pytestmark = pytest.mark.timeout(60)


def _pair() -> tuple[Connection, wire.FrameReader, socket.socket]:
    a, b = socket.socketpair()
    return Connection(a.detach()), wire.FrameReader(b.fileno()), b


def test_reader_splits_and_completes_frames_from_both_writers():
    """Messages of every size, written by Connection.send_bytes and by send_frame in a
    random mix while the reader reads: the reader returns each one whole and in order,
    however the stream was cut (a read that brings only part of a message returns none),
    then None at EOF."""
    writer, reader, keep = _pair()
    rng = random.Random(0)
    sizes = [0, 1, 3, 11, 16, 4096, 65_533, 65_536, 300_000]
    messages = [os.urandom(rng.choice(sizes)) for _ in range(400)]

    def write() -> None:
        for m in messages:
            if rng.random() < 0.5:
                writer.send_bytes(m)
            else:
                wire.send_frame(writer.fileno(), wire.frame(m))
        writer.close()

    thread = threading.Thread(target=write)
    thread.start()
    got = []
    reads = 0
    while (batch := reader.read()) is not None:
        got.extend(bytes(m) for m in batch)
        reads += bool(batch)
    thread.join()
    keep.close()
    assert got == messages
    assert reads < len(messages)  # several messages per read happened


def test_reader_returns_none_when_the_peer_dies_mid_message():
    writer, reader, keep = _pair()
    framed = wire.frame(b"x" * 1000)
    os.write(writer.fileno(), framed[:500])  # half a message, then the writer is gone
    writer.close()
    assert reader.read() == []  # the first half: kept, no message yet
    assert reader.read() is None
    keep.close()


def test_frame_matches_connection_framing():
    writer, _, keep = _pair()
    a, b = socket.socketpair()
    receiver = Connection(b.detach())
    for m in (b"", b"abc", os.urandom(70_000)):
        wire.send_frame(a.fileno(), wire.frame(m))
        assert receiver.recv_bytes() == m
    a.close()
    receiver.close()
    writer.close()
    keep.close()


def test_kinds_are_one_set_and_the_constants_are_their_values():
    assert len({int(k) for k in wire.Kind}) == len(wire.Kind)
    for k in wire.Kind:
        assert getattr(wire, k.name) == int(k) and type(getattr(wire, k.name)) is int
    assert all(k < 10 for k in wire.Kind if k.name.startswith("TASK_"))
    assert all(k >= 10 for k in wire.Kind if k.name.startswith("RES_"))


def test_frames_decode_what_they_encode():
    a, b = socket.socketpair()
    reader = wire.FrameReader(b.fileno())
    frames = (
        wire.ring_frame(12, 1 << 40),
        wire.epoch_frame(5),
        # torch's base seeds reach 2**63 - 1, and a worker's seed adds its id
        wire.epoch_frame(2**63 + 5, reseed=False, epoch_seed=0, shared_seed=2**62),
        wire.frame(wire.pack(wire.TASK_STOP)),
    )
    for framed in frames:
        wire.send_frame(a.fileno(), framed)
    ring_msg, epoch_msg, kept_msg, stop_msg = reader.read()
    assert wire.unpack(ring_msg) == (wire.TASK_RING, NO_SLOT, 0)
    assert wire.ring_info(ring_msg) == (12, 1 << 40)
    assert wire.epoch_seed(epoch_msg) == 5 and wire.epoch_info(epoch_msg) == (5, True, None, None)
    assert wire.epoch_info(kept_msg) == (2**63 + 5, False, 0, 2**62)
    assert wire.unpack(stop_msg)[0] == wire.TASK_STOP
    payload = wire.size_payload(4096, b"rest")
    assert wire.needed_bytes(payload) == 4096 and bytes(wire.pickled_batch(payload)) == b"rest"
    a.close()
    b.close()


def test_slot_header_round_trips_through_a_ring():
    from shmloader.memory.ring import Ring

    ring = Ring.create(3, 4096)
    numbers = bytes(range(24))
    content = wire.SlotContent(100, b"sk", numbers, b"objs")
    assert wire.numbers_offset(100, 2) == 104 and content.total == 104 + 24 + 4
    # (data_end, layout_off, layout_len, objects_off, objects_len, seq, numbers)
    header = wire.SlotHeader(100, 100, 2, 104 + 24, 4, 7, 3)
    # What a worker writes (the content after the arrays, and the header) is where the
    # consumer reads each part; the arrays before it, and the other slots, stay untouched.
    slot = ring.slot_buffer(1)
    slot[:100] = b"\xaa" * 100
    content.write(ring, 1, 7)
    got = wire.read_header(ring, 1)
    assert got == header and isinstance(got, wire.SlotHeader) and got.seq == 7
    assert bytes(slot[:100]) == b"\xaa" * 100
    assert bytes(slot[got.layout_off : got.layout_off + got.layout_len]) == b"sk"
    at = wire.numbers_offset(got.layout_off, got.layout_len)
    assert bytes(slot[at : at + 8 * got.numbers]) == numbers
    assert bytes(slot[got.objects_off : got.objects_off + got.objects_len]) == b"objs"
    content.write(ring, 2, 9)  # the same content for another batch: only its number differs
    assert wire.read_header(ring, 2) == header._replace(seq=9)
    wire.SlotContent(100, b"sk", numbers, b"").write(ring, 0, 1)  # no objects: none written
    assert wire.read_header(ring, 0) == (100, 100, 2, 128, 0, 1, 3)
    assert not any(ring.slot_buffer(0)[:100]) and not any(ring.slot_buffer(0)[128:256])
    # The pair on its own: what write_header writes, read_header reads back, in its slot only.
    wire.write_header(ring, 2, *header._replace(seq=11, numbers=5))
    assert wire.read_header(ring, 2) == header._replace(seq=11, numbers=5)
    assert wire.read_header(ring, 1) == header
    ring.close_fd()


def test_writer_queues_what_a_full_socket_does_not_take_and_never_blocks():
    """Frames far larger than the socket's buffer, one with a descriptor: send() returns
    at once, flush() on POLLOUT writes the rest; the reader gets every frame whole, in
    order, and the descriptor with its own frame."""
    a, b = socket.socketpair()
    writer = wire.FrameWriter(a.fileno())
    reader = wire.FrameReader(b.fileno())
    big = [os.urandom(n) for n in (700_000, 5, 300_000)]
    r, w = os.pipe()
    assert writer.send(wire.frame(big[0])) is False and writer.pending
    writer.send(wire.frame(big[1]), w)  # queued behind the first, with a duplicate of w
    os.close(w)  # ours may go: the queue holds its own
    writer.send(wire.frame(big[2]))
    got = []
    while len(got) < 3:
        if writer.pending and select.select([], [a], [], 0)[1]:
            writer.flush()
        if select.select([b], [], [], 0.01)[0]:
            got.extend(bytes(m) for m in reader.read())
    assert got == big and not writer.pending
    fd = reader.take_fd()
    os.write(fd, b"!")
    assert os.read(r, 1) == b"!"
    os.close(fd)
    os.close(r)
    b.close()
    # The peer is gone: sending neither blocks nor raises; the writer reports it broken.
    assert writer.send(wire.frame(b"x" * 1_000_000)) is False and writer.broken
    assert not writer.pending
    a.close()


def test_reader_on_a_non_blocking_socket_returns_no_message_when_nothing_came():
    a, b = socket.socketpair()
    b.setblocking(False)
    reader = wire.FrameReader(b.fileno())
    assert reader.read() == []
    a.close()
    assert reader.read() is None
    b.close()
