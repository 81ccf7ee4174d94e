"""A corrupt shared segment or wire frame ends in one clear error (CorruptDataError),
never a stray read, a hang, an unbounded build or another exception type."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest

from shmloader import CorruptDataError, ShmLoaderError, share
from shmloader.memory.shared import layout as L
from shmloader.memory.shared import store as store_mod
from shmloader.memory.shared import views
from shmloader.transport import wire

from . import share_fuzz

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def deadline(seconds: float):
    """A TimeoutError where the block runs past ``seconds`` (a Python-level loop: a hang
    fails the test instead of the run)."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def segment(data: bytes | bytearray) -> store_mod.Store:
    """A segment holding ``data`` as it is (the reader's view of a corrupt segment)."""
    return store_mod.create(bytes(data))


def root(data: bytes | bytearray):
    store = segment(data)
    return views.value_at(store, L.ROOT, store.size)


def bytes_of(shared) -> bytearray:
    return bytearray(shared._store.mm)


def test_corrupt_data_error_is_a_value_error_of_shmloader():
    assert issubclass(CorruptDataError, ValueError) and issubclass(CorruptDataError, ShmLoaderError)


def test_an_array_past_the_segment_is_refused_whatever_numpy_would_accept():
    """numpy checks offset + nbytes against the buffer with arithmetic that overflows: an
    offset near 2**63 gives an array over memory that is not the segment's."""
    data = bytes_of(share([np.arange(2)]))
    seq = L.REF.unpack_from(data, L.ROOT)[1]
    node = L.REF.unpack_from(data, seq + L.SEQ_HEAD.size)[1]
    ndim, descr_len, _, nbytes = L.ARRAY_HEAD.unpack_from(data, node)
    for data_off, shape in [(2**63 - 8, 2), (8, 2**59), (len(data) - 8, 2)]:
        bad = bytearray(data)
        L.ARRAY_HEAD.pack_into(bad, node, ndim, descr_len, data_off, nbytes)
        L.U64.pack_into(bad, node + L.ARRAY_HEAD.size, shape)
        view = views.view_at(segment(bad), L.ROOT)
        with pytest.raises(CorruptDataError, match="array"):
            view[0]


def _doubling_keys(depth: int, record: bool) -> bytes:
    """A segment whose one dict key is a tuple of two references to one tuple, and so on
    ``depth`` levels down: 2**depth values from a few hundred bytes."""
    buf = bytearray(L.MAGIC + bytes(L.REF_SIZE))
    below = L.REF_INT.pack(L.INT, 7)
    for _ in range(depth):
        at = len(buf)
        buf += L.SEQ_HEAD.pack(L.REFS, 2) + below + below
        below = L.REF.pack(L.TUPLE, at)
    if record:
        table = len(buf)
        buf += L.U64.pack(1) + below
        node = len(buf)
        buf += L.RECORD_HEAD.pack(table, 1) + L.REF_INT.pack(L.INT, 1)
        buf[L.ROOT : L.ROOT + L.REF_SIZE] = L.REF.pack(L.RECORD, node)
    else:
        node = len(buf)
        buf += L.DICT_HEAD.pack(1, 0) + struct.pack("=I4x", 0) + below + L.REF_INT.pack(L.INT, 1)
        buf[L.ROOT : L.ROOT + L.REF_SIZE] = L.REF.pack(L.DICT, node)
    return bytes(buf)


def test_a_key_table_builds_no_more_than_its_segment_holds():
    """A key referencing one tuple twice per level would build 2**depth objects in one
    call (2**40 from 2 KB: hours, uninterruptible); the work is bounded by the segment's
    size, and the table is corrupt."""
    data = _doubling_keys(20, record=True)
    with deadline(30), pytest.raises(CorruptDataError, match="key"):
        root(data)
    with deadline(30), pytest.raises(CorruptDataError, match="key"):
        views.view_at(segment(data), L.ROOT)  # the view's own decoding of the table


def _full_buckets() -> bytes:
    """A dict of 300 keys (too many for a record) whose bucket table has no free slot."""
    data = bytes_of(share({f"k{i}": i for i in range(300)}))
    tag, node = L.REF.unpack_from(data, L.ROOT)
    n, buckets = L.DICT_HEAD.unpack_from(data, node)
    assert (tag, n, buckets) == (L.DICT, 300, 1024)
    table = node + L.DICT_HEAD.size + L.pad(4 * n) + 2 * L.REF_SIZE * n
    for i in range(buckets):
        L.U32.pack_into(data, table + 4 * i, 1 + i % n)
    return bytes(data)


def test_bucket_probing_is_bounded_by_the_table():
    shared = views.view_at(segment(_full_buckets()), L.ROOT)
    for lookup in (lambda: "absent" in shared, lambda: shared.get("absent"), lambda: shared["absent"]):
        with deadline(10), pytest.raises(CorruptDataError, match="bucket"):
            lookup()


def test_a_list_longer_than_its_segment_is_refused_before_it_is_allocated():
    """A count that fits the segment's size but not its bytes: refused before a list of
    that many items is made (a 16 MB segment must not cost 128 MB to refuse)."""
    size = 16 << 20
    buf = bytearray(size)
    buf[:8] = L.MAGIC
    buf[L.ROOT : L.ROOT + L.REF_SIZE] = L.REF.pack(L.LIST, 32)
    buf[32:48] = L.SEQ_HEAD.pack(L.REFS, size // 2)
    store = segment(buf)
    del buf
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError):
            views.value_at(store, L.ROOT, store.size)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def _corruptions() -> list[tuple[str, bytes]]:
    """Hand-made corrupt segments, each of which once escaped as another exception type."""
    out = []
    good = bytes_of(share([np.arange(2)]))
    seq = L.REF.unpack_from(good, L.ROOT)[1]
    node = L.REF.unpack_from(good, seq + L.SEQ_HEAD.size)[1]
    _, descr_len, data_off, nbytes = L.ARRAY_HEAD.unpack_from(good, node)
    bad = bytearray(good)
    L.ARRAY_HEAD.pack_into(bad, node, 2**40, descr_len, data_off, nbytes)
    out.append(("ndim of 2**40 (struct.error)", bytes(bad)))
    bad = bytearray(good)
    at = node + L.ARRAY_HEAD.size + 8
    bad[at : at + 4] = b"{'[("
    out.append(("a dtype description that does not parse (SyntaxError)", bytes(bad)))
    bad = bytearray(good)
    bad[at : at + 3] = b"'O'"
    out.append(("an object dtype (numpy refuses a buffer)", bytes(bad)))
    bad = bytearray(good)
    L.SEQ_HEAD.pack_into(bad, seq, 9, 1)
    out.append(("a list of an unknown form", bytes(bad)))
    strs = bytes_of(share(["ab", "cd"] * 10))
    bad = bytearray(strs)
    seq = L.REF.unpack_from(strs, L.ROOT)[1]
    bad[seq + L.SEQ_HEAD.size + 8 * 21 :] = b"\xff" * (len(strs) - seq - L.SEQ_HEAD.size - 8 * 21)
    out.append(("a list of str whose bytes are not utf-8 (UnicodeDecodeError)", bytes(bad)))
    bad = bytearray(strs)
    L.SEQ_HEAD.pack_into(bad, seq, L.STRS, 2**40)
    out.append(("a list of str longer than the segment (struct.error)", bytes(bad)))
    big = bytes_of(share([2**70]))
    seq = L.REF.unpack_from(big, L.ROOT)[1]
    node = L.REF.unpack_from(big, seq + L.SEQ_HEAD.size)[1]
    bad = bytearray(big)
    L.U64.pack_into(bad, node, 2**40)
    out.append(("a big int longer than the segment", bytes(bad)))
    keyed = bytes_of(share([{"a": 1, "b": 2}] * 20))
    table = keyed.find(L.U64.pack(2) + L.REF_SPAN.pack(L.SPAN, 1, keyed.find(b"ab")))
    assert table > 0
    bad = bytearray(keyed)
    L.REF.pack_into(bad, table + 8, L.LIST, L.REF.unpack_from(keyed, L.ROOT)[1])
    out.append(("a key table whose key is a list (TypeError: unhashable)", bytes(bad)))
    bad = bytearray(keyed)
    L.U64.pack_into(bad, table, 2**40)
    out.append(("a key table longer than the segment", bytes(bad)))
    out.append(("a truncated segment", bytes(keyed[: len(keyed) // 2])))
    return out


def _read_all(value, depth: int = 0) -> None:
    """Read every value of ``value`` the ways a dataset does."""
    if depth > 50:
        return
    if isinstance(value, (views.SharedList, views.SharedTuple, list, tuple)):
        for i in range(len(value)):
            _read_all(value[i], depth + 1)
        for item in value:
            _read_all(item, depth + 1)
        if isinstance(value, views.SharedList) and len(value) < 64:
            np.asarray(value)
    elif isinstance(value, (views.SharedDict, dict)):
        missing = object()
        for key, item in value.items():
            _read_all(key, depth + 1)
            _read_all(item, depth + 1)
            _read_all(value.get(key, missing), depth + 1)
            assert (key in value) in (True, False)
        assert "absent" not in value
    elif isinstance(value, np.ndarray):
        bytes(value.data)  # every byte of its data read


@pytest.mark.parametrize(("what", "data"), _corruptions(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_corrupt_segment_is_one_error_type(what, data):
    with deadline(30), pytest.raises(CorruptDataError):
        _read_all(views.view_at(segment(data), L.ROOT))


# --- the wire ---------------------------------------------------------------------------


@pytest.mark.parametrize("length", [-4, -2, -(2**31), wire.MAX_FRAME + 1, 2**64 - 1])
def test_a_frame_of_an_impossible_length_is_a_protocol_error_naming_the_worker(length):
    a, b = socket.socketpair()
    try:
        reader = wire.FrameReader(b.fileno(), "worker 3")
        good = wire.frame(wire.pack(wire.RES_WAKE))
        if -(2**31) <= length < 2**31:
            stray = struct.pack("!i", length) + b"junk"
        else:
            stray = struct.pack("!iQ", -1, length) + b"junk"
        a.sendall(good + stray + good)
        with deadline(10), pytest.raises(CorruptDataError, match="worker 3"):
            while True:
                assert reader.read() is not None
        with pytest.raises(CorruptDataError, match="worker 3"):
            reader.read()  # the stream cannot be followed: it stays refused
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "decode",
    [
        wire.unpack,
        wire.ready_clocks,
        wire.ring_info,
        wire.channel_info,
        wire.epoch_info,
        wire.needed_bytes,
        lambda m: wire.task_keys(wire.TASK_SCALARS, m),
    ],
)
def test_a_message_too_short_for_its_kind_is_one_error_type(decode):
    for message in (b"", b"\x0b\x00\x00", b"\x0b\x00\x00\x00\x00\x00"):
        with pytest.raises(CorruptDataError):
            decode(message)
    with pytest.raises(CorruptDataError):  # a type char that names no integer type
        wire.task_keys(wire.TASK_SCALARS, struct.pack("<qq", ord("O"), 1) + bytes(8))


def test_a_stray_length_costs_no_more_memory_than_the_bytes_that_came():
    """A length read from stray bytes (2 GiB here) makes no 2 GiB buffer: the buffer grows
    as the message's bytes arrive."""
    a, b = socket.socketpair()
    try:
        reader = wire.FrameReader(b.fileno(), "worker 0")
        a.sendall(struct.pack("!i", 2**31 - 1) + bytes(1000))
        a.close()
        tracemalloc.start()
        try:
            while reader.read() is not None:
                pass
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < wire._GROW_FROM * 2
    finally:
        a.close()
        b.close()


def test_messages_longer_than_their_first_buffer_come_whole(monkeypatch):
    monkeypatch.setattr(wire, "_GROW_FROM", 1000)
    a, b = socket.socketpair()
    try:
        reader = wire.FrameReader(b.fileno(), "worker 0")
        messages = [os.urandom(n) for n in (999, 1000, 1001, 4097, 300_000, 0, 5)]
        sender = threading.Thread(target=lambda: (a.sendall(b"".join(map(wire.frame, messages))), a.close()))
        sender.start()
        got = []
        while (batch := reader.read()) is not None:
            got.extend(bytes(m) for m in batch)
        sender.join()
        assert got == messages
    finally:
        a.close()
        b.close()


def _fuzz(seed: int, cases: int, timeout: float) -> None:
    """Run tests/share_fuzz.py in a child: a crash or a hang there fails this test only."""
    script = os.path.join(os.path.dirname(__file__), "share_fuzz.py")
    done = subprocess.run(
        [sys.executable, script, "--seed", str(seed), "--cases", str(cases)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"{cases} cases from seed {seed}" in done.stdout


def test_seeded_mutations_of_segments_and_frames_give_values_or_one_error():
    _fuzz(0, 2000, 100)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", [1, 2])
def test_long_mutation_run(seed):
    # (20,000 cases a seed: each case now also reads its segment whole, so this is the
    # CI time the 40,000 cases of segment reads alone took; longer runs: share_fuzz.py)
    _fuzz(seed, 20_000, 1100)


def test_a_container_referring_back_to_itself_is_refused_not_recursed_into():
    """share() writes a container's children before it; a reference to a container at or
    past the node holding it (a cycle) is corrupt: whole-structure operations (copy,
    ==, repr, pickle) end in CorruptDataError, not RecursionError."""
    data = bytes_of(share([list(range(70)) for _ in range(3)]))
    outer = L.REF.unpack_from(data, L.ROOT)[1]
    bad = bytearray(data)
    L.REF.pack_into(bad, outer + L.SEQ_HEAD.size + L.REF_SIZE, L.LIST, outer)  # item 1: the list itself
    for read in (
        lambda v: v.copy(),
        lambda v: v == [list(range(70))] * 3,
        repr,
        lambda v: v[1],
        lambda v: list(v),
    ):
        with deadline(30), pytest.raises(CorruptDataError, match=r"before it|at or after"):
            read(views.view_at(segment(bad), L.ROOT))


def _plain_chain(depth: int, tags: tuple[int, ...]) -> object:
    """The plain structure share_fuzz.deep_chain(depth, tags) lays out."""
    value: object = 7
    for level in range(depth):
        tag = tags[level % len(tags)]
        value = {0: value} if tag == L.DICT else ((value,) if tag == L.TUPLE else [value])
    return value


def _whole_reads(depth: int, tags: tuple[int, ...]) -> dict[str, object]:
    """Reads of a whole chain, each recursive through every level of it."""
    top = tags[(depth - 1) % len(tags)]
    reads: dict[str, object] = {
        "copy": lambda v, data: v.copy(),
        "== another view": lambda v, data: v == views.view_at(segment(data), L.ROOT),
        "== the plain chain": lambda v, data: v == _plain_chain(depth, tags),
        "repr": lambda v, data: repr(v),
        "pickle": lambda v, data: pickle.dumps(v),
    }
    if top != L.DICT:
        reads["<"] = lambda v, data: v < views.view_at(segment(data), L.ROOT)
    if top == L.TUPLE:
        reads["hash"] = lambda v, data: hash(v)
    return reads


@pytest.mark.parametrize("depth", [L.MAX_NESTING + 1, 20_000])
@pytest.mark.parametrize(
    "tags",
    [(L.LIST,), (L.TUPLE,), (L.DICT,), (L.TUPLE, L.DICT, L.LIST)],
    ids=["lists", "tuples", "dicts", "mixed"],
)
def test_a_chain_deeper_than_share_writes_is_corrupt_not_a_recursion_error(tags, depth):
    """A hand-made chain of containers, each after its child as share() writes them (no
    loop), one level or far deeper than share() writes: a copy, ==, <, repr, pickle or
    hash of it ends in CorruptDataError, not RecursionError; read a level at a time, it
    reads."""
    data = share_fuzz.deep_chain(depth, tags)
    for read in _whole_reads(depth, tags).values():
        with deadline(30), pytest.raises(CorruptDataError, match=f"nest more than {L.MAX_NESTING}"):
            read(views.view_at(segment(data), L.ROOT), data)
    value = views.view_at(segment(data), L.ROOT)
    for _ in range(depth):
        value = value[0]  # a dict's key is 0
    assert value == 7


def test_a_structure_as_deep_as_share_writes_keeps_python_s_own_recursion_error():
    """share() takes MAX_NESTING levels: a copy of that, like a pickle of the original,
    goes past Python's recursion limit; that is a RecursionError (the segment is sound),
    not a CorruptDataError."""
    value: object = 7
    for _ in range(L.MAX_NESTING):
        value = [value]
    shared = share(value)
    with pytest.raises(RecursionError) as caught:
        shared.copy()
    assert not isinstance(caught.value, CorruptDataError)
    with pytest.raises(RecursionError, match=f"more than {L.MAX_NESTING} levels"):
        share([value])
