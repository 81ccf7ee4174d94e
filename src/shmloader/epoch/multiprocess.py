"""The iterator of an epoch loaded by worker processes: the glue of the pieces.

The consumer side of the data path: claim a FREE slot (:mod:`shmloader.memory.leases`), give
(slot, batch number, sample indices) to a worker, wait for results (its task and result
queues, its socket and its process sentinel: :mod:`shmloader.epoch.exchange`), and when a slot
comes back READY hand out views of it (:mod:`shmloader.batch.handout`). A slot returns to FREE
only when the last view of it dies (a lease on the batch's root array).

The workers are a :class:`~shmloader.workers.pool.WorkerPool` (start, watch, stop, death and
timeout errors); which worker loads which batch and the order batches are handed out in
is a :class:`~shmloader.epoch.scheduler.Scheduler`; the frames and the slot header are
:mod:`shmloader.transport.wire`'s; the rings and slot leases are :mod:`shmloader.memory.leases`'.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shmloader.batch.handout import Handout
from shmloader.epoch import state as _state
from shmloader.epoch.ahead import Ahead
from shmloader.epoch.exchange import Exchange
from shmloader.epoch.exchange import Task as _Task
from shmloader.epoch.inprocess import iterable_len_limit, warn_len_exceeded
from shmloader.epoch.restarts import Restarts
from shmloader.epoch.scheduler import Scheduler
from shmloader.errors import LoaderTimeoutError, RingLimitError, ShmSpaceError, WorkerDiedError
from shmloader.memory import leases as _leases
from shmloader.memory.ring import Ring
from shmloader.memory.ringmaker import BACKGROUND_MIN_BATCH_BYTES, RingMaker
from shmloader.transport import wire
from shmloader.tuning.autotune import Tuning
from shmloader.workers.pool import WorkerHandle, WorkerPool
from shmloader.workers.worker import WorkerConfig, worker_main

if TYPE_CHECKING:
    from shmloader.runtime import LoaderRuntime

_WorkerHandle = WorkerHandle  # (the pool's)


_live_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_iterators() -> None:
    for it in list(_live_iterators):
        it.close()


def _forget_workers_after_fork() -> None:
    """In a copy of the consumer made by os.fork(): the workers are not its children.
    multiprocessing still lists them, and at the copy's exit its atexit hook would
    SIGTERM them (killing the real consumer's epoch) and fail to join them."""
    children = getattr(multiprocessing.process, "_children", None)
    if children is None:
        return
    for it in list(_live_iterators):
        for w in getattr(it, "_workers", ()):
            children.discard(w.proc)


os.register_at_fork(after_in_child=_forget_workers_after_fork)


class MultiProcessIter(Ahead, Restarts, Tuning, Exchange):
    """Iterator over one epoch with worker processes (reused across epochs when
    persistent); a :class:`~shmloader.epoch.state.Positioned` for state_dict()."""

    def __init__(
        self, loader: Any, runtime: LoaderRuntime, start: Callable[[Any], _state.EpochPlan], copy: bool
    ) -> None:
        # Nothing starts here: the first next() calls ``start`` (state.epoch_starter) to
        # begin the epoch and starts the workers, so iter() alone moves nothing.
        self._loader = loader
        self._runtime = runtime
        self._handout = Handout(loader, runtime, copy)
        self._start_epoch = start
        self._pid = os.getpid()
        self.closed = False
        self.plan: _state.EpochPlan | None = None
        self.epoch_done = False
        # True until the first next() of an epoch and after close(): __next__'s one check.
        self._idle = True
        self._launched = False  # the workers were started (once per iterator)
        # torch's check on iterable datasets: batches handed out this epoch against what
        # len(loader) said (see inprocess.warn_len_exceeded).
        self._len_limit = iterable_len_limit(runtime)
        self._yielded = 0
        self._timing = runtime.timing  # where the time goes (timing.py), the loader's for its life
        self._tuner = runtime.tuner  # num_workers or prefetch_factor "auto" (autotune.py), or None
        # Start, watch (sockets and sentinels in one poll), stop; _workers is its list.
        self._pool = WorkerPool()
        self._workers = self._pool.workers
        self._ring_wanted = 0  # bytes a batch that came outside the ring needs: a ring to make
        self._ring_maker: RingMaker | None = None  # making that ring meanwhile, on a thread
        ctx = loader.multiprocessing_context
        if ctx is None or isinstance(ctx, str):
            ctx = multiprocessing.get_context(ctx)
        self._ctx = ctx
        self._ring: Ring | None = None
        # Round robin, reordering and the position for state_dict: state.py reads
        # scheduler.handed_out(), .handed_out_per_worker() and .shard_states_handed_out().
        # Its results dict is this iterator's _results for its whole life.
        self.scheduler = Scheduler(loader.num_workers, loader.in_order, wire.RES_ITER_END)
        self._results = self.scheduler.results
        self._tasks: dict[int, _Task] = {}
        self._asleep: list[_WorkerHandle] = []  # workers asleep with tasks queued (_send_task)
        # Workers whose worker_init_fn failed: their exit is expected (exchange._exited).
        self._retired: set[_WorkerHandle] = set()
        self._unlaunched: dict[int, WorkerConfig] = {}  # configs of workers not started yet
        self._source: Any = None
        self._source_done = True

    @property
    def readers(self) -> dict[bytes, Any]:
        """The layout readers the hand-out made, one per batch structure seen (clearing
        it makes the next batch's layout be decoded again)."""
        return self._handout.readers

    # --- set-up -------------------------------------------------------------------------

    def start(self) -> None:
        """Begin the epoch now, as the first ``next()`` does: the loader's epoch begins and
        the workers start (or, persistent, switch to it once the previous epoch's tasks
        are back). Idempotent; nothing on a closed iterator."""
        if not self._idle or self.closed:
            return
        if not self._launched:
            plan = self._start_epoch(self)
            self._begin_epoch(plan)  # (first: a grown ring may shrink, see _begin_epoch)
            # A ring whose descriptor is closed (this process was forked from the one that
            # made it) cannot be handed to new workers: the first batch sizes a new one.
            ring = self._runtime.leases.current
            self._ring = ring if ring is not None and ring.fd is not None else None
            self._launched = True
            _live_iterators.add(self)
            try:
                # Each worker gets its first task as soon as it is forked: it works while
                # the next one is forked (a fork of a process with torch loaded takes
                # 5-10 ms), instead of every worker waiting for the last fork.
                self._start_workers(plan.epoch_seed)
            except BaseException:
                self.close()
                raise
        else:
            plan = None
            if self._ahead is not None:  # (ahead.py: its first tasks went out last epoch)
                plan = self._start_epoch(self)
                if self._take_ahead(plan):
                    self._idle = False
                    return
            # Results still owed by the workers must come back before their slots are reused.
            while self._tasks:
                self._wait()
            self._next_epoch_on_workers(plan if plan is not None else self._start_epoch(self))
        self._idle = False

    def _next_epoch_on_workers(self, plan: _state.EpochPlan) -> None:
        """Start ``plan``'s epoch on the running workers and ring (nothing in flight)."""
        for _, task, _ in self._results.values():
            _leases.give_back(task.ring, task.slot)
        self._begin_epoch(plan)
        # A worker that died since the last epoch (idle: nothing was in flight) is raised
        # now, or replaced before it is given anything (the new one has this epoch's seed).
        self._check_exits()
        for w in self._workers:
            self._pool.send(
                w, wire.epoch_frame(plan.epoch_seed + w.id, plan.reseed, plan.sample_seed, plan.shared_seed)
            )
        try:
            self._dispatch()
        except (RingLimitError, ShmSpaceError):
            self.close()  # as in __next__: the epoch cannot start, leave nothing running
            raise

    def _begin_epoch(self, plan: _state.EpochPlan) -> None:
        loader = self._loader
        self._source = None if loader.iterable else _state.index_sequence(self._runtime.config, plan)
        self._source_done = False
        self._tasks = {}
        # Nothing in flight: a ring that grew for batches the loop kept last epoch goes
        # back to its first size when they are gone (workers already running get it now;
        # new ones start with it).
        smaller = self._runtime.leases.new_epoch()
        if smaller is not None and self._launched:
            self._adopt_ring(smaller)
        self.plan = plan
        self.epoch_done = False
        self._yielded = 0
        # Iterable datasets, for state_dict(): the round robin starts where the saved run
        # would have gone on.
        self.scheduler.begin_epoch(plan.start_worker)
        if self._tuner is not None:
            self._tuner.window = None  # its first window begins with the epoch's batches
            self._tuner.due = 0.0

    @property
    def _send_seq(self) -> int:
        """The next batch number to send."""
        return self.scheduler.send_seq

    @property
    def _rcvd_seq(self) -> int:
        """In order: the next batch number to hand out."""
        return self.scheduler.rcvd_seq

    def _start_workers(self, epoch_seed: int) -> None:
        # Every config is made before the first fork (pool.start), and each worker gets
        # tasks as soon as it runs: a task may make a new ring (the old one grew, or a
        # fork saw a batch held in it) while later workers wait to start. Their configs
        # take the new ring (_adopt_ring), as the running ones take its frame.
        unlaunched = self._unlaunched

        def config(wid: int, use_pdeathsig: bool) -> WorkerConfig:
            resume = _state.worker_resume(self.plan, wid)
            made = unlaunched[wid] = self._worker_config(wid, use_pdeathsig, epoch_seed + wid, resume)
            return made

        def started() -> None:
            for w in self._workers:
                unlaunched.pop(w.id, None)
            self._dispatch()

        try:
            self._pool.start(self._ctx, self._loader.num_workers, config, worker_main, started=started)
        finally:
            unlaunched.clear()

    def _worker_config(self, wid: int, use_pdeathsig: bool, seed: int, resume: dict | None) -> WorkerConfig:
        """The config of worker ``wid``, started with the epoch or in place of a dead one."""
        loader = self._loader
        rank, world = self._runtime.worker_shard()
        ring = self._ring
        if ring is not None and ring.fd is None:
            # Another iterator of the loader retired this ring (its descriptor is closed):
            # every worker moves to the current one, as when the ring grows.
            ring = self._runtime.leases.usable()
            if ring is not None:
                self._adopt_ring(ring)
        return WorkerConfig(
            worker_id=wid,
            # "auto": the most the loader may start (the same in every worker, above every id)
            num_workers=loader.num_workers if self._tuner is None else self._tuner.settings.max_workers,
            seed=seed,
            dataset=loader.dataset,
            recipe=self._runtime.recipe(),
            worker_init_fn=loader.worker_init_fn,
            ring=ring,
            fixed_slot_bytes=loader.slot_bytes is not None,
            parent_pid=os.getpid(),
            use_pdeathsig=use_pdeathsig,
            rank=rank,
            world_size=world,
            resume=resume,
            epoch_seed=self.plan.sample_seed,  # type: ignore[union-attr]
            shared_seed=self.plan.shared_seed,  # type: ignore[union-attr]
            report_state=self.plan.stateful,  # type: ignore[union-attr]
            shm_backend=loader.shm_backend,
        )

    # --- dispatch -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Send tasks until every worker has prefetch_factor of them (one each before the
        ring exists: the first results size it)."""
        if self._ring_wanted:
            if self._tasks or self._results:
                return  # __next__ makes the ring after handing out the batch that asked
            self._make_wanted_ring()
        loader = self._loader
        ring = self._ring  # a ring short of memory has fewer slots: never more tasks than it holds
        per_worker = (
            1
            if ring is None
            else min(loader.prefetch_factor, max(1, (ring.num_slots - 2) // loader.num_workers))
        )
        workers = self._workers
        # Batches dispatched and not yet handed out, received or not: this bounds the
        # slots in use by the loader, whatever order the workers finish in.
        cap = per_worker * loader.num_workers
        # While the workers are being started, only those already running get tasks.
        started = len(workers) if len(workers) < loader.num_workers else None
        sched = self.scheduler
        tasks, results = self._tasks, self._results
        iterable = loader.iterable
        # (Which workers are active changes only as results come in: never in this loop.)
        while not self._source_done and len(tasks) + len(results) < cap:
            wid = sched.pick(cap, started)
            if wid is None:
                if not sched.any_active():
                    self._source_done = True
                break
            worker = workers[wid]
            if iterable:
                kind, payload, indices = wire.TASK_ITER, b"", None
            else:
                try:
                    indices = next(self._source)  # type: ignore[arg-type]
                except StopIteration:
                    self._source_done = True
                    break
                kind, payload = wire.task_payload(indices)
            slot = self._claim_slot(wid)
            seq = sched.assign(wid)
            tasks[seq] = _Task(seq, worker, slot, indices, self._ring)
            self._send_task(worker, kind, slot, seq, payload)
        # A worker that sleeps is woken once for all the tasks this call queued for it. Not
        # later: deferring the wake-up while batches are ready (tried: until one is left)
        # saved no measurable consumer CPU on W4 (70 vs 72 us a batch, same window) and
        # left the prefetch unworked through a long training step.
        if self._asleep:
            self._wake_workers()

    def _claim_slot(self, wid: int) -> int:
        """A slot for worker ``wid``'s next task (NO_SLOT before the first batch sized the
        ring). The leases may hand back a new ring (grown, or the old one shared with a
        forked child): the workers get it before the task that uses it."""
        ring = self._ring
        if ring is None:
            return wire.NO_SLOT
        # Each worker looks first in its own share of the slots, from its start: a worker
        # keeps writing the few slots it already faulted in (pages are mapped per process,
        # ~2 us a page on first write), instead of every worker faulting in every slot.
        start = wid * ring.num_slots // self._loader.num_workers
        ring, slot = self._runtime.leases.claim(start)
        if ring is not self._ring and ring is not None:
            self._adopt_ring(ring)
        return slot

    # --- receive ------------------------------------------------------------------------

    def __iter__(self) -> MultiProcessIter:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        timing = self._timing
        entered = time.perf_counter()
        ring = self._ring  # batches loaded in the ring and not handed out yet (one C call)
        timing.entered(entered, ring.states.count_ready() if ring is not None else len(self._results))
        try:
            batch = self._next_batch()
        except BaseException:  # the epoch's end, or an error: no step of the loop follows
            timing.paused()
            raise
        now = time.perf_counter()
        timing.returned(entered, now)
        tuner = self._tuner
        if tuner is not None and now >= tuner.due:
            self._tune(now)  # autotune.Tuning: a worker more, or more prefetch
        return batch

    def _next_batch(self) -> Any:
        try:
            if self._idle:  # the epoch's first next() (or a closed iterator)
                if self.closed:
                    raise StopIteration
                self.start()
            if self._ring_wanted and self._ring_ready():
                self._make_wanted_ring()
                # Tasks go out at once (with in_order=False a slow first batch must not
                # hold the other workers: torch's order).
                self._dispatch()
            # (A ring still being made: results already here go out first; _dispatch
            # waits for the ring when nothing else is left to hand out.)
            # (The result due is most often here already: no wait, one call.)
            item = self.scheduler.pop() or self._next_result()
            if item is not None and not self._ring_wanted:
                # (A ring to make waits for the next call: this batch goes out first.)
                self._dispatch()
                if self._source_done:
                    self._ahead_more()  # ahead.py: the next epoch's first tasks, meanwhile
            elif item is None and self.plan.resumed and self.scheduler.yielded_nothing():  # type: ignore[union-attr]
                # A loaded position at its epoch's end: the next epoch, in full, instead.
                self._next_epoch_on_workers(self._start_epoch(self))
                item = self._next_result()
        except (WorkerDiedError, LoaderTimeoutError):
            # Dead or hung workers: do not wait for a busy one to finish its batch
            # (a timeout would otherwise surface only after pool.JOIN_TIMEOUT_S more).
            self.close(graceful=False)
            raise
        except (RingLimitError, ShmSpaceError):
            self.close()  # the epoch cannot go on: leave nothing running
            raise
        if item is None:
            self._end_epoch()
            raise StopIteration
        kind, task, payload = item
        if kind == wire.RES_READY:
            batch = self._handout.from_slot(task)  # (the common kind, without batch()'s tests)
        else:
            if kind == wire.RES_INIT_ERROR:
                self.close()  # the worker exits: the epoch cannot go on
            batch = self._handout.batch(kind, task, payload)
        self._yielded = yielded = self._yielded + 1
        if yielded > self._len_limit:
            warn_len_exceeded(self._runtime, yielded, self._loader.num_workers)
        return batch

    def _next_result(self) -> tuple[int, _Task, bytes] | None:
        """The next result to hand out, waiting for it; None at the end of the epoch."""
        pop = self.scheduler.pop
        while True:
            item = pop()
            if item is not None:
                return item  # type: ignore[return-value]
            if not self._owes_this_epoch():  # (not counting the next epoch's: ahead.py)
                self._dispatch()
                if not self._owes_this_epoch():
                    # A worker that died since the last wait (idle, its work done) is
                    # raised or replaced now, as the epoch ends: not left for the next
                    # epoch to find (torch raises it as it dies).
                    self._check_exits()
                    return None
            self._wait()

    def _want_ring(self, needed: int) -> None:
        """A batch needs ``needed`` slot bytes and the ring has no such slot: a ring to make.
        Reserving a ring of big slots takes tens of ms: it is made on a thread from now on,
        while the batches already here are handed out (see ringmaker). A small one is made
        in line at the next call, after this batch is handed out."""
        self._ring_wanted = max(self._ring_wanted, needed)
        if self._ring_maker is None and needed >= BACKGROUND_MIN_BATCH_BYTES:
            self._ring_maker = RingMaker(self._runtime.leases, needed, self._ring)

    def _ring_ready(self) -> bool:
        """True when the wanted ring can be taken without waiting for its maker."""
        maker = self._ring_maker
        return maker is None or maker.done()

    def _make_wanted_ring(self) -> None:
        """Take (waiting if need be) the ring that a batch from outside it asked for (the
        first one, or one with larger slots: the old ring retires as its batches die);
        hand it to the workers. A maker's error (no room, max_shm_bytes) is raised here."""
        wanted, self._ring_wanted = self._ring_wanted, 0
        maker, self._ring_maker = self._ring_maker, None
        leases = self._runtime.leases
        ring = maker.result() if maker is not None else None
        if ring is None or wanted > ring.slot_bytes or ring.fd is None:
            # A batch larger than the one the maker sized for arrived meanwhile, or
            # another iterator of the loader made a ring since (this one is retired).
            ring = leases.ring_for_batch(wanted, ring if ring is not None else self._ring)
        self._adopt_ring(ring)

    def _adopt_ring(self, ring: Ring) -> None:
        """Make ``ring`` this iterator's ring and hand it to every worker. Tasks sent
        before keep their old ring: each worker reads its socket in order, so it finishes
        them before it switches."""
        self._ring = ring
        for config in self._unlaunched.values():
            config.ring = ring
        message = wire.ring_frame(ring.num_slots, ring.slot_bytes)
        for w in self._workers:
            if w.proc.is_alive():  # (a dead worker is reported by its sentinel)
                self._pool.send(w, message, ring.fd)

    # --- position, for DataLoader.state_dict() -------------------------------------------

    # The position, for state.py (until it calls self.scheduler's public methods).

    def _shard_state(self, worker: _WorkerHandle, seq: int, blob: bytes) -> None:
        """A worker's dataset state after batch ``seq`` (see Scheduler.keep_shard_state)."""
        self.scheduler.keep_shard_state(worker.id, seq, blob)

    def handed_out(self) -> int:
        """Results handed out (or raised) this epoch (see state.Positioned)."""
        return self.scheduler.handed_out()

    def shard_positions(self) -> tuple[list[int], int, dict[int, Any]]:
        """Iterable datasets: the scheduler's replay of the round robin, and the shard
        states workers reported after their last handed-out batch (see state.Positioned)."""
        counts, next_worker = self.scheduler.handed_out_per_worker()
        states = {wid: pickle.loads(blob) for wid, blob in self.scheduler.shard_states_handed_out().items()}
        return counts, next_worker, states

    def shards_exhausted(self) -> bool:
        """Iterable datasets: every worker ran out and all it produced was handed out."""
        return self.scheduler.exhausted()

    # --- errors -------------------------------------------------------------------------

    def _death_error(self, worker: _WorkerHandle, note: str = "") -> WorkerDiedError:
        batch, indices, started = self._death_point(worker)
        return self._pool.death_error(worker, batch, indices, note, started)

    def _timeout_error(self, timeout: float) -> LoaderTimeoutError:
        # Results that arrived unread while waiting on one worker: those workers are not busy.
        for worker in self._pool.readable_now():
            self._receive(worker)
        self._collect()
        waiting = min(self._tasks) if self._tasks else self._rcvd_seq
        task = self._tasks.get(waiting)
        busy = [t.worker for t in self._tasks.values()]
        return self._pool.timeout_error(timeout, waiting, task and task.indices, busy)

    # --- epochs and shutdown ------------------------------------------------------------

    def _end_epoch(self) -> None:
        self.epoch_done = True
        if not self._loader.persistent_workers:
            self.close()

    def reset(self, start: Callable[[Any], _state.EpochPlan], copy: bool) -> None:
        """Persistent workers: the next epoch runs on the same workers and ring. Like
        ``__init__`` it moves nothing: the epoch begins at the next ``next()``."""
        self._start_epoch = start
        self._handout.copy = copy
        self._len_limit = iterable_len_limit(self._runtime)
        self.plan = None
        self.epoch_done = False
        self._idle = True

    def close(self, graceful: bool = True) -> None:
        """Stop and reap every worker, return unused slots; idempotent. ``graceful``:
        give workers pool.JOIN_TIMEOUT_S to finish their batch and exit, else kill them."""
        if self.closed:
            return
        self.closed = True
        self._idle = True
        if os.getpid() != self._pid:
            return  # a forked copy of the consumer: the workers are not ours to stop
        self._asleep.clear()
        self._pool.stop(graceful)
        maker, self._ring_maker = self._ring_maker, None
        if maker is not None:
            maker.wait()  # its ring (if made) stays the loader's current one, for later epochs
        # The workers are gone: slots they were given but we never handed out are free.
        for task in self._tasks.values():
            _leases.give_back(task.ring, task.slot)
        for _, task, _ in self._results.values():
            _leases.give_back(task.ring, task.slot)
        self._tasks.clear()
        self._results.clear()  # (the scheduler's)
        self._pool.release()
        _live_iterators.discard(self)

    def _shutdown_workers(self) -> None:
        """torch's name for :meth:`close` (code written for torch's iterator calls it)."""
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
