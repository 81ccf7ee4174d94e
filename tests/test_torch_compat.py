"""shmloader's workers as torch code sees them, with torch's DataLoader as the oracle.

- ``torch.utils.data.get_worker_info()`` answers inside shmloader's workers as in torch's
  (its own immutable ``WorkerInfo``: id, num_workers, seed, the worker's dataset copy),
  and is None in the main process;
- torch runs one intra-op thread in a worker, so a fork after the parent used torch's
  thread pool cannot hang (checked in a child process with a deadline);
- ``batch_size=None`` hands out samples as torch's ``default_convert`` does;
- a collate_fn's sparse, nested, quantized or grad-requiring tensors come back as they
  were, however many workers;
- the errors a torch user catches as ``RuntimeError`` are ``RuntimeError``s;
- torch's ``default_collate`` / ``default_convert`` given explicitly keep the default
  (zero-copy) path.

Real worker processes under fork, spawn and forkserver where the start method matters.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmloader  # noqa: E402
from shmloader import errors  # noqa: E402
from shmloader.batch.recipe import is_torch_default  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TorchDataset = torch.utils.data.Dataset
TorchIterable = torch.utils.data.IterableDataset
TorchLoader = torch.utils.data.DataLoader


def ours(dataset: Any, **kwargs: Any) -> shmloader.DataLoader:
    kwargs.setdefault("output", "torch")
    return shmloader.DataLoader(dataset, **kwargs)


# --- datasets (module level: spawn and forkserver workers unpickle them) ------------------


class SplitRange(TorchIterable):
    """torch's documented pattern: each worker reads its slice of range(n), found with
    torch.utils.data.get_worker_info()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(range(self.n))
        per = -(-self.n // info.num_workers)
        start = info.id * per
        return iter(range(start, min(start + per, self.n)))


class WhoLoads(TorchDataset):
    """Each sample: what torch's get_worker_info() says in the process that loads it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return {"index": i, "id": -1, "num_workers": 0, "shmloader": False, "checks": ""}
        mine = shmloader.get_worker_info()
        failed = []
        if type(info) is not torch.utils.data._utils.worker.WorkerInfo:
            failed.append(f"type {type(info).__name__}")
        if info.dataset is not self:
            failed.append("dataset is not this worker's copy")
        if mine is not None and (mine.id, mine.num_workers, mine.seed) != (
            info.id,
            info.num_workers,
            info.seed,
        ):
            failed.append(f"shmloader's info {mine!r} differs from torch's {info!r}")
        if info.seed != torch.initial_seed():
            failed.append(f"seed {info.seed} is not torch's initial seed {torch.initial_seed()}")
        try:
            info.id = 99
            failed.append("setattr did not raise")
        except AttributeError:  # torch's WorkerInfo is frozen
            pass
        for k in ("id", "num_workers", "seed", "dataset"):
            if f"{k}=" not in repr(info):
                failed.append(f"{k} missing from repr")
        return {
            "index": i,
            "id": info.id,
            "num_workers": info.num_workers,
            "shmloader": mine is not None,  # False in torch's workers
            "checks": "; ".join(failed),
        }


def check_info_in_init(worker_id: int) -> None:
    """A worker_init_fn as torch's own test writes it: torch's info is there already."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id and worker_id < info.num_workers
    assert info.seed == torch.initial_seed()
    info.dataset.init_by = worker_id  # the worker's copy, never the main process's


class InitMark(TorchDataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        return getattr(self, "init_by", -1)


class Threads(TorchDataset):
    """Each sample: torch's intra-op thread count where it was loaded."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return torch.get_num_threads()


NT = collections.namedtuple("NT", "a b")

UNBATCHED_SAMPLES = [
    3,
    -2.5,
    True,
    "text",
    b"bytes",
    None,
    np.float32(1.5),
    np.int64(7),
    np.bool_(False),
    np.arange(3, dtype=np.int16),
    np.array(2.0),
    np.array(["a", "b"]),
    torch.arange(4.0).reshape(2, 2),
    {"label": 1, "x": np.ones(2, np.float32), "name": "n", "t": torch.tensor([1, 2])},
    (1, np.float64(2.0), "s"),
    [np.int32(4), 5.0],
    NT(a=np.zeros(2), b=7),
    {"nested": (np.uint8(3), [True, np.array([1, 2])])},
]


class Unbatched(TorchDataset):
    def __len__(self) -> int:
        return len(UNBATCHED_SAMPLES)

    def __getitem__(self, i: int) -> Any:
        return UNBATCHED_SAMPLES[i]


class Eye(TorchDataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.eye(4)[i % 4] * (i + 1)


def sparse_coo(batch: list) -> list:
    return [x.to_sparse() for x in batch]


def sparse_csr(batch: list) -> dict:
    return {"csr": torch.stack(batch).to_sparse_csr(), "dense": torch.stack(batch)}


def nested(batch: list) -> torch.Tensor:
    return torch.nested.nested_tensor([x[: i + 1] for i, x in enumerate(batch)])


def quantized(batch: list) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.stack(batch), 0.5, 0, torch.quint8)


def requires_grad(batch: list) -> tuple:
    return torch.stack(batch).requires_grad_(), torch.stack(batch)


def parameter(batch: list) -> torch.Tensor:
    return torch.nn.Parameter(torch.stack(batch))


# --- comparison ---------------------------------------------------------------------------


def assert_same(a: Any, b: Any, where: str = "batch") -> None:
    """``a`` (ours) is ``b`` (torch's): types, containers, dtypes, layouts, values."""
    assert type(a) is type(b), (
        f"{where}: ours {type(a).__name__} {a!r:.80}, torch {type(b).__name__} {b!r:.80}"
    )
    if isinstance(b, torch.Tensor):
        assert (a.dtype, a.layout, a.is_nested, a.is_quantized, a.requires_grad) == (
            b.dtype,
            b.layout,
            b.is_nested,
            b.is_quantized,
            b.requires_grad,
        ), f"{where}: ours {a!r}, torch {b!r}"
        if b.is_nested:
            for i, (x, y) in enumerate(zip(a.unbind(), b.unbind(), strict=True)):
                assert_same(x, y, f"{where}.unbind()[{i}]")
            return
        if b.is_quantized:
            a, b = a.dequantize(), b.dequantize()
        if b.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        assert a.shape == b.shape and torch.equal(a.detach(), b.detach()), f"{where}: ours {a!r}, torch {b!r}"
    elif isinstance(b, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{where}: {a!r} vs {b!r}"
    elif isinstance(b, collections.abc.Mapping):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in b:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: ours {a!r}, torch {b!r}"


# --- 1. torch.utils.data.get_worker_info() ------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("ctx", "batch_size"), [("fork", None), ("fork", 3), ("spawn", 3)])
def test_iterable_split_by_torch_worker_info_reads_each_sample_once(ctx, batch_size):
    """A torch IterableDataset that shards by torch's get_worker_info() gives torch's
    multiset of samples with 2 workers: each once, none duplicated. (torch's loader, the
    oracle, runs under fork: the multiset does not depend on the start method.)"""
    n = 23
    kw = {"batch_size": batch_size, "num_workers": 2}
    theirs = TorchLoader(SplitRange(n), multiprocessing_context="fork", **kw)
    want = sorted(int(x) for b in theirs for x in np.atleast_1d(b))
    got_batches = list(ours(SplitRange(n), multiprocessing_context=ctx, **kw))
    got = sorted(int(x) for b in got_batches for x in np.atleast_1d(b))
    assert got == want == list(range(n))
    if batch_size is None:  # torch's default_convert keeps ints
        assert all(type(b) is int for b in got_batches)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_torch_worker_info_fields_in_workers(ctx):
    """Per sample, torch's get_worker_info() in a worker: torch's WorkerInfo class, the
    worker's id and count, a seed that is torch's initial seed and shmloader's, the
    worker's own dataset copy, immutable; batches of one worker each, both workers used,
    as in torch's loader."""
    kw = {"batch_size": 2, "num_workers": 2}
    theirs = list(TorchLoader(WhoLoads(), multiprocessing_context="fork", **kw))  # (the oracle)
    mine = list(ours(WhoLoads(), multiprocessing_context=ctx, **kw))
    for batches in (theirs, mine):
        assert [c for b in batches for c in b["checks"] if c] == []
        assert sorted(int(i) for b in batches for i in b["index"]) == list(range(8))
        assert all(len(set(b["id"].tolist())) == 1 for b in batches)  # one worker per batch
        assert {int(b["id"][0]) for b in batches} == {0, 1}
        assert {int(n) for b in batches for n in b["num_workers"]} == {2}
    assert not any(bool(s) for b in theirs for s in b["shmloader"])
    assert all(bool(s) for b in mine for s in b["shmloader"])


@pytest.mark.timeout(60)
def test_torch_worker_info_is_none_in_the_main_process():
    """None in the main process before, during (num_workers=0) and after loading."""
    assert torch.utils.data.get_worker_info() is None
    batches = list(ours(WhoLoads(), batch_size=4))
    assert [int(i) for b in batches for i in b["id"]] == [-1] * 8
    list(ours(WhoLoads(), batch_size=4, num_workers=2))
    assert torch.utils.data.get_worker_info() is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_worker_init_fn_sees_torch_worker_info(ctx):
    """worker_init_fn runs with torch's info set (torch's own test of it): its dataset is
    the worker's copy, so what it sets there is seen by that worker only."""
    dataset = InitMark()
    kw = {"batch_size": 3, "num_workers": 2, "worker_init_fn": check_info_in_init}
    got = sorted(int(x) for b in ours(dataset, multiprocessing_context=ctx, **kw) for x in b)
    theirs = TorchLoader(InitMark(), multiprocessing_context="fork", **kw)  # (the oracle)
    assert got == sorted(int(x) for b in theirs for x in b) == [0, 0, 0, 1, 1, 1]
    assert not hasattr(dataset, "init_by")


def datapipe(n: int, shuffle: bool) -> Any:
    from torch.utils.data.datapipes.iter import IterableWrapper

    dp = IterableWrapper(range(n))
    return (dp.shuffle() if shuffle else dp).sharding_filter()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_datapipe_is_sharded_and_shuffled_alike_in_workers(shuffle, batch_size):
    """A torch DataPipe with shuffle() and sharding_filter(), 2 fork workers: as in
    torch's loader, workers shuffle with one shared seed and each reads its shard, so
    every sample comes once; a new shuffle every epoch."""
    n = 30
    kw = {"batch_size": batch_size, "num_workers": 2, "multiprocessing_context": "fork"}

    def flat(batches: list) -> list[int]:
        return [int(x) for b in batches for x in np.atleast_1d(b)]

    theirs = flat(TorchLoader(datapipe(n, shuffle), **kw))
    loader = ours(datapipe(n, shuffle), **kw)
    epochs = [flat(loader) for _ in range(2)]
    for got in epochs:
        assert sorted(got) == sorted(theirs) == list(range(n))
    if shuffle:
        assert epochs[0] != epochs[1]


@pytest.mark.timeout(60)
def test_torch_worker_info_is_set_only_where_torch_is_imported():
    """context.set_torch_worker_info never imports torch (checked in a fresh interpreter)."""
    code = textwrap.dedent(
        """
        import sys
        from shmloader import context
        info = context.WorkerInfo(0, 2, 5, None)
        context.set_worker_info(info)
        assert context.get_worker_info() is info
        assert "torch" not in sys.modules, "set_worker_info imported torch"
        import torch
        assert context.set_torch_worker_info(info)
        t = torch.utils.data.get_worker_info()
        assert (t.id, t.num_workers, t.seed, t.dataset) == (0, 2, 5, None), t
        print("OK")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


# --- 2. torch's thread pool and fork --------------------------------------------------------

_HANG_SCRIPT = """
import sys, torch
import shmloader

class MatmulPerSample(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        a = torch.full((256, 256), float(i))
        return (a @ a).sum()  # a multi-threaded op unless the worker has one thread

torch.set_num_threads(2)
x = torch.randn(2000, 2000)
(x @ x).sum().item()  # the parent's OpenMP pool is now up
loader = shmloader.DataLoader(
    MatmulPerSample(), batch_size=4, num_workers=2, multiprocessing_context="fork", output="torch"
)
for epoch in range(2):
    total = sum(float(b.sum()) for b in loader)
print("OK", total)
"""


@pytest.mark.timeout(180)
def test_fork_after_the_parent_used_torch_threads_does_not_hang():
    """The parent ran a multi-threaded matmul, then a fork loader whose samples run torch
    ops: it finishes (workers give torch one thread, as torch's do). In a child process
    with a deadline, so a hang fails this test only."""
    rc, out, err = _run_with_deadline(_HANG_SCRIPT, 120)
    want = sum(
        float((torch.full((256, 256), float(i)) @ torch.full((256, 256), float(i))).sum()) for i in range(16)
    )
    assert rc == 0, f"exit {rc} (a hang is -9: killed at the deadline)\n{out[-2000:]}\n{err[-3000:]}"
    assert out.startswith("OK") and float(out.split()[1]) == pytest.approx(want), out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_workers_give_torch_one_thread_as_torch_workers_do(ctx):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that the check can fail on a one-core machine too
    try:
        kw = {"batch_size": 2, "num_workers": 2}
        theirs = TorchLoader(Threads(), multiprocessing_context="fork", **kw)  # (the oracle)
        assert [int(t) for b in theirs for t in b] == [1, 1, 1, 1]
        assert [int(t) for b in ours(Threads(), multiprocessing_context=ctx, **kw) for t in b] == [1, 1, 1, 1]
        assert torch.get_num_threads() == 2  # the main process keeps its own
    finally:
        torch.set_num_threads(before)


class SeededDraws(TorchDataset):
    """Each sample: the worker's seed and its first draws from torch's global RNG, plus
    whether those draws are the stream ``torch.manual_seed(seed)`` starts."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        seed = torch.utils.data.get_worker_info().seed
        draws = torch.rand(3)
        torch.manual_seed(torch.initial_seed())  # replay this worker's stream from its start
        expected = torch.rand(3 * (self.calls + 1))[-3:]
        self.calls += 1
        return {"seed": seed, "draws": draws, "is_manual_seed_stream": bool(torch.equal(draws, expected))}

    calls = 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_workers_seed_torch_as_manual_seed_does(ctx):
    """A worker's torch RNG is where ``torch.manual_seed(worker seed)`` puts it, as in
    torch's workers (the oracle), though shmloader seeds only the CPU generator on a
    build with no accelerator (which this CPU build is: the fast path is the one tested)."""
    from shmloader.workers.seeding import _cpu_only

    assert _cpu_only(torch) == (torch.version.cuda is None and torch.version.hip is None)
    kw = {"batch_size": 1, "num_workers": 2}
    for loader in (
        TorchLoader(SeededDraws(), multiprocessing_context="fork", **kw),
        ours(SeededDraws(), multiprocessing_context=ctx, **kw),
    ):
        batches = list(loader)
        assert all(bool(b["is_manual_seed_stream"][0]) for b in batches), batches
        first = {int(b["seed"][0]): b["draws"][0] for b in batches[:2]}
        for seed, draws in first.items():
            assert torch.equal(draws, torch.rand(3, generator=torch.Generator().manual_seed(seed)))


# --- 3. batch_size=None ---------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_unbatched_samples_are_torch_default_convert(num_workers):
    """batch_size=None, output="torch": each sample exactly as torch's loader gives it
    (Python scalars, str, bytes and None unchanged; numpy scalars and arrays tensors, a
    str array unchanged; tuples lists, dicts and namedtuples kept), map-style and
    iterable."""
    kw = {"batch_size": None, "num_workers": num_workers}
    theirs = list(TorchLoader(Unbatched(), **kw))
    mine = list(ours(Unbatched(), **kw))
    assert len(mine) == len(theirs) == len(UNBATCHED_SAMPLES)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        assert_same(a, b, f"sample {i}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_unbatched_samples_with_numpy_output_keep_python_scalars(num_workers):
    """output="numpy": the numpy side of default_convert. Python scalars, str, bytes and
    None unchanged, numpy scalars 0-d arrays, arrays and tensors unchanged, tuples lists."""
    got = list(shmloader.DataLoader(Unbatched(), batch_size=None, num_workers=num_workers, output="numpy"))
    for i, (value, sample) in enumerate(zip(got, UNBATCHED_SAMPLES)):
        if isinstance(sample, (bool, int, float, str, bytes)) or sample is None:
            assert type(value) is type(sample) and value == sample, (i, value)
        elif isinstance(sample, np.generic):
            assert type(value) is np.ndarray and value.shape == () and value.dtype == sample.dtype, (i, value)
    assert type(got[14]) is list and type(got[14][0]) is int and type(got[14][1]) is np.ndarray
    assert type(got[12]) is torch.Tensor and isinstance(got[9], np.ndarray)


# --- 4. tensors the ring cannot hold --------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "collate_fn",
    [sparse_coo, sparse_csr, nested, quantized, requires_grad, parameter],
    ids=lambda f: f.__name__,
)
def test_collate_fn_tensors_the_ring_cannot_hold_travel_unchanged(collate_fn, num_workers):
    """A collate_fn's sparse (COO, CSR), nested, quantized, grad-requiring or Parameter
    tensors come back with their layout, type and values, as torch's loader gives them
    with num_workers=0 (torch's own workers fail on quantized tensors; ours do not)."""
    kw = {"batch_size": 4, "collate_fn": collate_fn}
    with torch.sparse.check_sparse_tensor_invariants(False):
        theirs = list(TorchLoader(Eye(), **kw))
        mine = list(ours(Eye(), num_workers=num_workers, **kw))
    assert len(mine) == len(theirs) == 2
    for k, (a, b) in enumerate(zip(mine, theirs)):
        assert_same(a, b, f"batch {k}")


# --- 5. exceptions --------------------------------------------------------------------------


class Slow(TorchDataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        import time

        time.sleep(30)
        return i


class RaisesKey(TorchDataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        raise KeyError(f"no sample {i}")


class Exits(TorchDataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        os._exit(3)


@pytest.mark.parametrize(
    "cls",
    [
        errors.LoaderTimeoutError,
        errors.WorkerDiedError,
        errors.WorkerError,
        errors.StrayStopIteration,
        errors.ShmSpaceError,
        errors.RingLimitError,
        errors.BatchLayoutError,
        errors.BatchTypeError,
        errors.BatchKeyError,
    ],
)
def test_errors_torch_raises_as_runtime_error_are_runtime_errors(cls):
    """torch raises RuntimeError for a timeout, a dead worker, shared memory running out
    and samples torch.stack cannot stack: ``except RuntimeError:`` catches ours too,
    beside the builtin that names each best."""
    assert issubclass(cls, RuntimeError) and issubclass(cls, errors.ShmLoaderError)
    assert issubclass(errors.LoaderTimeoutError, TimeoutError)
    assert issubclass(errors.BatchTypeError, TypeError) and issubclass(errors.BatchKeyError, KeyError)


def test_key_error_message_reads_as_lines():
    """errors.KeyErrorMessage: a KeyError made with it prints its text, newlines and all
    (for failures.rebuild_error, as torch's KeyErrorMessage)."""
    text = "Caught KeyError in DataLoader worker 0.\nOriginal Traceback (most recent call last):"
    assert str(KeyError(errors.KeyErrorMessage(text))) == text
    assert str(KeyError(text)) != text  # (what a plain str gives)


def first_error(loader: Any) -> tuple[list[type], str]:
    """The exception the loader's first batch raises: its classes and text (not the
    exception itself: its traceback would keep the iterator and its workers alive)."""
    it = iter(loader)
    try:
        next(it)
    except Exception as exc:
        return list(type(exc).__mro__), str(exc)
    finally:
        del it
    raise AssertionError("the first batch loaded")


@pytest.mark.timeout(120)
def test_timeout_is_caught_by_except_runtime_error():
    """``except RuntimeError:`` written for torch's timeout catches ours (still a
    TimeoutError too)."""
    mro, text = first_error(ours(Slow(), batch_size=2, num_workers=1, timeout=0.5))
    assert RuntimeError in mro and TimeoutError in mro and "DataLoader timed out" in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_errors_keep_their_type_as_in_torch(num_workers):
    """An exception in __getitem__ is re-raised with its own type, as torch does."""
    # (torch's loader, the oracle, without workers: its workers take 5 s each to stop
    # after an error, and re-raise the same way)
    for loader in (
        TorchLoader(RaisesKey(), batch_size=2),
        ours(RaisesKey(), batch_size=2, num_workers=num_workers),
    ):
        mro, text = first_error(loader)
        assert mro[0] is KeyError and "no sample" in text, (loader, mro, text)


@pytest.mark.timeout(120)
def test_worker_death_is_a_runtime_error_as_in_torch():
    """A worker that exits mid-batch: a RuntimeError naming the worker's pid, in both."""
    for loader in (
        TorchLoader(Exits(), batch_size=2, num_workers=1),
        ours(Exits(), batch_size=2, num_workers=1),
    ):
        mro, text = first_error(loader)
        assert RuntimeError in mro and "DataLoader worker" in text and "pid" in text, (loader, mro, text)


# --- torch's default collate functions given explicitly -------------------------------------


class Records(TorchDataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full(3, i, np.float32), "label": i, "name": f"s{i}", "t": torch.tensor([i, -i])}


def test_is_torch_default():
    from torch.utils.data import default_collate, default_convert

    assert is_torch_default(default_collate, True) and is_torch_default(default_convert, False)
    assert not is_torch_default(default_collate, False) and not is_torch_default(default_convert, True)
    assert not is_torch_default(None, True) and not is_torch_default(lambda b: b, True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [4, None])
def test_explicit_torch_default_collate_keeps_the_ring_path(batch_size, num_workers):
    """collate_fn=torch's default_collate (batches) or default_convert (batch_size=None),
    as a framework passes loader.collate_fn back: torch's batches, made by shmloader's own
    collate (torch's function is never called), and with workers still zero-copy from the
    ring (no batch copied)."""
    from torch.utils.data import default_collate, default_convert

    fn = default_collate if batch_size is not None else default_convert
    kw = {"batch_size": batch_size}
    theirs = list(TorchLoader(Records(), collate_fn=fn, **kw))
    loader = ours(Records(), collate_fn=fn, num_workers=num_workers, **kw)
    mine = list(loader)
    assert len(mine) == len(theirs)
    for k, (a, b) in enumerate(zip(mine, theirs)):
        assert_same(a, b, f"batch {k}")
    if num_workers:
        # Only each worker's first batch, made before the ring is sized, travels apart;
        # the rest view slots of the ring.
        assert loader.stats()["batches_copied"] <= num_workers, loader.stats()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_explicit_default_collate_is_never_called(monkeypatch, num_workers):
    """torch's default_collate given explicitly is never called: the collate it goes
    through (torch's ``collate``) raises once patched, and every batch still loads (fork
    workers inherit the patch)."""
    import torch.utils.data._utils.collate as torch_collate

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch's collate was called")

    loader = ours(
        Records(),
        batch_size=4,
        collate_fn=torch_collate.default_collate,
        num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )
    monkeypatch.setattr(torch_collate, "collate", refuse)
    with pytest.raises(AssertionError, match="called"):  # the patch is live
        torch_collate.default_collate([1, 2])
    batches = list(loader)
    assert len(batches) == 3 and isinstance(batches[0]["x"], torch.Tensor)
    assert batches[0]["name"] == ["s0", "s1", "s2", "s3"]


@pytest.mark.timeout(60)
def test_explicit_default_collate_follows_the_output():
    """With output="numpy" torch's default_collate given explicitly is the default too:
    numpy batches, the same as with no collate_fn."""
    from torch.utils.data import default_collate

    def numeric(batch: dict) -> dict:
        return {k: v for k, v in batch.items() if k in ("x", "label")}

    a = [numeric(b) for b in shmloader.DataLoader(Records(), batch_size=4, output="numpy")]
    b = [
        numeric(b)
        for b in shmloader.DataLoader(Records(), batch_size=4, output="numpy", collate_fn=default_collate)
    ]
    assert all(type(x["x"]) is np.ndarray for x in b)
    for x, y in zip(a, b, strict=True):
        assert_same(y, x)


# --- helpers --------------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ)
    src = str(Path(shmloader.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run_with_deadline(code: str, deadline: float) -> tuple[int, str, str]:
    """Run ``code`` in a fresh interpreter in its own session; past ``deadline`` s kill
    the whole session (the child and its workers) and return -9."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -9, out, err
    return proc.returncode, out, err
