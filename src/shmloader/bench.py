"""The built-in benchmark: this loader and torch's DataLoader side by side, in one run.

Ratios, not absolute times, are what it reports: both loaders run in the same process,
alternating, after a warm-up, and each figure is the median of the repeats.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class ImageBatchDataset:
    """Synthetic images: 3x224x224 uint8 samples and an int64 label, fetched from a small
    cached array so the dataset's own cost is near zero and the transport is measured."""

    def __init__(self, length: int = 4096, shape: tuple[int, ...] = (3, 224, 224), dtype: str = "uint8"):
        rng = np.random.default_rng(0)
        self.cache = rng.integers(0, 255, (16, *shape)).astype(dtype)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.cache[i % 16], i


@dataclass
class Result:
    """One loader's figures on one workload."""

    loader: str
    batches_per_s: float
    spread: float  # (max - min) / median of the repeats
    gb_per_s: float
    consumer_cpu_ms: float  # consumer CPU time per batch


def _measure(make_iter: Callable[[], Any], batches: int, batch_bytes: int) -> tuple[float, float]:
    """Batches/s and consumer CPU seconds per batch over ``batches`` batches."""
    it = make_iter()
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _batch in it:
        n += 1
        if n == batches:
            break
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    del it
    return n / wall, cpu / max(n, 1)


def run(batches: int = 200, repeat: int = 3, workers: int = 2, out=print) -> list[Result]:
    """Run the default workload (W1: 64x3x224x224 uint8 batches) and return the results."""
    from shmloader import DataLoader

    batch_size = 64
    ds = ImageBatchDataset(length=batch_size * (batches + 8))
    batch_bytes = batch_size * (3 * 224 * 224 + 8)
    loaders: dict[str, Callable[[], Any]] = {}
    shm = DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True)
    loaders["shmloader"] = lambda: iter(shm)
    try:
        import torch.utils.data as tud

        tl = tud.DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True)
        loaders["torch"] = lambda: iter(tl)
    except ImportError:
        out("torch is not installed: its rows are skipped (pip install torch to compare).")
    for make in loaders.values():  # warm-up: process start, page faults, ring sizing
        _measure(make, 10, batch_bytes)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    for r in range(repeat):
        for name, make in loaders.items():
            samples[name].append(_measure(make, batches, batch_bytes))
            out(f"  repeat {r + 1}/{repeat} {name}: {samples[name][-1][0]:.0f} batches/s")
    results = []
    for name, runs in samples.items():
        rates = [s[0] for s in runs]
        med = statistics.median(rates)
        results.append(
            Result(
                loader=name,
                batches_per_s=med,
                spread=(max(rates) - min(rates)) / med,
                gb_per_s=med * batch_bytes / 1e9,
                consumer_cpu_ms=statistics.median(s[1] for s in runs) * 1e3,
            )
        )
    shm.shutdown()
    return results


def format_table(results: list[Result]) -> str:
    """The results as a text table with the ratio to torch."""
    torch_rate = next((r.batches_per_s for r in results if r.loader == "torch"), None)
    lines = [
        f"{'loader':<10} {'batches/s':>10} {'spread':>7} {'GB/s':>7} {'CPU ms/batch':>13} {'vs torch':>9}",
    ]
    for r in results:
        ratio = f"{r.batches_per_s / torch_rate:.1f}x" if torch_rate else "n/a"
        lines.append(
            f"{r.loader:<10} {r.batches_per_s:>10.0f} {r.spread:>6.0%} {r.gb_per_s:>7.2f} "
            f"{r.consumer_cpu_ms:>13.3f} {ratio:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``shmloader bench``: W1 through both loaders, printed as a table."""
    import argparse

    parser = argparse.ArgumentParser(prog="shmloader bench", description=main.__doc__)
    parser.add_argument("--batches", type=int, default=200, help="batches timed per repeat")
    parser.add_argument("--repeat", type=int, default=3, help="repeats (the median is reported)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes per loader")
    args = parser.parse_args(argv)
    print(
        f"W1: 64x3x224x224 uint8 batches, {args.workers} workers, {args.batches} batches x "
        f"{args.repeat} repeats, python {sys.version.split()[0]}, numpy {np.__version__}",
        flush=True,
    )
    results = run(args.batches, args.repeat, args.workers, out=lambda s: print(s, flush=True))
    print(format_table(results))
    return 0
