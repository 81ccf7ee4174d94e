"""More workers than cores: W1's and W4's steady throughput at several worker counts,
measured in alternating rounds (each round runs every count once, in a rotated order),
with the consumer's and the workers' CPU per batch.

    python benchmarks/worker_counts.py                      # W1,W4 at 2,4,8 workers, 4 rounds
    python benchmarks/worker_counts.py --workloads W4 --workers 2,8 --rounds 6

A measurement is one persistent shmloader loader (fork, the bench's dataset of the
workload): its first batches are a warm-up, then batches are counted for ``--seconds``.
Each count's figure is the median of its rounds; its ratio to the first count's is the
median of the per-round ratios (a round's counts ran minutes apart at most), with their
range. Hold the CPU lock while measuring (``flock /tmp/cpu.lock ...``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from shmloader import DataLoader
from shmloader.bench.machine import children_cpu_s
from shmloader.bench.workloads import WORKLOADS

WARMUP_BATCHES = {"W1": 20, "W4": 2000}


def measure(workload: str, workers: int, seconds: float) -> dict[str, float]:
    """Steady batches/s of one persistent loader, and the CPU per batch of its consumer
    and of its workers."""
    wl = WORKLOADS[workload]
    dataset = wl.make(10**7)  # (a virtual length: samples repeat a small cache)
    loader = DataLoader(dataset, batch_size=wl.batch_size, num_workers=workers, persistent_workers=True)
    it = iter(loader)
    try:
        for _ in range(WARMUP_BATCHES.get(workload, 20)):
            next(it)
        n = 0
        w0 = children_cpu_s()
        t0, c0 = time.perf_counter(), time.process_time()
        end = t0 + seconds
        while True:
            next(it)
            n += 1
            if n % 16 == 0 and time.perf_counter() >= end:
                break
        t1, c1 = time.perf_counter(), time.process_time()
        w1 = children_cpu_s()
    finally:
        del it
        loader.shutdown()
    return {
        "batches_s": n / (t1 - t0),
        "consumer_us": (c1 - c0) / n * 1e6,
        "workers_us": (w1 - w0) / n * 1e6,
    }


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W4")
    parser.add_argument("--workers", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    for workload in args.workloads.split(","):
        runs: dict[int, list[dict[str, float]]] = {w: [] for w in counts}
        for r in range(args.rounds):
            order = counts[r % len(counts) :] + counts[: r % len(counts)]
            for w in order:
                got = measure(workload, w, args.seconds)
                runs[w].append(got)
                print(
                    f"{workload} round {r + 1} {w} workers: {got['batches_s']:,.0f} batches/s, "
                    f"consumer {got['consumer_us']:.1f} us/batch, workers {got['workers_us']:.1f} us/batch",
                    flush=True,
                )
        base = counts[0]
        print(f"\n{workload}, median (range) of {args.rounds} rounds:")
        for w in counts:
            rows: list[Any] = runs[w]
            ratios = [a["batches_s"] / b["batches_s"] for a, b in zip(rows, runs[base])]
            print(
                f"  {w} workers: {_fmt([x['batches_s'] for x in rows])} batches/s, "
                f"x{statistics.median(ratios):.2f} of {base} workers ({min(ratios):.2f}-{max(ratios):.2f}); "
                f"consumer {statistics.median(x['consumer_us'] for x in rows):.1f} us/batch, "
                f"workers {statistics.median(x['workers_us'] for x in rows):.1f} us/batch"
            )
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
