"""The figures of docs/autotune.md: ``num_workers="auto"`` against hand-tuned counts, and
the first batch of an epoch with and without prefetch across the epoch's end.

    flock /work/shared/cpu.lock python benchmarks/autotune.py workers   # ~1 min on 2 cores
    flock /work/shared/cpu.lock python benchmarks/autotune.py epochs    # ~1 min

``workers``: a map-style dataset whose samples each burn ``--cost`` seconds of CPU (a
decode and augment), batches of ``--batch-size``, a training loop that does nothing (the
data-bound case autotune is for). Per run: the epoch's batches per second for
``num_workers=1``, ``=<cores>`` (hand-tuned: every core) and ``"auto"``; for ``"auto"``, when it
reached each count (``stats()["autotune"]``) and its rate from the moment it reached the
hand-tuned count to the epoch's end (its steady rate). ``--repeat`` runs, in turn.
``--assume-free-core``: the tuner's free-core test (idle time in /proc/stat) always
passes, to measure how fast it grows where other jobs keep every core busy.

``epochs``: persistent workers, samples of ``--cost`` s, a training step of ``--step`` s
(``time.sleep``: a step on an accelerator leaves the cores to the workers), 4 epochs; the
time of each epoch's first ``next()`` after the first epoch, with the next epoch's first
batches prefetched during the last one (``prefetch_next_epoch=True``) and without (the
default), and with ``persistent_workers=False``.

Prints one JSON object: every run's figures, then the median and the min-max of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

import shmloader
from shmloader import DataLoader
from shmloader.tuning import autotune


class Burn:
    """``n`` samples of 64 float32 that burn ``cost`` seconds of CPU each."""

    def __init__(self, n: int, cost: float) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        return np.full(64, shmloader.sample_rng(i).random(), np.float32)


def one_epoch(num_workers: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One epoch of a fresh loader: its rate, and for "auto" when it reached each count."""
    loader = DataLoader(
        Burn(args.samples, args.cost),
        batch_size=args.batch_size,
        num_workers=num_workers,
        seed=0,
        output="numpy",
    )
    stamps = []
    t0 = time.perf_counter()
    for _ in loader:
        stamps.append(time.perf_counter())
    elapsed = stamps[-1] - t0
    out: dict[str, Any] = {"batches_per_s": len(stamps) / elapsed, "epoch_s": elapsed}
    auto = loader.stats().get("autotune")
    if auto is not None:
        out["changes"] = auto["changes"]
        out["final_workers"] = auto["num_workers"]
        # When it reached the most workers, on the epoch's clock (the tuner's clock starts
        # at the epoch's first batch): from then on, its steady rate.
        first = stamps[0] - t0
        reached = next((c["at_s"] for c in auto["changes"] if c["num_workers"] == auto["max_workers"]), None)
        if reached is not None:
            at = t0 + first + reached
            later = [s for s in stamps if s >= at]
            out["reached_s"] = first + reached
            if len(later) > 1:
                out["steady_batches_per_s"] = (len(later) - 1) / (later[-1] - later[0])
    return out


def workers(args: argparse.Namespace) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    runs: dict[str, list[dict[str, Any]]] = {"1": [], str(cores): [], "auto": []}
    for _ in range(args.repeat):
        for key in runs:
            runs[key].append(one_epoch(key if key == "auto" else int(key), args))
    summary = {}
    for key, rs in runs.items():
        summary[f"{key}:batches_per_s"] = _spread([r["batches_per_s"] for r in rs])
    auto = runs["auto"]
    reached = [r["reached_s"] for r in auto if "reached_s" in r]
    steady = [r["steady_batches_per_s"] for r in auto if "steady_batches_per_s" in r]
    summary["auto:reached_all_cores_s"] = _spread(reached) if reached else None
    summary["auto:steady_batches_per_s"] = _spread(steady) if steady else None
    summary["auto:runs_reaching_all_cores"] = f"{len(reached)} of {len(auto)}"
    return {"cores": cores, "runs": runs, "summary": summary}


def epoch_starts(mode: str, args: argparse.Namespace) -> list[float]:
    """The first next() of epochs 2.. (ms) of a loader in ``mode``."""
    loader = DataLoader(
        Burn(args.samples // 4, args.cost),
        batch_size=args.batch_size,
        num_workers=2,
        seed=0,
        output="numpy",
        persistent_workers=mode != "not persistent",
        prefetch_next_epoch=mode == "persistent, prefetch across epochs",
    )
    firsts = []
    for epoch in range(4):
        it = iter(loader)
        t = time.perf_counter()
        next(it)
        if epoch:
            firsts.append((time.perf_counter() - t) * 1000)
        time.sleep(args.step)
        for _ in it:
            time.sleep(args.step)
    loader.shutdown()
    return firsts


def epochs(args: argparse.Namespace) -> dict[str, Any]:
    modes = ["persistent, prefetch across epochs", "persistent, no prefetch across epochs", "not persistent"]
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeat):
        for m in modes:
            runs[m].extend(epoch_starts(m, args))
    return {"runs_ms": runs, "summary_ms": {m: _spread(v) for m, v in runs.items()}}


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "n": len(values),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["workers", "epochs"])
    parser.add_argument("--samples", type=int, default=1600)
    parser.add_argument("--cost", type=float, default=0.002, help="CPU seconds per sample")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--step", type=float, default=0.02, help="epochs: the training step, seconds")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--assume-free-core",
        action="store_true",
        help="workers: the tuner's free-core test always passes (on a machine other jobs keep busy)",
    )
    args = parser.parse_args(argv)
    if args.assume_free_core:
        autotune.FREE_CORE = -1.0
    started = time.perf_counter()
    out = workers(args) if args.part == "workers" else epochs(args)
    out["settings"] = vars(args)
    out["loadavg_before_after"] = [_loadavg_at_start, os.getloadavg()]
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=1))
    return 0


_loadavg_at_start = os.getloadavg()

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
