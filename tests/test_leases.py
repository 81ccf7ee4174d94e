"""Slot leases (issue 12, items 1, 2, 8): a held slot is never rewritten.

Only the process that holds a slot releases it (a forked child inherits the release
finalizers); a batch a forked child can see stays unchanged after the parent drops it;
a slot's state is returned whatever raises between claim and hand-out. The sizing
policy is one (sizing.py, its names still importable from leases.py), used by the loader,
doctor and bench.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from shmloader import doctor
from shmloader.memory import sizing
from shmloader.memory.ring import ring_bytes
from shmloader.system import slots as _slots

from . import datasets as D
from .datasets import NumpyLoader as DataLoader  # numpy output: these tests check numpy views
from .faultcases import alive

FORK = {"multiprocessing_context": "fork"}


def slot_of(ring, array) -> int:
    """The slot of ``ring`` whose memory ``array`` views."""
    assert ring.contains(array)
    offset = array.__array_interface__["data"][0] - ring.mapping.address - ring.control_bytes
    return offset // ring.slot_stride


def run_child(fn) -> int:
    """Fork; run ``fn()`` in the child (its return value is the exit status); the
    child's exit status in the parent."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# --- item 1: only the owning process releases ----------------------------------------------


def test_a_forked_child_dropping_a_batch_does_not_free_the_parents_slot():
    dl = DataLoader(D.Squares(64), batch_size=4, num_workers=2, slot_bytes=4096, **FORK)
    it = iter(dl)
    x, y = next(it)
    ring = dl.ring
    slot = slot_of(ring, x)
    assert ring.states.load(slot) == _slots.HELD

    def child() -> int:
        nonlocal x, y
        x = y = None  # the child's copies of the batch die: its inherited finalizer runs
        gc.collect()
        return 0

    assert run_child(child) == 0
    assert ring.states.load(slot) == _slots.HELD, "the child freed a slot the parent holds"
    expect = x.copy()
    rest = [b[1].tolist() for b in it]  # slots are reused: never the one we hold
    assert np.array_equal(x, expect)
    assert len(rest) == 15
    del x, y
    gc.collect()
    assert ring.states.load(slot) == _slots.FREE, "the parent releases its own slot"


class Allocates:
    """A dataset whose __getitem__ allocates a little: enough to run the worker's
    garbage collector, which clears what the worker inherited from the consumer."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> np.ndarray:
        _ = [[] for _ in range(50)]
        return np.full(8, i, np.int64)


def test_the_next_epochs_workers_do_not_free_batches_kept_through_cycles():
    """The issue's reproducer: default settings (fork workers, not persistent); the loop
    keeps a reference cycle to each batch and keeps some batches with a copy. Before,
    the next epoch's workers freed the held slots and the kept batches changed ("slot N
    holds batch M")."""
    dl = DataLoader(Allocates(), num_workers=2, **FORK)
    kept = []
    for epoch in range(10):
        for i, b in enumerate(dl):
            step = {"b": b}
            step["me"] = step  # collected by the cyclic gc only
            if i % 5 == 0:
                kept.append((epoch, i, b, b.copy()))
        for e, i, view, copy in kept:
            assert np.array_equal(view, copy), f"epoch {e} batch {i} changed after epoch {epoch}"
    assert len(kept) == 200


# --- item 2: a batch a forked child can see is never rewritten ----------------------------


def test_a_batch_a_forked_child_holds_is_not_rewritten():
    dl = DataLoader(D.Squares(200), batch_size=4, num_workers=2, **FORK)
    it = iter(dl)
    for _ in range(4):  # past the first batches (their own segments): now from the ring
        x, y = next(it)
    assert dl.ring.contains(x)
    expect_x, expect_y = x.copy(), y.copy()
    held = {"batch": (x, y)}
    del x, y
    r, w = os.pipe()

    def child() -> int:
        os.close(w)
        os.read(r, 1)  # the parent has gone through the whole ring meanwhile
        x, y = held["batch"]
        same = np.array_equal(x, expect_x) and np.array_equal(y, expect_y)
        return 0 if same else 3

    try:
        code_pid = os.fork()
        if code_pid == 0:  # pragma: no cover - child
            code = 1
            try:
                code = child()
            finally:
                os._exit(code)
        os.close(r)
        held.clear()  # the parent drops the batch the child still sees
        rings = dl.stats()["rings_created"]
        n = sum(1 for _ in it)  # 46 batches: every slot of a ring would be reused
        assert n == 46
        os.write(w, b"x")
    finally:
        os.close(w)
    _, status = os.waitpid(code_pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's batch changed under it"
    assert dl.stats()["rings_created"] == rings + 1, "the shared ring was retired, once"


def test_the_loaders_own_worker_starts_retire_no_ring():
    """Non-persistent fork workers start each epoch while the consumer holds the last
    batch of the one before: they cannot see it, so the ring stays."""
    dl = DataLoader(D.Squares(40), batch_size=4, num_workers=2, **FORK)
    last = None
    for _ in range(3):
        for b in dl:
            last = b  # holds the epoch's last batch while the next epoch's workers start
    assert dl.ring.contains(last[0])
    assert dl.stats()["rings_created"] == 1


def test_a_fork_while_no_slot_is_held_retires_no_ring():
    dl = DataLoader(D.Squares(80), batch_size=4, num_workers=2, **FORK)
    it = iter(dl)
    for _ in range(4):
        b = next(it)
    del b
    gc.collect()
    assert run_child(lambda: 0) == 0
    assert sum(1 for _ in it) == 16
    assert dl.stats()["rings_created"] == 1


# --- item 8: the slot comes back whatever raises --------------------------------------------


def _explode() -> None:
    raise ValueError("this leaf cannot be rebuilt in the consumer")


class Bomb:
    """An object leaf that pickles in the worker and raises when the consumer unpickles
    it: a failure between the slot's claim and its hand-out."""

    def __reduce__(self):
        return (_explode, ())


def bomb_collate(samples):
    return {"x": np.stack([s[0] for s in samples]), "bomb": Bomb()}


def assert_no_slot_held(ring) -> None:
    gc.collect()
    states = [ring.states.load(i) for i in range(ring.num_slots)]
    assert _slots.HELD not in states, states


def test_a_batch_that_fails_to_build_returns_its_slot():
    dl = DataLoader(
        D.Squares(128), batch_size=4, num_workers=2, collate_fn=bomb_collate, slot_bytes=4096, **FORK
    )
    ring = dl.ring
    it = iter(dl)
    failures = 0
    for _ in range(32):
        with pytest.raises(ValueError, match="cannot be rebuilt"):
            next(it)
        failures += 1
    assert failures == 32
    assert dl.stats()["rings_created"] == 1, "the ring grew for slots leaked by failed batches"
    assert next(it, None) is None
    assert_no_slot_held(ring)


class Strings:
    """Samples with a '<U1' leaf next to a numeric one."""

    def __len__(self) -> int:
        return 128

    def __getitem__(self, i: int):
        return {"x": np.full(2, i, np.int64), "s": np.array("ab"[i % 2])}


def test_torch_output_of_a_non_numeric_leaf_leaks_no_slot():
    """Whatever output="torch" does with a '<U1' leaf (raise, or pass it through), no
    slot stays HELD and the ring does not grow for nothing."""
    pytest.importorskip("torch")
    dl = DataLoader(Strings(), batch_size=4, num_workers=2, output="torch", slot_bytes=4096, **FORK)
    ring = dl.ring
    it = iter(dl)
    for _ in range(32):
        try:
            next(it)
        except (TypeError, ValueError):
            pass
    assert dl.stats()["rings_created"] == 1
    del it
    assert_no_slot_held(ring)


def test_a_failing_reader_in_copy_mode_returns_its_slot(monkeypatch):
    dl = DataLoader(D.Squares(64), batch_size=4, num_workers=2, slot_bytes=4096, copy=True, **FORK)
    ring = dl.ring
    it = iter(dl)
    next(it)

    def failing(key):
        raise RuntimeError("reader failed")

    it.readers.clear()  # the next batch's layout is decoded again: that raises
    monkeypatch.setattr("shmloader.batch.handout.decode", failing)
    with pytest.raises(RuntimeError, match="reader failed"):
        next(it)
    assert_no_slot_held(ring)
    it.close()


# --- sizing policy ------------------------------------------------------------------------


def test_one_sizing_policy_for_loader_doctor_and_bench():
    dl = DataLoader(D.Squares(40), batch_size=4, num_workers=3, prefetch_factor=3)
    assert dl.num_slots == sizing.default_num_slots(3, 3) == 3 * 3 + sizing.HELD_SLOTS_RESERVE
    total, slots, slot_bytes = doctor.default_ring_bytes(2, 10_000)
    assert (total, slots, slot_bytes) == sizing.default_ring(2, 10_000)
    assert slots == sizing.default_num_slots(2)
    assert slot_bytes == sizing.slot_bytes_for(10_000) >= 10_000
    assert total == ring_bytes(slots, slot_bytes)


def test_the_first_ring_is_sized_by_the_policy():

    dl = DataLoader(D.Squares(40, side=16), batch_size=4, num_workers=2, **FORK)
    for _ in dl:
        pass
    ring = dl.ring
    batch_bytes = 4 * 16 * 16 * 4 + 4 * 8
    assert ring.num_slots == sizing.default_num_slots(2)
    assert sizing.slot_bytes_for(batch_bytes) <= ring.slot_bytes <= sizing.slot_bytes_for(batch_bytes + 256)
    assert dl.pinned_shm_bytes() == ring.total_bytes


# --- the lease mechanism, without workers ---------------------------------------------------


class RecordingPinner:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, states, slot: int) -> None:
        self.released.append(slot)


def test_a_lease_frees_its_slot_in_its_own_process_only(monkeypatch):
    from shmloader.memory import leases
    from shmloader.memory.ring import Ring

    ring = Ring.create(2, 4096)
    try:
        ring.states.store(1, _slots.HELD)
        root = np.frombuffer(ring.slot_buffer(1), np.uint8)
        leases.lease(root, ring, 1)
        monkeypatch.setattr(leases, "_this_pid", -1)  # as in a forked child
        del root
        assert ring.states.load(1) == _slots.HELD
        monkeypatch.undo()
        ring.states.store(1, _slots.HELD)
        root = np.frombuffer(ring.slot_buffer(1), np.uint8)
        leases.lease(root, ring, 1)
        del root
        assert ring.states.load(1) == _slots.FREE
    finally:
        ring.close_fd()


def test_a_lease_releases_through_the_pinner_it_was_taken_with():
    """A ring first leased without a pinner (copy=True, a segment) and later with one:
    each lease releases as it was taken."""
    from shmloader.memory import leases
    from shmloader.memory.ring import Ring

    ring = Ring.create(2, 4096)
    pinner = RecordingPinner()
    try:
        for pin, state in ((None, _slots.FREE), (pinner, _slots.HELD), (None, _slots.FREE)):
            ring.states.store(0, _slots.HELD)
            root = np.frombuffer(ring.slot_buffer(0), np.uint8)
            leases.lease(root, ring, 0, pin)
            del root
            assert ring.states.load(0) == state
        assert pinner.released == [0]
    finally:
        ring.close_fd()


def test_doctor_fails_a_ring_the_loaders_default_limit_refuses(monkeypatch):
    """The posix backend's default max_shm_bytes is half of /dev/shm's free space: a ring
    that passes it gets fewer slots (WARN), down to workers + 2; below that the loader
    refuses (FAIL). With memfd, /dev/shm does not hold rings: never a FAIL."""

    total, slots, slot_bytes = doctor.default_ring_bytes(2, 10 * 2**20)
    least = ring_bytes(sizing.min_num_slots(2), slot_bytes)
    free = least * 3 // 2  # the minimum ring fits /dev/shm, but not half of it

    class Stat:
        f_frsize = 1
        f_blocks = 2 * free
        f_bavail = free
        f_flag = 0

    monkeypatch.setattr(doctor.os, "statvfs", lambda path: Stat())
    check = doctor.check_shm(2, 10 * 2**20, "posix")
    assert check.status == doctor.FAIL and "max_shm_bytes" in check.detail, check
    assert "max_shm_bytes" in check.remedy and "--shm-size" in check.remedy
    assert doctor.check_shm(2, 10 * 2**20, "memfd").status == doctor.OK
    Stat.f_bavail = total * 3 // 2  # the minimum fits half of it: fewer slots
    fit = sizing.fit_slots(slots, slot_bytes, Stat.f_bavail // 2, sizing.min_num_slots(2))
    assert fit is not None and sizing.min_num_slots(2) <= fit < slots
    check = doctor.check_shm(2, 10 * 2**20, "posix")
    assert check.status == doctor.WARN and f"gets {fit} slots" in check.detail, check
    Stat.f_bavail = 3 * total  # within half: a warning (few such rings fit)
    check = doctor.check_shm(2, 10 * 2**20, "posix")
    assert check.status == doctor.WARN and "such ring(s) fit" in check.detail, check
    Stat.f_flag = os.ST_RDONLY  # read-only: nothing goes there (posix), nothing needs it (memfd)
    check = doctor.check_shm(2, 10 * 2**20, "posix")
    assert check.status == doctor.FAIL and "read-only" in check.detail and "memfd" in check.remedy
    assert doctor.check_shm(2, 10 * 2**20, "memfd").status == doctor.OK


def test_a_ring_limit_when_a_persistent_epoch_starts_stops_the_workers():
    """Persistent workers: the next epoch's first tasks need slots the consumer still
    holds, and the ring may not grow: the error comes from the epoch's first next()
    (iter() alone starts nothing) with the workers stopped (they were left running)."""
    limit = ring_bytes(8, 4096) + 4096
    dl = DataLoader(
        D.Squares(20),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        slot_bytes=4096,
        max_shm_bytes=limit,
        **FORK,
    )
    kept = list(dl)  # 5 batches held in 8 slots
    it = dl.persistent_iterator
    pids = [w.proc.pid for w in it.workers]
    again = iter(dl)
    with pytest.raises(MemoryError, match="max_shm_bytes"):
        next(again)
    assert it.closed and not [pid for pid in pids if alive(pid)]
    assert len(kept) == 5
    del kept


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_a_batch_of_scalars_holds_its_slot_while_a_view_of_it_lives(output):
    """A batch that is one 1-d array (scalars, batch_size 1: read by the reader's shortest
    path) views its slot's root: a slice of it keeps the slot HELD, and its death frees it."""
    if output == "torch":
        pytest.importorskip("torch")
    dl = DataLoader(np.arange(40, dtype=np.int64), batch_size=1, num_workers=1, output=output)
    it = iter(dl)
    batches = [next(it) for _ in range(4)]  # (the first came in its own segment)
    part = batches[-1][0:1]  # a view of the last batch, not the batch itself
    assert int(part[0]) == 3
    ring = dl.ring
    del batches
    gc.collect()

    def held() -> int:
        return [ring.states.load(i) for i in range(ring.num_slots)].count(_slots.HELD)

    assert held() == 1, "the view's slot is held"
    del part
    gc.collect()
    assert held() == 0, "its death frees it"
    for _ in it:
        pass
