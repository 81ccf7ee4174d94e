"""A fresh loader's first epoch (issue 14, part 2): the behaviour its speed relies on.

- Each worker's first batch comes apart (pickled when small, else a one-off segment: see
  test_variable) and is correct; every later batch is a view of the ring, under every
  start method.
- A forked worker is handed what the consumer already knows at its start (whether torch
  has devices to seed, whether the dataset is a DataPipe), instead of working it out.
- Workers do not pre-fault the whole ring: a worker's pages of the ring are only those of
  the slots it wrote, and each worker writes into its own share of the slots; the ring
  is made sparse (where the kernel has MADV_POPULATE_WRITE): only the slots written are
  reserved.
- The first ring of big batches is made on a thread (shmloader.memory.ringmaker): its errors come
  out in the consumer, nothing is left running, and a fork waits for a ring being made.
- Held batches keep their values while claims go worker by worker and the ring grows.

Behaviour only: the timings are the benchmark's (``shmloader bench``, its cold column).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np
import pytest

from shmloader import Dataset, RingLimitError, get_worker_info
from shmloader.memory.ring import populate_supported
from shmloader.memory.ringmaker import BACKGROUND_MIN_BATCH_BYTES, RingMaker

from .datasets import NumpyLoader as DataLoader


class Tagged(Dataset):
    """Sample i: ``side`` float32 values equal to i, then i, the loading worker's id and pid."""

    def __init__(self, n: int, side: int = 256):
        self.n = n
        self.side = side

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        return np.full(self.side, i, np.float32), i, -1 if info is None else info.id, os.getpid()


def _check(batch, first: int, size: int) -> None:
    values, index, _, _ = batch
    assert index.tolist() == list(range(first, first + size))
    assert (values == index[:, None]).all(), "a batch holds its own samples' values"


def _ring_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shmloader-ring"]


_BIG = BACKGROUND_MIN_BATCH_BYTES // 4 // 4  # float32 values a sample: batches of 4 get a ring maker


@pytest.mark.timeout(60)
def test_first_batches_come_apart_and_the_rest_from_the_ring(method, monkeypatch):
    _first_batches(method, _BIG, monkeypatch)  # big batches: the ring is made on a thread


@pytest.mark.timeout(60)
def test_small_first_batches_make_their_ring_in_line(monkeypatch):
    _first_batches("fork", 256, monkeypatch)  # (the in-line path: test_variable, every method)


def _first_batches(method: str, side: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmloader.epoch import rings

    made: list[int] = []

    class Counted(RingMaker):
        def __init__(self, leases, batch_bytes, like):
            made.append(batch_bytes)
            super().__init__(leases, batch_bytes, like)

    monkeypatch.setattr(rings, "RingMaker", Counted)
    dl = DataLoader(Tagged(48, side), batch_size=4, num_workers=2, multiprocessing_context=method)
    in_ring = []
    for b, batch in enumerate(dl):
        _check(batch, 4 * b, 4)
        in_ring.append(dl.ring is not None and dl.ring.contains(batch[0]))
    assert in_ring == [False, False] + [True] * 10, "each worker's first batch sized the ring"
    assert dl.stats()["batches_copied"] == 2 and dl.stats()["rings_created"] == 1
    # Big batches: the ring was made on a thread, once; small ones: in line.
    assert len(made) == (1 if side == _BIG else 0)
    assert not _ring_threads()


def _ring_rss(pid: int, size: int) -> int:
    """Resident bytes of the ``size``-byte shmloader mapping of process ``pid``."""
    found, rss = False, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found = hi - lo >= size and hi - lo - size < 4096 and "shmloader" in line
            elif found and fields[0] == "Rss:":
                rss = int(fields[1]) * 1024
                found = False
    assert rss is not None, f"no shmloader mapping of {size} bytes in process {pid}"
    return rss


@pytest.mark.timeout(60)
def test_each_worker_faults_in_only_its_own_slots():
    dl = DataLoader(Tagged(4 * 40, side=16384), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        _each_worker_faults_in_only_its_own_slots(dl)
    finally:
        dl.shutdown()


def _each_worker_faults_in_only_its_own_slots(dl: DataLoader) -> None:
    slots: dict[int, set[int]] = {0: set(), 1: set()}
    pids = {}
    for b, batch in enumerate(dl):  # one batch held at a time (and the previous, during next())
        _check(batch, 4 * b, 4)
        ring = dl.ring
        if ring is not None and ring.contains(batch[0]):
            start = batch[0].__array_interface__["data"][0] - ring.mapping.address
            wid = int(batch[2][0])
            slots[wid].add((start - ring.slot_offset(0)) // ring.slot_stride)
            pids[wid] = int(batch[3][0])
    del batch
    assert dl.stats()["rings_created"] == 1
    share = ring.num_slots // 2
    assert slots[0] and slots[1] and not slots[0] & slots[1], f"slots written: {slots}"
    assert all(len(s) <= share for s in slots.values()), f"each within its share: {slots}"
    if populate_supported():
        # A sparse ring: the memory reserved is the control area and the slots written.
        written = len(slots[0]) + len(slots[1])
        reserved = os.fstat(ring.fd).st_blocks * 512
        assert reserved <= ring.slot_offset(0) + written * (ring.slot_stride + 2 * 4096), (reserved, slots)
    for wid, pid in pids.items():
        # Not pre-faulted: a worker maps the ring's control pages and the slots it wrote.
        rss = _ring_rss(pid, ring.total_bytes)
        assert rss <= ring.slot_offset(0) + len(slots[wid]) * ring.slot_stride + 4096, (wid, rss)
        assert rss < ring.total_bytes // 2


@pytest.mark.timeout(60)
def test_held_batches_keep_their_values_while_the_ring_grows():
    dl = DataLoader(Tagged(4 * 24, side=4096), batch_size=4, num_workers=2)
    kept = list(dl)  # every batch held: the ring grows past its 8 slots
    assert dl.stats()["rings_created"] >= 2
    for b, batch in enumerate(kept):
        _check(batch, 4 * b, 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", [256, _BIG], ids=["small", "big"])
def test_a_ring_that_cannot_be_made_fails_in_the_consumer_and_leaves_nothing(side):
    dl = DataLoader(Tagged(48, side), batch_size=4, num_workers=2, max_shm_bytes=4096)
    got = []
    with pytest.raises(RingLimitError, match="max_shm_bytes=4096"):
        for batch in dl:
            got.append(batch[1].tolist())
    assert got in ([], [[0, 1, 2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]]), "only the batches made apart"
    assert not _ring_threads()
    assert dl.ring is None


class _SlowLeases:
    """Stands in for leases.Leases: ring_for_batch takes ``delay`` s, or raises ``error``;
    ``cheap``: its rings are sparse (made in line)."""

    def __init__(self, delay: float, error: BaseException | None = None, cheap: bool = False):
        self.delay = delay
        self.error = error
        self.cheap = cheap

    def rings_are_cheap(self) -> bool:
        return self.cheap

    def warnings_deferred(self):
        return contextlib.nullcontext()

    def emit_warnings(self) -> None:
        pass

    def ring_for_batch(self, batch_bytes: int, like):
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return ("ring", batch_bytes, like)


def test_ring_maker_hands_over_its_ring_or_its_error():
    maker = RingMaker(_SlowLeases(0.05), 1000, None)
    assert maker.result() == ("ring", 1000, None) and maker.done()
    failing = RingMaker(_SlowLeases(0.0, RingLimitError("no room (test)")), 1000, None)
    with pytest.raises(RingLimitError, match="no room"):
        failing.result()
    assert not _ring_threads()


def test_a_sparse_ring_is_made_in_line_when_the_first_batch_arrives():
    maker = RingMaker(_SlowLeases(0.0, cheap=True), 1000, None)
    assert maker.done() and not _ring_threads(), "no thread for a ring that takes ~0.5 ms"
    assert maker.result() == ("ring", 1000, None)
    failing = RingMaker(_SlowLeases(0.0, RingLimitError("no room (test)"), cheap=True), 1000, None)
    with pytest.raises(RingLimitError, match="no room"):
        failing.result()  # raised where the ring is taken, as from a thread


def test_a_fork_waits_for_the_ring_being_made():
    maker = RingMaker(_SlowLeases(0.3), 1000, None)
    assert not maker.done()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not _ring_threads() else 1)  # the child copies no maker thread
    assert maker.done(), "the fork waited for the maker (an at-fork hook)"
    assert os.waitpid(pid, 0)[1] == 0
    assert maker.result() == ("ring", 1000, None)


def _only_in(pid: int, real):
    """``real``, callable in process ``pid`` only: a worker that calls it exits with 3."""

    def guarded(*args):
        if os.getpid() != pid:
            os._exit(3)
        return real(*args)

    return guarded


@pytest.mark.timeout(60)
def test_forked_workers_are_told_what_the_consumer_knows(monkeypatch):
    pytest.importorskip("torch")
    from shmloader.batch import recipe as fetch
    from shmloader.workers import seeding

    # A spy must replace the probe the module calls itself: only then does a call in a worker show.
    monkeypatch.setattr(seeding, "_cpu_only", _only_in(os.getpid(), seeding._cpu_only))
    monkeypatch.setattr(fetch, "is_datapipe", _only_in(os.getpid(), fetch.is_datapipe))
    dl = DataLoader(Tagged(16, 4), batch_size=4, num_workers=2, multiprocessing_context="fork")
    for b, batch in enumerate(dl):
        _check(batch, 4 * b, 4)


def test_a_new_ring_reads_the_memory_budget_once(monkeypatch):
    """The leases' check of a new ring and the ring's own check before it reserves share
    one reading of the budget (cgroup and /proc files: read while the first batch waits)."""
    from shmloader.memory.leases import Leases
    from shmloader.system import limits as memory

    leases = Leases(8, None, None, {"rings_created": 0}, num_workers=2)
    reads = []
    real = memory.budget
    monkeypatch.setattr(memory, "budget", lambda kind: reads.append(kind) or real(kind))
    ring = leases.new_ring(8, 4096)
    assert len(reads) == 1 and ring.num_slots == 8
    ring.close_fd()


@pytest.mark.timeout(60)
def test_no_worker_holds_another_workers_socket():
    """Every worker is made (socket pair, process, channel) before the first fork, yet no
    worker inherits a later one's end of its socket: a killed worker's socket reads EOF
    in the consumer at once."""
    import select
    import signal

    dl = DataLoader(Tagged(64, 4), batch_size=4, num_workers=2, multiprocessing_context="fork")
    it = iter(dl)
    next(it)
    last = it.workers[-1]
    os.kill(last.proc.pid, signal.SIGKILL)
    last.proc.join(10)
    poller = select.poll()
    poller.register(last.fd, select.POLLIN | select.POLLRDHUP)
    events = dict(poller.poll(5000))
    assert events.get(last.fd, 0) & (select.POLLHUP | select.POLLRDHUP), "its socket's other end is held open"
    del it
