"""Where a loader's time goes: the workers' clocks, the training loop's, and a verdict.

Each worker keeps three clocks (nanoseconds, since its last report): **fetch** (the
dataset making samples: ``__getitem__`` or the iterable's ``next``), **collate** (collating
and writing the batch into its slot) and **idle** (waiting for a task: the ring had no free
slot for it, or every batch the loader may prefetch was already made). It reports them with
each batch it puts in the ring (:func:`shmloader.transport.wire.ready_frame`), so the cost is three
integers per batch and no extra message.

The consumer's iterator keeps three: **start** (the first ``next()`` of each epoch: workers
starting, the first batches loading), **wait** (inside the other ``next()`` calls: the time
the training loop was held up by the loader) and **loop** (between ``next()`` calls: the
training step's own time), and counts the batches loaded in the ring and not handed out
yet when ``next()`` was called (how full the prefetch was: the ring's occupancy).
:meth:`Timing.report` turns them into ``loader.stats()["time"]`` with a one-line verdict:
data-bound or compute-bound, and what to change.
"""

from __future__ import annotations

from typing import Any

from shmloader.system.cores import usable_cores
from shmloader.tuning.counts import WorkerCounts

NS = 1e-9

# A loop that waits for batches more than this share of its time is data-bound.
DATA_BOUND_SHARE = 0.10
# Workers busier than this share of their time cannot go faster: more of them would.
WORKERS_SATURATED = 0.85


class Timing:
    """The clocks of one loader, summed over its epochs and iterators. The per-batch
    updates are plain attribute and list arithmetic (no locks, no system calls)."""

    def __init__(self, num_workers: int) -> None:
        # Per worker id, for the most workers the loader may run: [fetch_ns, collate_ns, idle_ns]
        self.workers: list[list[int]] = [[0, 0, 0] for _ in range(num_workers)]
        self._counts: WorkerCounts | None = None  # the last epoch's with workers (read by the verdict)
        self.start_s = 0.0  # inside the first next() of each epoch
        self.wait_s = 0.0  # inside the other next() calls
        self.loop_s = 0.0  # between a next() that returned a batch and the next call
        self.calls = 0  # next() calls that returned a batch
        self.ready_sum = 0  # batches already loaded, summed over those calls
        self.last_return: float | None = None  # when next() last returned a batch
        self.starting = True  # the next next() is an epoch's first

    def make_room(self, num_workers: int) -> None:
        """Clocks for worker ids below ``num_workers`` too (an epoch with more workers
        than the loader was made with: its ``num_workers`` was raised since)."""
        self.workers.extend([0, 0, 0] for _ in range(num_workers - len(self.workers)))

    def counting(self, counts: WorkerCounts) -> None:
        """An epoch with workers uses ``counts`` (read, never stored here): the verdict
        names the worker count in use."""
        self._counts = counts

    def add_worker(self, worker_id: int, fetch_ns: int, collate_ns: int, idle_ns: int) -> None:
        """A worker's report with one batch: its clocks since its previous report."""
        row = self.workers[worker_id]
        row[0] += fetch_ns
        row[1] += collate_ns
        row[2] += idle_ns

    def entered(self, now: float, ready: int) -> None:
        """``next()`` was called at ``now`` with ``ready`` batches already loaded."""
        last = self.last_return
        if last is not None:
            self.loop_s += now - last
        self.ready_sum += ready

    def returned(self, entered: float, now: float) -> None:
        """``next()`` (called at ``entered``) returned a batch at ``now``."""
        if self.starting:
            self.starting = False
            self.start_s += now - entered
        else:
            self.wait_s += now - entered
        self.calls += 1
        self.last_return = now

    def paused(self) -> None:
        """The epoch ended (or the iterator closed): the time until the next ``next()``
        is not the training step's, and the next ``next()`` starts an epoch."""
        self.last_return = None
        self.starting = True

    def report(self, in_process: bool = False) -> dict[str, Any]:
        """``stats()["time"]``: seconds per worker, the epochs' start, the loop's wait and
        step time, the mean prefetched batches at ``next()``, the shares (the epochs' first
        batches left out: a start costs the same however the loop runs), and the verdict. ``in_process``:
        num_workers=0 (the loading happens inside ``next()``)."""
        workers = [{"fetch_s": f * NS, "collate_s": c * NS, "idle_s": i * NS} for f, c, i in self.workers]
        busy = sum(w["fetch_s"] + w["collate_s"] for w in workers)
        total = busy + sum(w["idle_s"] for w in workers)
        spent = self.wait_s + self.loop_s
        out: dict[str, Any] = {
            "start_s": self.start_s,
            "wait_s": self.wait_s,
            "loop_s": self.loop_s,
            "waited_share": self.wait_s / spent if spent > 0 else 0.0,
            "ready_batches_mean": self.ready_sum / self.calls if self.calls else 0.0,
            "workers": workers,
            "workers_busy_share": busy / total if total > 0 else 0.0,
        }
        in_use = self._counts.workers if self._counts is not None else len(self.workers)
        out["verdict"] = verdict(out, in_use, in_process)
        return out


def verdict(figures: dict[str, Any], num_workers: int, in_process: bool = False) -> str:
    """One line: is the training loop waiting for data, and what to change."""
    if not figures["loop_s"] and not figures["wait_s"]:
        return "no batches yet: nothing measured."
    waited = figures["waited_share"]
    share = f"the training loop waited {waited:.0%} of the time"
    if waited < DATA_BOUND_SHARE:
        busy = figures["workers_busy_share"]
        if in_process or not num_workers:
            return f"compute-bound: {share} (loading in the main process)."
        advice = "; fewer workers would do" if busy < 0.5 and num_workers > 1 else ""
        return f"compute-bound: {share}; workers busy {busy:.0%}{advice}."
    if in_process or not num_workers:
        return f"data-bound: {share}, loading in the main process: set num_workers (e.g. {usable_cores()})."
    busy = figures["workers_busy_share"]
    if busy >= WORKERS_SATURATED:
        cpus = usable_cores()
        if num_workers < cpus:
            todo = f"add workers (num_workers={num_workers}, {cpus} CPUs)"
        else:
            todo = f"make samples cheaper: {num_workers} workers already use the {cpus} CPUs"
        return f"data-bound: {share}; workers busy {busy:.0%}: {todo}."
    return (
        f"data-bound: {share}, yet workers were busy only {busy:.0%}: the per-batch hand-over is "
        "the limit (larger batches), or prefetch runs dry (raise prefetch_factor)."
    )
