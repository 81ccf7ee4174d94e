"""The one harness: peers warmed up, then timed ``repeat`` times, alternating.

A peer is anything with ``name``, ``warm_up()``, ``run(batches, max_s) -> (batches/s,
consumer CPU seconds per batch, batches)`` and ``close()``, its consumer reading every
page of every batch (:mod:`shmloader.bench.consume`): a DataLoader over fresh epochs
(:class:`LoaderPeer`), the copy ceiling (:mod:`shmloader.bench.ceiling`), or a loader timed
over whole epochs (W6, :mod:`shmloader.bench.jpeg`). :func:`time_peers` times them side by
side and :func:`summarize` turns the runs into medians, spreads and paired ratios.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any, Protocol

from shmloader.bench.consume import read_every_page
from shmloader.bench.progress import Progress
from shmloader.bench.results import Row, median_spread

WARMUP_BATCHES = 16
_WARMUP_MAX_S = 1.0


class Peer(Protocol):
    """What :func:`time_peers` times."""

    name: str

    def warm_up(self) -> None: ...

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]: ...

    def close(self) -> None: ...


def torch_dataloader() -> Any | None:
    """torch.utils.data.DataLoader, or None when torch is not installed."""
    try:
        from torch.utils.data import DataLoader as TorchDataLoader
    except ImportError:
        return None
    return TorchDataLoader


def close_loader(loader: Any) -> None:
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


def close_iter(it: Any) -> None:
    """Stop an epoch iterator's workers now (both kinds)."""
    close = getattr(it, "close", None)
    if close is not None:
        close()
        return
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


def time_loader(loader: Any, batches: int, max_s: float, from_first: bool = True) -> tuple[float, float, int]:
    """Iterate up to ``batches`` batches or ``max_s`` seconds of a new epoch: batches/s,
    consumer CPU seconds per batch and the batches timed. Every batch is read
    (:func:`~shmloader.bench.consume.read_every_page`), as a training step reads it.

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
            read_every_page(_batch)
            break
        t0, c0 = perf(), cpu()
    deadline = t0 + max_s
    n = 0
    for _batch in it:
        read_every_page(_batch)
        n += 1
        if n >= batches or perf() >= deadline:
            break
    wall = perf() - t0
    used = cpu() - c0
    _batch = None
    if not getattr(loader, "persistent_workers", False):
        close_iter(it)
    del it
    return n / wall, used / max(n, 1), n


class LoaderPeer:
    """A DataLoader made once and timed over fresh epochs."""

    def __init__(self, name: str, loader: Any, from_first: bool = True):
        self.name = name
        self.loader = loader
        self.from_first = from_first

    def warm_up(self) -> None:
        """A short epoch first (workers started, ring sized, caches warm)."""
        time_loader(self.loader, WARMUP_BATCHES, _WARMUP_MAX_S, self.from_first)

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]:
        """One timed repeat (see :func:`time_loader`)."""
        return time_loader(self.loader, batches, max_s, self.from_first)

    def close(self) -> None:
        """Stop the loader's workers."""
        close_loader(self.loader)


def time_peers(
    label: str, peers: Sequence[Peer], *, batches: int, max_s: float, repeat: int, progress: Progress
) -> dict[str, Row]:
    """Warm every peer up, then time each ``repeat`` times, the order reversed every other
    repeat, so slow drifts of the machine touch every peer alike. One row per peer, with
    its runs (see :func:`summarize`). The caller closes the peers."""
    rows = {p.name: Row(p.name) for p in peers}
    for p in peers:
        p.warm_up()
        progress.step(f"{label} warm-up {p.name}")
    for r in range(repeat):
        for p in peers if r % 2 == 0 else peers[::-1]:
            rate, cpu_s, n = p.run(batches, max_s)
            row = rows[p.name]
            row.runs.append(rate)
            row.cpu_ms_runs.append(cpu_s * 1e3)
            row.batches_runs.append(n)
            progress.step(f"{label} repeat {r + 1}/{repeat} {p.name}: {rate:,.0f} batches/s ({n} batches)")
    return rows


def close_peers(peers: Sequence[Peer]) -> None:
    """Close ``peers`` newest first: workers forked later inherit the earlier loaders'
    sockets, and a shmloader worker stops on EOF, which only comes once every copy is closed."""
    for p in reversed(peers):
        p.close()


def summarize(
    rows: dict[str, Row], batch_bytes: int, base: str = "torch", ceiling: str = "copy ceiling"
) -> None:
    """Fill each row's medians and spreads, and its ratios to ``base`` and ``ceiling``
    (medians of ratios paired within a repeat) where those peers ran."""
    base_runs = rows[base].runs if base in rows else None
    ceil_runs = rows[ceiling].runs if ceiling in rows else None
    for row in rows.values():
        row.batches_per_s, row.spread = median_spread(row.runs)
        row.gb_per_s = row.batches_per_s * batch_bytes / 1e9
        cpus = [c for c in row.cpu_ms_runs if not math.isnan(c)]
        row.consumer_cpu_ms = statistics.median(cpus) if cpus else None
        row.cpu_ms_runs = cpus
        if base_runs:
            ratios = [a / b for a, b in zip(row.runs, base_runs, strict=True)]
            row.ratio_to_torch = statistics.median(ratios)
            row.ratio_range = (min(ratios), max(ratios))
        if ceil_runs:
            row.pct_of_ceiling = 100 * statistics.median(
                a / b for a, b in zip(row.runs, ceil_runs, strict=True)
            )
