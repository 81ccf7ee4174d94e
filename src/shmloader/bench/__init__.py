"""The built-in benchmark: this loader beside torch's DataLoader, in one run.

Every figure is a ratio of two systems measured in the same run: for each workload and
worker count the peers are this loader, ``torch.utils.data.DataLoader`` on the *same*
dataset object with the same settings, this loader with ``num_workers=0``, and the copy
ceiling (as many processes as workers doing nothing but ``np.copyto`` of the same bytes
into as many batch-sized buffers as the ring has slots). Each peer is warmed up first,
then timed ``repeat`` times, the peers alternating inside each repeat; the report gives
the median, the spread ((max - min) / median) and ratios paired within a repeat.

Each timed repeat is bounded twice: ``batches`` batches or ``seconds`` seconds, whichever
comes first, so a fast loader gets many batches and a slow one does not run for minutes.

A fresh (non-persistent) loader's short epoch is measured separately, the peers
alternating: the **cold** figure (constructor to the last batch of a ``cold_batches``-batch
epoch, worker start-up and the first ring included), with time to first batch from the
same runs. Peak consumer memory and the system's shared-memory use in a fresh subprocess per loader, so
one loader's allocations never count against the other.

Run it as ``shmloader bench`` (see ``shmloader bench --help``) or :func:`main`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shmloader.tree import leaves as tree_leaves

_CACHE_ITEMS = 16  # samples come from a cache this big, so the dataset's cost is ~0
_WARMUP_BATCHES = 16
_WARMUP_MAX_S = 1.0
_PREFETCH = 2  # both loaders' default prefetch_factor
_PROBE_TIMEOUT_S = 120.0
_MEM_SAMPLE_INTERVAL_S = 0.005
COLD_BATCHES = 64  # a fresh loader's short epoch (validation passes, sweeps, notebooks)

# ---------------------------------------------------------------------------------------
# Datasets: module level, so they pickle under spawn and forkserver.


class ImageDataset:
    """3x224x224 images (uint8 or float32) and an int64 label: sample ``i`` is item
    ``i % 16`` of a prebuilt cache, so fetching costs one list lookup."""

    def __init__(self, length: int, dtype: str = "uint8", shape: tuple[int, ...] = (3, 224, 224)):
        rng = np.random.default_rng(0)
        images = rng.integers(0, 255, (_CACHE_ITEMS, *shape)).astype(dtype)
        labels = np.arange(_CACHE_ITEMS, dtype=np.int64)
        self.samples = [(images[k], labels[k]) for k in range(_CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return self.samples[i % _CACHE_ITEMS]


class RecordDataset:
    """Small records ``{"x": float32[16], "y": int64}``, from a prebuilt 16-item cache."""

    def __init__(self, length: int):
        rng = np.random.default_rng(0)
        x = rng.random((_CACHE_ITEMS, 16), dtype=np.float32)
        y = np.arange(_CACHE_ITEMS, dtype=np.int64)
        self.samples = [{"x": x[k], "y": y[k]} for k in range(_CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i % _CACHE_ITEMS]


class ScalarDataset:
    """One int64 scalar per sample, from a 16-item cache: measures per-batch overhead."""

    def __init__(self, length: int):
        values = np.arange(_CACHE_ITEMS, dtype=np.int64)
        self.samples = [values[k] for k in range(_CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.int64:
        return self.samples[i % _CACHE_ITEMS]


class ComputeDataset:
    """Each sample costs ~``sample_s`` of CPU (sorting a cached random array), then a
    float32[64] vector and an int64 label: the loader should not matter at all here.

    The sort size is calibrated once, in the process that builds the dataset, so both
    loaders run exactly the same computation.
    """

    def __init__(self, length: int, sample_s: float = 1e-3):
        rng = np.random.default_rng(0)
        x = rng.random((_CACHE_ITEMS, 64), dtype=np.float32)
        y = np.arange(_CACHE_ITEMS, dtype=np.int64)
        self.samples = [(x[k], y[k]) for k in range(_CACHE_ITEMS)]
        self.length = length
        self.work = rng.random(16384)
        for _ in range(3):  # scale the work to the target cost
            cost = self.cost_s()
            self.work = rng.random(max(1024, int(len(self.work) * sample_s / cost)))
        self.sample_s = self.cost_s()

    def cost_s(self) -> float:
        """The median CPU seconds one sample's computation takes here."""
        times = []
        for _ in range(7):
            c0 = time.thread_time()
            np.sort(self.work)
            times.append(time.thread_time() - c0)
        return max(statistics.median(times), 1e-6)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        np.sort(self.work)
        return self.samples[i % _CACHE_ITEMS]


class TokenDataset:
    """Variable-length int32 token sequences (W7): sample ``i`` has ``lengths[i]`` tokens,
    drawn uniformly in ``[min_len, max_len]`` from a seeded RNG, and is a prefix of row
    ``i % 16`` of a cached pool (a view: fetching costs one slice)."""

    def __init__(self, length: int, min_len: int = 16, max_len: int = 2048, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(min_len, max_len + 1, length).tolist()
        self.pool = rng.integers(1, 32_000, (_CACHE_ITEMS, max_len), dtype=np.int32)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:
        return self.pool[i % _CACHE_ITEMS, : self.lengths[i]]


def pad_collate(samples: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """torch's side of W7: pad 1-d samples to the batch's longest with zeros (numpy);
    returns ``(padded, lengths)``, as shmloader's ``collate="pad"`` does."""
    lengths = np.fromiter((len(x) for x in samples), np.int64, len(samples))
    out = np.zeros((len(samples), int(lengths.max())), samples[0].dtype)
    for row, x in zip(out, samples, strict=True):
        row[: len(x)] = x
    return out, lengths


def _bucket_sampler(dataset: TokenDataset, batch_size: int) -> Any:
    from shmloader import BucketBatchSampler

    return BucketBatchSampler(dataset.lengths, batch_size, num_buckets=16, seed=0)


def padding_waste(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> dict[str, float]:
    """Padding of ``batches`` padded to each batch's longest sample: the share of padded
    elements in all elements, and the mean elements per batch."""
    lens = np.asarray(lengths, dtype=np.int64)
    total = real = 0
    for b in batches:
        bl = lens[np.asarray(b, dtype=np.int64)]
        total += len(bl) * int(bl.max())
        real += int(bl.sum())
    return {"waste": (total - real) / total, "elements_per_batch": total / max(len(batches), 1)}


def w7_padding(dataset: TokenDataset, batch_size: int) -> dict[str, dict[str, float]]:
    """One epoch's padding waste with the bucketed sampler and with plain batching over a
    shuffled order (what ``BatchSampler(RandomSampler(...))`` gives), from the lengths."""
    n = len(dataset)
    order = np.random.default_rng(0).permutation(n)
    plain = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return {
        "bucketed": padding_waste(dataset.lengths, list(_bucket_sampler(dataset, batch_size))),
        "unbucketed": padding_waste(dataset.lengths, plain),
    }


# ---------------------------------------------------------------------------------------
# Workloads and run configurations.


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    batch_size: int
    default_batches: int  # per timed repeat (the time box usually ends it first for slow peers)
    make: Callable[[int], Any] | None  # length -> dataset (None: W6 brings its own run)
    time_scale: float = 1.0  # this workload's repeats run this many times --seconds
    ragged: bool = False  # W7: bucketed batches padded per batch; no copy ceiling


def _make_w1(n: int) -> ImageDataset:
    return ImageDataset(n, "uint8")


def _make_w2(n: int) -> ImageDataset:
    return ImageDataset(n, "float32")


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "images uint8 3x224x224 + int64 label, batch 64", 64, 1000, _make_w1),
    "W2": Workload("W2", "images float32 3x224x224 + int64 label, batch 64", 64, 200, _make_w2),
    "W3": Workload("W3", 'records {"x": float32[16], "y": int64}, batch 256', 256, 5000, RecordDataset),
    "W4": Workload("W4", "one int64 scalar, batch 1 (per-batch overhead)", 1, 40000, ScalarDataset),
    "W5": Workload(
        "W5",
        "~1 ms of numpy CPU per sample, float32[64] + int64, batch 16",
        16,
        400,
        ComputeDataset,
        time_scale=2.0,  # slow batches: longer repeats, so +-5% is measurable
    ),
    "W6": Workload(
        "W6",
        "2,000 synthetic JPEGs ~400 px -> RandomResizedCrop 224 + flip -> batch 64 uint8 HWC "
        "(shmloader.vision.benchmark; epochs, not a time box)",
        64,
        0,
        None,
    ),
    "W7": Workload(
        "W7",
        "int32 token sequences of 16..2048, BucketBatchSampler(64, 16 buckets), padded per batch",
        64,
        4000,
        TokenDataset,
        ragged=True,
    ),
}
W6_PEERS = ("torch+conventional", "torch+ImageFolder", "shmloader+ImageFolder")

# Variants: (suffix, in_order, persistent_workers)
VARIANTS: dict[str, tuple[str, bool, bool]] = {
    "W1-unordered": ("W1", False, True),
    "W1-fresh": ("W1", True, False),  # persistent_workers=False: each epoch starts workers
    "W7-unordered": ("W7", False, True),  # both loaders balance tasks over their workers
}
ALL_NAMES = [*WORKLOADS, *VARIANTS]
DEFAULT_NAMES = ["W1", "W4"]


@dataclass(frozen=True)
class Config:
    """One measured setting: a workload, a worker count, and the loader options."""

    name: str  # "W1", "W1-unordered", ...
    workload: str  # "W1"
    workers: int
    in_order: bool = True
    persistent_workers: bool = True

    @property
    def label(self) -> str:
        return f"{self.name} w{self.workers}"


def make_configs(names: Sequence[str], workers: Sequence[int]) -> list[Config]:
    """The configurations for ``names`` x ``workers``, in that order."""
    configs = []
    for w in workers:
        for name in names:
            base, in_order, persistent = VARIANTS.get(name, (name, True, True))
            configs.append(Config(name, base, w, in_order, persistent))
    return configs


# ---------------------------------------------------------------------------------------
# Results.


@dataclass
class Row:
    """One peer's figures in one configuration."""

    loader: str  # "shmloader", "torch", "shmloader w0", "copy ceiling"
    status: str = "ok"  # or "not installed", "failed: ..."
    runs: list[float] = field(default_factory=list)  # batches/s of each repeat
    cpu_ms_runs: list[float] = field(default_factory=list)  # consumer CPU ms per batch
    batches_runs: list[int] = field(default_factory=list)
    batches_per_s: float | None = None  # median
    spread: float | None = None  # (max - min) / median
    gb_per_s: float | None = None
    consumer_cpu_ms: float | None = None  # median consumer CPU ms per batch
    ratio_to_torch: float | None = None  # median of per-repeat ratios
    ratio_range: tuple[float, float] | None = None
    pct_of_ceiling: float | None = None  # median of per-repeat ratios, in %


@dataclass
class ConfigResult:
    config: Config
    description: str
    batch_size: int
    batch_bytes: int
    num_slots: int
    rows: list[Row] = field(default_factory=list)
    first_batch_s: dict[str, dict[str, Any]] = field(default_factory=dict)
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    ring: dict[str, int] | None = None  # the shmloader ring this configuration used
    # Fresh loaders' short epochs: {"batches": n, "shmloader"/"torch": {"median_s", "spread",
    # "runs_s"}, "ratio": median of torch/shmloader paired per round, "ratio_range": [lo, hi]}
    cold: dict[str, Any] = field(default_factory=dict)
    load_average: list[float] | None = None  # 1-minute load at the start and the end
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # W6's report, W7's padding waste

    def row(self, loader: str) -> Row | None:
        return next((r for r in self.rows if r.loader == loader), None)


def _median_spread(values: Sequence[float]) -> tuple[float, float]:
    med = statistics.median(values)
    return med, ((max(values) - min(values)) / med if med else 0.0)


# ---------------------------------------------------------------------------------------
# Progress: a bar on a terminal, plain lines otherwise.


class Progress:
    """Reports steps done out of ``total``: a one-line bar on a terminal (stderr), plain
    lines on ``out`` otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, out: Callable[[str], None], enabled: bool = True):
        self.total = max(total, 1)
        self.done = 0
        self.out = out
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            width = 28
            fill = int(width * self.done / self.total)
            bar = "#" * fill + "-" * (width - fill)
            cols = max(40, shutil.get_terminal_size((100, 20)).columns - 1)
            line = f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {text}"
            sys.stderr.write("\r" + line[:cols].ljust(cols))
            sys.stderr.flush()
        else:
            self.out(f"[{self.done}/{self.total} {elapsed:.0f}s] {text}")

    def close(self) -> None:
        if self.tty:
            cols = max(40, shutil.get_terminal_size((100, 20)).columns - 1)
            sys.stderr.write("\r" + " " * cols + "\r")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------
# Peers.


def _torch_dataloader() -> Any | None:
    """torch.utils.data.DataLoader, or None when torch is not installed."""
    try:
        from torch.utils.data import DataLoader as TorchDataLoader
    except ImportError:
        return None
    return TorchDataLoader


def _close_loader(loader: Any) -> None:
    """Stop a loader's persistent workers now (both kinds)."""
    shutdown = getattr(loader, "shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    it = getattr(loader, "_iterator", None)  # torch keeps its persistent iterator here
    if it is not None:
        stop = getattr(it, "_shutdown_workers", None)
        if stop is not None:
            stop()
        loader._iterator = None


def _close_iter(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()
        return
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


def _time_loader(
    loader: Any, batches: int, max_s: float, from_first: bool = True
) -> tuple[float, float, int]:
    """Iterate up to ``batches`` batches or ``max_s`` seconds of a new epoch: batches/s,
    consumer CPU seconds per batch and the batches timed.

    ``from_first``: the clocks start once the first batch is in hand, so the figure is the
    steady state (a new epoch's reset and pipeline fill are excluded, for every loader
    alike); otherwise they start before ``iter()``, which then counts worker start-up.
    """
    gc.collect()
    perf, cpu = time.perf_counter, time.process_time
    t0, c0 = perf(), cpu()
    it = iter(loader)
    _batch = None
    if from_first:
        for _batch in it:
            break
        t0, c0 = perf(), cpu()
    deadline = t0 + max_s
    n = 0
    for _batch in it:
        n += 1
        if n >= batches or perf() >= deadline:
            break
    wall = perf() - t0
    used = cpu() - c0
    _batch = None
    if not getattr(loader, "persistent_workers", False):
        _close_iter(it)
    del it
    return n / wall, used / max(n, 1), n


class LoaderPeer:
    """A DataLoader made once and timed over fresh epochs."""

    def __init__(self, name: str, loader: Any, from_first: bool = True):
        self.name = name
        self.loader = loader
        self.from_first = from_first

    def warm_up(self) -> None:
        _time_loader(self.loader, _WARMUP_BATCHES, _WARMUP_MAX_S, self.from_first)

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]:
        return _time_loader(self.loader, batches, max_s, self.from_first)

    def close(self) -> None:
        _close_loader(self.loader)


def _ceiling_sources(dataset: Any, batch_size: int) -> list[np.ndarray]:
    """Per leaf, the first ``k`` samples stacked, ``k`` dividing the batch size: copying
    them ``batch_size / k`` times moves exactly a batch's bytes from the same cached
    source the datasets read."""
    k = math.gcd(batch_size, _CACHE_ITEMS)
    samples = [dataset[i] for i in range(k)]

    cols = list(zip(*([np.asarray(v) for v in tree_leaves(s)] for s in samples), strict=True))
    return [np.stack(col) for col in cols]


def _ceiling_child(
    sources: list[np.ndarray],
    batch_size: int,
    num_slots: int,
    batches: int,
    max_s: float,
    shared: bool,
    barrier: Any,
    conn: Any,
) -> None:
    """One copying process: rotate over ``num_slots`` batch-sized buffers (private
    memory, or ``shared`` memory: a shmem-backed mapping like the ring's)."""
    try:
        k = sources[0].shape[0]
        slots = []
        for _ in range(num_slots):
            bufs = [_buffer((batch_size, *s.shape[1:]), s.dtype, shared) for s in sources]
            slots.append([b.reshape(batch_size // k, *s.shape) for b, s in zip(bufs, sources, strict=True)])
        copyto = np.copyto
        for views in slots:  # warm-up: one pass over every buffer
            for v, s in zip(views, sources, strict=True):
                copyto(v, s)
        barrier.wait(30)
        perf = time.perf_counter
        t0 = perf()
        deadline = t0 + max_s
        n = 0
        while n < batches:
            for v, s in zip(slots[n % num_slots], sources, strict=True):
                copyto(v, s)
            n += 1
            if perf() >= deadline:
                break
        conn.send((n, perf() - t0))
    except BaseException as exc:
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


def _buffer(shape: tuple[int, ...], dtype: np.dtype, shared: bool) -> np.ndarray:
    """A touched buffer: private (numpy's allocator; huge pages where the kernel gives
    them) or a MAP_SHARED anonymous mapping (shmem, like the ring's tmpfs pages)."""
    if not shared:
        return np.ones(shape, dtype)
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    buf = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    buf[:] = 1
    return buf[:nbytes].view(dtype).reshape(shape)


class CeilingPeer:
    """``procs`` processes copying batch bytes into a ring-sized rotation of buffers.

    The copy is one ``np.copyto`` per leaf per batch (from a cached block of samples, the
    same bytes the datasets return): the most a process can move. ``shared`` puts the
    buffers in shared memory, so the figure shows what the ring's pages themselves allow.
    """

    def __init__(self, dataset: Any, batch_size: int, num_slots: int, procs: int, shared: bool = False):
        self.name = "copy ceiling shm" if shared else "copy ceiling"
        self.shared = shared
        self.sources = _ceiling_sources(dataset, batch_size)
        self.batch_size = batch_size
        self.num_slots = num_slots
        self.procs = procs
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        self.ctx = multiprocessing.get_context(method)

    def warm_up(self) -> None:
        self.run(4 * self.procs, 0.2)

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]:
        ctx = self.ctx
        barrier = ctx.Barrier(self.procs)
        per_proc = max(1, -(-batches // self.procs))
        children = []
        for _ in range(self.procs):
            ours, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_ceiling_child,
                args=(
                    self.sources,
                    self.batch_size,
                    self.num_slots,
                    per_proc,
                    max_s,
                    self.shared,
                    barrier,
                    theirs,
                ),
                daemon=True,
            )
            p.start()
            theirs.close()
            children.append((p, ours))
        rate, total = 0.0, 0
        try:
            for _p, conn in children:
                if not conn.poll(max_s + 60):
                    raise RuntimeError("a copy-ceiling process did not report in time")
                msg = conn.recv()
                if msg[0] == "error":
                    raise RuntimeError(f"a copy-ceiling process failed: {msg[1]}")
                n, wall = msg
                rate += n / wall
                total += n
        finally:
            for p, conn in children:
                conn.close()
                p.join(5)
                if p.exitcode is None:
                    p.kill()
                    p.join()
        return rate, float("nan"), total

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------
# Measurements of one configuration.


def batch_bytes_of(dataset: Any, batch_size: int) -> int:
    """Bytes of array data in one batch."""
    return sum(int(s.nbytes) for s in _ceiling_sources(dataset, batch_size)) * (
        batch_size // math.gcd(batch_size, _CACHE_ITEMS)
    )


def _loader_options(wl: Workload, dataset: Any, peer: str) -> dict[str, Any]:
    """How ``peer`` ("shmloader" or "torch") batches ``wl``: its batch size, or for W7 a
    bucketed batch sampler (a fresh one per loader, same seed) and padding (shmloader's
    ``collate="pad"``, torch's :func:`pad_collate`)."""
    if not wl.ragged:
        return {"batch_size": wl.batch_size}
    opts: dict[str, Any] = {"batch_sampler": _bucket_sampler(dataset, wl.batch_size)}
    if peer == "torch":
        opts["collate_fn"] = pad_collate
    else:
        opts["collate"] = "pad"
    return opts


def _make_loaders(
    cfg: Config, dataset: Any, wl: Workload, torch_dl: Any | None
) -> tuple[Any, Any | None, Any]:
    from shmloader import DataLoader

    common = dict(num_workers=cfg.workers, persistent_workers=cfg.persistent_workers, in_order=cfg.in_order)
    shm = DataLoader(dataset, **common, **_loader_options(wl, dataset, "shmloader"))
    tl = (
        torch_dl(dataset, **common, **_loader_options(wl, dataset, "torch")) if torch_dl is not None else None
    )
    w0 = DataLoader(dataset, num_workers=0, **_loader_options(wl, dataset, "shmloader"))
    return shm, tl, w0


class _Prefix:
    """The first ``n`` samples of ``dataset`` (a short epoch over the same samples); W7's
    ``lengths`` too, for its bucketed sampler."""

    def __init__(self, dataset: Any, n: int):
        self.dataset = dataset
        self.n = n
        lengths = getattr(dataset, "lengths", None)
        if lengths is not None:
            self.lengths = lengths[:n]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.dataset[i]


def _summary(runs: list[float]) -> dict[str, Any]:
    med, spread = _median_spread(runs)
    return {"median_s": med, "spread": spread, "runs_s": runs}


def _cold_times(
    cfg: Config,
    dataset: Any,
    wl: Workload,
    torch_dl: Any | None,
    repeat: int,
    cold_batches: int,
    progress: Progress,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Fresh loaders (fork, not persistent) over the first ``cold_batches`` batches of
    ``dataset``, the peers alternating, the first round a warm-up: seconds from
    constructing the loader to its first batch, and to the last batch of the epoch (the
    cold figure; the workers' shutdown after it is not counted)."""
    from shmloader import DataLoader

    data = _Prefix(dataset, min(len(dataset), cold_batches * wl.batch_size))
    makers: dict[str, Callable[[], Any]] = {
        "shmloader": lambda: DataLoader(
            data, num_workers=cfg.workers, **_loader_options(wl, data, "shmloader")
        ),
    }
    if torch_dl is not None:
        makers["torch"] = lambda: torch_dl(
            data, num_workers=cfg.workers, **_loader_options(wl, data, "torch")
        )
    first: dict[str, list[float]] = {k: [] for k in makers}
    last: dict[str, list[float]] = {k: [] for k in makers}
    batches = 0
    perf = time.perf_counter
    for r in range(repeat + 1):
        order = list(makers) if r % 2 == 0 else list(reversed(makers))
        for name in order:
            gc.collect()
            t0 = perf()
            loader = makers[name]()
            it = iter(loader)
            batches = len(loader)
            t_first = None
            for n, _batch in enumerate(it, 1):
                if t_first is None:
                    t_first = perf() - t0
                if n == batches:
                    break  # the last batch is in hand: the shutdown that follows is not timed
            t_last = perf() - t0
            _batch = None
            _close_iter(it)
            del it, loader
            if r and t_first is not None:
                first[name].append(t_first)
                last[name].append(t_last)
        progress.step(f"{cfg.label} cold epoch ({batches} batches), round {r}/{repeat}")
    first_batch = {name: _summary(ts) for name, ts in first.items()}
    cold: dict[str, Any] = {"batches": batches}
    cold.update({name: _summary(ts) for name, ts in last.items()})
    if "torch" in last:
        ratios = [t / s for s, t in zip(last["shmloader"], last["torch"], strict=True)]
        cold["ratio"] = statistics.median(ratios)
        cold["ratio_range"] = [min(ratios), max(ratios)]
    return first_batch, cold


def measure_config(
    cfg: Config,
    *,
    batches: int | None,
    seconds: float,
    repeat: int,
    memory: bool,
    torch_dl: Any | None,
    progress: Progress,
    cold_batches: int = COLD_BATCHES,
) -> ConfigResult:
    """Time every peer of ``cfg``, then fresh loaders' short epochs (cold, and time to
    first batch) and memory."""
    from shmloader.leases import default_num_slots

    wl = WORKLOADS[cfg.workload]
    if wl.make is None:
        return measure_w6(cfg, repeat=repeat, torch_dl=torch_dl, progress=progress)
    n_batches = batches or wl.default_batches
    length = wl.batch_size * (n_batches + _WARMUP_BATCHES + 8)
    dataset = wl.make(length)
    num_slots = default_num_slots(cfg.workers, _PREFETCH)  # the loader's ring, for the ceiling
    load0 = _load1()
    extra: dict[str, Any] = {}
    if wl.ragged:
        extra["padding"] = w7_padding(dataset, wl.batch_size)
        batch_bytes = int(extra["padding"]["bucketed"]["elements_per_batch"] * 4 + wl.batch_size * 8)
    else:
        batch_bytes = batch_bytes_of(dataset, wl.batch_size)
    res = ConfigResult(cfg, wl.description, wl.batch_size, batch_bytes, num_slots, extra=extra)
    if isinstance(dataset, ComputeDataset):
        res.notes.append(f"W5 sample cost measured: {dataset.sample_s * 1e3:.2f} ms")
    if wl.ragged:
        pad = extra["padding"]
        res.notes.append(
            f"W7 GB/s counts the mean bucketed batch ({batch_bytes / 2**20:.2f} MiB; "
            f"padding waste {pad['bucketed']['waste']:.1%}, {pad['unbucketed']['waste']:.1%} unbucketed)"
        )
    shm, tl, w0 = _make_loaders(cfg, dataset, wl, torch_dl)
    # Persistent workers: steady state, from the first batch; otherwise from iter(), so
    # the worker start-up each epoch pays is what the variant shows.
    steady = cfg.persistent_workers
    peers: list[Any] = [LoaderPeer("shmloader", shm, steady)]
    if tl is not None:
        peers.append(LoaderPeer("torch", tl, steady))
    peers.append(LoaderPeer("shmloader w0", w0))
    if not wl.ragged:  # ragged batches: no fixed bytes per batch to copy
        peers += [
            CeilingPeer(dataset, wl.batch_size, num_slots, cfg.workers),
            CeilingPeer(dataset, wl.batch_size, num_slots, cfg.workers, shared=True),
        ]
    rows = {p.name: Row(p.name) for p in peers}
    have_torch = tl is not None
    try:
        for p in peers:
            p.warm_up()
            progress.step(f"{cfg.label} warm-up {p.name}")
        for r in range(repeat):
            order = peers if r % 2 == 0 else peers[::-1]
            for p in order:
                rate, cpu_s, n = p.run(n_batches, seconds * wl.time_scale)
                row = rows[p.name]
                row.runs.append(rate)
                row.cpu_ms_runs.append(cpu_s * 1e3)
                row.batches_runs.append(n)
                progress.step(
                    f"{cfg.label} repeat {r + 1}/{repeat} {p.name}: {rate:,.0f} batches/s ({n} batches)"
                )
        ring = getattr(shm, "ring", None)
        if ring is not None:
            res.ring = {
                "num_slots": int(ring.num_slots),
                "slot_bytes": int(ring.slot_bytes),
                "total_bytes": int(getattr(ring, "total_bytes", 0)),
            }
            res.notes.append(
                f"{cfg.label} ring: {ring.num_slots} slots x {ring.slot_bytes / 2**20:.2f} MiB"
                f" = {res.ring['total_bytes'] / 2**20:.1f} MiB"
            )
    finally:
        # Newest first: workers forked later inherit the earlier loaders' sockets, and a
        # shmloader worker stops on EOF, which only comes once every copy is closed.
        for p in reversed(peers):
            p.close()
        del shm, tl, w0, peers
        gc.collect()
    torch_runs = rows["torch"].runs if "torch" in rows else None
    ceil_runs = rows["copy ceiling"].runs if "copy ceiling" in rows else None
    for row in rows.values():
        row.batches_per_s, row.spread = _median_spread(row.runs)
        row.gb_per_s = row.batches_per_s * res.batch_bytes / 1e9
        cpus = [c for c in row.cpu_ms_runs if not math.isnan(c)]
        row.consumer_cpu_ms = statistics.median(cpus) if cpus else None
        row.cpu_ms_runs = cpus
        if torch_runs:
            ratios = [a / b for a, b in zip(row.runs, torch_runs, strict=True)]
            row.ratio_to_torch = statistics.median(ratios)
            row.ratio_range = (min(ratios), max(ratios))
        if ceil_runs:
            row.pct_of_ceiling = 100 * statistics.median(
                a / b for a, b in zip(row.runs, ceil_runs, strict=True)
            )
    res.rows = list(rows.values())
    if not have_torch:
        res.rows.insert(1, Row("torch", status="not installed"))
    if wl.ragged:
        res.rows += [
            Row(name, status="n/a (ragged batches)") for name in ("copy ceiling", "copy ceiling shm")
        ]
    res.first_batch_s, res.cold = _cold_times(cfg, dataset, wl, torch_dl, repeat, cold_batches, progress)
    if memory:
        for name in ["shmloader", "torch"] if torch_dl is not None else ["shmloader"]:
            res.memory[name] = _probe_memory(cfg, name)
            progress.step(f"{cfg.label} memory probe {name}")
    if load0 is not None:
        res.load_average = [load0, _load1() or 0.0]
    return res


def _w6_missing(torch_dl: Any | None) -> str | None:
    """Why W6 cannot run here, or None."""
    import importlib.util

    missing = [
        name for mod, name in (("PIL", "Pillow"), ("simplejpeg", "simplejpeg")) if not _importable(mod)
    ]
    if missing:
        return f'needs Pillow and simplejpeg ({", ".join(missing)} missing: pip install "shmloader[vision]")'
    if torch_dl is None or importlib.util.find_spec("torch") is None:
        return "needs torch (its peers are torch DataLoaders)"
    return None


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _w6_steps(repeat: int) -> int:
    return 1 + len(W6_PEERS) * (1 + repeat)  # dataset, warm-up epochs, timed epochs


def measure_w6(cfg: Config, *, repeat: int, torch_dl: Any | None, progress: Progress) -> ConfigResult:
    """W6, through :func:`shmloader.vision.benchmark.run`: three peers, ``repeat`` timed
    epochs each after a warm-up epoch; rows in batches of 64 and ratios to
    torch+conventional, the full report in ``extra["w6"]``."""
    wl = WORKLOADS["W6"]
    size = 224 * 224 * 3
    res = ConfigResult(cfg, wl.description, wl.batch_size, wl.batch_size * (size + 8), 0)
    why = _w6_missing(torch_dl)
    if why is not None:
        res.rows = [Row(name, status=f"skipped: {why}") for name in W6_PEERS]
        res.notes.append(f"{cfg.label} skipped: {why}")
        for _ in range(_w6_steps(repeat)):
            progress.step(f"{cfg.label} skipped")
        return res
    from shmloader.bench import jpeg as vb

    folder = vb.default_cache_dir() / f"w6-jpeg-{vb.W6_COUNT}"
    if not (folder / ".complete").exists():
        progress.out(f"{cfg.label}: writing {vb.W6_COUNT} synthetic JPEGs to {folder} (once, about a minute)")
    vb.ensure_images(folder)
    progress.step(f"{cfg.label} dataset ready: {folder}")
    load0 = _load1()
    report = vb.run(
        folder,
        batch_size=wl.batch_size,
        workers=cfg.workers,
        repeat=repeat,
        log=lambda text: progress.step(f"{cfg.label} {text.strip()}"),
    )
    base = {r.peer: r.runs for r in report["results"]}["torch+conventional"]
    for r in report["results"]:
        runs = [x / wl.batch_size for x in r.runs]
        ratios = [a / b for a, b in zip(r.runs, base, strict=True)]
        med, spread = _median_spread(runs)
        res.rows.append(
            Row(
                r.peer,
                runs=runs,
                batches_per_s=med,
                spread=spread,
                gb_per_s=med * res.batch_bytes / 1e9,
                consumer_cpu_ms=r.consumer_cpu_ms_per_batch,
                ratio_to_torch=statistics.median(ratios),
                ratio_range=(min(ratios), max(ratios)),
            )
        )
    res.extra["w6"] = {**report, "results": [asdict(r) for r in report["results"]]}
    res.extra["w6_table"] = vb.format_table(report)
    res.notes.append(
        f"{cfg.label}: batches/s = images/s / 64 over whole epochs of {vb.W6_COUNT} images (the last "
        f"batch short); 'vs torch' = vs torch+conventional; resample backend {report['backend']}"
    )
    if load0 is not None:
        res.load_average = [load0, _load1() or 0.0]
    return res


def _load1() -> float | None:
    """The 1-minute load average (other work on the machine skews every figure)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# ---------------------------------------------------------------------------------------
# Memory: peak consumer RSS and system shared memory, in a fresh process per loader.


def _proc_kb(path: str, keys: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def _shm_used_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


_STATUS_KEYS = ("VmRSS", "RssAnon", "RssShmem", "VmHWM")


def _probe_main(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: run one loader over ``spec``'s workload, touching every page
    of every batch like a real consumer, and sample this process's RSS and the system's
    shared memory while it runs."""
    cfg = Config(**spec["config"])
    wl = WORKLOADS[cfg.workload]
    batches = spec["batches"]
    dataset = wl.make(wl.batch_size * (batches + 8))
    if spec["loader"] == "torch":
        from torch.utils.data import DataLoader as Loader
    else:
        from shmloader import DataLoader as Loader
    gc.collect()
    try:  # reset the kernel's peak-RSS mark (VmHWM) so it covers the loader only
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _proc_kb("/proc/self/status", _STATUS_KEYS)
    base_shmem = _proc_kb("/proc/meminfo", ("Shmem",)).get("Shmem")
    base_devshm = _shm_used_bytes()
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0, "Shmem": 0, "devshm": 0}
    stop = threading.Event()

    def sample() -> None:
        while True:
            st = _proc_kb("/proc/self/status", _STATUS_KEYS)
            mi = _proc_kb("/proc/meminfo", ("Shmem",))
            for k in ("VmRSS", "RssAnon", "RssShmem"):
                peaks[k] = max(peaks[k], st.get(k, 0))
            peaks["Shmem"] = max(peaks["Shmem"], mi.get("Shmem", 0))
            peaks["devshm"] = max(peaks["devshm"], _shm_used_bytes() or 0)
            if stop.wait(_MEM_SAMPLE_INTERVAL_S):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    loader = Loader(
        dataset,
        num_workers=cfg.workers,
        persistent_workers=cfg.persistent_workers,
        in_order=cfg.in_order,
        **_loader_options(wl, dataset, spec["loader"]),
    )
    n = 0
    t0 = time.perf_counter()
    for batch in loader:
        for leaf in tree_leaves(batch):
            arr = leaf.numpy() if hasattr(leaf, "numpy") else np.asarray(leaf)
            flat = arr.reshape(-1).view(np.uint8)
            int(flat[::4096].sum())  # touch every page, as a consumer reading it would
        n += 1
        if n >= batches or time.perf_counter() - t0 > spec["seconds"]:
            break
    del batch
    stop.set()
    thread.join()
    end = _proc_kb("/proc/self/status", _STATUS_KEYS)
    _close_loader(loader)
    kib = 1024
    return {
        "batches": n,
        "baseline_rss_mb": base.get("VmRSS", 0) * kib / 2**20,
        "peak_rss_mb": max(end.get("VmHWM", 0), peaks["VmRSS"]) * kib / 2**20,
        "peak_rss_anon_mb": peaks["RssAnon"] * kib / 2**20,
        "peak_rss_shmem_mb": peaks["RssShmem"] * kib / 2**20,
        "shmem_delta_mb": (peaks["Shmem"] - base_shmem) * kib / 2**20 if base_shmem is not None else None,
        "dev_shm_delta_mb": (peaks["devshm"] - base_devshm) / 2**20 if base_devshm is not None else None,
    }


def _probe_memory(cfg: Config, loader: str, batches: int = 60, seconds: float = 3.0) -> dict[str, Any]:
    spec = {"config": asdict(cfg), "loader": loader, "batches": batches, "seconds": seconds}
    cmd = [sys.executable, "-m", "shmloader.bench", "--probe", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"the memory probe did not finish in {_PROBE_TIMEOUT_S:.0f} s"}
    if proc.returncode != 0:
        return {"error": f"the memory probe failed: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------
# Machine information.


def _git_commit() -> str | None:
    """The checkout's commit (with "+dirty" for local changes), when run from one; the
    SHMLOADER_COMMIT environment variable names it for a tree exported without .git."""
    if os.environ.get("SHMLOADER_COMMIT"):
        return os.environ["SHMLOADER_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
            timeout=5,
        )  # fmt: skip
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=here,
            capture_output=True, text=True, timeout=5,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine_info() -> dict[str, Any]:
    """What the figures depend on: CPU, cores, memory, versions, start method, load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    import shmloader

    mem = _proc_kb("/proc/meminfo", ("MemTotal",)).get("MemTotal")
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "shmloader_commit": _git_commit(),
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gb": mem / 2**20 if mem else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch_version,
        "shmloader": shmloader.__version__,
        "start_method": multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_context().get_start_method(),
        "load_average": load,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


# ---------------------------------------------------------------------------------------
# Targets (issue 4): judged on the 2-worker configurations.

_RATIO_TARGETS = {"W1": 8.0, "W2": 6.0, "W3": 10.0, "W4": 20.0}
_COLD_TARGET = 4.0  # a fresh loader's short epoch vs torch's, W1-W4 with 2 workers (issue 14)
_W7_TARGET = 5.0
_W6_TARGETS = {"torch+conventional": 2.0, "torch+ImageFolder": 1.15}


def evaluate_targets(results: list[ConfigResult]) -> list[dict[str, Any]]:
    """Each target that the results can judge: name, figure, goal and whether it is met."""
    by = {(r.config.name, r.config.workers): r for r in results}
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, met: bool | None) -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": met})

    for wl, goal in _RATIO_TARGETS.items():
        res = by.get((wl, 2))
        if res is None:
            continue
        row = res.row("shmloader")
        val = row.ratio_to_torch if row else None
        add(f"{wl} w2 vs torch", val, f">= {goal:g}x", None if val is None else val >= goal)
    for wl in _RATIO_TARGETS:
        res = by.get((wl, 2))
        if res is None or not res.cold:
            continue
        val = res.cold.get("ratio")
        add(
            f"{wl} w2 cold vs torch",
            val,
            f">= {_COLD_TARGET:g}x",
            None if val is None else val >= _COLD_TARGET,
        )
    res = by.get(("W5", 2))
    if res is not None:
        row = res.row("shmloader")
        val = row.ratio_to_torch if row else None
        add("W5 w2 vs torch", val, "0.95x - 1.05x", None if val is None else 0.95 <= val <= 1.05)
    res = by.get(("W6", 2))
    if res is not None:
        ours = res.row("shmloader+ImageFolder")
        for peer, goal in _W6_TARGETS.items():
            theirs = res.row(peer)
            val = None
            if ours and theirs and ours.runs and theirs.runs:
                val = statistics.median(a / b for a, b in zip(ours.runs, theirs.runs, strict=True))
            add(
                f"W6 w2 shmloader+ImageFolder vs {peer}",
                val,
                f">= {goal:g}x",
                None if val is None else val >= goal,
            )
    res = by.get(("W7", 2))
    if res is not None:
        row = res.row("shmloader")
        val = row.ratio_to_torch if row else None
        add("W7 w2 vs torch", val, f">= {_W7_TARGET:g}x", None if val is None else val >= _W7_TARGET)
    for wl in ("W1", "W2"):
        res = by.get((wl, 2))
        if res is not None:
            val = res.row("shmloader").pct_of_ceiling  # type: ignore[union-attr]
            add(f"{wl} w2 % of copy ceiling", val, ">= 50%", None if val is None else val >= 50)
    res = by.get(("W1", 2))
    if res is not None:
        s, t = res.row("shmloader"), res.row("torch")
        val = None
        if s and t and t.consumer_cpu_ms and s.consumer_cpu_ms is not None:
            val = s.consumer_cpu_ms / t.consumer_cpu_ms
        add("W1 w2 consumer CPU/batch vs torch", val, "<= 0.1x", None if val is None else val <= 0.1)
        fb = res.first_batch_s
        val = None
        if "torch" in fb and "shmloader" in fb:
            val = fb["shmloader"]["median_s"] / fb["torch"]["median_s"]
        add(
            "W1 w2 time to first batch vs torch",
            val,
            "<= 1.0x",
            None if val is None else val <= 1.0,
        )
    return out


# ---------------------------------------------------------------------------------------
# Output.


def _fmt(v: float | None, spec: str, missing: str = "-") -> str:
    return missing if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


_COLUMNS = [
    "workload",
    "loader",
    "batches/s",
    "spread",
    "GB/s",
    "vs torch",
    "% ceiling",
    "CPU ms/batch",
]


def table_rows(results: list[ConfigResult]) -> list[list[str]]:
    """The main table's cells, one list per peer."""
    rows = []
    for res in results:
        for r in res.rows:
            if r.status != "ok":
                rows.append([res.config.label, r.loader, r.status, "", "", "", "", ""])
                continue
            rows.append(
                [
                    res.config.label,
                    r.loader,
                    _fmt(r.batches_per_s, ",.0f"),
                    _fmt(r.spread, ".0%"),
                    _fmt(r.gb_per_s, ".2f"),
                    _fmt(r.ratio_to_torch, ".2f", "n/a") + ("x" if r.ratio_to_torch is not None else ""),
                    _fmt(r.pct_of_ceiling, ".0f") + ("%" if r.pct_of_ceiling is not None else ""),
                    _fmt(r.consumer_cpu_ms, ".3f"),
                ]
            )
    return rows


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _timing_text(timing: dict[str, float] | None, missing: str) -> str:
    """``median ms ±spread`` of one loader's timings, or ``missing`` where it did not run."""
    return f"{timing['median_s'] * 1e3:.0f} ms ±{timing['spread']:.0%}" if timing else missing


def _first_batch_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results:
        fb = res.first_batch_s
        if not fb:
            continue  # W6: not measured
        s, t = fb.get("shmloader"), fb.get("torch")
        rows.append(
            [
                res.config.label,
                _timing_text(s, "-"),
                _timing_text(t, "not installed"),
                f"{s['median_s'] / t['median_s']:.2f}x" if s and t else "n/a",
            ]
        )
    return rows


def _ratio_text(ratio: float | None, span: Sequence[float] | None) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.2f}x" + (f" ({span[0]:.2f}-{span[1]:.2f})" if span else "")


def _cold_rows(results: list[ConfigResult]) -> list[list[str]]:
    """Cold (a fresh loader's short epoch) beside steady (persistent workers), per config."""
    rows = []
    for res in results:
        cold = res.cold
        if not cold:
            continue  # W6: not measured
        s, t = cold.get("shmloader"), cold.get("torch")
        steady = res.row("shmloader")
        rows.append(
            [
                res.config.label,
                str(cold["batches"]),
                _timing_text(s, "-"),
                _timing_text(t, "not installed"),
                _ratio_text(cold.get("ratio"), cold.get("ratio_range")),
                _ratio_text(steady.ratio_to_torch, steady.ratio_range) if steady else "n/a",
            ]
        )
    return rows


def _memory_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results:
        for name, m in res.memory.items():
            if "error" in m:
                rows.append([res.config.label, name, m["error"], "", "", "", ""])
                continue
            rows.append(
                [
                    res.config.label,
                    name,
                    f"{m['peak_rss_mb']:.0f}",
                    f"{m['peak_rss_mb'] - m['baseline_rss_mb']:.0f}",
                    f"{m['peak_rss_shmem_mb']:.0f}",
                    _fmt(_nonneg(m["shmem_delta_mb"]), ".0f"),
                    _fmt(_nonneg(m["dev_shm_delta_mb"]), ".0f"),
                ]
            )
    return rows


def _loads(v: Any) -> str:
    return "unknown" if not v else " / ".join(f"{x:.1f}" for x in v)


def _nonneg(v: float | None) -> float | None:
    """A peak-over-baseline figure: below zero only when other processes freed memory."""
    return None if v is None else max(0.0, v)


_FB_HEADER = ["workload", "shmloader", "torch", "ratio"]
_COLD_HEADER = ["workload", "batches", "shmloader", "torch", "cold vs torch", "steady vs torch"]
_COLD_TITLE = (
    "Cold vs steady (cold: a fresh loader, fork, constructor to the last batch of a short "
    "epoch, median ± spread; ratios: median of paired rounds (min-max))"
)
_MEM_HEADER = [
    "workload",
    "loader",
    "peak RSS MB",
    "over baseline",
    "of it shm MB",
    "sys Shmem +MB",
    "/dev/shm +MB",
]


def _target_rows(targets: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for t in targets:
        v = t["value"]
        shown = "-" if v is None else (f"{v:.1f}%" if "%" in t["goal"] else f"{v:.3g}x")
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")
        rows.append([t["target"], shown, t["goal"], met])
    return rows


_WASTE_HEADER = ["workload", "bucketed waste", "unbucketed waste", "elements/batch bucketed", "unbucketed"]


def _waste_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results:
        pad = res.extra.get("padding")
        if pad:
            b, u = pad["bucketed"], pad["unbucketed"]
            rows.append(
                [
                    res.config.label,
                    f"{b['waste']:.1%}",
                    f"{u['waste']:.1%}",
                    f"{b['elements_per_batch']:,.0f}",
                    f"{u['elements_per_batch']:,.0f}",
                ]
            )
    return rows


_WASTE_TITLE = "W7 padding waste (padded / all elements of one epoch's batches, from the sampler and lengths)"


def format_report(results: list[ConfigResult], targets: list[dict[str, Any]]) -> str:
    """Every table of a run, as text."""
    parts = [_text_table(_COLUMNS, table_rows(results))]
    notes = [n for r in results for n in r.notes]
    if notes:
        parts.append("\n".join(sorted(set(notes))))
    for res in results:
        if "w6_table" in res.extra:
            parts.append(f"{res.config.label} in detail:\n" + res.extra["w6_table"])
    waste = _waste_rows(results)
    if waste:
        parts.append(f"{_WASTE_TITLE}:\n" + _text_table(_WASTE_HEADER, waste))
    cold = _cold_rows(results)
    if cold:
        parts.append(f"{_COLD_TITLE}:\n" + _text_table(_COLD_HEADER, cold))
    parts.append(
        "Time to first batch (fresh loader, fork):\n" + _text_table(_FB_HEADER, _first_batch_rows(results))
    )
    mem = _memory_rows(results)
    if mem:
        parts.append(
            "Memory (fresh process per loader, every page of every batch read):\n"
            + _text_table(_MEM_HEADER, mem)
        )
    if targets:
        parts.append(
            "Targets (2 workers):\n"
            + _text_table(["target", "figure", "goal", "status"], _target_rows(targets))
        )
    return "\n\n".join(parts)


_LEGEND = [
    "- shmloader / torch: the same dataset object, batch size, num_workers, prefetch_factor 2, "
    "default collate, numpy samples; persistent_workers=True and timed from the first batch of "
    "each epoch (steady state), except W1-fresh (persistent_workers=False, timed from iter(), "
    "so each epoch's worker start-up counts). W1-unordered, W7-unordered: in_order=False (both "
    "loaders then give no task to a worker that already has its share in flight).",
    "- shmloader w0: this loader with num_workers=0 (fetch and collate in the consumer).",
    "- cold: each round a fresh loader of each kind (fork, persistent_workers=False, the same "
    "settings) over the first --cold-batches batches of the same dataset, timed from its "
    "constructor to the last batch in hand (worker start-up and shmloader's first ring "
    "included, the workers' shutdown after it not); the first round is a warm-up, the peers "
    "alternate. Time to first batch comes from the same runs.",
    "- copy ceiling: as many processes as workers, each doing one np.copyto per leaf per batch "
    "of the same bytes from the same cached samples, rotating over as many batch-sized "
    "buffers as the ring has slots (private memory: numpy's allocator, huge pages where the "
    "kernel gives them). copy ceiling shm: the same into shared memory (4 KiB shmem pages, "
    "like the ring's).",
    "- CPU ms/batch: the consumer process's CPU time (user + system) per batch.",
    "- W6 (shmloader.vision.benchmark): torch+conventional is torch's DataLoader over the "
    "dataset people write (Pillow open, convert, torchvision's RandomResizedCrop algorithm, "
    "flip, np.array); torch+ImageFolder is torch's DataLoader over shmloader.vision.ImageFolder; "
    "shmloader+ImageFolder is this loader over the same ImageFolder. Shuffled, persistent "
    "workers, one warm-up epoch, then whole epochs timed; 'vs torch' is vs torch+conventional.",
    "- W7: both loaders (and w0) get the same BucketBatchSampler(lengths, 64, num_buckets=16, "
    "seed=0); shmloader pads with collate='pad', torch with a numpy collate_fn "
    "(shmloader.bench.pad_collate) returning (padded, lengths). No copy ceiling: batch sizes vary.",
]


def format_markdown(
    results: list[ConfigResult], targets: list[dict[str, Any]], info: dict[str, Any], command: str
) -> str:
    """A RESULTS.md: machine, command, and every table."""
    lines = [
        "# shmloader vs torch DataLoader",
        "",
        f"Reproduce with: `{command}`",
        "",
        f"shmloader {info.get('shmloader_commit') or info['shmloader']}. "
        f"Machine: {info['cpu_model']}, {info['usable_cores']} usable cores of {info['cores']}, "
        f"{_fmt(info['memory_gb'], '.0f')} GB; python {info['python']}, numpy {info['numpy']}, "
        f"torch {info['torch'] or 'not installed'}, start method {info['start_method']}; "
        f"{info['date']}; "
        f"load average (1, 5, 15 min) at start {_loads(info.get('load_average'))}, at end "
        f"{_loads(info.get('load_average_end'))}: other work on the machine skews every "
        "figure, which is why each ratio pairs two loaders measured back to back.",
        "",
        "batches/s and consumer CPU are medians of the repeats; spread = (max - min) / median; "
        "'vs torch' and '% ceiling' are medians of ratios paired within a repeat.",
        "",
        *_LEGEND,
        "",
        _md_table(_COLUMNS, table_rows(results)),
        "",
    ]
    notes = sorted({n for r in results for n in r.notes})
    lines += [*notes, ""] if notes else []
    for res in results:
        if "w6_table" in res.extra:
            lines += [f"## {res.config.label} in detail", "", "```", res.extra["w6_table"], "```", ""]
    waste = _waste_rows(results)
    if waste:
        lines += [f"## {_WASTE_TITLE}", "", _md_table(_WASTE_HEADER, waste), ""]
    cold = _cold_rows(results)
    if cold:
        lines += [f"## {_COLD_TITLE}", "", _md_table(_COLD_HEADER, cold), ""]
    lines += [
        "## Time to first batch (fresh loader, fork)",
        "",
        _md_table(_FB_HEADER, _first_batch_rows(results)),
        "",
    ]
    mem = _memory_rows(results)
    if mem:
        lines += [
            "## Memory (fresh process per loader, every page of every batch read)",
            "",
            _md_table(_MEM_HEADER, mem),
            "",
        ]
    if targets:
        lines += [
            "## Targets (2 workers)",
            "",
            _md_table(["target", "figure", "goal", "status"], _target_rows(targets)),
            "",
        ]
    return "\n".join(lines)


def results_json(
    results: list[ConfigResult],
    targets: list[dict[str, Any]],
    info: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The machine-readable form of a run."""
    configs = []
    for res in results:
        d = asdict(res)
        d["label"] = res.config.label
        configs.append(d)
    return {"machine": info, "settings": settings, "configs": configs, "targets": targets}


def write_plot(path: str, results: list[ConfigResult]) -> str:
    """A PNG bar chart of each peer's ratio to torch; returns a message for the user."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: matplotlib is not installed, so no chart was drawn (pip install matplotlib)."
    labels = [r.config.label for r in results]
    peers = ["shmloader", "shmloader w0", "copy ceiling shm", "copy ceiling"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4.5))
    width = 0.8 / len(peers)
    for j, peer in enumerate(peers):
        vals = []
        for res in results:
            row = res.row(peer) or (res.row("shmloader+ImageFolder") if peer == "shmloader" else None)
            vals.append(row.ratio_to_torch if row and row.ratio_to_torch else 0.0)
        ax.bar([i + (j - 1.5) * width for i in range(len(labels))], vals, width, label=peer)
    ax.axhline(1.0, color="black", linewidth=0.8, label="torch DataLoader")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("batches/s relative to torch DataLoader (log)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart written to {path}"


# ---------------------------------------------------------------------------------------
# Command line.


def _parse_list(text: str, allowed: Sequence[str] | None = None) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if allowed is not None:
        if items == ["all"]:
            return list(allowed)
        lookup = {a.lower(): a for a in allowed}
        bad = [i for i in items if i.lower() not in lookup]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown workload(s) {bad}; choose from {', '.join(allowed)} or 'all'"
            )
        items = [lookup[i.lower()] for i in items]
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmloader bench",
        description="Compare shmloader with torch.utils.data.DataLoader (and with its own "
        "num_workers=0 path and the memory-copy ceiling) on synthetic workloads, in one run.",
        epilog="Workloads: "
        + "; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values())
        + "; W1-unordered, W7-unordered: W1, W7 with in_order=False; W1-fresh: W1 with "
        "persistent_workers=False. "
        "W6 needs Pillow and simplejpeg, and writes its images once under $SHMLOADER_CACHE "
        "(default ~/.cache/shmloader; about a minute). "
        "With no options: W1 and W4 with 2 workers, about a minute.",
    )
    parser.add_argument(
        "--workloads",
        type=lambda s: _parse_list(s, ALL_NAMES),
        default=DEFAULT_NAMES,
        help=f"comma-separated, or 'all' (default: {','.join(DEFAULT_NAMES)})",
    )
    parser.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in _parse_list(s)],
        default=[2],
        help="comma-separated worker counts, e.g. 2,1 (default: 2)",
    )
    parser.add_argument(
        "--batches", type=int, default=None, help="batches per timed repeat (default: per workload)"
    )
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="time box of one timed repeat (default: 2)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed repeats; the median is reported (default: 3)"
    )
    parser.add_argument(
        "--cold-batches",
        type=int,
        default=COLD_BATCHES,
        help=f"batches of the fresh loaders' short epoch, the cold figure (default: {COLD_BATCHES})",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the memory probes (a subprocess per loader)"
    )
    parser.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as markdown here")
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG bar chart of the ratios (needs matplotlib)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    return parser


def _config_steps(cfg: Config, repeat: int, memory: bool, have_torch: bool) -> int:
    """Progress steps of one configuration (see measure_config)."""
    wl = WORKLOADS[cfg.workload]
    if wl.make is None:
        return _w6_steps(repeat)
    peers = (2 if have_torch else 1) + 1 + (0 if wl.ragged else 2)
    mem_steps = (2 if have_torch else 1) if memory else 0
    return peers + peers * repeat + repeat + 1 + mem_steps


def run(
    configs: list[Config],
    *,
    batches: int | None = None,
    seconds: float = 2.0,
    repeat: int = 3,
    memory: bool = True,
    out: Callable[[str], None] = print,
    quiet: bool = False,
    cold_batches: int = COLD_BATCHES,
) -> list[ConfigResult]:
    """Measure ``configs``; torch's rows say "not installed" when torch is missing."""
    torch_dl = _torch_dataloader()
    if torch_dl is None:
        out("torch is not installed: its rows say so and the rest runs (pip install torch to compare).")
    total = sum(_config_steps(cfg, repeat, memory, torch_dl is not None) for cfg in configs)
    progress = Progress(total, out, enabled=not quiet)
    results = []
    try:
        for cfg in configs:
            results.append(
                measure_config(
                    cfg,
                    batches=batches,
                    seconds=seconds,
                    repeat=repeat,
                    memory=memory,
                    torch_dl=torch_dl,
                    progress=progress,
                    cold_batches=cold_batches,
                )
            )
    finally:
        progress.close()
    return results


def main(argv: list[str] | None = None) -> int:
    """``shmloader bench``: run the benchmark and print the tables."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(_probe_main(json.loads(args.probe))))
        return 0
    if (
        args.repeat < 1
        or (args.batches is not None and args.batches < 1)
        or args.seconds <= 0
        or args.cold_batches < 1
    ):
        parser.error("--repeat, --batches and --cold-batches must be positive, and --seconds above zero")
    if any(w < 1 for w in args.workers):
        parser.error("--workers must be positive: the num_workers=0 path is measured in every configuration")

    def out(s: str) -> None:
        print(s, flush=True)

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            out(
                "note: --plot needs matplotlib, which is not installed: the run goes on "
                "without a chart (pip install matplotlib)."
            )
    configs = make_configs(args.workloads, args.workers)
    info = machine_info()
    out(
        f"shmloader bench: {', '.join(c.label for c in configs)}; up to "
        f"{args.batches or 'default'} batches or {args.seconds:g} s per repeat, "
        f"{args.repeat} repeats; {info['cpu_model']}, {info['usable_cores']} cores, "
        f"python {info['python']}, numpy {info['numpy']}, torch {info['torch'] or 'not installed'}"
    )
    t0 = time.perf_counter()
    results = run(
        configs,
        batches=args.batches,
        seconds=args.seconds,
        repeat=args.repeat,
        memory=not args.no_memory,
        out=out,
        quiet=args.quiet,
        cold_batches=args.cold_batches,
    )
    targets = evaluate_targets(results)
    out("")
    out(format_report(results, targets))
    out(f"\n{len(configs)} configuration(s) in {time.perf_counter() - t0:.0f} s.")
    command = "shmloader bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    settings = {
        "workloads": args.workloads,
        "workers": args.workers,
        "batches": args.batches,
        "seconds": args.seconds,
        "repeat": args.repeat,
        "cold_batches": args.cold_batches,
        "memory": not args.no_memory,
        "command": command.strip(),
    }
    info["load_average_end"] = machine_info()["load_average"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results_json(results, targets, info, settings), f, indent=1, default=str)
        out(f"results written to {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(results, targets, info, command.strip()))
        out(f"markdown written to {args.markdown}")
    if args.plot:
        out(write_plot(args.plot, results))
    return 0


if __name__ == "__main__":
    # Run the package module's main, so datasets pickle as shmloader.bench.* (not __main__.*).
    from shmloader.bench import main as _main

    sys.exit(_main())
