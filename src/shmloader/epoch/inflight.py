"""What an iterator has in flight: the tasks its workers owe, the results not handed out
yet, how many more tasks may go, and the one rule for a replaced worker's tasks.

A task is sent only where a slot is free for it, and the tasks sent and not handed out
(received or not) stay below ``num_workers * prefetch_factor`` (one per worker before the
first batch sized the ring): that bounds the slots in use by the loader, whatever order
the workers finish in. Which worker gets the next task and the order results are handed
out in are the :class:`~shmloader.epoch.scheduler.Scheduler`'s.

With persistent workers and ``prefetch_next_epoch`` the tasks of the next epoch may be in
flight too (:mod:`shmloader.epoch.ahead`): they are numbered on from this epoch's last
(``scheduler.limit``), and :attr:`InFlight.next_plan` is their epoch's plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shmloader.epoch.courier import Courier
from shmloader.epoch.rings import RingKeeper
from shmloader.epoch.scheduler import Scheduler
from shmloader.memory import leases as _leases
from shmloader.memory.ring import NO_SLOT, Ring
from shmloader.sampling.position import EpochPlan
from shmloader.transport import wire
from shmloader.workers.pool import WorkerHandle, WorkerPool


class Task:
    """One batch sent to a worker: its slot is in ``ring`` (the ring current when it was
    sent; a ring that grows since keeps serving the tasks given before)."""

    __slots__ = ("indices", "ring", "seq", "slot", "worker")

    def __init__(self, seq: int, worker: WorkerHandle, slot: int, indices: Any, ring: Ring | None) -> None:
        self.seq = seq
        self.worker = worker
        self.slot = slot
        self.indices = indices
        self.ring = ring


class InFlight:
    """The tasks and results of one iterator, and the counts that bound them
    (``num_workers`` and ``prefetch_factor``, which a tuner may raise)."""

    def __init__(
        self,
        pool: WorkerPool,
        courier: Courier,
        rings: RingKeeper,
        num_workers: int,
        prefetch_factor: int,
        in_order: bool,
        iterable: bool,
    ) -> None:
        self._pool = pool
        self._courier = courier
        self._rings = rings
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._iterable = iterable
        self.scheduler = Scheduler(num_workers, in_order, wire.RES_ITER_END)
        self.results = self.scheduler.results  # (one dict for the scheduler's life)
        self.tasks: dict[int, Task] = {}
        self.plan: EpochPlan | None = None  # the epoch whose tasks go out
        self.next_plan: EpochPlan | None = None  # the next epoch's, while its tasks go out early
        self._source: Iterator[Any] = iter(())  # the epoch's index lists (map-style datasets)
        self.source_done = True  # every task the source allows now was sent

    # --- an epoch --------------------------------------------------------------------------

    def begin(self, plan: EpochPlan, source: Iterator[Any] | None) -> None:
        """Start sending ``plan``'s tasks, from ``source`` (None: an iterable dataset, whose
        workers read their own shards). Nothing may be in flight."""
        self._source = source if source is not None else iter(())
        self.source_done = False
        self.tasks = {}
        self.plan = plan
        self.scheduler.begin_epoch(plan.start_worker)

    def open_next(self, plan: EpochPlan, source: Iterator[Any]) -> None:
        """Every task of this epoch was sent: the tasks sent from now on are ``plan``'s
        (the next epoch's), from ``source``."""
        self.next_plan = plan
        self.scheduler.open_next(plan.start_worker)
        self._source = source
        self.source_done = False

    def reopen(self) -> None:
        """The source may give tasks again (it stopped while the ring had no free slot)."""
        self.source_done = False

    def drop_last_epoch(self) -> EpochPlan | None:
        """The next epoch begins, nothing of the last one in flight: its results not handed
        out (it was left before its end) are dropped, their slots freed, and the tasks sent
        early stop counting as the next epoch's. Returns their plan (None: none were sent)."""
        plan, self.next_plan = self.next_plan, None
        sched = self.scheduler
        if sched.limit is not None:
            for _, task, _ in sched.drop_before(sched.limit):
                _leases.give_back(task.ring, task.slot)
        return plan

    def take_next(self, plan: EpochPlan, source: Iterator[Any], source_done: bool) -> None:
        """The epoch ``plan`` takes over the tasks and results sent early for it (see
        :meth:`drop_last_epoch`); ``source`` gives the rest of its tasks."""
        self.scheduler.take_next(plan.start_worker)
        self.plan = plan
        self._source = source
        self.source_done = source_done

    # --- sending -------------------------------------------------------------------------

    def fill(self) -> None:
        """Send tasks until every worker has ``prefetch_factor`` of them (one each before
        the ring exists: the first results size it)."""
        rings = self._rings
        if rings.wanted:
            if self.tasks or self.results:
                return  # the iterator makes the ring after handing out the batch that asked
            rings.make_wanted()
        ring = rings.ring  # a ring short of memory has fewer slots: never more tasks than it holds
        n = self.num_workers
        per_worker = 1 if ring is None else min(self.prefetch_factor, max(1, (ring.num_slots - 2) // n))
        cap = per_worker * n
        workers = self._pool.workers
        started = len(workers) if len(workers) < n else None  # (only running workers get tasks)
        sched, tasks, results = self.scheduler, self.tasks, self.results
        while not self.source_done and len(tasks) + len(results) < cap:
            wid = sched.pick(cap, started)
            if wid is None:
                if not sched.any_active():
                    self.source_done = True
                break
            if self._iterable:
                kind, payload, indices = wire.TASK_ITER, b"", None
            else:
                try:
                    indices = next(self._source)
                except StopIteration:
                    self.source_done = True
                    break
                kind, payload = wire.task_payload(indices)
            slot = rings.claim(wid, n)
            seq = sched.assign(wid)
            tasks[seq] = Task(seq, workers[wid], slot, indices, rings.ring)
            self._courier.task(workers[wid], kind, slot, seq, payload)
        # A worker that sleeps is woken once for all the tasks this call queued for it,
        # not later: a wake-up deferred while batches are ready leaves the prefetch
        # unworked through a long training step.
        if self._courier.owes_wake_ups:
            self._courier.wake_sleepers()

    # --- receiving -----------------------------------------------------------------------

    def ready(self, worker: WorkerHandle, seq: int) -> Task | None:
        """Batch ``seq`` is READY in its slot: its task, now a result (None: a result from
        before a reset, already discarded)."""
        task = self.tasks.pop(seq, None)
        if task is not None:
            self.scheduler.answered(worker.id)
            self.results[seq] = (wire.RES_READY, task, b"")
        return task

    def answered(self, worker: WorkerHandle, seq: int) -> Task | None:
        """``worker`` answered batch ``seq`` with something other than a batch in its slot:
        the task (its slot freed), or None for a result from before a reset."""
        task = self.tasks.pop(seq, None)
        if task is not None:
            self.scheduler.answered(worker.id)
            _leases.give_back(task.ring, task.slot)
            task.slot = NO_SLOT
        return task

    def retire(self, worker: WorkerHandle, kind: int, payload: bytes) -> None:
        """``worker`` will load nothing more this epoch (its worker_init_fn failed): its
        tasks are dropped and one result of ``kind`` takes the place of the first."""
        mine = self.owed_by(worker)
        tasks = [self.tasks.pop(seq) for seq in mine]
        for task in tasks:
            _leases.give_back(task.ring, task.slot)
            task.slot = NO_SLOT
        self.scheduler.retire(worker.id)
        seq = mine[0] if mine else self.scheduler.rcvd_seq
        task = tasks[0] if tasks else Task(seq, worker, NO_SLOT, None, None)
        self.scheduler.put(seq, (kind, task, payload))

    # --- questions -----------------------------------------------------------------------

    def epoch_plan(self) -> EpochPlan:
        """The plan of the epoch whose tasks go out (the last one begun)."""
        if self.plan is None:
            raise RuntimeError("no epoch has begun on these workers yet")
        return self.plan

    def owed_by(self, worker: WorkerHandle, this_epoch: bool = False) -> list[int]:
        """Batch numbers ``worker`` owes, in order; ``this_epoch``: not those of the next
        epoch sent early."""
        mine = sorted(seq for seq, t in self.tasks.items() if t.worker is worker)
        if this_epoch and self.next_plan is not None:
            mine = [seq for seq in mine if not self.scheduler.is_next(seq)]
        return mine

    def owes_this_epoch(self) -> bool:
        """Whether a task of the running epoch is still in flight (not one sent early for
        the next)."""
        tasks = self.tasks
        if not tasks:
            return False
        limit = self.scheduler.limit
        return self.next_plan is None or limit is None or min(tasks) < limit

    def owes_work(self, worker: WorkerHandle) -> bool:
        """Whether ``worker`` has batches of this epoch in flight or still to be given."""
        wid = worker.id
        sched = self.scheduler
        return bool(sched.outstanding[wid]) or (sched.active[wid] and not self.source_done)

    def began_loading(self) -> bool:
        """Whether a task of this epoch was sent."""
        return self.scheduler.send_seq != self.scheduler.base

    def due(self) -> Task | None:
        """In order: the task of the batch to hand out next, where it is in flight."""
        return self.tasks.get(self.scheduler.rcvd_seq)

    def death_point(self, worker: WorkerHandle) -> tuple[int | None, Any, bool]:
        """Where ``worker`` was when it died: its oldest unanswered batch of this epoch
        (None: it owed none) with that batch's indices, and whether it had started on it.
        It had not when that task is still in its task queue: tasks are taken in order, so
        it was idle (between batches, or not started yet), with work queued for it."""
        pending = self.owed_by(worker, this_epoch=True)
        if not pending:
            return None, None, True
        first = pending[0]
        return first, self.tasks[first].indices, first not in worker.channel.queued_seqs()

    # --- a replaced worker ------------------------------------------------------------------

    def requeue(self, old: WorkerHandle, new: WorkerHandle) -> int:
        """Send ``new`` (started in ``old``'s place) every task ``old`` never answered, with
        the same batch numbers and indices, in their order. While the next epoch's tasks go
        out early, ``new`` is then told that epoch's seeds (it gets its tasks from now on)
        and given its tasks of it again. Returns how many of this epoch's were sent."""
        now = self.owed_by(old, this_epoch=True)
        this_epoch = set(now)
        later = [seq for seq in self.owed_by(old) if seq not in this_epoch]
        for seq in now:
            self._resend(self.tasks[seq], new)
        if self.next_plan is not None:  # (its next tasks are the next epoch's too)
            self._courier.epoch_ahead(new, self.next_plan)
            for seq in later:
                self._resend(self.tasks[seq], new)
        return len(now)

    def _resend(self, task: Task, new: WorkerHandle) -> None:
        task.worker = new
        task.ring, task.slot = self._rings.reclaim(task.ring, task.slot, new.id, self.num_workers)
        if self._iterable:
            kind, payload = wire.TASK_ITER, b""
        else:
            kind, payload = wire.task_payload(task.indices)
        self._courier.task_frame(new, kind, task.slot, task.seq, payload)

    # --- the end ---------------------------------------------------------------------------

    def free_results(self) -> None:
        """Give back the slots of results not handed out (an epoch left before its end)."""
        for _, task, _ in self.results.values():
            _leases.give_back(task.ring, task.slot)

    def free_all(self) -> None:
        """The workers are gone: the slots they were given and that were never handed out
        are free; nothing is in flight any more."""
        for task in self.tasks.values():
            _leases.give_back(task.ring, task.slot)
        self.free_results()
        self.tasks.clear()
        self.results.clear()
