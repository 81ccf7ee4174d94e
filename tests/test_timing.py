"""loader.stats()["time"]: where the time goes, measured in real workers (issue 16, part 2).

Each case makes one side slow on purpose (samples, collation, or the training step) and
checks that the clocks see it there and the verdict names the right side.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from shmloader import DataLoader
from shmloader.tuning.timing import Timing, verdict


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Costly:
    """Samples that take ``cost`` seconds each to make."""

    def __init__(self, n: int, cost: float) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        _spin(self.cost)
        return np.full(256, i, np.float32)


def slow_collate(samples: list) -> np.ndarray:
    time.sleep(0.004)
    return np.stack(samples)


@pytest.mark.timeout(60)
def test_slow_samples_are_data_bound_and_counted_as_fetch_time():
    n, cost = 96, 0.002
    loader = DataLoader(Costly(n, cost), batch_size=4, num_workers=2)
    assert sum(1 for _ in loader) == n // 4
    t = loader.stats()["time"]
    fetch = sum(w["fetch_s"] for w in t["workers"])
    assert fetch >= 0.9 * n * cost  # every sample's cost, in the worker that made it
    assert fetch < 10 * n * cost
    assert t["waited_share"] > 0.5
    assert t["workers_busy_share"] > 0.5
    assert t["verdict"].startswith("data-bound"), t["verdict"]
    assert t["start_s"] > 0 and t["loop_s"] >= 0


@pytest.mark.timeout(60)
def test_slow_collation_is_counted_as_collate_time():
    batches = 24
    loader = DataLoader(Costly(batches * 2, 0.0), batch_size=2, num_workers=2, collate_fn=slow_collate)
    assert sum(1 for _ in loader) == batches
    t = loader.stats()["time"]
    collate = sum(w["collate_s"] for w in t["workers"])
    fetch = sum(w["fetch_s"] for w in t["workers"])
    # Every batch's collation, the first of each worker's included (it travels with the next).
    assert collate >= 0.9 * batches * 0.004
    assert fetch < collate


@pytest.mark.timeout(60)
def test_a_slow_training_step_is_compute_bound_with_batches_waiting():
    step = 0.02
    loader = DataLoader(Costly(48, 0.0), batch_size=4, num_workers=2)
    for _ in loader:
        time.sleep(step)
    t = loader.stats()["time"]
    assert t["loop_s"] >= 0.95 * 12 * step
    assert t["waited_share"] < 0.1, t
    assert t["ready_batches_mean"] >= 1  # the workers were ahead: batches waited for the loop
    assert t["verdict"].startswith("compute-bound"), t["verdict"]
    idle = sum(w["idle_s"] for w in t["workers"])
    assert idle > sum(w["fetch_s"] + w["collate_s"] for w in t["workers"])


@pytest.mark.timeout(60)
def test_each_epoch_start_is_kept_apart_from_the_wait():
    """The first next() of an epoch (workers starting) is start_s; the pause between epochs
    is neither the loop's nor the loader's."""
    loader = DataLoader(Costly(16, 0.0), batch_size=4, num_workers=2, persistent_workers=True)
    for _ in range(2):
        list(loader)
        time.sleep(0.3)  # between epochs: not the training step
    t = loader.stats()["time"]
    assert t["loop_s"] < 0.3
    assert t["start_s"] > 0


@pytest.mark.timeout(60)
def test_main_process_loading_says_so():
    loader = DataLoader(Costly(24, 0.002), batch_size=4, num_workers=0)
    list(loader)
    t = loader.stats()["time"]
    assert t["workers"] == []
    assert t["wait_s"] >= 0.9 * 20 * 0.002  # the batches after the first: loaded inside next()
    assert t["verdict"].startswith("data-bound") and "num_workers" in t["verdict"], t["verdict"]


def test_verdicts_name_the_side_and_the_remedy():
    def figures(wait: float, loop: float, busy: float) -> dict:
        share = wait / (wait + loop)
        return {"wait_s": wait, "loop_s": loop, "waited_share": share, "workers_busy_share": busy}

    assert verdict({"wait_s": 0, "loop_s": 0}, 2).startswith("no batches yet")
    text = verdict(figures(38, 62, 0.97), 1)
    assert text.startswith("data-bound: the training loop waited 38% of the time; workers busy 97%")
    assert "add workers" in text or "already use" in text
    assert "raise prefetch_factor" in verdict(figures(50, 50, 0.3), 2)
    text = verdict(figures(2, 98, 0.2), 4)
    assert text.startswith("compute-bound") and "fewer workers" in text


def test_timing_adds_reports_per_worker():
    timing = Timing(2)
    timing.add_worker(1, 2_000_000_000, 1_000_000_000, 500_000_000)
    timing.add_worker(1, 1_000_000_000, 0, 0)
    report = timing.report()
    assert report["workers"][0] == {"fetch_s": 0.0, "collate_s": 0.0, "idle_s": 0.0}
    assert report["workers"][1] == pytest.approx({"fetch_s": 3.0, "collate_s": 1.0, "idle_s": 0.5})
    assert report["workers_busy_share"] == pytest.approx(4 / 4.5)


def test_the_verdict_names_the_worker_count_in_use(monkeypatch):
    """Timing keeps a row per worker the loader may run (with num_workers="auto", the
    cores) but names the count the running epoch uses, read from its counts, which a
    tuner raises."""
    from shmloader.tuning import timing as timing_module
    from shmloader.tuning.counts import WorkerCounts

    monkeypatch.setattr(timing_module, "usable_cores", lambda: 4)
    timing = Timing(4)
    counts = WorkerCounts(1, 2)
    timing.counting(counts)
    timing.add_worker(0, 1_000_000_000, 0, 0)  # busy all the time: data-bound, saturated
    timing.wait_s, timing.loop_s = 0.5, 0.5
    assert "add workers (num_workers=1, 4 CPUs)" in timing.report()["verdict"]
    counts.add_worker()
    assert "add workers (num_workers=2, 4 CPUs)" in timing.report()["verdict"]


@pytest.mark.timeout(120)
def test_the_example_tells_a_compute_bound_loop_from_a_data_bound_one():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "where_time_goes.py"
    out = subprocess.run(
        [sys.executable, str(example), "--batches", "24", "--step-ms", "40"],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    ).stdout
    verdicts = [line.split("verdict: ")[1] for line in out.splitlines() if "verdict: " in line]
    assert len(verdicts) == 2, out
    assert verdicts[0].startswith("compute-bound"), out  # W1 with a 40 ms step
    assert verdicts[1].startswith("data-bound"), out  # W5: ~1 ms per sample, no step
