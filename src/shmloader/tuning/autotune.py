"""``num_workers="auto"`` and ``prefetch_factor="auto"``: a loader that tunes itself.

The loader starts small (one worker, torch's prefetch of 2) and, every
:data:`WINDOW_S` seconds of a running epoch, reads the clocks of :mod:`shmloader.tuning.timing`
over that window:

- the training loop **waited** more than :data:`~shmloader.tuning.timing.DATA_BOUND_SHARE` of its
  time and the workers were **busy** (at least
  :data:`~shmloader.tuning.timing.WORKERS_SATURATED` of theirs): more workers would load more,
  so one is added, mid-epoch, where a core is free (the cores this process may use were
  idle for at least :data:`FREE_CORE` of one over the window: /proc/stat), the worker
  count is below the cores this process may use, the ring has a slot per worker more,
  and the memory there leaves its margin with the new worker's batch and slots counted;
- the loop waited while the workers were **not** busy: they had nothing to do while the
  loop was slow, then too little ready when it was fast: the prefetch runs dry, so it is
  raised by one, up to :data:`MAX_PREFETCH` and what the ring's slots hold
  (``num_workers * prefetch_factor + 2``; the ring is bounded by ``max_shm_bytes``).

Nothing ever shrinks, and nothing changes a batch: the same seed gives the same batches
whatever the worker count where the dataset's randomness is per sample
(:func:`shmloader.sample_rng`) or absent (a worker's global RNG is seeded with the epoch
seed plus its id, so draws from it follow which worker loads which batch, as with any
change of ``num_workers``).

``loader.num_workers`` and ``loader.prefetch_factor`` report the counts in use now (ints,
as frameworks expect); ``get_worker_info().num_workers`` is the most the loader may start
(the same in every worker, above every worker id). An iterable dataset's shards are its
workers, fixed for an epoch: there ``num_workers="auto"`` is the cores this process may
use, from the start (``prefetch_factor="auto"`` still tunes). What changed and why is in
``loader.stats()["autotune"]``; see docs/autotune.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shmloader.memory import sizing
from shmloader.system import limits as memory
from shmloader.system.cores import affinity_cpus, usable_cores
from shmloader.tuning.counts import WorkerCounts
from shmloader.tuning.timing import DATA_BOUND_SHARE, WORKERS_SATURATED, Timing

AUTO = "auto"
WINDOW_S = 0.2  # seconds of a running epoch between two decisions
MIN_BATCHES = 3  # batches handed out in a window for its figures to count
MAX_PREFETCH = 8  # the most prefetch_factor="auto" raises to
FREE_CORE = 0.5  # idle share of one core, over a window, that counts as a free core
_EXTRA_MIB = 32 * 2**20  # a new worker's own memory, beside its batch


@dataclass
class Settings:
    """What was asked for and the bounds: ``start_*`` is what the loader starts with."""

    auto_workers: bool
    auto_prefetch: bool
    start_workers: int
    max_workers: int
    start_prefetch: int | None
    max_prefetch: int | None


def settings(num_workers: Any, prefetch_factor: Any, iterable: bool) -> Settings | None:
    """The tuner's settings for these arguments, or None when neither is ``"auto"``. An
    argument that is not ``"auto"`` is left for the loader's own checks."""
    auto_workers = isinstance(num_workers, str) and num_workers == AUTO
    auto_prefetch = isinstance(prefetch_factor, str) and prefetch_factor == AUTO
    if not auto_workers and not auto_prefetch:
        return None
    cores = max(1, usable_cores())
    if auto_workers:
        start = cores if iterable else 1  # an iterable dataset's shards cannot change mid-epoch
        top = cores
    else:
        start = top = num_workers
    if auto_prefetch:
        start_pf: Any = sizing.DEFAULT_PREFETCH_FACTOR
        top_pf: Any = MAX_PREFETCH
    else:
        start_pf = top_pf = prefetch_factor
    return Settings(auto_workers, auto_prefetch, start, top, start_pf, top_pf)


@dataclass
class _Window:
    """The clocks when a window began."""

    at: float
    wait_s: float
    loop_s: float
    calls: int
    busy_ns: int
    idle_ns: int
    cpu: tuple[int, int] | None


@dataclass
class Tuner:
    """A loader's tuner: the window being measured, the changes made (for
    ``stats()["autotune"]``), and the running epoch's counts it reports (a
    :class:`~shmloader.tuning.counts.WorkerCounts` given by :meth:`epoch_began`;
    :meth:`decide` raises the deciding iterator's): it holds no copy of them."""

    settings: Settings
    counts: WorkerCounts  # the running epoch's (the starting counts before the first)
    due: float = 0.0  # time.perf_counter() of the next decision
    began: float | None = None  # when the first window began
    window: _Window | None = None
    changes: list[dict[str, Any]] = field(default_factory=list)
    held_by: str = ""  # why the last data-bound window changed nothing

    @classmethod
    def of(cls, s: Settings) -> Tuner:
        """The tuner of a loader made with ``s``: at its starting counts."""
        return cls(s, WorkerCounts(s.start_workers, s.start_prefetch))

    def epoch_began(self, counts: WorkerCounts) -> None:
        """An epoch begins with ``counts`` (those :meth:`report` names from now on): the
        first window begins with its batches."""
        self.counts = counts
        self.window = None
        self.due = 0.0

    def restart_window(self, now: float, timing: Timing) -> None:
        """Measure from ``now`` (after a change, or at an epoch's first batch)."""
        busy, idle = _worker_ns(timing)
        self.window = _Window(now, timing.wait_s, timing.loop_s, timing.calls, busy, idle, _cpu_idle())
        if self.began is None:
            self.began = now
        self.due = now + WINDOW_S

    def decide(self, now: float, timing: Timing, room: Any, counts: WorkerCounts) -> str | None:
        """At ``now`` (past :attr:`due`): what to change, ``"worker"``, ``"prefetch"`` or
        None, from the window that ends now, made in ``counts`` (the deciding iterator's)
        already: one worker more (the caller starts it) or one task more per worker.
        ``room`` answers what the memory allows (:class:`Room`). Starts the next window."""
        w = self.window
        if w is None or timing.calls - w.calls < MIN_BATCHES:
            if w is None:
                self.restart_window(now, timing)
            else:
                self.due = now + WINDOW_S / 4  # too few batches yet: look again soon
            return None
        spent = (timing.wait_s - w.wait_s) + (timing.loop_s - w.loop_s)
        waited = (timing.wait_s - w.wait_s) / spent if spent > 0 else 0.0
        busy_ns, idle_ns = _worker_ns(timing)
        busy_d, idle_d = busy_ns - w.busy_ns, idle_ns - w.idle_ns
        busy = busy_d / (busy_d + idle_d) if busy_d + idle_d > 0 else 1.0
        free = _free_cores(w.cpu, _cpu_idle())
        self.restart_window(now, timing)
        if waited <= DATA_BOUND_SHARE:
            self.held_by = ""
            return None
        s = self.settings
        workers, prefetch = counts.workers, counts.prefetch
        action = None
        if busy >= WORKERS_SATURATED and s.auto_workers:
            if workers >= s.max_workers:
                self.held_by = f"num_workers is at the {s.max_workers} cores this process may use"
            elif free is not None and free < FREE_CORE:
                self.held_by = f"no core is free (idle {free:.2f} of a core)"
            elif not room.slots_for(workers + 1, prefetch or 1):
                self.held_by = "the ring has no slots for another worker (max_shm_bytes, or memory)"
            elif not room.memory_for_worker(prefetch or 1):
                self.held_by = "the memory there has no room for another worker's batches"
            else:
                counts.add_worker()
                action = "worker"
        elif busy < WORKERS_SATURATED and s.auto_prefetch and prefetch is not None:
            if prefetch >= (s.max_prefetch or 0):
                self.held_by = f"prefetch_factor is at its most, {s.max_prefetch}"
            elif not room.slots_for(workers, prefetch + 1):
                self.held_by = "the ring has no slots for more prefetch (max_shm_bytes, or memory)"
            else:
                counts.raise_prefetch()
                action = "prefetch"
        if action is not None:
            self.held_by = ""
            self.changes.append(
                {
                    "at_s": round(now - (self.began or now), 4),
                    "num_workers": counts.workers,
                    "prefetch_factor": counts.prefetch,
                    "waited_share": round(waited, 3),
                    "workers_busy_share": round(busy, 3),
                }
            )
        return action

    def report(self) -> dict[str, Any]:
        """``stats()["autotune"]``: the counts now, the bounds, the changes made (each at
        ``at_s`` seconds after the first window began, with the window's figures that
        asked for it) and, where the last data-bound window changed nothing, why."""
        s = self.settings
        return {
            "num_workers": self.counts.workers,
            "prefetch_factor": self.counts.prefetch,
            "max_workers": s.max_workers,
            "max_prefetch": s.max_prefetch,
            "changes": [dict(c) for c in self.changes],
            "held_by": self.held_by,
        }


class Room:
    """What the memory allows, asked only when a change is considered: the ring's slots
    (``workers * prefetch + 2`` of them in use at most, the scheduler's bound) and the
    memory there for a worker's batch and the slots it fills."""

    def __init__(self, ring: Any, backend: str) -> None:
        self.ring = ring
        self.backend = backend

    def slots_for(self, workers: int, prefetch: int) -> bool:
        ring = self.ring
        return ring is None or workers * prefetch + sizing.IN_FLIGHT_EXTRA_SLOTS <= ring.num_slots

    def memory_for_worker(self, prefetch: int) -> bool:
        if self.ring is None:
            return True
        from shmloader.system.segment import resolve_backend

        need = (1 + prefetch) * self.ring.slot_bytes + _EXTRA_MIB
        room = memory.ring_room(memory.budget(resolve_backend(self.backend)), need)
        return room is None or room > 0


def _worker_ns(timing: Timing) -> tuple[int, int]:
    """(busy, idle) nanoseconds summed over the workers' reports so far."""
    busy = idle = 0
    for fetch_ns, collate_ns, idle_ns in timing.workers:
        busy += fetch_ns + collate_ns
        idle += idle_ns
    return busy, idle


def _cpu_idle() -> tuple[int, int] | None:
    """(idle, total) jiffies of the cores this process may use, from /proc/stat; None
    where it cannot be read."""
    mine = {f"cpu{c}" for c in affinity_cpus()}
    try:
        idle = total = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                parts = line.split()
                if parts[0] not in mine:
                    continue
                values = [int(v) for v in parts[1:9]]
                idle += values[3] + values[4]  # idle, iowait
                total += sum(values)
        return (idle, total) if total else None
    except (OSError, ValueError, IndexError):
        return None


def _free_cores(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Cores idle over a window, on average (e.g. 1.0: one core did nothing), or None
    where /proc/stat could not be read."""
    if before is None or after is None:
        return None
    idle, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return None
    return len(affinity_cpus()) * idle / total
