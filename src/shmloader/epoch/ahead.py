"""Prefetch across an epoch's end, for persistent workers with ``prefetch_next_epoch=True``
(opt-in): the next epoch's first batches load while the last of this one are consumed
(torch issue 158704), so the first ``next()`` of the next epoch finds them ready instead
of waiting for a worker. torch loads nothing of an epoch before its ``iter()``: those
batches are made before the loop's per-epoch code runs (a curriculum, an epoch counter
the dataset reads), so they see the state the dataset had then. Hence opt-in.

A mixin of :class:`~shmloader.epoch.multiprocess.MultiProcessIter` (it works on the iterator's
pool, tasks, scheduler and source). Once every task of this epoch was sent and there is
room in the ring, the iterator works out the next epoch's plan without moving the
loader's cursor (:func:`shmloader.epoch.state.plan_ahead`: only where that plan is a function
of the seed and the epoch; never with ``generator=``, so a user who reseeds the generator
before ``iter()`` still gets that epoch), sends each worker the next epoch's seed (after
its last task of this one: a worker reads its socket in order) and goes on sending that
epoch's tasks, numbered on from this epoch's last (:meth:`Scheduler.open_next`); nothing
of them is handed out in this epoch.

When the next epoch begins, its real plan (``set_epoch``, the dataset's length, the world
size read then) is compared with the one prefetched: equal, the epoch takes the tasks and
results over (:meth:`Scheduler.take_next`); different, they are waited for and dropped
(their slots freed) and the epoch starts as without prefetch. A prefetched batch is a
batch like any other for the ring (its slot is ASSIGNED, then READY, never HELD before it
is handed out), and :meth:`close` frees its slot as any other's. A worker replaced while
tasks of the next epoch are in flight gets the next epoch's seed after its tasks of this
one, then those tasks again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shmloader.epoch import state as _state
from shmloader.memory import leases as _leases
from shmloader.system import slots as _slots
from shmloader.transport import wire


class Ahead:
    """The cross-epoch half of the epoch iterator (see the module's docstring)."""

    # (Attributes and methods of MultiProcessIter, used here.)
    _loader: Any
    _runtime: Any  # the loader's LoaderRuntime (shmloader.runtime)
    _pool: Any
    _tasks: dict
    _ring: Any
    _ring_wanted: int
    _source: Any
    _source_done: bool
    _workers: list
    closed: bool
    epoch_done: bool
    _yielded: int
    plan: Any
    scheduler: Any
    # The prefetched epoch's plan, or None: set by _go_ahead, cleared when an epoch begins.
    _ahead: _state.EpochPlan | None = None
    _ahead_tried: Any = None  # the plan of the epoch whose end last tried to go ahead

    def _may_go_ahead(self) -> bool:
        """Whether the next epoch's tasks may go out now: persistent workers and
        ``prefetch_next_epoch`` asked for, every task of this epoch sent, none of the next
        epoch's yet, and no ring being remade."""
        loader = self._loader
        return (
            self._ahead is None
            and self._ahead_tried is not self.plan
            and not self.closed
            and loader.persistent_workers
            and loader.prefetch_next_epoch
            and not loader.iterable
            and not self._ring_wanted
            and self._ring is not None
        )

    def _go_ahead(self) -> None:
        """Begin sending the next epoch's tasks (see the module's docstring), where its
        plan is known now."""
        self._ahead_tried = self.plan  # once per epoch: plan_ahead draws the epoch's order
        ahead = _state.plan_ahead(self._runtime.config, self._runtime.cursor, self._runtime.now())
        if ahead is None:
            return
        plan, source = ahead
        self._ahead = plan
        self.scheduler.open_next(plan.start_worker)
        for w in self._workers:
            self._pool.send(w, wire.epoch_frame(plan.epoch_seed + w.id))
        self._source = _Gate(source, lambda: self._ring)
        self._source_done = False
        self._dispatch()  # type: ignore[attr-defined]

    def _ahead_more(self) -> None:
        """Every task this epoch may send is out (``_source_done``): begin the next
        epoch's (:meth:`_go_ahead`), or send more of them where slots came free since the
        gate last closed."""
        if self._ahead is None:
            if self._may_go_ahead():
                self._go_ahead()
            return
        gate = self._source
        if isinstance(gate, _Gate) and not gate.exhausted and gate.open():
            self._source_done = False
            self._dispatch()  # type: ignore[attr-defined]

    def _owes_this_epoch(self) -> bool:
        """Whether a task of the running epoch is still in flight (not one prefetched for
        the next)."""
        tasks = self._tasks
        if not tasks:
            return False
        return self._ahead is None or min(tasks) < self.scheduler.limit

    def _take_ahead(self, plan: _state.EpochPlan) -> bool:
        """The epoch ``plan`` begins: take over the prefetched tasks and results when they
        are its own (True), else wait for them and free their slots (False: the caller
        starts the epoch afresh). Either way the last epoch's leftovers (it was left
        before its end) are dropped first."""
        sched = self.scheduler
        while self._owes_this_epoch():
            self._wait()  # type: ignore[attr-defined]
        ahead, self._ahead = self._ahead, None
        for _, task, _ in sched.drop_before(sched.limit):
            _leases.give_back(task.ring, task.slot)
        stats = self._runtime.stats
        if ahead != plan:
            while self._tasks:
                self._wait()  # type: ignore[attr-defined]
            # (Their slots go back with the epoch's start: _next_epoch_on_workers.)
            stats["batches_ahead_dropped"] += len(sched.results)
            return False
        stats["epochs_ahead"] += 1
        _state.took_ahead(self._runtime.config)
        sched.take_next(plan.start_worker)
        gate = self._source
        if isinstance(gate, _Gate):  # the epoch's own now: its tasks may grow the ring
            self._source = gate.source
            self._source_done = gate.exhausted
        self.plan = plan
        self.epoch_done = False
        self._yielded = 0
        tuner = self._runtime.tuner
        if tuner is not None:
            tuner.window = None  # its first window begins with the epoch's batches
        self._dispatch()  # type: ignore[attr-defined]
        return True

    def _restart(self, worker: Any, timed_out: float | None = None) -> None:
        """Restarts (restarts.py) with the next epoch's tasks in flight: the replacement
        gets this epoch's tasks again, then the next epoch's seed and its tasks again."""
        sched = self.scheduler
        if self._ahead is None:
            super()._restart(worker, timed_out)  # type: ignore[misc]
            return
        later = sorted(seq for seq, t in self._tasks.items() if t.worker is worker and sched.is_next(seq))
        held = {seq: self._tasks.pop(seq) for seq in later}
        try:
            super()._restart(worker, timed_out)  # type: ignore[misc]
        finally:
            self._tasks.update(held)  # (on an error, close() frees their slots)
        new = next(w for w in self._workers if w.id == worker.id)
        self._pool.send(new, wire.epoch_frame(self._ahead.epoch_seed + new.id))
        for seq in later:
            task = held[seq]
            task.worker = new
            if task.slot != wire.NO_SLOT and task.ring is self._ring:
                task.ring.states.store(task.slot, _slots.ASSIGNED)
            else:
                _leases.give_back(task.ring, task.slot)
                task.slot = self._claim_slot(worker.id)  # type: ignore[attr-defined]
                task.ring = self._ring
            kind, payload = wire.task_payload(task.indices)
            self._pool.send(new, wire.frame(wire.pack(kind, task.slot, seq, payload)))


class _Gate:
    """The next epoch's tasks while they are prefetched: each is let through only where
    the ring has a FREE slot for it, so a prefetch never makes the ring grow (nor fails
    on ``max_shm_bytes`` in this epoch, where the consumer may hold every slot). Closed,
    it raises StopIteration (the dispatch stops) and may let tasks through later."""

    __slots__ = ("exhausted", "ring", "source")

    def __init__(self, source: Any, ring: Callable[[], Any]) -> None:
        self.source = source
        self.ring = ring  # the iterator's current ring (it may change meanwhile)
        self.exhausted = False

    def open(self) -> bool:
        """Whether a task may go now: a FREE slot in the current ring."""
        ring = self.ring()
        return ring is not None and ring.states.count(_slots.FREE) > 0

    def __iter__(self) -> _Gate:
        return self

    def __next__(self) -> Any:
        if self.exhausted or not self.open():
            raise StopIteration
        try:
            return next(self.source)
        except StopIteration:
            self.exhausted = True
            raise
