"""One configuration of a cached-dataset workload (W1-W5, W7), measured: the steady state
of every peer side by side, then fresh loaders' short epochs (cold, and time to first
batch), then memory in a fresh process per loader.

The steady peers: this loader, torch's DataLoader on the *same* dataset object with the
same settings, this loader with ``num_workers=0``, and the copy ceiling in private and in
shared memory (not for W7: its batches vary in size).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from shmloader.bench.ceiling import CeilingPeer, batch_bytes_of
from shmloader.bench.consume import read_every_page
from shmloader.bench.datasets import ComputeDataset, w7_padding
from shmloader.bench.machine import load1
from shmloader.bench.memory import probe_memory
from shmloader.bench.peers import (
    WARMUP_BATCHES,
    LoaderPeer,
    Peer,
    close_iter,
    close_peers,
    summarize,
    time_peers,
)
from shmloader.bench.progress import Progress
from shmloader.bench.results import ConfigResult, Row, timing_summary
from shmloader.bench.workloads import WORKLOADS, Config, Workload, loader_options

COLD_BATCHES = 64  # a fresh loader's short epoch (validation passes, sweeps, notebooks)
_PREFETCH = 2  # both loaders' default prefetch_factor


def config_steps(cfg: Config, repeat: int, memory: bool, have_torch: bool) -> int:
    """Progress steps of :func:`measure_config`."""
    wl = WORKLOADS[cfg.workload]
    peers = (2 if have_torch else 1) + 1 + (0 if wl.ragged else 2)
    mem_steps = (2 if have_torch else 1) if memory else 0
    return peers + peers * repeat + repeat + 1 + mem_steps


def _make_loaders(
    cfg: Config, dataset: Any, wl: Workload, torch_dl: Any | None
) -> tuple[Any, Any | None, Any]:
    from shmloader import DataLoader

    common = dict(num_workers=cfg.workers, persistent_workers=cfg.persistent_workers, in_order=cfg.in_order)
    shm = DataLoader(dataset, **common, **loader_options(wl, dataset, "shmloader"))
    tl = torch_dl(dataset, **common, **loader_options(wl, dataset, "torch")) if torch_dl is not None else None
    w0 = DataLoader(dataset, num_workers=0, **loader_options(wl, dataset, "shmloader"))
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
    ``dataset``, the peers alternating, the first round a warm-up, every batch read:
    seconds from constructing the loader to its first batch, and to the last batch of
    the epoch (the cold figure; the workers' shutdown after it is not counted)."""
    from shmloader import DataLoader

    data = _Prefix(dataset, min(len(dataset), cold_batches * wl.batch_size))
    makers: dict[str, Callable[[], Any]] = {
        "shmloader": lambda: DataLoader(
            data, num_workers=cfg.workers, **loader_options(wl, data, "shmloader")
        ),
    }
    if torch_dl is not None:
        makers["torch"] = lambda: torch_dl(data, num_workers=cfg.workers, **loader_options(wl, data, "torch"))
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
                read_every_page(_batch)
                if t_first is None:
                    t_first = perf() - t0
                if n == batches:
                    break  # the last batch is in hand: the shutdown that follows is not timed
            t_last = perf() - t0
            _batch = None
            close_iter(it)
            del it, loader
            if r and t_first is not None:
                first[name].append(t_first)
                last[name].append(t_last)
        progress.step(f"{cfg.label} cold epoch ({batches} batches), round {r}/{repeat}")
    first_batch = {name: timing_summary(ts) for name, ts in first.items()}
    cold: dict[str, Any] = {"batches": batches}
    cold.update({name: timing_summary(ts) for name, ts in last.items()})
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
    """Time every peer of ``cfg`` side by side, then fresh loaders' short epochs (cold,
    and time to first batch), then memory (``memory``: a fresh process per loader)."""
    wl = WORKLOADS[cfg.workload]
    if wl.make is None:
        raise ValueError(f"{cfg.label}: W6 is measured by shmloader.bench.jpeg.measure_w6, not here.")
    n_batches = batches or wl.default_batches
    dataset = wl.make(wl.batch_size * (n_batches + WARMUP_BATCHES + 8))
    load0 = load1()
    res = _new_result(cfg, wl, dataset)
    _time_steady(res, cfg, wl, dataset, torch_dl, n_batches, seconds * wl.time_scale, repeat, progress)
    res.first_batch_s, res.cold = _cold_times(cfg, dataset, wl, torch_dl, repeat, cold_batches, progress)
    if memory:
        for name in ["shmloader", "torch"] if torch_dl is not None else ["shmloader"]:
            res.memory[name] = probe_memory(cfg, name)
            progress.step(f"{cfg.label} memory probe {name}")
    if load0 is not None:
        res.load_average = [load0, load1() or 0.0]
    return res


def _new_result(cfg: Config, wl: Workload, dataset: Any) -> ConfigResult:
    """``cfg``'s result before any timing: the batch's bytes, the ring the loader will
    make (for the copy ceiling), and the workload's own notes (W5's sample cost, W7's
    padding)."""
    from shmloader.memory.sizing import default_num_slots

    num_slots = default_num_slots(cfg.workers, _PREFETCH)
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
    return res


def _time_steady(
    res: ConfigResult,
    cfg: Config,
    wl: Workload,
    dataset: Any,
    torch_dl: Any | None,
    n_batches: int,
    max_s: float,
    repeat: int,
    progress: Progress,
) -> None:
    """The side-by-side rounds of every peer (this loader, torch's, num_workers=0, the
    copy ceilings) into ``res.rows``, and the ring this loader made."""
    shm, tl, w0 = _make_loaders(cfg, dataset, wl, torch_dl)
    # Persistent workers: steady state, from the first batch; otherwise from iter(), so
    # the worker start-up each epoch pays is what the variant shows.
    steady = cfg.persistent_workers
    peers: list[Peer] = [LoaderPeer("shmloader", shm, steady)]
    if tl is not None:
        peers.append(LoaderPeer("torch", tl, steady))
    peers.append(LoaderPeer("shmloader w0", w0))
    if not wl.ragged:  # ragged batches: no fixed bytes per batch to copy
        peers += [
            CeilingPeer(dataset, wl.batch_size, res.num_slots, cfg.workers),
            CeilingPeer(dataset, wl.batch_size, res.num_slots, cfg.workers, shared=True),
        ]
    try:
        rows = time_peers(cfg.label, peers, batches=n_batches, max_s=max_s, repeat=repeat, progress=progress)
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
        close_peers(peers)
        del shm, tl, w0, peers
        gc.collect()
    summarize(rows, res.batch_bytes)
    res.rows = list(rows.values())
    if wl.ragged:
        res.rows += [
            Row(name, status="n/a (ragged batches)") for name in ("copy ceiling", "copy ceiling shm")
        ]
