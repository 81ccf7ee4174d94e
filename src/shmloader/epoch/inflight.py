"""What an iterator has in flight: the tasks its workers owe, the results not handed out
yet, how many more tasks may go, and the one rule for a replaced worker's tasks.

A task is sent only where a slot is free for it, and the tasks sent and not handed out
(received or not) stay below ``num_workers * prefetch_factor`` (one per worker before the
first batch sized the ring): that bounds the slots in use by the loader, whatever order
the workers finish in. Which worker gets the next task and the order results are handed
out in are the :class:`~shmloader.epoch.scheduler.Scheduler`'s.

With persistent workers and ``prefetch_next_epoch`` the tasks of the next epoch may be in
flight too (:mod:`shmloader.epoch.ahead`): they are numbered on from this epoch's last
(the scheduler's ``limit``), and :attr:`InFlight.next_plan` is their epoch's plan.

The tasks, the results and the scheduler are InFlight's alone: the collector, the
iterator, the restarts and the prefetch across epochs change them through its methods and
ask it questions. The counts it sends by (:class:`~shmloader.tuning.counts.WorkerCounts`)
are read at each fill: a tuner that adds a worker tells it with :meth:`InFlight.workers_added`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from shmloader.epoch.courier import Courier
from shmloader.epoch.rings import RingKeeper
from shmloader.epoch.scheduler import Scheduler
from shmloader.memory import leases as _leases
from shmloader.memory.ring import NO_SLOT, Ring
from shmloader.sampling.position import EpochPlan
from shmloader.transport import wire
from shmloader.tuning.counts import WorkerCounts
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
    """The tasks and results of one iterator, bounded by ``counts`` (the worker count
    and prefetch depth in use, which a tuner may raise)."""

    def __init__(
        self,
        pool: WorkerPool,
        courier: Courier,
        rings: RingKeeper,
        counts: WorkerCounts,
        in_order: bool,
        iterable: bool,
    ) -> None:
        self._pool = pool
        self._courier = courier
        self._rings = rings
        self._counts = counts
        self._iterable = iterable
        self._scheduler = Scheduler(counts, in_order, wire.RES_ITER_END)
        self._results = self._scheduler.results  # (one dict for the scheduler's life)
        self._tasks: dict[int, Task] = {}
        self._plan: EpochPlan | None = None  # the epoch whose tasks go out
        self._next_plan: EpochPlan | None = None  # the next epoch's, while its tasks go out early
        self._source: Iterator[Any] = iter(())  # the epoch's index lists (map-style datasets)
        # Whether every task the source allows now was sent: read by the iterator at each
        # batch (a plain attribute for that), changed only by InFlight's methods.
        self.source_done = True
        # The next result to hand out now, ``(kind, task, payload)``, or None where it has
        # not arrived: the scheduler's pop, called once or twice a batch (bound here: no
        # call in between).
        self.pop: Callable[[], tuple[Any, ...] | None] = self._scheduler.pop

    @property
    def plan(self) -> EpochPlan | None:
        """The plan of the epoch whose tasks go out (None before the first)."""
        return self._plan

    @property
    def next_plan(self) -> EpochPlan | None:
        """The next epoch's plan while its tasks go out early, else None."""
        return self._next_plan

    # --- an epoch --------------------------------------------------------------------------

    def begin(self, plan: EpochPlan, source: Iterator[Any] | None) -> None:
        """Start sending ``plan``'s tasks, from ``source`` (None: an iterable dataset, whose
        workers read their own shards). Nothing may be in flight."""
        self._source = source if source is not None else iter(())
        self.source_done = False
        self._tasks = {}
        self._plan = plan
        self._scheduler.begin_epoch(plan.start_worker)

    def open_next(self, plan: EpochPlan, source: Iterator[Any]) -> None:
        """Every task of this epoch was sent: the tasks sent from now on are ``plan``'s
        (the next epoch's), from ``source``; each worker is told that epoch's seeds (after
        its last task of this one: a worker reads its socket in order) and given tasks."""
        self._next_plan = plan
        self._scheduler.open_next(plan.start_worker)
        self._source = source
        self.source_done = False
        for w in self._pool.workers:
            self._courier.epoch_ahead(w, plan)
        self.fill()

    def workers_added(self) -> None:
        """The counts gained workers (started already, map-style datasets): the round robin
        takes them in from its next turn, and they are given tasks now."""
        self._scheduler.grow()
        self.fill()

    def reopen(self) -> None:
        """The source may give tasks again (it stopped while the ring had no free slot)."""
        self.source_done = False

    def drop_last_epoch(self) -> EpochPlan | None:
        """The next epoch begins, nothing of the last one in flight: its results not handed
        out (it was left before its end) are dropped, their slots freed, and the tasks sent
        early stop counting as the next epoch's. Returns their plan (None: none were sent)."""
        plan, self._next_plan = self._next_plan, None
        sched = self._scheduler
        if sched.limit is not None:
            for _, task, _ in sched.drop_before(sched.limit):
                _leases.give_back(task.ring, task.slot)
        return plan

    def take_next(self, plan: EpochPlan, source: Iterator[Any], source_done: bool) -> None:
        """The epoch ``plan`` takes over the tasks and results sent early for it (see
        :meth:`drop_last_epoch`); ``source`` gives the rest of its tasks."""
        self._scheduler.take_next(plan.start_worker)
        self._plan = plan
        self._source = source
        self.source_done = source_done

    # --- sending -------------------------------------------------------------------------

    def fill(self) -> None:
        """Send tasks until every worker has ``prefetch_factor`` of them (one each before
        the ring exists: the first results size it)."""
        rings = self._rings
        if rings.wanted:
            if self._tasks or self._results:
                return  # the iterator makes the ring after handing out the batch that asked
            rings.make_wanted()
        ring = rings.ring  # a ring short of memory has fewer slots: never more tasks than it holds
        counts = self._counts
        n = counts.workers
        per_worker = 1 if ring is None else min(counts.prefetch or 1, max(1, (ring.num_slots - 2) // n))
        cap = per_worker * n
        workers = self._pool.workers
        started = len(workers) if len(workers) < n else None  # (only running workers get tasks)
        sched, tasks, results = self._scheduler, self._tasks, self._results
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
        task = self._tasks.pop(seq, None)
        if task is not None:
            self._scheduler.answered(worker.id)
            self._results[seq] = (wire.RES_READY, task, b"")
        return task

    def answered(self, worker: WorkerHandle, seq: int) -> Task | None:
        """``worker`` answered batch ``seq`` with something other than a batch in its slot:
        the task (its slot freed), or None for a result from before a reset."""
        task = self._tasks.pop(seq, None)
        if task is not None:
            self._scheduler.answered(worker.id)
            _leases.give_back(task.ring, task.slot)
            task.slot = NO_SLOT
        return task

    def keep(
        self, worker: WorkerHandle, kind: int, task: Task, payload: bytes, segment: Ring | None = None
    ) -> None:
        """Keep the result of ``task`` (which :meth:`answered` returned), of ``kind``, until
        it is its turn. A batch outside its slot (``RES_SEGMENT``: in ``segment``, its own
        mapped segment; ``RES_PICKLED``) tells the ring keeper its size: the first batch
        sizes the ring, a bigger one grows it. An iterable dataset's end
        (``RES_ITER_END``) means ``worker`` gets no more tasks this epoch."""
        if kind == wire.RES_SEGMENT or kind == wire.RES_PICKLED:
            if segment is not None:
                task.ring, task.slot = segment, 0
            self._rings.outside(wire.needed_bytes(payload))
        elif kind == wire.RES_ITER_END:
            self._scheduler.ended(worker.id, task.seq)
        self._scheduler.put(task.seq, (kind, task, payload))

    def keep_shard_state(self, worker: WorkerHandle, seq: int, blob: bytes) -> None:
        """``worker``'s dataset state after batch ``seq`` (iterable datasets), pickled."""
        self._scheduler.keep_shard_state(worker.id, seq, blob)

    def retire(self, worker: WorkerHandle, kind: int, payload: bytes) -> None:
        """``worker`` will load nothing more this epoch (its worker_init_fn failed): its
        tasks are dropped and one result of ``kind`` takes the place of the first."""
        mine = self.owed_by(worker)
        tasks = [self._tasks.pop(seq) for seq in mine]
        for task in tasks:
            _leases.give_back(task.ring, task.slot)
            task.slot = NO_SLOT
        self._scheduler.retire(worker.id)
        seq = mine[0] if mine else self._scheduler.rcvd_seq
        task = tasks[0] if tasks else Task(seq, worker, NO_SLOT, None, None)
        self._scheduler.put(seq, (kind, task, payload))

    # --- questions -----------------------------------------------------------------------

    def epoch_plan(self) -> EpochPlan:
        """The plan of the epoch whose tasks go out (the last one begun)."""
        if self._plan is None:
            raise RuntimeError("no epoch has begun on these workers yet")
        return self._plan

    def owes(self) -> bool:
        """Whether any task is in flight (of this epoch or sent early for the next)."""
        return bool(self._tasks)

    def owed_count(self) -> int:
        """Tasks in flight (of this epoch or sent early for the next)."""
        return len(self._tasks)

    def owes_batch(self, seq: int) -> bool:
        """Whether batch ``seq``'s task is still in flight."""
        return seq in self._tasks

    def results_waiting(self) -> int:
        """Results received and not handed out yet."""
        return len(self._results)

    def oldest_owed(self) -> Task | None:
        """The task in flight with the lowest batch number (None: none is)."""
        tasks = self._tasks
        return tasks[min(tasks)] if tasks else None

    def waited_for(self) -> tuple[int, Any]:
        """The batch a wait that timed out was for (the oldest in flight, else the next to
        hand out) and its indices where its task is in flight."""
        tasks = self._tasks
        waiting = min(tasks) if tasks else self._scheduler.rcvd_seq
        task = tasks.get(waiting)
        return waiting, task.indices if task is not None else None

    def busy_workers(self) -> list[WorkerHandle]:
        """The worker of every task in flight (one entry per task)."""
        return [t.worker for t in self._tasks.values()]

    def owed_by(self, worker: WorkerHandle, this_epoch: bool = False) -> list[int]:
        """Batch numbers ``worker`` owes, in order; ``this_epoch``: not those of the next
        epoch sent early."""
        mine = sorted(seq for seq, t in self._tasks.items() if t.worker is worker)
        if this_epoch and self._next_plan is not None:
            mine = [seq for seq in mine if not self._scheduler.is_next(seq)]
        return mine

    def owes_this_epoch(self) -> bool:
        """Whether a task of the running epoch is still in flight (not one sent early for
        the next)."""
        tasks = self._tasks
        if not tasks:
            return False
        limit = self._scheduler.limit
        return self._next_plan is None or limit is None or min(tasks) < limit

    def owes_work(self, worker: WorkerHandle) -> bool:
        """Whether ``worker`` has batches of this epoch in flight or still to be given."""
        wid = worker.id
        sched = self._scheduler
        return bool(sched.outstanding[wid]) or (sched.active[wid] and not self.source_done)

    def began_loading(self) -> bool:
        """Whether a task of this epoch was sent."""
        return self._scheduler.send_seq != self._scheduler.base

    def due(self) -> Task | None:
        """In order: the task of the batch to hand out next, where it is in flight."""
        return self._tasks.get(self._scheduler.rcvd_seq)

    def death_point(self, worker: WorkerHandle) -> tuple[int | None, Any, bool]:
        """Where ``worker`` was when it died: its oldest unanswered batch of this epoch
        (None: it owed none) with that batch's indices, and whether it had started on it.
        It had not when that task is still in its task queue: tasks are taken in order, so
        it was idle (between batches, or not started yet), with work queued for it."""
        pending = self.owed_by(worker, this_epoch=True)
        if not pending:
            return None, None, True
        first = pending[0]
        return first, self._tasks[first].indices, first not in worker.channel.queued_seqs()

    # --- position, for state_dict (see the scheduler) -----------------------------------------

    def handed_out(self) -> int:
        """Results handed out (or raised) this epoch."""
        return self._scheduler.handed_out()

    def handed_out_per_worker(self) -> tuple[list[int], int]:
        """Iterable datasets: batches each worker produced among those handed out, and the
        worker the next one comes from."""
        return self._scheduler.handed_out_per_worker()

    def shard_states_handed_out(self) -> dict[int, bytes]:
        """Per worker, the pickled dataset state after its last handed-out batch."""
        return self._scheduler.shard_states_handed_out()

    def shard_state_before(self, wid: int, pending: list[int]) -> bytes | None:
        """A replaced worker's resume point (see the scheduler's method of that name)."""
        return self._scheduler.shard_state_before(wid, pending)

    def exhausted(self) -> bool:
        """Iterable datasets: every worker ran out and all it produced was handed out."""
        return self._scheduler.exhausted()

    def yielded_nothing(self) -> bool:
        """Whether the epoch that ended had no batch at all (every task answered by an end)."""
        return self._scheduler.yielded_nothing()

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
            self._resend(self._tasks[seq], new)
        if self._next_plan is not None:  # (its next tasks are the next epoch's too)
            self._courier.epoch_ahead(new, self._next_plan)
            for seq in later:
                self._resend(self._tasks[seq], new)
        return len(now)

    def _resend(self, task: Task, new: WorkerHandle) -> None:
        task.worker = new
        task.ring, task.slot = self._rings.reclaim(task.ring, task.slot, new.id, self._counts.workers)
        if self._iterable:
            kind, payload = wire.TASK_ITER, b""
        else:
            kind, payload = wire.task_payload(task.indices)
        self._courier.task_frame(new, kind, task.slot, task.seq, payload)

    # --- the end ---------------------------------------------------------------------------

    def free_results(self) -> None:
        """Give back the slots of results not handed out (an epoch left before its end)."""
        for _, task, _ in self._results.values():
            _leases.give_back(task.ring, task.slot)

    def free_all(self) -> None:
        """The workers are gone: the slots they were given and that were never handed out
        are free; nothing is in flight any more."""
        for task in self._tasks.values():
            _leases.give_back(task.ring, task.slot)
        self.free_results()
        self._tasks.clear()
        self._results.clear()
