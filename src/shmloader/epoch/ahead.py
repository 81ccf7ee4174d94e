"""Prefetch across an epoch's end, for persistent workers with ``prefetch_next_epoch=True``
(opt-in): the next epoch's first batches load while the last of this one are consumed
(torch issue 158704), so the first ``next()`` of the next epoch finds them ready instead
of waiting for a worker. torch loads nothing of an epoch before its ``iter()``: those
batches are made before the loop's per-epoch code runs (a curriculum, an epoch counter
the dataset reads), so they see the state the dataset had then. Hence opt-in.

Once every task of this epoch was sent and there is room in the ring, :class:`Ahead`
works out the next epoch's plan without moving the loader's cursor
(:func:`shmloader.epoch.state.plan_ahead`: only where that plan is a function of the seed
and the epoch; never with ``generator=``, so a user who reseeds the generator before
``iter()`` still gets that epoch), sends each worker the next epoch's seed (after its last
task of this one: a worker reads its socket in order) and goes on sending that epoch's
tasks, numbered on from this epoch's last (:meth:`Scheduler.open_next`); nothing of them
is handed out in this epoch.

When the next epoch begins, its real plan (``set_epoch``, the dataset's length, the world
size read then) is compared with the one prefetched: equal, the epoch takes the tasks and
results over (:meth:`Scheduler.take_next`); different, they are waited for and dropped
(their slots freed) and the epoch starts as without prefetch. A prefetched batch is a
batch like any other for the ring (its slot is ASSIGNED, then READY, never HELD before it
is handed out), and closing the iterator frees its slot as any other's. A worker replaced
while tasks of the next epoch are in flight gets the next epoch's seed after its tasks of
this one, then those tasks again (:meth:`~shmloader.epoch.inflight.InFlight.requeue`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from shmloader.epoch.collector import Collector
from shmloader.epoch.inflight import InFlight
from shmloader.epoch.rings import RingKeeper
from shmloader.sampling.position import EpochPlan
from shmloader.system import slots as _slots


class Ahead:
    """The next epoch's tasks, sent early, of one iterator. ``enabled``: persistent
    workers, ``prefetch_next_epoch`` and a map-style dataset; ``plan_next``: the next
    epoch's plan and index lists where they are known now (else None), without moving the
    loader's cursor; ``stats``: the loader's counters (``epochs_ahead``,
    ``batches_ahead_dropped``)."""

    __slots__ = (
        "_collector",
        "_enabled",
        "_gate",
        "_inflight",
        "_plan_next",
        "_rings",
        "_stats",
        "_tried",
    )

    def __init__(
        self,
        enabled: bool,
        inflight: InFlight,
        rings: RingKeeper,
        collector: Collector,
        plan_next: Callable[[], tuple[EpochPlan, Iterator[Any]] | None],
        stats: dict[str, Any],
    ) -> None:
        self._enabled = enabled
        self._inflight = inflight
        self._rings = rings
        self._collector = collector
        self._plan_next = plan_next
        self._stats = stats
        self._gate: _Gate | None = None  # the next epoch's index lists while they go out early
        self._tried: EpochPlan | None = None  # the epoch whose end last tried to go ahead

    def more(self) -> None:
        """Every task this epoch may send is out: begin sending the next epoch's, or send
        more of them where slots came free since the gate last closed."""
        inflight = self._inflight
        if inflight.next_plan is None:
            if self._may_begin():
                self._begin()
            return
        gate = self._gate
        if gate is not None and not gate.exhausted and gate.open():
            inflight.reopen()
            inflight.fill()

    def _may_begin(self) -> bool:
        """Whether the next epoch's tasks may go out now: enabled, not tried yet at this
        epoch's end, and no ring being remade."""
        rings = self._rings
        return (
            self._enabled
            and self._tried is not self._inflight.plan
            and not rings.wanted
            and rings.ring is not None
        )

    def _begin(self) -> None:
        """Begin sending the next epoch's tasks, where its plan is known now."""
        inflight = self._inflight
        self._tried = inflight.plan  # once per epoch: working the plan out draws its order
        ahead = self._plan_next()
        if ahead is None:
            return
        plan, source = ahead
        self._gate = _Gate(source, self._rings)
        inflight.open_next(plan, self._gate)

    def take(self, plan: EpochPlan) -> bool:
        """The epoch ``plan`` begins while tasks sent early are in flight: take them and
        their results over when they are its own (True: the caller goes on with this
        epoch's bookkeeping), else wait for them and free their slots (False: the caller
        starts the epoch afresh). Either way the last epoch's leftovers (it was left before
        its end) are dropped first."""
        inflight, collector = self._inflight, self._collector
        while inflight.owes_this_epoch():
            collector.wait()
        sent = inflight.drop_last_epoch()
        gate, self._gate = self._gate, None
        if sent != plan:
            while inflight.owes():
                collector.wait()
            # (Their slots go back with the epoch's start.)
            self._stats["batches_ahead_dropped"] += inflight.results_waiting()
            return False
        self._stats["epochs_ahead"] += 1
        # The epoch's own now: its tasks may grow the ring.
        if gate is not None:
            inflight.take_next(plan, gate.source, gate.exhausted)
        return True


class _Gate:
    """The next epoch's index lists while they go out early: each is let through only where
    the ring has a FREE slot for it, so a prefetch never makes the ring grow (nor fails on
    ``max_shm_bytes`` in this epoch, where the consumer may hold every slot). Closed, it
    raises StopIteration (the dispatch stops) and may let tasks through later."""

    __slots__ = ("exhausted", "rings", "source")

    def __init__(self, source: Iterator[Any], rings: RingKeeper) -> None:
        self.source = source
        self.rings = rings  # (whose ring may change meanwhile)
        self.exhausted = False

    def open(self) -> bool:
        """Whether a task may go now: a FREE slot in the current ring."""
        ring = self.rings.ring
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
