"""shmloader.DataLoader as torch's DataLoader: the class, attributes, samplers, output
types and argument checks that frameworks and torch code rely on. The oracle is
torch.utils.data.DataLoader on the same dataset and arguments."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shmloader
from shmloader import DataLoader

torch = pytest.importorskip("torch")
data = torch.utils.data

pytestmark = pytest.mark.timeout(120)


class NumpySamples:
    """Tutorial-style samples: a float32 image and a Python int label."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return np.full((3, 4, 4), i, np.float32), i % 3


class Mixed:
    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int):
        return {"x": np.arange(3) + i, "name": f"s{i}", "w": float(i), "flag": bool(i % 2)}


def assert_same_batch(a, b) -> None:
    """Same types and values as torch's batch, recursively."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(b, dict):
        assert a.keys() == b.keys()
        for k in b:
            assert_same_batch(a[k], b[k])
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_batch(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "make", [NumpySamples, Mixed, lambda: data.TensorDataset(torch.randn(9, 2), torch.arange(9))]
)
def test_default_output_is_torch_default_collate(make, num_workers):
    """Only the import changes: batches are what torch's DataLoader gives (tensors where
    default_collate makes them, strings stay lists), so `model(x)` and `.to()` work."""
    ds = make()
    ours = list(DataLoader(ds, batch_size=4, num_workers=num_workers))
    theirs = list(data.DataLoader(ds, batch_size=4))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert_same_batch(a, b)


def test_tutorial_step_runs_on_default_output():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(NumpySamples(), batch_size=4, shuffle=True, num_workers=2):
        loss = torch.nn.functional.cross_entropy(model(x.to("cpu")), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_without_torch_nothing_of_torch_is_imported():
    """A numpy user never imports torch: numpy batches, a plain class."""
    code = textwrap.dedent(
        """
        import sys, numpy as np, shmloader
        class D:
            def __len__(self): return 6
            def __getitem__(self, i): return np.arange(2) + i, i
        loader = shmloader.DataLoader(D(), batch_size=3, num_workers=2, shuffle=True)
        batches = list(loader)
        assert type(loader) is shmloader.DataLoader, type(loader).__mro__
        assert type(loader.sampler) is shmloader.RandomSampler
        assert isinstance(batches[0][0], np.ndarray) and isinstance(batches[0][1], np.ndarray)
        assert loader.output == "numpy" and loader.collate_fn is None
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_is_a_torch_dataloader_with_torch_samplers():
    ds = NumpySamples()
    loader = DataLoader(ds, batch_size=4, shuffle=True)
    assert isinstance(loader, data.DataLoader) and isinstance(loader, DataLoader)
    assert isinstance(loader.sampler, data.RandomSampler)
    assert isinstance(loader.sampler, shmloader.RandomSampler)
    assert isinstance(loader.batch_sampler, data.BatchSampler)
    assert loader.collate_fn is data.default_collate
    assert loader.pin_memory_device == ""
    assert len(loader) == len(data.DataLoader(ds, batch_size=4, shuffle=True)) == 3
    plain = DataLoader(ds)
    assert isinstance(plain.sampler, data.SequentialSampler)
    unbatched = DataLoader(ds, batch_size=None)
    assert unbatched.collate_fn is data.default_convert and unbatched.batch_sampler is None
    assert isinstance(shmloader.BucketBatchSampler([1, 2, 3], 2), data.Sampler)
    # Type hints written for torch: DataLoader[T] is subscriptable.
    assert DataLoader[int] is not None and shmloader.Sampler[int] is not None


def test_flavoured_objects_pickle():
    sampler = pickle.loads(
        pickle.dumps(shmloader.BatchSampler(shmloader.SequentialSampler(range(5)), 2, False))
    )
    assert isinstance(sampler, data.BatchSampler) and list(sampler) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    "name", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_fixed_attributes_refuse_changes_like_torch(name):
    ds = NumpySamples()
    for cls in (data.DataLoader, DataLoader):
        loader = cls(ds, batch_size=2)
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after"):
            setattr(loader, name, getattr(loader, name))
    loader = DataLoader(ds, batch_size=2)
    loader.collate_fn = lambda b: len(b)  # torch allows these
    loader.worker_init_fn = print
    assert list(loader) == [2] * 5


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_workers": 0, "multiprocessing_context": "spawn"}, ValueError),
        ({"num_workers": 2, "multiprocessing_context": "no-such-method"}, ValueError),
        ({"num_workers": 2, "multiprocessing_context": 3}, TypeError),
    ],
)
def test_multiprocessing_context_checked_at_construction_like_torch(kwargs, error):
    for cls in (data.DataLoader, DataLoader):
        with pytest.raises(error):
            cls(NumpySamples(), **kwargs)


def test_multiprocessing_context_name_becomes_a_context():
    loader = DataLoader(NumpySamples(), num_workers=2, multiprocessing_context="spawn")
    assert isinstance(loader.multiprocessing_context, multiprocessing.context.BaseContext)
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert DataLoader(NumpySamples(), num_workers=2).multiprocessing_context is None


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_environments_rank_does_not_shard_a_default_loader_as_torch(monkeypatch, num_workers):
    """RANK and WORLD_SIZE set (torchrun, a launcher), no DistributedSampler: torch's
    loader yields the whole dataset, and so does ours unless asked to shard."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = NumpySamples()
    reference = list(data.DataLoader(ds, batch_size=2, num_workers=num_workers))
    loader = DataLoader(ds, batch_size=2, num_workers=num_workers)
    ours = list(loader)
    assert len(loader) == len(reference) == len(ours) == 5
    for a, b in zip(ours, reference):
        assert_same_batch(a, b)
    assert (loader.rank, loader.world_size) == (0, 1), "the loader does not shard"
    asked = DataLoader(ds, batch_size=2, num_workers=num_workers, distributed="auto")
    assert (asked.rank, asked.world_size) == (1, 2)
    assert [int(v) for x, _ in asked for v in x[:, 0, 0, 0]] == [1, 3, 5, 7, 9]


def test_rank_and_world_size_are_read_when_the_epoch_starts(monkeypatch):
    """A loader made before the job's rank is known shards once it is (when asked to
    shard: distributed="auto"), like torch's DistributedSampler over the same order."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = NumpySamples()
    loader = DataLoader(ds, batch_size=2, distributed="auto")
    assert len(loader) == 5 and loader.world_size == 1
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (loader.rank, loader.world_size) == (1, 2)
    reference = data.DataLoader(ds, batch_size=2, sampler=data.DistributedSampler(ds, 2, 1, shuffle=False))
    ours = list(loader)
    assert len(loader) == len(reference) == len(ours) == 3
    for a, b in zip(ours, reference):
        assert_same_batch(a, b)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_sampler_injection_shards_once(monkeypatch, shuffle, num_workers):
    """Lightning and Fabric rebuild a torch DataLoader from its attributes with a
    DistributedSampler; the rebuilt loader is sharded exactly once on every rank."""
    fabric_data = pytest.importorskip("lightning.fabric.utilities.data")
    pl_data = pytest.importorskip("lightning.pytorch.utilities.data")
    ds = NumpySamples()
    loader = DataLoader(ds, batch_size=2, shuffle=shuffle, num_workers=num_workers)
    assert pl_data._is_dataloader_shuffled(loader) is shuffle
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))  # what our own detection would shard by
        monkeypatch.setenv("WORLD_SIZE", "2")
        sampler = data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=shuffle, seed=3)
        rebuilt = fabric_data._update_dataloader(loader, sampler)
        assert isinstance(rebuilt, DataLoader) and isinstance(rebuilt, data.DataLoader)
        labels = [int(i) for x, _ in rebuilt for i in x[:, 0, 0, 0]]
        assert len(rebuilt) == 3 and len(labels) == 5
        reference = data.DataLoader(ds, batch_size=2, sampler=sampler)
        assert labels == [int(i) for x, _ in reference for i in x[:, 0, 0, 0]]
        seen.append(labels)
    assert sorted(seen[0] + seen[1]) == list(range(10))


def test_datapipe_accepts_shuffle_like_torch():
    datapipes = pytest.importorskip("torch.utils.data.datapipes.iter")
    pipe = datapipes.IterableWrapper(range(12)).shuffle()
    assert list(DataLoader(pipe, batch_size=None, shuffle=False)) == list(range(12))
    assert list(data.DataLoader(pipe, batch_size=None, shuffle=False)) == list(range(12))
    shuffled = [int(x) for x in DataLoader(pipe, batch_size=None, shuffle=True)]
    assert sorted(shuffled) == list(range(12))


def test_output_numpy_stays_one_argument_away():
    x, y = next(iter(DataLoader(NumpySamples(), batch_size=4, num_workers=2, output="numpy")))
    assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
    with pytest.raises(ValueError, match="output should be"):
        DataLoader(NumpySamples(), output="jax")


class MissingKey:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return {}["absent"]


class Slow:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        import time

        time.sleep(5)
        return i


def test_a_workers_key_error_reads_as_lines_like_torch():
    with pytest.raises(KeyError) as ours:
        next(iter(DataLoader(MissingKey(), num_workers=1)))
    text = str(ours.value)
    assert "\n" in text and "Traceback" in text and not text.startswith("'")


def test_timeout_reads_as_torch_and_is_a_runtime_error():
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after \d+ seconds"):
        next(iter(DataLoader(Slow(), num_workers=1, timeout=1)))


def test_worker_died_error_pickles_whole():
    err = shmloader.WorkerDiedError("worker 0 died", worker_id=0, pid=12, exitcode=-11)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.worker_id, back.pid, back.exitcode) == ("worker 0 died", 0, 12, -11)
    assert str(type(err)("text only")) == "text only"  # torch rebuilds errors from their text
    stuck = pickle.loads(pickle.dumps(shmloader.WorkerStartError("stuck", worker_id=1, pid=13)))
    assert type(stuck) is shmloader.WorkerStartError and (stuck.worker_id, stuck.pid) == (1, 13)


def test_more_workers_than_cores_warns_like_torch():
    many = len(os.sched_getaffinity(0)) + 1
    for cls in (data.DataLoader, DataLoader):
        with pytest.warns(UserWarning, match=f"will create {many} worker processes"):
            cls(NumpySamples(), num_workers=many)


class NestedSamples:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return torch.nested.nested_tensor([torch.arange(i + 1.0), torch.arange(2.0)])


def test_default_collate_of_nested_tensors_is_torchs_error():
    for cls in (data.DataLoader, DataLoader):
        with pytest.raises(RuntimeError, match="nested tensors are not currently supported"):
            next(iter(cls(NestedSamples(), batch_size=2)))


def test_datapipe_in_the_main_process_is_sharded_by_rank(monkeypatch):
    """num_workers=0: the main process reads shard `rank` of `world_size`, as torch's
    single-process iterator applies sharding, where the loader shards (distributed="auto");
    by default, as torch's, the environment's rank does not shard it."""
    datapipes = pytest.importorskip("torch.utils.data.datapipes.iter")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    pipe = datapipes.IterableWrapper(range(10)).sharding_filter()
    assert [int(x) for x in DataLoader(pipe, batch_size=None, distributed="auto")] == [1, 3, 5, 7, 9]
    theirs = [int(x) for x in data.DataLoader(pipe, batch_size=None)]
    assert [int(x) for x in DataLoader(pipe, batch_size=None)] == theirs == list(range(10))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_accelerate_skip_first_batches_yields_this_loaders_batches(num_workers):
    """accelerate.skip_first_batches rebuilds a torch DataLoader over loader.batch_sampler:
    it must yield the batches this loader's next epoch would, never another draw."""
    accelerate_data = pytest.importorskip("accelerate.data_loader")
    ds = data.TensorDataset(torch.arange(20))
    loader = DataLoader(ds, batch_size=3, shuffle=True, seed=1, num_workers=num_workers)
    for _epoch in range(2):
        skipped = [b[0].tolist() for b in accelerate_data.skip_first_batches(loader, 2)]
        epoch = [b[0].tolist() for b in loader]
        assert skipped == epoch[2:] and len(epoch) == 7
    # After a loaded position: the rest of its epoch.
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(3)]
    state = loader.state_dict()
    rest = [b[0].tolist() for b in it]
    resumed = DataLoader(ds, batch_size=3, shuffle=True, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in accelerate_data.skip_first_batches(resumed, 0)] == rest
    assert len(first + rest) == 7


def _live_workers() -> int:
    psutil = pytest.importorskip("psutil")
    return sum(
        1
        for p in psutil.Process().children()
        if p.status() != psutil.STATUS_ZOMBIE
        and not any(h in " ".join(p.cmdline()) for h in ("resource_tracker", "forkserver"))
    )


def test_a_dropped_persistent_loader_stops_its_workers_without_gc():
    """torch's persistent iterator holds no reference to its loader, so `del` stops the
    workers at once; no reference cycle may keep ours alive until a cyclic gc."""
    import gc
    import time

    before = _live_workers()
    gc.disable()
    try:
        it = iter(DataLoader(list(range(100)), batch_size=2, num_workers=2, persistent_workers=True))
        next(it)
        assert _live_workers() == before + 2
        del it
        deadline = time.monotonic() + 10
        while _live_workers() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _live_workers() == before
        # A for loop over a loader nothing else holds runs its whole epoch.
        assert (
            sum(
                len(b)
                for b in DataLoader(list(range(10)), batch_size=3, num_workers=2, persistent_workers=True)
            )
            == 10
        )
    finally:
        gc.enable()


# --- dataset methods the loader calls: only its own names (issue 27) --------------------


class _Touchy:
    """Methods a dataset may have for itself (normalisation figures, a cache's state):
    each call is counted in a shared counter and raises, as a method that needs a lock or
    a file the workers do not have would."""

    def __init__(self, calls):
        self.calls = calls

    def _called(self, name: str):
        self.calls.value += 1
        raise RuntimeError(f"{name}() of the dataset was called by the loader")

    def stats(self):
        self._called("stats")

    def state_dict(self):
        self._called("state_dict")

    def load_state_dict(self, state):
        self._called("load_state_dict")


class TouchyMap(_Touchy):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return np.int64(i)


class TouchyStream(_Touchy, data.IterableDataset):
    def __iter__(self):
        info = data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter([np.int64(i) for i in range(wid, 12, nw)])


@pytest.fixture(scope="module")
def calls():
    """A counter shared with forked workers (made once: multiprocessing keeps its arena's
    descriptor for the session)."""
    return multiprocessing.Value("q", 0, lock=False)


@pytest.mark.parametrize("restarts", [0, 2], ids=["no-restarts", "restarts"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cls", [TouchyMap, TouchyStream], ids=["map", "iterable"])
def test_a_datasets_own_stats_and_state_dict_are_never_called_as_torch(calls, cls, num_workers, restarts):
    """torch's loader calls none of a dataset's stats(), state_dict() or
    load_state_dict(); neither does ours (its protocol has names of its own), whether
    workers load, restarts are allowed, or the loader's stats() and state_dict() are
    read."""
    calls.value = 0
    ds = cls(calls)
    kw = dict(batch_size=4, num_workers=num_workers)
    if num_workers:
        kw["multiprocessing_context"] = "fork"
    theirs = sorted(int(v) for b in data.DataLoader(ds, **kw) for v in b)
    loader = DataLoader(ds, max_worker_restarts=restarts, **kw)
    it = iter(loader)
    ours = [int(v) for v in next(it)]
    state = loader.state_dict()  # mid-epoch: an iterable dataset's shard positions
    ours += [int(v) for b in it for v in b]
    assert sorted(ours) == theirs == list(range(12))
    assert loader.stats()["dataset"] == {}
    if cls is TouchyStream and num_workers == 0:
        fresh = DataLoader(ds, **kw)
        with pytest.warns(UserWarning, match=r"has state_dict\(\), which the loader never calls"):
            fresh.load_state_dict(state)  # fast-forwards: the dataset has no loader pair
        assert sorted(int(v) for b in fresh for v in b) == list(range(4, 12))
    assert calls.value == 0, "the loader called a method of the dataset's own"
