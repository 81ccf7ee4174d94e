"""Waiting for results and reading them: the workers' result queues, their sockets, their
process sentinels, and what a worker's exit or silence means.

A result comes back through the worker's result queue in shared memory; the socket carries
the rare messages (errors, shard states, stats, batches in one-off segments) and the
wake-up a worker writes when the consumer sleeps there. Waiting for one worker's result
(the batch due, in order; or the only worker), the consumer of a quiet machine first
yields its CPU for a window that adapts to the waits seen (transport/yielding.py; the
consumer measures the machine's load, system/cpuload.py, and tells its workers, which
yield the same way). Then it sleeps on that worker's result queue (a futex,
:data:`~shmloader.system.slots.HAS_FUTEX`): the worker's result wakes it with no byte
written and no time slice lost, however busy the machine; past
:data:`~shmloader.transport.channel.SLEEP_WINDOW_NS`, or where there is no futex, it
blocks on the sockets and sentinels. A worker that exits is
replaced or its death raised at once (:class:`~shmloader.epoch.restarts.Restarts`); no
result within ``timeout`` replaces the worker that owes the batch waited for, or raises.
"""

from __future__ import annotations

import os
import pickle
import select
import time
from typing import Any

from shmloader.epoch.courier import Courier
from shmloader.epoch.inflight import InFlight
from shmloader.epoch.restarts import Restarts
from shmloader.errors import LoaderTimeoutError, WorkerDiedError
from shmloader.memory.ring import attach_fd
from shmloader.system import slots as _slots
from shmloader.system.cpuload import OthersLoad
from shmloader.system.process import yield_cpu
from shmloader.transport import wire
from shmloader.transport.channel import (
    RESULT_SPIN_NS,
    SLEEP_FUTEX,
    SLEEP_WINDOW_NS,
)
from shmloader.transport.yielding import RESULT_YIELD_MAX_NS, YieldWindow
from shmloader.tuning.timing import Timing
from shmloader.workers import pool as _pool
from shmloader.workers.pool import WorkerHandle, WorkerPool


class Collector:
    """Takes the results of one pool's workers into :class:`InFlight`.

    ``timeout``: seconds a wait may last (0: forever); ``in_order``: wait on the worker
    whose batch is due only; ``dataset_counts``: where the workers' dataset counters add up
    (``stats()["dataset"]``)."""

    def __init__(
        self,
        pool: WorkerPool,
        courier: Courier,
        inflight: InFlight,
        restarts: Restarts,
        timing: Timing,
        dataset_counts: dict[str, Any],
        timeout: float,
        in_order: bool,
    ) -> None:
        self._pool = pool
        self._courier = courier
        self._inflight = inflight
        self._restarts = restarts
        self._timing = timing
        self._dataset_counts = dataset_counts
        self._timeout = timeout
        self._in_order = in_order
        self._futex = _slots.HAS_FUTEX  # sleep on a result queue's futex before blocking
        self._load = OthersLoad()  # whether other processes keep the CPUs busy
        self._yielding = YieldWindow(RESULT_YIELD_MAX_NS, not self._load.busy)  # how long to yield first
        self._retired: set[WorkerHandle] = set()  # worker_init_fn failed: their exit is expected

    # --- the next result -------------------------------------------------------------------

    def next_result(self) -> tuple[Any, ...] | None:
        """The next result to hand out, waiting for it; None at the end of the epoch."""
        inflight = self._inflight
        pop = inflight.pop
        while True:
            item = pop()
            if item is not None:
                return item
            if not inflight.owes_this_epoch():  # (not counting the next epoch's)
                inflight.fill()
                if not inflight.owes_this_epoch():
                    # What the workers wrote to their sockets and nothing read yet (a
                    # result taken from its queue needs no poll) is read now, as the epoch
                    # ends: a late message is handled, bytes that are no frame raise.
                    self.read_sockets()
                    # A worker that died since the last wait (idle, its work done) is raised
                    # or replaced now, as the epoch ends: not left for the next epoch to find.
                    self.check_exits()
                    return None
            self.wait()

    def wait(self) -> None:
        """Take the results queued by the workers; when there are none, wake the workers
        owed a wake-up and block until a result, a message or an exit, and handle it."""
        if self._collect():
            return
        if self._courier.owes_wake_ups:
            self._courier.wake_sleepers()  # before this process blocks: it waits for their work
        timeout = self._timeout
        timeout_at = deadline = time.monotonic() + timeout if timeout > 0 else None
        start_by = self._pool.start_deadline()  # (None once every forked worker started)
        if start_by is not None and (deadline is None or start_by < deadline):
            deadline = start_by
        due = self._inflight.due() if self._in_order else None
        now = time.perf_counter_ns()
        if self._load.due(now):
            self._measure_load(now)
        window = self._yielding.window()
        if window and self._yield_for(window):
            return
        slept = time.perf_counter_ns()
        if self._futex and self._sleep_for(due.worker if due is not None else None, deadline):
            self._yielding.slept(time.perf_counter_ns() - slept)
            return
        events = self._pool.wait(due.worker if due is not None else None, deadline)
        # Yield next time as long as it would have caught this result (a data-bound loop,
        # whose waits last milliseconds, soon sleeps at once again).
        self._yielding.slept(time.perf_counter_ns() - slept)
        if events is None:
            if start_by is not None and self._replace_stuck():
                return
            if timeout_at is not None and time.monotonic() >= timeout_at:
                self._deadline_passed(due, timeout)
            return
        dead = []
        owners = self._pool.fd_owner
        for fd, mask in events:
            worker, is_sentinel = owners.get(fd, (None, False))
            if worker is None:
                continue
            if is_sentinel:
                dead.append(worker)
            elif mask != select.POLLOUT:
                self._receive(worker)
        self._collect()
        for worker in dead:
            self._exited(worker)

    def _deadline_passed(self, due: Any, timeout: float) -> None:
        """No result within ``timeout``: return where one came after all (a result queued
        right at the deadline counts; others, not due, do not), or a worker died, or the
        hung one was replaced; raise the timeout error otherwise."""
        if self._collect() and (due is None or not self._inflight.owes_batch(due.seq)):
            return
        if self.check_exits():  # (a death at the deadline: no worker is "busy")
            return
        if self._restarts.limit and self._replace_hung(timeout):
            return
        raise self.timeout_error(timeout)

    def _sleep_for(self, worker: WorkerHandle | None, deadline: float | None) -> bool:
        """Sleep on the result queue of ``worker`` (the one whose batch is due; None: the
        only worker, if there is one) until it publishes a result or writes a frame, for
        up to SLEEP_WINDOW_NS or ``deadline``; True when a result came. False (nothing
        came, a frame came, or bytes wait to be written to some worker) leaves the rest to
        the sockets' and sentinels' poll, which sees what the futex does not."""
        pool = self._pool
        if worker is None:
            workers = pool.workers
            if len(workers) != 1:
                return False
            worker = workers[0]
        if pool.sending or worker.fd not in pool.fd_owner:
            return False
        channel = worker.channel
        if channel.arm_results(SLEEP_FUTEX):
            # A frame written before the arm rang nobody: its count says it is there.
            if channel.frames_written() > worker.frames_read:
                channel.disarm_results()
                return self._collect()
            window = SLEEP_WINDOW_NS
            if deadline is not None:
                window = min(window, max(0, int((deadline - time.monotonic()) * 1e9)))
            channel.sleep_results(window, RESULT_SPIN_NS)
        return self._collect()

    def _yield_for(self, window_ns: int) -> bool:
        """Give this CPU to whatever else is runnable on it (often the worker loading the
        batch due), looking for results between yields, for up to ``window_ns``; True when
        a result came. Cheaper than sleeping when the result is that close: no wake-up for
        the worker to make, no sleep and wake of this process."""
        clock = time.perf_counter_ns
        end = clock() + window_ns
        while True:
            yield_cpu()  # (releases the GIL: the consumer's other threads run too)
            if self._collect():
                return True
            if clock() >= end:
                return False

    def _measure_load(self, now_ns: int) -> None:
        """Measure whether other processes keep the CPUs busy, and allow yielding (this
        process's and its workers') only while they do not."""
        workers = self._pool.workers
        allowed = not self._load.measure(now_ns, [w.proc.pid for w in workers])
        self._yielding.allowed = allowed
        for worker in workers:
            worker.channel.allow_yielding(allowed)

    # --- reading -----------------------------------------------------------------------------

    def _collect(self) -> bool:
        """Take the results every worker published in its result queue; True if any."""
        got = False
        for worker in self._pool.workers:
            results = worker.channel.take_results()
            if results:
                got = True
                for _kind, _slot, seq, stamp, fetch_ns, collate_ns, idle_ns in results:
                    while stamp > worker.frames_read:
                        # Frames the worker sent before this result come first (channel.py):
                        # they are all in the socket already (sent before the result was).
                        before = worker.frames_read
                        if not self._receive(worker) or worker.frames_read == before:
                            break
                    self._ready(worker, seq, fetch_ns, collate_ns, idle_ns)
        return got

    def _ready(self, worker: WorkerHandle, seq: int, fetch_ns: int, collate_ns: int, idle_ns: int) -> None:
        """Batch ``seq`` is READY in its slot (from the queue or a RES_READY frame)."""
        if self._inflight.ready(worker, seq) is not None:
            self._timing.add_worker(worker.id, fetch_ns, collate_ns, idle_ns)

    def _receive(self, worker: WorkerHandle) -> bool:
        """Read what ``worker`` sent (one read: its socket is non-blocking) and handle every
        message completed; False at EOF (the worker is gone)."""
        try:
            messages = worker.reader.read()
        except OSError:
            messages = None
        if messages is None:
            # EOF can be seen twice (its poll event, then _drain when the sentinel fires
            # in the same round): forget_fd is idempotent.
            self._pool.forget_fd(worker.fd)
            return False
        worker.frames_read += len(messages)
        for msg in messages:
            self._handle(worker, msg)
        return True

    def _handle(self, worker: WorkerHandle, msg: bytes) -> None:
        """Act on one message from ``worker``."""
        kind, _slot, seq = wire.unpack(msg)
        if kind == wire.RES_READY:
            self._ready(worker, seq, *wire.ready_clocks(msg))
        elif kind >= wire.RES_INIT_ERROR:  # rare kinds, behind one comparison
            self._handle_rare(worker, kind, seq, wire.body(msg))
        else:
            self._handle_result(worker, kind, seq, wire.body(msg))

    def _handle_rare(self, worker: WorkerHandle, kind: int, seq: int, body: bytes) -> None:
        """A message that is not a batch: a wake-up, a shard's state, stats, or the failure
        of worker_init_fn (the worker exits; its exit is expected)."""
        if kind == wire.RES_WAKE:
            return  # (the result is in the worker's queue: _collect takes it)
        if kind == wire.RES_SHARD_STATE:
            self._inflight.keep_shard_state(worker, seq, body)
        elif kind == wire.RES_STATS:
            counts = self._dataset_counts
            for name, gained in pickle.loads(body).items():
                counts[name] = counts.get(name, 0) + gained
        else:
            self._retired.add(worker)
            self._inflight.retire(worker, wire.RES_INIT_ERROR, body)

    def _handle_result(self, worker: WorkerHandle, kind: int, seq: int, payload: bytes) -> None:
        """A batch outside its slot (a one-off segment, pickled), an error, or an iterable
        worker's end."""
        task = self._inflight.answered(worker, seq)
        if task is None:  # a result from before a reset; already discarded
            if kind == wire.RES_SEGMENT:
                os.close(worker.reader.take_fd())
            return
        segment = None
        if kind == wire.RES_SEGMENT:
            # The batch's own segment, mapped here (not pre-faulted: only what the consumer
            # reads comes in); its descriptor is closed at once.
            segment = attach_fd(worker.reader.take_fd(), 1, wire.needed_bytes(payload), populate=False)
        self._inflight.keep(worker, kind, task, payload, segment)  # (an end: tasks sent from now on skip it)

    def read_sockets(self) -> None:
        """Read every worker's socket that has input now, without waiting."""
        for worker in self._pool.readable_now():
            self._receive(worker)

    def _drain(self, worker: WorkerHandle) -> None:
        """Handle everything ``worker`` sent before it exited."""
        while self._pool.has_input(worker) and self._receive(worker):
            pass
        while results := worker.channel.take_results():  # (and what it queued)
            for _kind, _slot, seq, _stamp, fetch_ns, collate_ns, idle_ns in results:
                self._ready(worker, seq, fetch_ns, collate_ns, idle_ns)

    # --- exits and silence ---------------------------------------------------------------------

    def check_exits(self) -> bool:
        """Handle the workers that exited while the consumer was not waiting on them (see
        :meth:`_exited`); True when there was one."""
        dead = self._pool.exited()
        for worker in dead:
            self._exited(worker)
        return bool(dead)

    def _exited(self, worker: WorkerHandle) -> None:
        """``worker``'s process exited. What it sent before is handled first; then it is
        replaced (``max_worker_restarts``) or its death raised (WorkerDiedError), whatever
        it was doing: loading a batch, or idle (a dead worker left in the pool would be
        given tasks and waited for forever). Only a worker whose worker_init_fn failed
        exits as expected (it said so first)."""
        self._drain(worker)
        if worker in self._retired:
            self._pool.forget(worker)
        else:
            self._lost(worker)

    def _lost(self, worker: WorkerHandle, timed_out: float | None = None) -> None:
        """``worker`` died (or hung past ``timed_out`` s): replace it, or raise."""
        refusal = self._restarts.refusal(worker)
        if refusal is None:
            self._restarts.replace(worker, timed_out)
        elif timed_out is not None:
            raise self.timeout_error(timed_out)
        else:
            raise self.death_error(worker, refusal)

    def _replace_stuck(self) -> bool:
        """Replace the forked workers stuck inside their fork (pool.FORK_START_DEADLINE_S);
        True when there was one."""
        stuck = self._pool.stuck_at_start()
        for worker in stuck:
            self._restarts.replace_stuck(worker, _pool.FORK_START_DEADLINE_S)
        return bool(stuck)

    def _replace_hung(self, timeout: float) -> bool:
        """No result within ``timeout`` s: replace the worker that owes the batch waited for
        (in order: the due one; else the oldest one, unless some result came meanwhile);
        False where there is none (the caller raises the timeout error)."""
        inflight = self._inflight
        owed = inflight.owed_count()
        for w in self._pool.readable_now():  # results that arrived unread meanwhile
            self._receive(w)
        if self._in_order:
            task = inflight.due()
        else:
            task = inflight.oldest_owed() if inflight.owed_count() == owed else None
        if task is None:
            return bool(inflight.results_waiting()) or not inflight.owes()  # it came: no worker hung
        self._lost(task.worker, timed_out=timeout)
        return True

    def death_error(self, worker: WorkerHandle, note: str = "") -> WorkerDiedError:
        """The error for ``worker``'s unexpected exit, naming the batch it was loading."""
        batch, indices, started = self._inflight.death_point(worker)
        return self._pool.death_error(worker, batch, indices, note, started)

    def timeout_error(self, timeout: float) -> LoaderTimeoutError:
        """The error for ``timeout`` s without the batch waited for, naming the busy workers."""
        # Results that arrived unread while waiting on one worker: those workers are not busy.
        for worker in self._pool.readable_now():
            self._receive(worker)
        self._collect()
        waiting, indices = self._inflight.waited_for()
        return self._pool.timeout_error(timeout, waiting, indices, self._inflight.busy_workers())
