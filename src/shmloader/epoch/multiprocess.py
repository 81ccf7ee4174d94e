"""The iterator of an epoch loaded by worker processes: a coordinator that owns nothing but
the order of calls between the pieces it composes.

The consumer side of the data path: claim a FREE slot and send a task
(:class:`~shmloader.epoch.inflight.InFlight`, :class:`~shmloader.epoch.rings.RingKeeper`,
:class:`~shmloader.epoch.courier.Courier`), wait for the result
(:class:`~shmloader.epoch.collector.Collector`), and when a slot comes back READY hand out
views of it (:mod:`shmloader.batch.handout`); a slot returns to FREE only when the last view
of it dies. Beside that path: the workers' start (:class:`~shmloader.epoch.crew.Crew`), the
restart policy (:class:`~shmloader.epoch.restarts.Restarts`), the next epoch's prefetch
(:class:`~shmloader.epoch.ahead.Ahead`) and the tuner (:class:`~shmloader.epoch.tuning.Tuning`).

Nothing here sees the loader: the iterator runs by the epoch's frozen
:class:`~shmloader.settings.EpochSettings`, reaches the loader's runtime through
:class:`~shmloader.epoch.link.LoaderLink`, and reports back through the
:class:`~shmloader.settings.LoaderReports` the loader passed in; the pieces get explicit
values and objects.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import sys
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shmloader.batch.handout import Handout
from shmloader.epoch.ahead import Ahead
from shmloader.epoch.collector import Collector
from shmloader.epoch.courier import Courier
from shmloader.epoch.crew import Crew
from shmloader.epoch.inflight import InFlight
from shmloader.epoch.link import LoaderLink
from shmloader.epoch.restarts import Restarts
from shmloader.epoch.rings import RingKeeper
from shmloader.epoch.tuning import Tuning
from shmloader.errors import LoaderTimeoutError, RingLimitError, ShmSpaceError, WorkerDiedError
from shmloader.memory import sizing
from shmloader.sampling.position import EpochPlan
from shmloader.settings import EpochSettings, LoaderReports
from shmloader.system import forks
from shmloader.system.startmethod import worker_context
from shmloader.transport import wire
from shmloader.tuning.counts import WorkerCounts
from shmloader.workers.pool import WorkerHandle, WorkerPool, WorkerProcess

if TYPE_CHECKING:
    from shmloader.runtime import LoaderRuntime

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
        for w in it.workers:
            children.discard(w.proc)


forks.register(__name__, after_in_child=_forget_workers_after_fork)


def _weak(method: Callable[..., Any]) -> Callable[[], None]:
    """``method()`` while its object lives, without keeping it alive (the pieces call back
    into the iterator: a strong reference would make a cycle, and ``del it`` would stop
    the workers only at the next cyclic gc)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _start_method(context: Any) -> str:
    """The start method of a multiprocessing context (or of the default one: None)."""
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method()
    return method or "fork"


class MultiProcessIter:
    """Iterator over one epoch with worker processes (reused across epochs when
    persistent); a :class:`~shmloader.epoch.state.Positioned` for state_dict()."""

    def __init__(
        self,
        runtime: LoaderRuntime,
        settings: EpochSettings,
        start: Callable[[Any], EpochPlan],
        copy: bool,
        reports: LoaderReports,
    ) -> None:
        """An iterator working with a loader's ``runtime``, its first epoch run by
        ``settings``, telling the loader what it must know through ``reports``. Nothing
        starts here: the first next() calls ``start`` (state.epoch_starter) to begin the
        epoch and starts the workers, so iter() alone moves nothing."""
        self._runtime = runtime
        link = self._link = LoaderLink(runtime, settings, reports)
        self._handout = Handout(settings.output, runtime, copy)
        self._start_epoch = start
        self._pid = os.getpid()
        self.closed = False
        self._exited: list[WorkerProcess] = []  # the workers, once close() stopped them
        self.plan: EpochPlan | None = None
        self.epoch_done = False
        self._idle = True  # until the first next() of an epoch and after close(): __next__'s one check
        self._launched = False  # the workers were started (once per iterator)
        self._len_limit = link.len_limit()  # torch's check on iterable datasets' lengths
        self._draws: Any = None  # the running epoch's draws (torch's RNG)
        self._watch_at = sys.maxsize  # batches handed out at which _watch() is due
        self._yielded = 0
        self._timing = runtime.timing  # where the time goes, the loader's for its life
        self._compose(runtime, settings)

    def _compose(self, runtime: LoaderRuntime, s: EpochSettings) -> None:
        """Make the pieces, each given what it works with (a persistent iterator's pieces
        keep the first epoch's counts, timeout and start method, as torch's)."""
        link, stats = self._link, runtime.stats
        prefetch = s.prefetch_factor
        if prefetch is None:  # (a TypeError at iter(), as torch's iterator raises one)
            raise TypeError(
                f"prefetch_factor is None with num_workers={s.num_workers}: a loader made with "
                "num_workers=0 has no prefetch_factor; assign loader.prefetch_factor too (2 is "
                "torch's default) when assigning num_workers."
            )
        self._persistent = s.persistent_workers
        self._pool = pool = WorkerPool()
        courier = self._courier = Courier(pool)
        rings = self._rings = RingKeeper(runtime.leases, courier, s.fixed_slot_bytes)
        # The worker count and prefetch depth of this iterator's epochs, stored here only:
        # a tuner raises them, the pieces below read them.
        counts = self._counts = WorkerCounts(s.num_workers, prefetch)
        self._timing.counting(counts)
        inflight = self._inflight = InFlight(pool, courier, rings, counts, s.in_order, s.iterable)
        self._memory = memory = runtime.memory
        self._share_dataset = s.share_dataset
        context = worker_context(s.multiprocessing_context)
        self._forks = _start_method(context) == "fork"
        crew = self._crew = Crew(pool, context, rings, memory)  # (its settings are set as each epoch begins)
        restarts = Restarts(
            s.max_worker_restarts, s.iterable, s.dataset, stats, inflight, crew, _weak(self._abort)
        )
        collector = self._collector = Collector(
            pool, courier, inflight, restarts, self._timing, stats["dataset"], s.timeout, s.in_order
        )
        ahead_on = s.persistent_workers and s.prefetch_next_epoch and not s.iterable
        self._ahead = Ahead(ahead_on, inflight, rings, collector, link.plan_next, stats)
        tuner = runtime.tuner
        self._tuning: Tuning | None = None
        if tuner is not None:
            self._tuning = Tuning(
                tuner,
                counts,
                self._timing,
                crew,
                inflight,
                rings,
                s.shm_backend,
                link.publish_counts,
                _weak(self.close),
            )

    # --- read-only views, for tests and tools ----------------------------------------------

    @property
    def workers(self) -> tuple[WorkerHandle, ...]:
        """The running workers, by id (each with ``proc``, its process, and ``conn``, the
        consumer's end of its socket); empty before the first ``next()`` and after close."""
        return tuple(self._pool.workers)

    @property
    def _workers(self) -> list[Any]:
        """torch's (private) name for the iterator's worker processes: a
        :class:`~shmloader.workers.pool.WorkerProcess` each (``pid``, ``exitcode``,
        ``is_alive()``, ``join()``, ``terminate()``, ``kill()``), which stays usable after
        the iterator closed (code written for torch's iterator joins them then). torch's
        iterator starts its workers at ``iter()``: read before the first ``next()``, this
        begins the epoch now, as that ``next()`` would."""
        if self.closed:
            return list(self._exited)
        self.start()
        return [w.view for w in self._pool.workers]

    def worker_pids(self) -> list[int]:
        """The process ids of the running workers, by id."""
        return [w.proc.pid for w in self._pool.workers]

    @property
    def prefetching_next_epoch(self) -> bool:
        """Whether the next epoch's first tasks are out (``prefetch_next_epoch``)."""
        return self._inflight.next_plan is not None

    @property
    def readers(self) -> dict[bytes, Any]:
        """The cached batch readers, one per batch structure (clearing it makes the next
        batch's layout be decoded again)."""
        return self._handout.readers

    # --- an epoch's start ----------------------------------------------------------------

    def start(self) -> None:
        """Begin the epoch now, as the first ``next()`` does: the loader's epoch begins and
        the workers start (or, persistent, switch to it once the previous epoch's tasks
        are back). Idempotent; nothing on a closed iterator."""
        if not self._idle or self.closed:
            return
        if not self._launched:
            self._launch()
        else:
            self._switch_epoch()
        self._idle = False

    def _launch(self) -> None:
        """The first epoch: begin it and start the workers, each given its first task as
        soon as it is forked (it works while the next one is forked)."""
        plan = self._start_epoch(self)
        settings = self._link.settings
        self._timing.make_room(settings.num_workers)
        if settings.prefetch_factor is not None:
            # Counts raised since the loader was made: the ring holds what they keep in
            # flight, as torch's iterator keeps num_workers * prefetch_factor tasks out.
            needed = sizing.default_num_slots(settings.num_workers, settings.prefetch_factor)
            self._rings.need_slots(needed, settings.num_workers)
        self._begin_epoch(plan)  # (first: a grown ring may shrink)
        self._rings.take_current()
        self._launched = True
        _live_iterators.add(self)
        if self._share_dataset:
            self._memory.share_dataset()  # before the first fork: workers map the shared copy
        self._memory.before_fork(self._forks)
        try:
            self._rings.make_first(self._crew.slot_bytes_ahead())
            self._crew.start(self._counts.workers, plan, started=self._inflight.fill)
        except BaseException:
            self.close()
            raise

    def _switch_epoch(self) -> None:
        """A later epoch on the running workers: take the tasks sent early when they are
        its own; else wait for what is still owed and start it afresh."""
        plan = None
        if self._inflight.next_plan is not None:
            plan = self._start_epoch(self)
            if self._ahead.take(plan):
                self._epoch_began(plan)
                self._inflight.fill()
                return
        if not self._inflight.source_done:  # (the last epoch was left before its end)
            self._send_as_torch_had()
        # Results still owed by the workers must come back before their slots are reused.
        while self._inflight.owes():
            self._collector.wait()
        self._next_epoch_on_workers(plan if plan is not None else self._start_epoch(self))

    def _send_as_torch_had(self) -> None:
        """The last epoch was left before its end (a ``break``, or one batch looked at):
        send the tasks torch's iterator would have sent by now, so each worker loads, and
        moves its RNGs for, the batches torch's loads before its next epoch (every task
        sent: ``prefetch_factor`` per worker ahead of the batches handed out); the
        results are dropped."""
        rings, inflight = self._rings, self._inflight
        try:
            if rings.wanted:
                # The first batches came outside the ring (one task per worker): the ring
                # that lets each worker have its prefetch_factor, once they are back.
                while inflight.owes():
                    self._collector.wait()
                rings.make_wanted()
            inflight.fill()
        except (RingLimitError, ShmSpaceError):
            self.close()  # as in __next__: the epoch cannot start, leave nothing running
            raise

    def _next_epoch_on_workers(self, plan: EpochPlan) -> None:
        """Start ``plan``'s epoch on the running workers and ring (nothing in flight)."""
        self._inflight.free_results()
        self._begin_epoch(plan)
        # A worker that died since the last epoch (idle: nothing was in flight) is raised
        # now, or replaced before it is given anything (the new one has this epoch's seed).
        self._collector.check_exits()
        for w in self._pool.workers:
            self._courier.epoch(w, plan)
        try:
            self._inflight.fill()
        except (RingLimitError, ShmSpaceError):
            self.close()  # as in __next__: the epoch cannot start, leave nothing running
            raise

    def _begin_epoch(self, plan: EpochPlan) -> None:
        """``plan``'s epoch begins with nothing in flight: its tasks from the first."""
        source = self._link.index_sequence(plan)
        self._rings.new_epoch(self._launched)
        self._inflight.begin(plan, source)
        self._epoch_began(plan)

    def _epoch_began(self, plan: EpochPlan) -> None:
        """The bookkeeping of every epoch's start, however its tasks went out."""
        self.plan = plan
        self.epoch_done = False
        self._yielded = 0
        draws = self._draws = plan.draws
        if draws is not None:
            draws.pay_due(0)
        # One test per batch for both: torch's length warning and the shuffle's last draw.
        self._watch_at = min(self._len_limit + 1, draws.tail_due if draws is not None else sys.maxsize)
        settings = self._link.settings
        self._crew.epoch_began(settings, self._runtime.recipe(settings))
        if self._tuning is not None:
            self._tuning.epoch_began()  # (the tuner raises this iterator's counts from now on)

    # --- the hand-out ----------------------------------------------------------------------

    def __iter__(self) -> MultiProcessIter:
        return self

    def __len__(self) -> int:
        return self._link.length()

    def __next__(self) -> Any:
        timing = self._timing
        entered = time.perf_counter()
        ring = self._rings.ring  # batches loaded in the ring and not handed out yet (one C call)
        timing.entered(
            entered, ring.states.count_ready() if ring is not None else self._inflight.results_waiting()
        )
        try:
            batch = self._next_batch()
        except BaseException:  # the epoch's end, or an error: no step of the loop follows
            timing.paused()
            raise
        now = time.perf_counter()
        timing.returned(entered, now)
        tuning = self._tuning
        if tuning is not None and now >= tuning.tuner.due and not self._idle and not self.closed:
            tuning.tune(now)  # a worker more, or more prefetch
        if now >= self._memory.due:
            self._memory.check(now)  # the workers' memory, on a schedule that thins out
        return batch

    def _next_batch(self) -> Any:
        try:
            item = self._next_item()
        except (WorkerDiedError, LoaderTimeoutError):
            # Dead or hung workers: do not wait for a busy one to finish its batch (a
            # timeout would otherwise surface only after pool.JOIN_TIMEOUT_S more).
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
        if yielded >= self._watch_at:
            self._watch(yielded)
        return batch

    def _watch(self, yielded: int) -> None:
        """What is due after ``yielded`` batches: torch's warning when an iterable dataset
        yields more than its length said; the shuffle's last draw, made where torch's
        sampler runs out (its iterator asks it ``prefetch_factor * num_workers`` batches
        ahead)."""
        if yielded > self._len_limit:
            self._link.warn_len_exceeded(yielded)
        if self._draws is not None:
            self._draws.pay_due(yielded)

    def _next_item(self) -> tuple[Any, ...] | None:
        """The next result to hand out (waiting for it), tasks sent in its place; None at
        the epoch's end."""
        if self._idle:  # the epoch's first next() (or a closed iterator)
            if self.closed:
                raise StopIteration
            self.start()
        rings, inflight = self._rings, self._inflight
        if rings.wanted and rings.wanted_ready():
            rings.make_wanted()
            # Tasks go out at once (with in_order=False a slow first batch must not hold
            # the other workers: torch's order).
            inflight.fill()
        # (A ring still being made: results already here go out first; fill() waits for
        # the ring when nothing else is left to hand out.)
        item = inflight.pop() or self._collector.next_result()
        if item is not None and not rings.wanted:
            # (A ring to make waits for the next call: this batch goes out first.)
            inflight.fill()
            if inflight.source_done and not self.closed:
                self._ahead.more()  # the next epoch's first tasks, meanwhile
        elif item is None and self._resumed_at_end():
            # A loaded position at its epoch's end: the next epoch, in full, instead.
            self._next_epoch_on_workers(self._start_epoch(self))
            item = self._collector.next_result()
        return item

    def _resumed_at_end(self) -> bool:
        """Whether the epoch that ended was a loaded position with nothing left in it."""
        plan = self.plan
        return plan is not None and plan.resumed and self._inflight.yielded_nothing()

    # --- position, for DataLoader.state_dict() ---------------------------------------------

    def handed_out(self) -> int:
        """Results handed out (or raised) this epoch (see state.Positioned)."""
        return self._inflight.handed_out()

    def shard_positions(self) -> tuple[list[int], int, dict[int, Any]]:
        """Iterable datasets: the scheduler's replay of the round robin, and the shard
        states workers reported after their last handed-out batch (see state.Positioned)."""
        inflight = self._inflight
        counts, next_worker = inflight.handed_out_per_worker()
        states = {wid: pickle.loads(blob) for wid, blob in inflight.shard_states_handed_out().items()}
        return counts, next_worker, states

    def shards_exhausted(self) -> bool:
        """Iterable datasets: every worker ran out and all it produced was handed out."""
        return self._inflight.exhausted()

    # --- epochs and shutdown ---------------------------------------------------------------

    def _end_epoch(self) -> None:
        self.epoch_done = True
        if self._draws is not None:
            self._draws.pay()  # (an epoch shorter than the whole order's: a rank's share)
        if self._persistent:
            # The workers live on: their memory at an epoch's end (where copy-on-read did
            # the most) says what the next epoch starts from. Workers that stop now are
            # not read: their memory goes with them, the scheduled checks saw them run,
            # and the reads (milliseconds a worker) would hold the last next().
            self._memory.epoch_ended(time.perf_counter())
        else:
            self.close()

    def reset(self, start: Callable[[Any], EpochPlan], copy: bool, settings: EpochSettings) -> None:
        """Persistent workers: the next epoch runs on the same workers and ring, by
        ``settings`` (read by its ``iter()``). Like ``__init__`` it moves nothing: the
        epoch begins at the next ``next()``."""
        self._start_epoch = start
        self._link.settings = settings
        self._handout.renew(settings.output, copy)
        self._len_limit = self._link.len_limit()
        self.plan = None
        self.epoch_done = False
        self._idle = True

    def _abort(self) -> None:
        """A piece could not go on (no worker could start in a lost one's place)."""
        self.close(graceful=False)

    def close(self, graceful: bool = True) -> None:
        """Stop and reap every worker, return unused slots; idempotent. ``graceful``: give
        workers pool.JOIN_TIMEOUT_S to finish their batch and exit, else kill them."""
        if self.closed:
            return
        self.closed = True
        self._idle = True
        if os.getpid() != self._pid:
            return  # a forked copy of the consumer: the workers are not ours to stop
        self._courier.forget_sleepers()
        self._crew.stopping()
        self._pool.stop(graceful)
        self._rings.stop()
        self._inflight.free_all()  # the workers are gone: what they were given is free
        self._exited = [w.view for w in self._pool.workers]
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
