"""The consumer's side of the per-batch exchange with the workers: give tasks, wait, take
results. A mixin of :class:`~shmloader.epoch.multiprocess.MultiProcessIter` (it works on the
iterator's pool, tasks, scheduler and timing).

A task goes into the worker's task queue in shared memory (:mod:`shmloader.transport.channel`), a
result comes back through its result queue: a busy consumer and busy workers exchange
batches without a system call. Only a side that sleeps is written a wake-up, on the
socket that also carries the rare messages (errors, shard states, stats, batches in
one-off segments: :meth:`Exchange._handle`). A worker that fell asleep is woken once for
all the tasks one dispatch queued for it (see :meth:`Exchange._wake_workers`): on a small
machine a wake-up costs the consumer as much CPU as the rest of a small batch's path.
"""

from __future__ import annotations

import os
import pickle
import select
import time
from typing import Any

from shmloader.memory import leases as _leases
from shmloader.memory.ring import Ring, attach_fd
from shmloader.transport import wire
from shmloader.transport.channel import MAX_TASK_PAYLOAD, YIELD_MAX_NS, next_yield_window
from shmloader.workers.pool import WorkerHandle


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


class Exchange:
    """The exchange half of the epoch iterator (see the module's docstring)."""

    # How long (ns) the consumer yields its CPU before it blocks for a result
    # (:meth:`_wait`), adapted to the waits seen (channel.next_yield_window).
    _spin_ns = YIELD_MAX_NS

    # (Attributes and methods of MultiProcessIter, used here.)
    _loader: Any
    _runtime: Any  # the loader's LoaderRuntime (shmloader.runtime)
    _pool: Any
    _tasks: dict
    _workers: list
    _timing: Any
    _asleep: list
    _results: dict
    _ring: Any
    _source_done: bool
    scheduler: Any
    _rcvd_seq: int
    _restart: Any
    _restart_hung: Any
    _retired: set
    _timeout_error: Any
    _shard_state: Any
    _want_ring: Any

    def _send_task(self, worker: WorkerHandle, kind: int, slot: int, seq: int, payload: bytes) -> None:
        """Give ``worker`` a task: in its task queue (no system call unless it sleeps),
        or by frame when the queue has no room or the payload is too large for it."""
        if len(payload) <= MAX_TASK_PAYLOAD:
            queued = worker.channel.push_task(kind, slot, seq, payload)
            if queued:
                if queued == 2 and worker not in self._asleep:  # woken by _wake_workers
                    self._asleep.append(worker)
                return
        self._pool.send(worker, wire.frame(wire.pack(kind, slot, seq, payload)))

    def _wake_workers(self) -> None:
        """Wake the workers that sleep with tasks queued (one wake-up, however many tasks
        were queued since they fell asleep)."""
        for worker in self._asleep:
            if worker.channel.take_sleeper():
                self._pool.wake(worker)
        self._asleep.clear()

    def _wait(self) -> None:
        """Take the results queued by the workers; when there are none, wake the workers
        owed a wake-up and block until a result, a message or an exit, and handle it
        (queued task bytes are written as the sockets take them, meanwhile). Nothing
        else wakes a worker while the consumer blocks: ``_asleep`` is empty here until
        the next ``_dispatch``."""
        if self._collect():
            return
        if self._asleep:
            self._wake_workers()  # before this process blocks: it waits for their work
        spin = self._spin_ns
        if spin and self._yield_for(spin):
            return
        timeout = self._loader.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        pool = self._pool
        due = self._tasks.get(self._rcvd_seq) if self._loader.in_order else None
        blocked = time.perf_counter_ns()
        events = pool.wait(due.worker if due is not None else None, deadline)
        # Yield next time as long as it would have caught this result (a data-bound
        # loop, whose waits last milliseconds, soon blocks at once again).
        self._spin_ns = next_yield_window(spin, time.perf_counter_ns() - blocked)
        if events is None:
            # (A result queued right at the deadline counts; others, not due, do not.)
            if self._collect() and (due is None or due.seq not in self._tasks):
                return
            if self._check_exits():  # (a death at the deadline: no worker is "busy")
                return
            if self._loader.max_worker_restarts and self._restart_hung(timeout):
                return
            raise self._timeout_error(timeout)
        dead = []
        owners = pool.fd_owner
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

    def _exited(self, worker: WorkerHandle) -> None:
        """``worker``'s process exited. What it sent before is handled first; then it is
        replaced (``max_worker_restarts``) or its death raised (WorkerDiedError), whatever
        it was doing: loading a batch, or idle (a dead worker left in the pool would be
        given the next epoch's tasks, or this one's, and waited for forever). Only a worker
        whose worker_init_fn failed exits as expected (it said so first)."""
        self._drain(worker)
        if worker in self._retired:
            self._pool.forget(worker)
        else:
            self._restart(worker)  # raises the death error where it may not

    def _check_exits(self) -> bool:
        """Handle (see :meth:`_exited`) the workers that exited while the consumer was not
        waiting on them; True when there was one."""
        dead = self._pool.exited()
        for worker in dead:
            self._exited(worker)
        return bool(dead)

    def _death_point(self, worker: WorkerHandle) -> tuple[int | None, Any, bool]:
        """Where ``worker`` was when it died: its oldest unanswered batch of this epoch
        (None: it owed none) with that batch's indices, and whether it had started on it.
        It had not when that task is still in its task queue: tasks are taken in order, so
        it was idle (between batches, or not started yet), with work queued for it."""
        pending = sorted(seq for seq, t in self._tasks.items() if t.worker is worker)
        if not pending:
            return None, None, True
        first = pending[0]
        return first, self._tasks[first].indices, first not in worker.channel.queued_seqs()

    def _yield_for(self, window_ns: int) -> bool:
        """Give this CPU to whatever else is runnable on it (often the worker loading the
        batch due), looking for results between yields, for up to ``window_ns``; True when
        a result came. Cheaper than blocking when the result is that close: no wake-up
        for the worker to write, no sleep and wake of this process (W4: ~25% more
        batches/s, the consumer's CPU per batch unchanged)."""
        clock = time.perf_counter_ns
        end = clock() + window_ns
        while True:
            os.sched_yield()  # (releases the GIL: the consumer's other threads run too)
            if self._collect():
                return True
            if clock() >= end:
                return False

    def _collect(self) -> bool:
        """Take the results every worker published in its result queue; True if any."""
        got = False
        for worker in self._workers:
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
        task = self._tasks.pop(seq, None)
        if task is None:
            return  # a result from before a reset; already discarded
        # (Scheduler.answered and .put, without their calls: this runs once per batch.)
        self.scheduler.outstanding[worker.id] -= 1
        self._timing.add_worker(worker.id, fetch_ns, collate_ns, idle_ns)
        self._results[seq] = (wire.RES_READY, task, b"")

    def _receive(self, worker: WorkerHandle) -> bool:
        """Read what ``worker`` sent (one read: its socket is non-blocking) and handle
        every message completed; False at EOF (the worker is gone)."""
        try:
            messages = worker.reader.read()
        except OSError:
            messages = None
        if messages is None:
            # EOF can be seen twice (its poll event, then _drain when the sentinel
            # fires in the same round): forget_fd is idempotent.
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
            return
        if kind >= wire.RES_INIT_ERROR:  # rare kinds, behind one comparison
            if kind == wire.RES_WAKE:
                return  # (the result is in the worker's queue: _collect takes it)
            if kind == wire.RES_SHARD_STATE:
                self._shard_state(worker, seq, wire.body(msg))
                return
            if kind == wire.RES_STATS:
                counts = self._runtime.stats["dataset"]
                for name, gained in pickle.loads(wire.body(msg)).items():
                    counts[name] = counts.get(name, 0) + gained
                return
            self._init_failed(worker, wire.body(msg))
            return
        task = self._tasks.pop(seq, None)
        if task is None:  # a result from before a reset; already discarded
            if kind == wire.RES_SEGMENT:
                os.close(worker.reader.take_fd())
            return
        self.scheduler.answered(worker.id)
        payload = wire.body(msg)
        _leases.give_back(task.ring, task.slot)
        task.slot = wire.NO_SLOT
        if kind == wire.RES_SEGMENT or kind == wire.RES_PICKLED:
            needed = wire.needed_bytes(payload)
            if kind == wire.RES_SEGMENT:
                # The batch's own segment, mapped here (not pre-faulted: only what the
                # consumer reads comes in); its descriptor is closed at once.
                task.ring = attach_fd(worker.reader.take_fd(), 1, needed, populate=False)
                task.slot = 0
            ring = self._ring
            if ring is None or (needed > ring.slot_bytes and self._loader.slot_bytes is None):
                # The first batch sizes the ring; a batch that outgrew its slot makes
                # a ring of larger slots.
                self._want_ring(needed)
        elif kind == wire.RES_ITER_END:
            self.scheduler.ended(worker.id, seq)  # tasks sent from now on skip it
        self.scheduler.put(seq, (kind, task, payload))

    def _init_failed(self, worker: WorkerHandle, payload: bytes) -> None:
        """worker_init_fn raised: the worker sent that before reading any task (its
        header carries no batch number) and exits. It answers for every task it was
        given: the error takes the place of the first one, the others are dropped, and
        the worker's exit is then expected (no WorkerDiedError)."""
        self._retired.add(worker)
        mine = sorted(seq for seq, t in self._tasks.items() if t.worker is worker)
        tasks = [self._tasks.pop(seq) for seq in mine]
        for task in tasks:
            _leases.give_back(task.ring, task.slot)
            task.slot = wire.NO_SLOT
        self.scheduler.retire(worker.id)
        seq = mine[0] if mine else self._rcvd_seq
        task = tasks[0] if tasks else Task(seq, worker, wire.NO_SLOT, None, None)
        self.scheduler.put(seq, (wire.RES_INIT_ERROR, task, payload))

    def _drain(self, worker: WorkerHandle) -> None:
        """Handle everything ``worker`` sent before it exited."""
        while self._pool.has_input(worker) and self._receive(worker):
            pass
        while results := worker.channel.take_results():  # (and what it queued)
            for _kind, _slot, seq, _stamp, fetch_ns, collate_ns, idle_ns in results:
                self._ready(worker, seq, fetch_ns, collate_ns, idle_ns)
