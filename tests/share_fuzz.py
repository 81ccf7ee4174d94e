"""Seeded mutation of real share() segments and real wire frames (run by test_share_corrupt,
in a child process: a crash or a hang fails one test, not the run).

Every case mutates a few bytes (or one 8-byte word, to values that make offsets and counts
point anywhere) of a segment or a stream of frames, then reads all of it as a dataset and
the consumer would; the only outcomes allowed are values and CorruptDataError. A case
running past its deadline is a hang. Prints one line per failure, then a summary.

    python tests/share_fuzz.py --seed 0 --cases 2000
"""

from __future__ import annotations

import argparse
import pickle
import random
import signal
import socket
import sys
import traceback
from typing import Any

import numpy as np

from shmloader import CorruptDataError, share
from shmloader.memory.shared import layout as L
from shmloader.memory.shared import nesting, views
from shmloader.memory.shared import store as store_mod
from shmloader.transport import wire

CASE_SECONDS = 5.0


class Hang(Exception):
    pass


def structures() -> list[Any]:
    """Structures of every node kind the encoder writes."""
    records = [
        {"path": f"img/{i:05d}.jpg", "label": i % 7, "ann": {"box": [1.0, 2.0, 3.0, 4.5], "crowd": False}}
        for i in range(40)
    ]
    shared = {"classes": ["a", "b"], "ids": [1, 2], "deep": [[1.5]]}
    return [
        records,
        [f"p{i}" for i in range(30)] + ["ünï", "\ud800x"],
        [*range(50), 2**70, -(2**65)],
        [0.5 * i for i in range(20)],
        {f"k{i}": [i, str(i), None] for i in range(300)},  # a dict node with buckets
        {(1, "a"): b"bytes", 2.5: None, True: (1, 2), None: "n", b"k": [1]},
        [np.arange(6, dtype=np.int32).reshape(2, 3), np.float32(1.5), np.zeros(3, "S4")],
        [np.zeros(2, dtype=[("x", "<f4"), ("y", "<i2", (2,))]), np.int64(7)],
        (("t", 1), [("u", 2.0)] * 20, {"nested": {"deep": [[1, 2], [3]]}}),
        [[i, i + 1] for i in range(20)] + [(i,) for i in range(20)],
        [{"p": i, "meta": shared} for i in range(20)]
        + [shared, [shared, shared]],  # one node, many references
    ]


def deep_chain(depth: int, tags: tuple[int, ...] = (L.LIST,)) -> bytes:
    """A hand-made segment: one container holding the next, ``depth`` levels down (each
    level's tag the next of ``tags``), every node after its child as share() writes them:
    a path with no loop, only deeper than share() writes (layout.MAX_NESTING)."""
    buf = bytearray(L.ROOT + L.REF_SIZE)
    buf[: L.HEADER.size] = L.MAGIC
    ref = L.REF_INT.pack(L.INT, 7)
    for level in range(depth):
        tag, off = tags[level % len(tags)], len(buf)
        if tag == L.DICT:  # one key, 0, whose hash is scanned (a small dict)
            buf += L.DICT_HEAD.pack(1, 0) + L.U32.pack(L.key_hash(0)) + bytes(4)
            buf += L.REF_INT.pack(L.INT, 0) + ref
        else:
            buf += L.SEQ_HEAD.pack(L.REFS, 1) + ref
        ref = L.REF.pack(tag, off)
    buf[L.ROOT : L.ROOT + L.REF_SIZE] = ref
    return bytes(buf)


_WORDS = (0, 1, 7, 8, 16, 2**31, 2**32, 2**63 - 8, 2**63, 2**64 - 1, 2**64 - 16)


def mutate(data: bytearray, rng: random.Random, hot: list[int] | None = None) -> None:
    """A few random bytes, or one aligned 8-byte word set to a value that sends an offset or
    a count anywhere (the segment's size and its neighbours included). ``hot``: offsets
    where most mutations land (a stream's frame heads)."""

    def place() -> int:
        if hot and rng.random() < 0.8:
            return min(len(data) - 1, rng.choice(hot) + rng.randrange(16))
        return rng.randrange(len(data))

    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 4)):
            data[place()] = rng.choice((0, 0xFF, 0x7F, 0x80, 0xFE, rng.randrange(256)))
    elif hot:
        at = min(len(data) - 4, place())
        data[at : at + 4] = rng.choice((-1, -2, -4, 2**31 - 1, 0, 3, 17)).to_bytes(4, "big", signed=True)
    else:
        at = rng.randrange(len(data) // 8) * 8
        word = rng.choice((*_WORDS, len(data), len(data) - 8, len(data) + 8, rng.randrange(len(data))))
        data[at : at + 8] = word.to_bytes(8, "little")


def read_all(value: Any, depth: int = 0) -> None:
    """Read every value of ``value`` the ways a dataset does: indexing, iteration,
    lookups of its keys, numpy conversion."""
    if depth > 40:
        return
    if isinstance(value, (views.SharedList, views.SharedTuple, list, tuple)):
        n = len(value)
        for i in range(min(n, 200)):
            read_all(value[i], depth + 1)
        for count, item in enumerate(value):
            if count >= 200:
                break
            read_all(item, depth + 1)
        if n:
            value[-1]
            value[: min(n, 5)]
        if isinstance(value, views.SharedList) and value._form in (L.INTS, L.FLOATS):
            np.asarray(value)
    elif isinstance(value, (views.SharedDict, dict)):
        missing = object()
        for count, (key, item) in enumerate(value.items()):
            if count >= 300:
                break
            read_all(key, depth + 1)
            read_all(item, depth + 1)
            value.get(key, missing)
            key in value  # noqa: B015 - the lookup is what is read
        "absent" in value  # noqa: B015
        (1, "absent") in value  # noqa: B015
    elif isinstance(value, np.ndarray):
        bytes(value.tobytes())


def read_whole(value: Any) -> None:
    """Read ``value`` whole the ways a program does, each recursive through every level:
    a copy, ``==`` with it (only run: a NaN or an array makes its answer no test),
    ``repr``, a pickle. A RecursionError only where the structure is as deep as one
    share() writes (Python refuses the original's copy alike): deeper is corrupt."""
    if not isinstance(value, (views.SharedList, views.SharedTuple, views.SharedDict)):
        return
    try:
        copied = value.copy()
        try:
            value == copied  # noqa: B015 - the comparison is what is read
        except ValueError as exc:
            if "truth value of a" not in str(exc):
                raise
        repr(value)
        pickle.dumps(value)
    except RecursionError:
        try:
            nesting.check(value._store, value._tag(), value._pos)
        except CorruptDataError as exc:
            raise AssertionError(f"a RecursionError where the segment is corrupt: {exc}") from None


def read_chain(value: Any) -> None:
    """Follow a chain of one-item containers down to its end, one read a level."""
    while isinstance(value, (views.SharedList, views.SharedTuple, views.SharedDict, list, tuple, dict)):
        if not value:
            return
        value = next(iter(value.values())) if isinstance(value, (dict, views.SharedDict)) else value[0]


def segment_case(data: bytes, rng: random.Random, chain: bool) -> None:
    """Read a mutated copy of ``data`` every way; ``chain``: the segment is a chain of one
    item a level (read down, not fanned out at every level: that would be 2**depth reads)."""
    bad = bytearray(data)
    mutate(bad, rng)
    store = store_mod.create(bytes(bad))
    if chain:
        read_chain(views.view_at(store, L.ROOT))
    else:
        read_all(views.view_at(store, L.ROOT))
        read_all(views.value_at(store, L.ROOT, store.size))
    read_whole(views.view_at(store, L.ROOT))


def frames() -> tuple[bytes, list[int]]:
    """A stream of real frames of every fixed layout, a task's keys and a message longer
    than a read; and where each frame starts."""
    scalars = wire.task_payload([np.int64(3), np.int64(4)])[1]
    keys = wire.task_payload([(1, 2), "k"])[1]
    parts = (
        wire.channel_frame(64, 4096),
        wire.ring_frame(8, 1 << 20),
        wire.epoch_frame(12345, True, 7, None),
        wire.frame(wire.pack(wire.TASK_SCALARS, 0, 3, scalars)),
        wire.frame(wire.pack(wire.TASK_KEYS, 1, 4, keys)),
        wire.ready_frame(2, 9, 100, 200, 300),
        wire.task_wake_frame(),
        wire.frame(wire.pack(wire.RES_SEGMENT, 0, 5, wire.size_payload(1 << 16))),
        wire.frame(bytes(70_000)),
        wire.result_wake_frame(),
    )
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part))
    return b"".join(parts), starts[:-1]


def decode(message: Any) -> None:
    """Decode ``message`` as the side receiving its kind does (a pickled payload aside:
    the peer that pickles it is trusted with more than bytes)."""
    kind = wire.unpack(message)[0]
    if kind == wire.TASK_CHANNEL:
        wire.channel_info(message)
    elif kind == wire.TASK_RING:
        wire.ring_info(message)
    elif kind == wire.TASK_EPOCH:
        wire.epoch_info(message)
    elif kind == wire.TASK_SCALARS:
        wire.task_keys(kind, wire.body(message))
    elif kind == wire.RES_READY:
        wire.ready_clocks(message)
    elif kind in (wire.RES_SEGMENT, wire.RES_PICKLED):
        wire.needed_bytes(wire.body(message))


def frame_case(stream: bytes, starts: list[int], rng: random.Random) -> None:
    bad = bytearray(stream)
    mutate(bad, rng, starts)
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        reader = wire.FrameReader(b.fileno(), "worker 0")
        pos = 0
        while True:
            if pos < len(bad):
                try:
                    pos += a.send(bad[pos : pos + rng.choice((7, 4096, 1 << 16))])
                except BlockingIOError:
                    pass
            elif a.fileno() >= 0:
                a.close()
            messages = reader.read()
            if messages is None:
                return
            for message in messages:
                decode(message)
    finally:
        a.close()
        b.close()


def run(seed: int, cases: int) -> int:
    """Run ``cases`` cases from ``seed``; the number of failures (each printed)."""
    rng = random.Random(seed)
    segments = [bytes(share(s)._store.mm) for s in structures()]
    chains = len(segments)  # segments from here on are hand-made chains
    segments += [deep_chain(L.MAX_NESTING + 100), deep_chain(3000, (L.DICT, L.TUPLE, L.LIST))]
    stream, starts = frames()

    def expired(signum: int, frame: Any) -> None:
        raise Hang

    signal.signal(signal.SIGALRM, expired)
    failures = refused = 0
    for case in range(cases):
        state = rng.getstate()
        what = "frames" if rng.random() < 0.25 else f"segment {rng.randrange(len(segments))}"
        signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
        try:
            if what == "frames":
                frame_case(stream, starts, rng)
            else:
                index = int(what.split()[1])
                segment_case(segments[index], rng, index >= chains)
        except CorruptDataError:
            refused += 1
        except Hang:
            failures += 1
            print(f"case {case} ({what}): still running after {CASE_SECONDS} s (state {hash(state)})")
        except Exception:
            failures += 1
            print(f"case {case} ({what}): {traceback.format_exc(limit=-3)}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    print(f"{cases} cases from seed {seed}: {refused} refused with CorruptDataError, {failures} failures")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=2000)
    args = parser.parse_args()
    sys.exit(1 if run(args.seed, args.cases) else 0)


if __name__ == "__main__":
    main()
