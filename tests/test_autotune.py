"""``num_workers="auto"``, ``prefetch_factor="auto"`` and prefetch across the epoch
boundary (issue 16, part 3), with real worker processes.

The tuner's signals are the loader's own clocks (timing.py) and the idle time of the
cores (/proc/stat). On a shared test machine no core may be free, so the cases that must
grow make the free-core test pass (``FREE_CORE``) and give the tuner a fixed number of
cores (``usable_cores``); the cases that must not grow make it fail. Every case compares
its batches with a run at a fixed ``num_workers``: the batches never change.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import shmloader
from shmloader import DataLoader, WorkerRestartWarning
from shmloader.system import slots as _slots
from shmloader.tuning import autotune

pytestmark = pytest.mark.timeout(60)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Burner:
    """Map-style samples that burn ``cost`` seconds of CPU each, with a per-sample random
    draw (shmloader.sample_rng), and report the worker that loaded them."""

    def __init__(self, n: int, cost: float) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        _spin(self.cost)
        info = shmloader.get_worker_info()
        return {
            "x": np.full(8, shmloader.sample_rng(i).random(), np.float64),
            "i": i,
            "wid": info.id if info is not None else -1,
            "seen": info.num_workers if info is not None else 0,
        }


class Stream(shmloader.IterableDataset):
    """0..11, split between the workers."""

    def __iter__(self):
        info = shmloader.get_worker_info()
        return iter(range(info.id, 12, info.num_workers))


def _plain(batch: dict) -> tuple:
    """A batch's contents, without the worker that loaded it."""
    return (np.asarray(batch["x"]).tolist(), np.asarray(batch["i"]).tolist())


@pytest.fixture
def free_cores(monkeypatch):
    """The tuner sees ``cores`` usable cores and a core free in every window."""

    def give(cores: int) -> None:
        monkeypatch.setattr(autotune, "usable_cores", lambda: cores)
        monkeypatch.setattr(autotune, "FREE_CORE", -1.0)
        # Short windows: the decisions come early in a short epoch, however fast this
        # machine loads it.
        monkeypatch.setattr(autotune, "WINDOW_S", 0.05)

    return give


def test_auto_workers_grow_mid_epoch_and_the_batches_are_those_of_a_fixed_count(free_cores):
    free_cores(3)
    data = Burner(256, 0.002)
    loader = DataLoader(data, batch_size=4, num_workers="auto", shuffle=True, seed=7)
    assert loader.num_workers == 1  # the count in use: it starts with one worker
    got, wids, seen = [], set(), set()
    for batch in loader:
        got.append(_plain(batch))
        wids.update(np.asarray(batch["wid"]).tolist())
        seen.update(np.asarray(batch["seen"]).tolist())
    auto = loader.stats()["autotune"]
    assert loader.num_workers == 3 == auto["num_workers"], auto
    assert [c["num_workers"] for c in auto["changes"]] == [2, 3], auto
    assert all(c["waited_share"] > 0.1 for c in auto["changes"])
    assert wids == {0, 1, 2}  # the added workers loaded batches, in the same epoch
    assert seen == {3}  # get_worker_info().num_workers: the most the loader may start
    fixed = DataLoader(data, batch_size=4, num_workers=2, shuffle=True, seed=7)
    assert got == [_plain(b) for b in fixed]
    # The next epoch starts with the count reached (and still equals a fixed count's).
    again = [_plain(b) for b in loader]
    assert loader.num_workers == 3
    assert again == [_plain(b) for b in fixed]


def test_auto_workers_grow_with_persistent_workers_and_in_order_false(free_cores):
    free_cores(2)
    data = Burner(160, 0.002)
    loader = DataLoader(
        data, batch_size=4, num_workers="auto", persistent_workers=True, in_order=False, seed=3
    )
    first = sorted(_plain(b) for b in loader)
    assert loader.num_workers == 2
    second = sorted(_plain(b) for b in loader)
    ref = DataLoader(data, batch_size=4, num_workers=1, seed=3, persistent_workers=True)
    assert first == sorted(_plain(b) for b in ref)
    assert second == sorted(_plain(b) for b in ref)
    loader.shutdown()
    ref.shutdown()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_auto_workers_grow_under_every_start_method(free_cores, method):
    """A worker added mid-epoch under spawn or forkserver (its config pickled, no fork of
    the consumer) loads the same batches as a fixed count would."""
    free_cores(2)
    data = Burner(256, 0.004)
    loader = DataLoader(data, batch_size=4, num_workers="auto", multiprocessing_context=method, seed=5)
    got, wids = [], set()
    for batch in loader:
        got.append(_plain(batch))
        wids.update(np.asarray(batch["wid"]).tolist())
    assert loader.num_workers == 2, loader.stats()["autotune"]
    assert wids == {0, 1}
    fixed = DataLoader(data, batch_size=4, num_workers=2, seed=5)
    assert got == [_plain(b) for b in fixed]


def test_no_worker_is_added_without_a_free_core(monkeypatch):
    monkeypatch.setattr(autotune, "usable_cores", lambda: 4)
    monkeypatch.setattr(autotune, "FREE_CORE", 1e9)
    monkeypatch.setattr(autotune, "WINDOW_S", 0.05)
    loader = DataLoader(Burner(160, 0.002), batch_size=4, num_workers="auto")
    assert sum(1 for _ in loader) == 40
    auto = loader.stats()["autotune"]
    assert loader.num_workers == 1 and auto["changes"] == []
    assert auto["held_by"].startswith("no core is free"), auto


def test_no_worker_is_added_while_the_training_loop_does_not_wait(free_cores):
    free_cores(4)
    loader = DataLoader(Burner(64, 0.0), batch_size=4, num_workers="auto")
    for _ in loader:
        time.sleep(0.03)  # a slow training step: the loader keeps up with one worker
    assert loader.num_workers == 1
    assert loader.stats()["autotune"]["changes"] == []


def test_auto_workers_stop_at_the_slots_the_ring_holds(free_cores):
    free_cores(8)
    # 5 slots: at most 3 workers with one batch in flight each (workers + 2).
    loader = DataLoader(Burner(320, 0.002), batch_size=4, num_workers="auto", num_slots=5, prefetch_factor=1)
    for _ in range(10):  # the third worker can come in the epoch's last window: then the
        # slots hold the tuner back only in a later epoch's window (the count carries over);
        # a window whose workers were not saturated (a loaded machine) holds nothing back
        assert sum(1 for _ in loader) == 80
        auto = loader.stats()["autotune"]
        if auto["held_by"]:
            break
    assert loader.num_workers == 3, auto
    assert "slots" in auto["held_by"], auto


def test_auto_prefetch_rises_when_the_workers_idle_and_the_loop_still_waits(free_cores):
    free_cores(1)
    data = Burner(192, 0.0015)

    def run(**kwargs) -> list:
        loader = DataLoader(data, batch_size=2, num_workers=1, seed=5, **kwargs)
        out = []
        for k, batch in enumerate(loader):
            out.append(_plain(batch))
            # Bursts: a slow step lets the prefetch fill (the worker idles), then fast
            # steps drain it (the loop waits).
            time.sleep(0.03 if k % 8 == 0 else 0.0)
        return out, loader

    got, loader = run(prefetch_factor="auto")
    auto = loader.stats()["autotune"]
    assert auto["prefetch_factor"] > 2 and loader.prefetch_factor == auto["prefetch_factor"], auto
    assert all(c["workers_busy_share"] < 0.85 for c in auto["changes"])
    assert got == run(prefetch_factor=2)[0]


def test_iterable_datasets_get_the_cores_from_the_start(monkeypatch):
    monkeypatch.setattr(autotune, "usable_cores", lambda: 2)

    loader = DataLoader(Stream(), batch_size=3, num_workers="auto")
    assert loader.num_workers == 2
    assert sorted(np.concatenate([np.asarray(b) for b in loader]).tolist()) == list(range(12))


def test_auto_arguments_are_checked():
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        DataLoader(Burner(4, 0), num_workers="many")
    with pytest.raises(ValueError, match="prefetch_factor should be a positive integer"):
        DataLoader(Burner(4, 0), num_workers=1, prefetch_factor="lots")
    with pytest.raises(ValueError, match="prefetch_factor option could only be specified"):
        DataLoader(Burner(4, 0), num_workers=0, prefetch_factor="auto")


# --- prefetch across the epoch's end (persistent workers) -----------------------------------


def _epochs(loader, epochs: int, step: float = 0.0, before=None) -> list:
    """``epochs`` epochs of ``loader``, each a list of plain batches; ``before(e)`` runs
    before epoch ``e``'s iter()."""
    out = []
    for e in range(epochs):
        if before is not None:
            before(e)
        batches = []
        for batch in loader:
            batches.append(_plain(batch))
            time.sleep(step)
        out.append(batches)
    return out


def _all_free(loader) -> bool:
    ring = loader.ring
    return all(ring.states.load(i) == 0 for i in range(ring.num_slots))


def test_persistent_workers_load_the_next_epochs_first_batches_during_this_one():
    data = Burner(48, 0.001)
    loader = DataLoader(
        data,
        batch_size=4,
        num_workers=2,
        shuffle=True,
        seed=11,
        persistent_workers=True,
        prefetch_next_epoch=True,
    )
    ref = DataLoader(data, batch_size=4, num_workers=2, shuffle=True, seed=11)
    got = []
    for _ in range(3):
        got.append([_plain(b) for b in loader])
        time.sleep(0.3)  # the loop's last step: the next epoch's first batches load meanwhile
        ready = loader.ring.states.count(_slots.READY)  # written by the workers, not read yet
        assert ready > 0, "no batch of the next epoch was loaded before its iter()"
    assert got == _epochs(ref, 3)
    stats = loader.stats()
    assert stats["epochs_ahead"] == 2 and stats["batches_ahead_dropped"] == 0, stats
    loader.shutdown()  # the third epoch's prefetched batches in flight or READY: freed
    assert _all_free(loader)


def test_a_changed_epoch_drops_the_prefetched_batches_and_loads_its_own():
    data = Burner(40, 0.0)
    loader = DataLoader(
        data,
        batch_size=4,
        num_workers=2,
        shuffle=True,
        seed=2,
        persistent_workers=True,
        prefetch_next_epoch=True,
    )
    ref = DataLoader(data, batch_size=4, num_workers=2, shuffle=True, seed=2)

    def jump(e: int, target) -> None:
        if e == 1:
            target.set_epoch(7)
            time.sleep(0.2)  # the prefetched batches arrive: they are dropped

    got = _epochs(loader, 3, before=lambda e: jump(e, loader))
    assert got == _epochs(ref, 3, before=lambda e: jump(e, ref))
    stats = loader.stats()
    assert stats["batches_ahead_dropped"] > 0 and stats["epochs_ahead"] == 1, stats  # epoch 8 followed 7
    loader.shutdown()
    assert _all_free(loader)


def test_an_epoch_left_early_then_the_next_epoch_is_exact_with_in_order_false():
    data = Burner(40, 0.0)
    kwargs = dict(batch_size=4, num_workers=2, shuffle=True, seed=5, in_order=False)
    loader = DataLoader(data, persistent_workers=True, prefetch_next_epoch=True, **kwargs)
    ref = DataLoader(data, **kwargs)

    def run(target) -> list:
        out = []
        for e in range(3):
            batches = []
            for k, batch in enumerate(target):
                if e == 0 and k == 8:
                    break  # the last batches of this epoch are never taken
                batches.append(_plain(batch))
            out.append(sorted(batches))
        return out

    got, want = run(loader), run(ref)
    assert len(got[0]) == len(want[0]) == 8  # (which 8: the order they arrived in)
    assert got[1:] == want[1:]
    del ref
    assert loader.stats()["epochs_ahead"] >= 1
    loader.shutdown()
    assert _all_free(loader)


def test_a_user_generator_is_never_drawn_from_before_the_epoch_begins():
    """Reseeding the generator before each epoch gives torch's orders (the oracle: with
    persistent workers torch draws the base seed once, so the epochs differ): nothing of
    the next epoch was drawn ahead of iter()."""
    torch = pytest.importorskip("torch")

    def orders(make):
        g = torch.Generator()
        loader = make(g)
        epochs = []
        for _ in range(2):
            g.manual_seed(0)
            epochs.append([np.asarray(b["i"]).tolist() for b in loader])
            time.sleep(0.05)
        return loader, epochs

    kwargs = dict(batch_size=4, num_workers=2, shuffle=True, persistent_workers=True)
    _, expected = orders(lambda g: torch.utils.data.DataLoader(Burner(24, 0.0), generator=g, **kwargs))
    loader, got = orders(
        lambda g: DataLoader(Burner(24, 0.0), generator=g, prefetch_next_epoch=True, **kwargs)
    )
    assert got == expected
    assert loader.stats()["epochs_ahead"] == 0
    loader.shutdown()


def test_a_worker_killed_with_the_next_epochs_tasks_in_flight_is_replaced_exactly():
    data = Burner(40, 0.001)
    kwargs = dict(batch_size=4, num_workers=2, shuffle=True, seed=9)
    loader = DataLoader(
        data, persistent_workers=True, prefetch_next_epoch=True, max_worker_restarts=2, **kwargs
    )
    got = []
    with pytest.warns(WorkerRestartWarning, match="SIGKILL"):
        for e in range(2):
            batches = []
            for k, batch in enumerate(loader):
                batches.append(_plain(batch))
                if e == 0 and k == 8:  # this epoch's last task and the next one's first are out
                    it = loader.persistent_iterator
                    assert it.prefetching_next_epoch
                    os.kill(it.workers[0].proc.pid, signal.SIGKILL)
            got.append(batches)
    del batch  # (its slot is HELD while it lives)
    assert got == _epochs(DataLoader(data, **kwargs), 2)
    stats = loader.stats()
    assert stats["worker_restarts"] == 1 and stats["epochs_ahead"] == 1, stats
    loader.shutdown()
    assert _all_free(loader)


def test_the_prefetch_takes_only_free_slots_and_never_grows_the_ring():
    data = Burner(40, 0.0)
    loader = DataLoader(
        data,
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        prefetch_next_epoch=True,
        num_slots=10,
        seed=1,
    )
    kept = list(loader)  # 10 batches held (those in the ring: HELD), 2 slots left for the prefetch
    time.sleep(0.1)
    states = [loader.ring.states.load(i) for i in range(loader.ring.num_slots)]
    in_ring = 10 - loader.stats()["batches_copied"]  # (each worker's first batch sized the ring)
    assert states.count(_slots.HELD) == in_ring and states.count(_slots.FREE) == 0, states
    assert loader.stats()["rings_created"] == 1
    del kept
    second = [_plain(b) for b in loader]
    ref = DataLoader(data, batch_size=4, num_workers=2, seed=1)
    assert second == _epochs(ref, 2)[1]
    assert loader.stats()["epochs_ahead"] == 1
    loader.shutdown()


def test_a_decision_raises_the_counts_of_the_iterator_that_decides(free_cores):
    """The tuner stores no count of its own: a decision raises the counts it is given
    (the deciding iterator's), and ``stats()["autotune"]`` reports those of the epoch
    begun last. Two iterators of one "auto" loader each grow their own."""
    from shmloader.tuning.counts import WorkerCounts
    from shmloader.tuning.timing import Timing

    free_cores(4)

    class Room:
        def slots_for(self, workers, prefetch):
            return True

        def memory_for_worker(self, prefetch):
            return True

    tuner = autotune.Tuner.of(autotune.settings("auto", "auto", iterable=False))
    first, second = WorkerCounts(1, 2), WorkerCounts(1, 2)
    tuner.epoch_began(second)
    timing = Timing(4)
    tuner.decide(0.0, timing, Room(), first)  # (opens the first window)
    timing.add_worker(0, 10**9, 0, 0)  # the worker busy all the window
    timing.wait_s, timing.calls = 1.0, autotune.MIN_BATCHES  # the loop waited all of it
    assert tuner.decide(1.0, timing, Room(), first) == "worker"
    assert (first.workers, second.workers) == (2, 1)
    assert tuner.report()["num_workers"] == 1  # the epoch begun last: the second's
    assert tuner.changes[-1]["num_workers"] == 2
