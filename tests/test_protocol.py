"""The framing of worker messages: FrameReader against Connection's own frames."""

from __future__ import annotations

import os
import random
import socket
import threading
from multiprocessing.connection import Connection

import pytest

from shmloader import protocol

pytestmark = pytest.mark.timeout(60)


def _pair() -> tuple[Connection, protocol.FrameReader, socket.socket]:
    a, b = socket.socketpair()
    return Connection(a.detach()), protocol.FrameReader(b.fileno()), b


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
                protocol.send_frame(writer.fileno(), protocol.frame(m))
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
    framed = protocol.frame(b"x" * 1000)
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
        protocol.send_frame(a.fileno(), protocol.frame(m))
        assert receiver.recv_bytes() == m
    a.close()
    receiver.close()
    writer.close()
    keep.close()
