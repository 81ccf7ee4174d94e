"""Epoch semantics (issue 13): what ``iter()``, the first ``next()``, the end of an epoch
and a resume do, with real worker processes; torch's DataLoader is the oracle where torch
behaviour is concerned (sampler ``set_epoch``, ``in_order=False``, the iterable length
warning).

- ``iter()`` alone does nothing: no worker, no epoch advanced, no seed drawn, the same
  ``state_dict()``; the epoch begins at the first ``next()`` (Lightning probes loaders
  with an extra ``iter()``).
- A state saved once an epoch's last batch was handed out resumes at the start of the
  next epoch, with all its batches; a mid-epoch state stays exact.
- ``in_order=False``: a slow first sample does not hold the other workers.
- An iterable dataset yielding more than ``len(loader)`` said warns as torch does.
"""

from __future__ import annotations

import io
import time
import warnings

import numpy as np
import psutil
import pytest

from shmloader import DataLoader, Dataset, IterableDataset, get_shard_info

FORK = {"multiprocessing_context": "fork"}

pytestmark = pytest.mark.timeout(120)


# --- datasets (module level, so any start method can pickle them) -----------------------


class Indexed(Dataset):
    """Sample i: i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.int64(i)


class Stream(IterableDataset):
    """Yields 0..n-1 split across every worker of every rank."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        info = get_shard_info()
        yield from (np.int64(v) for v in range(info.shard_id, self.n, info.num_shards))


class SlowFirst(Dataset):
    """10 samples; sample 0 takes ``delay`` seconds."""

    def __init__(self, delay: float = 1.0):
        self.delay = delay

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 0:
            time.sleep(self.delay)
        return i


try:  # torch's loader takes only its own IterableDataset as one (ours takes both)
    from torch.utils.data import IterableDataset as _TorchIterable
except ImportError:
    _TorchIterable = IterableDataset


class LongerThanLen(_TorchIterable):
    """Says it has ``said`` samples, yields ``n`` in every worker (no split): torch's
    warning case."""

    def __init__(self, said: int, n: int):
        self.said = said
        self.n = n

    def __len__(self):
        return self.said

    def __iter__(self):
        return iter(range(self.n))

    def __repr__(self):
        return f"LongerThanLen({self.said}, {self.n})"


class PairSampler:
    """A user batch sampler: ``n`` indices in pairs, reversed."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n // 2

    def __iter__(self):
        order = list(range(self.n))[::-1]
        return iter([order[k : k + 2] for k in range(0, self.n, 2)])


# --- helpers ----------------------------------------------------------------------------


def values(batches):
    return [np.asarray(b).reshape(-1).tolist() for b in batches]


def take(it, k):
    return [next(it) for _ in range(k)]


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def roundtrip(state):
    """What a torch checkpoint gives back (weights_only: plain data only)."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["loader"]


WORKERS = [
    pytest.param({"num_workers": 0}, id="main"),
    pytest.param({"num_workers": 2, **FORK}, id="workers"),
    pytest.param({"num_workers": 2, "persistent_workers": True, **FORK}, id="persistent"),
]


# --- 1. no work before the first next() -------------------------------------------------


@pytest.mark.parametrize("kw", WORKERS)
def test_iter_alone_starts_nothing_and_moves_nothing(kw):
    gen = np.random.default_rng(3)
    dl = DataLoader(Indexed(24), batch_size=4, shuffle=True, generator=gen, **kw)
    before_state, before_gen, before_kids = dl.state_dict(), gen.bit_generator.state, children()
    it = iter(dl)
    assert len(it) == 6, "len() of a not-started iterator"
    assert children() == before_kids, "iter() started no worker"
    assert gen.bit_generator.state == before_gen, "iter() drew no seed from the generator"
    assert dl.state_dict() == before_state, "iter() changed nothing state_dict() tells"
    first = next(it)
    if kw["num_workers"]:
        assert len(children() - before_kids) == 2, "the first next() started the workers"
    assert gen.bit_generator.state != before_gen, "the epoch drew its seed at the first next()"
    assert dl.state_dict()["consumed"] == 4
    assert sorted(v for b in values([first, *it]) for v in b) == list(range(24))
    dl.shutdown()


@pytest.mark.parametrize("kw", WORKERS)
def test_a_probing_iter_does_not_shift_epochs(kw):
    """Lightning's pattern: ``iter()`` once to probe, then the epochs. The loader's epoch
    e is the reference's epoch e, with and without set_epoch."""
    ref = DataLoader(Indexed(20), batch_size=4, shuffle=True, seed=7)
    epochs = [values(ref) for _ in range(3)]
    dl = DataLoader(Indexed(20), batch_size=4, shuffle=True, seed=7, **kw)
    probe = iter(dl)
    del probe
    assert values(dl) == epochs[0]
    assert dl.state_dict()["epoch"] == 1
    it = iter(dl)  # a probe between epochs (persistent: the workers stay on epoch 0's end)
    del it
    assert values(dl) == epochs[1]
    dl.set_epoch(2)
    iter(dl)
    assert dl.state_dict()["epoch"] == 2
    assert values(dl) == epochs[2]
    dl.shutdown()


@pytest.mark.parametrize("kw", WORKERS)
def test_set_epoch_reaches_a_torch_sampler_like_in_torch(kw):
    """Oracle: torch's DataLoader over a DistributedSampler the user set_epoch()s; ours
    calls the sampler's set_epoch with its own epoch, at the first next() (a probe
    iter() in between changes nothing)."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    def sampler():
        return DistributedSampler(Indexed(16), num_replicas=1, rank=0, shuffle=True, seed=11)

    theirs_sampler = sampler()
    theirs = torch.utils.data.DataLoader(Indexed(16), batch_size=4, sampler=theirs_sampler)
    expected = []
    for epoch in range(2):
        theirs_sampler.set_epoch(epoch)
        expected.append(values(theirs))
    ours = DataLoader(Indexed(16), batch_size=4, sampler=sampler(), **kw)
    got = []
    for _ in range(2):
        iter(ours)  # Lightning's probe
        got.append(values(ours))
    assert got == expected
    ours.shutdown()


@pytest.mark.parametrize("kw", WORKERS)
def test_state_between_iter_and_first_next_is_the_loaded_one(kw):
    ref = DataLoader(Indexed(40), batch_size=4, shuffle=True, seed=2)
    epoch0 = values(ref)
    dl = DataLoader(Indexed(40), batch_size=4, shuffle=True, seed=2, **kw)
    it = iter(dl)
    take(it, 3)
    state = roundtrip(dl.state_dict())
    del it
    dl.shutdown()
    fresh = DataLoader(Indexed(40), batch_size=4, shuffle=True, **kw)
    fresh.load_state_dict(state)
    it = iter(fresh)
    assert fresh.state_dict() == state, "iter() alone: still the loaded position"
    assert len(it) == 10
    assert values(it) == epoch0[3:]
    fresh.shutdown()


def test_persistent_workers_switch_epochs_at_the_first_next():
    dl = DataLoader(Indexed(12), batch_size=4, num_workers=2, persistent_workers=True, **FORK)
    it = iter(dl)
    take(it, 1)  # an epoch left midway
    pids = [w.proc.pid for w in it.workers]
    kept = dl.persistent_iterator
    again = iter(dl)
    assert dl.persistent_iterator is kept, "the same iterator, kept between epochs"
    assert dl.state_dict()["epoch"] == 1 and dl.state_dict()["consumed"] == 0
    assert values(again) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [w.proc.pid for w in it.workers] == pids, "the same workers"
    dl.shutdown()


# --- 2. resume at an epoch boundary -----------------------------------------------------

BOUNDARY = [
    pytest.param({"dataset": Indexed(96), "batch_size": 8, "shuffle": True}, id="own-shuffle"),
    pytest.param(
        {"dataset": Indexed(90), "batch_size": 8, "shuffle": True, "drop_last": True}, id="drop-last"
    ),
    pytest.param({"dataset": Indexed(20), "batch_sampler": PairSampler(20)}, id="batch-sampler"),
    pytest.param(
        {"dataset": Indexed(100), "batch_size": 8, "shuffle": True, "rank": 1, "world_size": 2}, id="rank1of2"
    ),
    pytest.param(
        {
            "dataset": Indexed(100),
            "batch_size": 8,
            "shuffle": True,
            "drop_last": True,
            "rank": 0,
            "world_size": 2,
        },
        id="rank0of2-drop-last",
    ),
    pytest.param({"dataset": Stream(30), "batch_size": 4}, id="iterable"),
]


def make(kw, workers, **extra):
    return DataLoader(seed=4, **kw, **workers, **extra)


def load(loader, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # iterable datasets: "fast-forwarding", said elsewhere
        loader.load_state_dict(state)


TWO_WAYS = pytest.mark.parametrize(
    "workers", [{"num_workers": 0}, {"num_workers": 2, **FORK}], ids=["main", "workers"]
)


@TWO_WAYS
@pytest.mark.parametrize("kw", BOUNDARY)
def test_a_state_at_an_epochs_end_resumes_the_next_epoch_in_full(kw, workers):
    ref = make(kw, workers)
    epochs = [values(ref) for _ in range(2)]
    n = len(epochs[0])
    assert n and len(epochs[1]) == n

    dl = make(kw, workers)
    it = iter(dl)
    assert values(take(it, n)) == epochs[0]
    # The last batch is out, StopIteration not raised yet (Lightning saves here).
    at_last_step = roundtrip(dl.state_dict())
    assert list(it) == []
    after_end = roundtrip(dl.state_dict())
    assert (after_end["epoch"], after_end.get("consumed", 0)) == (1, 0)
    if not dl.iterable:
        assert at_last_step == after_end, "the last batch is out: the next epoch's start"
    for state in (at_last_step, after_end):
        fresh = make(kw, workers)
        load(fresh, state)
        assert values(fresh) == epochs[1], "the next epoch, every batch"
        assert fresh.state_dict()["epoch"] == 2


@TWO_WAYS
@pytest.mark.parametrize("kw", BOUNDARY)
def test_a_position_at_the_end_of_its_epoch_rolls_over(kw, workers):
    """A state that names the end of its epoch ({"epoch": 0, "consumed": 96} of 96, what
    older versions saved; an iterable's shards all at their end) loads the next epoch in
    full, also when the training loop then calls set_epoch with either epoch."""
    ref = make(kw, workers)
    epochs = [values(ref) for _ in range(2)]
    dl = make(kw, workers)
    it = iter(dl)
    take(it, 1)
    state = dl.state_dict()  # then moved to the epoch's end:
    if dl.iterable:
        shards = max(dl.num_workers, 1)
        state["workers"] = [{"samples": len(range(w, 30, shards)), "state": None} for w in range(shards)]
        state["next_worker"] = 0
    else:
        state["consumed"] = len(kw["batch_sampler"]) if "batch_sampler" in kw else len(dl.sampler)
    del it
    dl.shutdown()
    for set_epoch in (None, 0, 1):
        fresh = make(kw, workers)
        load(fresh, state)
        if set_epoch is not None:
            fresh.set_epoch(set_epoch)
        assert values(fresh) == epochs[1], set_epoch
        assert fresh.state_dict()["epoch"] == 2


@TWO_WAYS
@pytest.mark.parametrize("kw", BOUNDARY)
def test_mid_epoch_resume_stays_exact(kw, workers):
    ref = make(kw, workers)
    epochs = [values(ref) for _ in range(2)]
    k = len(epochs[0]) // 2
    dl = make(kw, workers)
    it = iter(dl)
    first = values(take(it, k))
    state = roundtrip(dl.state_dict())
    del it
    dl.shutdown()
    fresh = make(kw, workers)
    load(fresh, state)
    assert first + values(fresh) == epochs[0]
    assert values(fresh) == epochs[1]


def test_a_persistent_loader_resumed_at_an_epochs_end():
    kw = {"num_workers": 2, "persistent_workers": True, **FORK}
    ref = DataLoader(Indexed(96), batch_size=8, shuffle=True, seed=4)
    epochs = [values(ref) for _ in range(3)]
    dl = DataLoader(Indexed(96), batch_size=8, shuffle=True, seed=4, **kw)
    it = iter(dl)
    take(it, 12)
    state = dl.state_dict()
    fresh = DataLoader(Indexed(96), batch_size=8, shuffle=True, seed=4, **kw)
    fresh.load_state_dict(state)
    assert [values(fresh) for _ in range(2)] == epochs[1:]
    dl.shutdown()
    fresh.shutdown()


# --- 3. in_order=False: a slow first sample holds nobody ---------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("prefetch_factor", [1, 2, 3])
def test_out_of_order_matches_torch_with_a_slow_first_sample(prefetch_factor):
    torch = pytest.importorskip("torch")
    kw = {"num_workers": 2, "in_order": False, "prefetch_factor": prefetch_factor, **FORK}
    theirs = [v for b in values(torch.utils.data.DataLoader(SlowFirst(), **kw)) for v in b]
    ours = [v for b in values(DataLoader(SlowFirst(), **kw)) for v in b]
    assert theirs[-1] in (0, 2, 4) and sorted(theirs) == list(range(10)), theirs  # the oracle ran as meant
    assert ours == theirs


@pytest.mark.timeout(60)
def test_out_of_order_persistent_second_epoch_also_flows():
    dl = DataLoader(SlowFirst(0.6), num_workers=2, in_order=False, persistent_workers=True, **FORK)
    for _ in range(2):
        got = [v for b in values(dl) for v in b]
        assert sorted(got) == list(range(10)) and got.index(0) >= 6, got
    dl.shutdown()


# --- 4. torch's warning: an iterable dataset longer than its __len__ ---------------------


def _warnings_of(loader, call_len: bool):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call_len:
            len(loader)
        got = [np.asarray(b).reshape(-1).tolist() for b in loader]
    texts = [
        str(w.message)
        for w in caught
        if issubclass(w.category, UserWarning) and "Length of" in str(w.message)
    ]
    return got, texts


@pytest.mark.parametrize("call_len", [True, False])
@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({"batch_size": None}, id="no-batching"),
        pytest.param({"batch_size": 2}, id="batch2"),
        pytest.param({"batch_size": 1, "num_workers": 2, **FORK}, id="workers"),
    ],
)
def test_iterable_longer_than_its_len_warns_like_torch(kw, call_len):
    torch = pytest.importorskip("torch")
    ds = LongerThanLen(said=3, n=7)
    theirs = _warnings_of(torch.utils.data.DataLoader(ds, **kw), call_len)
    ours = _warnings_of(DataLoader(ds, **kw), call_len)
    assert sorted(ours[0]) == sorted(theirs[0])
    assert ours[1] == theirs[1]
    assert bool(theirs[1]) == (call_len and len(theirs[0]) > 3)


# --- 6. per-epoch dataset state with persistent workers (issue 27) ----------------------


class EpochReader(Dataset):
    """Sample i: ``[i, epoch]``, ``epoch`` read from a shared counter the loop sets before
    each ``iter()`` (as a curriculum or ``dataset.set_epoch`` shared with workers does)."""

    def __init__(self, n: int, epoch):
        self.n = n
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.array([i, self.epoch.value], np.int64)


def _epochs_seen(make_loader, epoch, epochs: int = 3) -> list[list[int]]:
    """Per epoch, the epoch counter each sample saw; the loop sets the counter before
    each ``iter()``, after a last step slow enough for workers to get ahead."""
    loader = make_loader()
    seen = []
    for e in range(epochs):
        epoch.value = e
        seen.append([int(row[1]) for b in loader for row in np.asarray(b)])
        time.sleep(0.3)  # the loop's last step (logging, validation): workers are idle
    shutdown = getattr(loader, "shutdown", None)
    if shutdown is not None:
        shutdown()
    return seen


@pytest.fixture(scope="module")
def epoch_counter():
    """A ``multiprocessing.Value`` shared with the workers of any start method, made
    once: multiprocessing keeps the arena it lives in (and its descriptor) for the
    session, which a test's leak check would otherwise blame on the test."""
    import multiprocessing

    return multiprocessing.Value("q", -1, lock=False)


@pytest.mark.parametrize(
    "method, shuffle",
    [("fork", False), ("fork", True), ("spawn", True)],  # (spawn: ~20 s, once is enough)
    ids=["fork-sequential", "fork-shuffled", "spawn-shuffled"],
)
def test_persistent_workers_load_nothing_of_an_epoch_before_its_iter_as_torch(method, shuffle, epoch_counter):
    """Every sample of every epoch sees the state the loop set for it, by default: torch
    loads nothing of epoch N+1 before ``iter()``; with ``prefetch_next_epoch=True`` the
    next epoch's first batches load during the last one (the opt-in, with its hazard)."""
    epoch = epoch_counter
    ds = EpochReader(24, epoch)
    kw = dict(batch_size=4, num_workers=2, shuffle=shuffle, persistent_workers=True)
    kw["multiprocessing_context"] = method
    want = [[e] * 24 for e in range(3)]
    loader = DataLoader(ds, seed=1, **kw)
    assert _epochs_seen(lambda: loader, epoch) == want
    assert loader.stats()["epochs_ahead"] == 0
    assert loader.prefetch_next_epoch is False
    try:
        import torch
    except ImportError:
        pass
    else:  # the oracle
        assert _epochs_seen(lambda: torch.utils.data.DataLoader(ds, **kw), epoch) == want
    if method == "spawn":
        return  # (the opt-in's mechanics do not depend on the start method: fork shows them)
    ahead = DataLoader(ds, seed=1, prefetch_next_epoch=True, **kw)
    assert ahead.prefetch_next_epoch is True
    _epochs_seen(lambda: ahead, epoch)
    assert ahead.stats()["epochs_ahead"] > 0, "the option still prefetches"


def test_prefetch_next_epoch_is_checked():
    with pytest.raises(ValueError, match="needs persistent_workers=True"):
        DataLoader(Indexed(4), num_workers=1, prefetch_next_epoch=True)
    with pytest.raises(ValueError, match="prefetch_next_epoch should be True or False"):
        DataLoader(Indexed(4), num_workers=1, persistent_workers=True, prefetch_next_epoch="yes")


def test_planning_the_next_epoch_ahead_tells_the_sampler_nothing():
    """With ``prefetch_next_epoch`` the next epoch is planned during this one without side
    effects: a sampler with ``set_epoch`` is told epoch N+1 only when epoch N+1 begins
    (its order may depend on the epoch it is told, so that epoch is not loaded early),
    and the batches are those of the same loader without the option."""
    from shmloader.sampling.sampler import SequentialSampler

    class EpochTold(SequentialSampler):
        def __init__(self, data, told):
            super().__init__(data)
            self.told = told

        def set_epoch(self, epoch):
            self.told.append(epoch)

    def run(ahead: bool) -> tuple[list[list[int]], list[tuple[int, int]]]:
        told: list[int] = []
        events: list[tuple[int, int]] = []  # (epoch told, batches handed out when told)
        data = Indexed(24)
        loader = DataLoader(
            data,
            batch_size=4,
            num_workers=2,
            sampler=EpochTold(data, told),
            persistent_workers=True,
            prefetch_next_epoch=ahead,
            seed=3,
        )
        seen = []
        for _ in range(3):
            for batch in loader:
                seen.append([int(v) for v in batch])
                events.extend((e, len(seen)) for e in told)
                told.clear()
            events.extend((e, len(seen)) for e in told)
            told.clear()
        return seen, events

    seen_ahead, told_ahead = run(True)
    seen, told = run(False)
    assert seen_ahead == seen
    # Epoch N is told as its first batch comes out (6 batches an epoch): never earlier.
    assert told_ahead == told == [(0, 1), (1, 7), (2, 13)], (told_ahead, told)


def test_an_epoch_that_took_the_prefetched_tasks_leaves_the_shuffle_no_order():
    """The next epoch's tasks sent early iterate the loader's shuffle for that epoch; the
    epoch that takes them over leaves nothing set in it: a later ``iter(loader.sampler)``
    draws afresh instead of repeating that epoch's order."""
    loader = DataLoader(
        Indexed(64),
        batch_size=4,
        num_workers=2,
        shuffle=True,
        persistent_workers=True,
        prefetch_next_epoch=True,
        seed=5,
    )
    epochs = [[int(v) for batch in loader for v in batch] for _ in range(2)]
    assert loader.stats()["epochs_ahead"] >= 1, loader.stats()
    assert sorted(epochs[1]) == list(range(64)) and epochs[1] != epochs[0]
    assert list(loader.sampler) != epochs[1]
