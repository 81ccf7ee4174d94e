"""The consumer's per-batch cost on W4's shape (one int64 sample a batch, batch_size 1, 2
persistent workers): batches/s, the consumer's and the workers' CPU per batch, and where
the consumer's goes.

    python benchmarks/consumer_profile.py                 # 20,000 batches, 5 runs: figures
    python benchmarks/consumer_profile.py --workers 8     # with 8 workers
    python benchmarks/consumer_profile.py --steps         # and the per-step breakdown
    python benchmarks/consumer_profile.py --cprofile      # and cProfile's top functions

One warm-up epoch first (the workers start, the ring is made), then a measured epoch.
``--steps`` times the consumer's steps (inclusive wall time, the timers' own cost
subtracted; a step's figure still holds the timers of the steps inside it): the steps
nest as printed. Hold the CPU lock while measuring (``flock /work/shared/cpu.lock ...``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

from shmloader import DataLoader
from shmloader.batch.handout import Handout
from shmloader.bench.datasets import ScalarDataset
from shmloader.bench.machine import children_cpu_s
from shmloader.epoch.collector import Collector
from shmloader.epoch.courier import Courier
from shmloader.epoch.inflight import InFlight
from shmloader.epoch.multiprocess import MultiProcessIter
from shmloader.workers.pool import WorkerPool

# (label, owner, method name, depth): what --steps times, in the order printed.
STEPS = [
    ("next()", MultiProcessIter, "__next__", 0),
    ("dispatch (tasks out)", InFlight, "fill", 1),
    ("wake-ups (futex or socket)", Courier, "wake_sleepers", 2),
    ("wait for results", Collector, "wait", 1),
    ("poll (blocked)", WorkerPool, "wait", 2),
    ("take queued results", Collector, "_collect", 1),
    ("hand-out (views)", Handout, "from_slot", 1),
]


class _Timers:
    """Inclusive wall time and calls per wrapped method; nested calls of one method count
    once (the outermost)."""

    def __init__(self, clock: Any = time.perf_counter_ns) -> None:
        self.clock = clock
        self.spent: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._saved: list[tuple[type, str, Any]] = []

    def wrap(self, owner: type, name: str, label: str) -> None:
        original = getattr(owner, name)
        clock = self.clock
        spent, calls = self.spent, self.calls
        spent[label] = calls[label] = 0
        depth = [0]

        def timed(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return original(*args, **kwargs)
            depth[0] = 1
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += clock() - t0
                calls[label] += 1
                depth[0] = 0

        self._saved.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _timer_cost_ns() -> float:
    """What one timed call costs beyond the call itself (subtracted per call)."""

    class Probe:
        def f(self) -> None:
            pass

    probe = Probe()
    n = 200_000
    t0 = time.perf_counter_ns()
    for _ in range(n):
        probe.f()
    plain = time.perf_counter_ns() - t0
    timers = _Timers()
    timers.wrap(Probe, "f", "probe")
    t0 = time.perf_counter_ns()
    for _ in range(n):
        probe.f()
    wrapped = time.perf_counter_ns() - t0
    return max(0.0, (wrapped - plain) / n)


def one_run(batches: int, steps: bool, profile: bool, workers: int = 2) -> dict[str, Any]:
    """One loader, one warm-up epoch, one measured epoch of ``batches`` batches."""
    loader = DataLoader(ScalarDataset(batches), batch_size=1, num_workers=workers, persistent_workers=True)
    for _ in loader:
        pass
    timers = _Timers() if steps else None
    if timers is not None:
        for label, owner, name, _depth in STEPS:
            timers.wrap(owner, name, label)
    prof = cProfile.Profile() if profile else None
    n = 0
    workers_before = children_cpu_s()
    t0, c0 = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    loop_t0 = time.perf_counter_ns()
    for _ in loader:
        n += 1
    loop_ns = time.perf_counter_ns() - loop_t0
    if prof is not None:
        prof.disable()
    t1, c1 = time.perf_counter(), time.process_time()
    workers_s = children_cpu_s() - workers_before
    if timers is not None:
        timers.restore()
    loader.shutdown()
    out: dict[str, Any] = {
        "batches_s": n / (t1 - t0),
        "cpu_us": (c1 - c0) / n * 1e6,
        "workers_cpu_us": workers_s / n * 1e6,
        "n": n,
    }
    if timers is not None:
        out["spent"], out["calls"], out["loop_ns"] = timers.spent, timers.calls, loop_ns
    if prof is not None:
        out["profile"] = prof
    return out


def _print_steps(runs: list[dict[str, Any]], cost_ns: float) -> None:
    print(
        f"\nper-step breakdown (wall us per batch, inclusive, median of {len(runs)}; "
        f"timer cost {cost_ns:.0f} ns a call subtracted)"
    )
    print(f"  {'step':34} {'us/batch':>9} {'calls/batch':>12}")
    for label, _owner, _name, depth in STEPS:
        per = []
        calls = []
        for r in runs:
            c = r["calls"][label]
            per.append((r["spent"][label] - c * cost_ns) / r["n"] / 1e3)
            calls.append(c / r["n"])
        print(f"  {'  ' * depth + label:34} {statistics.median(per):9.2f} {statistics.median(calls):12.3f}")
    loop = statistics.median(
        (r["loop_ns"] - r["spent"]["next()"]) / r["n"] / 1e3
        - sum(r["calls"].values()) / r["n"] * cost_ns / 1e3
        for r in runs
    )
    print(f"  {'outside next() (the for loop)':34} {loop:9.2f}")


def _summary(name: str, values: list[float], unit: str) -> str:
    return f"{name} median {statistics.median(values):.1f} {unit} (range {min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", action="store_true", help="time the consumer's steps")
    parser.add_argument("--cprofile", action="store_true", help="cProfile the last run")
    args = parser.parse_args(argv)
    cost = _timer_cost_ns() if args.steps else 0.0
    runs = []
    for k in range(args.runs):
        profile = args.cprofile and k == args.runs - 1
        r = one_run(args.batches, args.steps, profile, args.workers)
        runs.append(r)
        print(
            f"run {k + 1}: {r['batches_s']:.0f} batches/s, consumer CPU {r['cpu_us']:.1f} us/batch, "
            f"workers' CPU {r['workers_cpu_us']:.1f} us/batch" + (" (profiled)" if profile else "")
        )
    plain = [r for r in runs if "profile" not in r]
    if plain:
        print(_summary("batches/s", [r["batches_s"] for r in plain], "/s"))
        print(_summary("consumer CPU", [r["cpu_us"] for r in plain], "us/batch"))
        print(_summary("workers' CPU", [r["workers_cpu_us"] for r in plain], "us/batch"))
    if args.steps and plain:
        _print_steps(plain, cost)
    if args.cprofile:
        print()
        pstats.Stats(runs[-1]["profile"]).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
