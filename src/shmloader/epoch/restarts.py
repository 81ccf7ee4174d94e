"""Worker restarts (``max_worker_restarts``): a dead or hung worker is replaced, and the
epoch still yields exactly the batches an undisturbed run yields.

A mixin of :class:`~shmloader.epoch.multiprocess.MultiProcessIter` (it works on the iterator's
pool, tasks, scheduler and ring): the replacement gets the dead worker's id and the
current epoch's seed, and the tasks the old one never answered go to it again with the
same batch numbers and indices, in their order. A slot is handed out only on a worker's
result, so one the dead worker was writing is never handed out half-written: a slot of
the current ring is given to the new worker as it is, one of a retired ring goes back and
the task gets a new one. An iterable dataset's shard resumes from the state its worker
reported after its last batch that arrived (so restarts need ``shmloader_state_dict()``
and ``shmloader_load_state_dict()`` there). See docs/restart.md.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from typing import Any

from shmloader.epoch import state as _state
from shmloader.errors import WorkerRestartWarning
from shmloader.memory import leases as _leases
from shmloader.system import slots as _slots
from shmloader.transport import wire
from shmloader.workers.failures import describe_exit
from shmloader.workers.pool import WorkerHandle, death_point
from shmloader.workers.worker import worker_main


class Restarts:
    """The restart half of the epoch iterator (see the module's docstring)."""

    # (Attributes and methods of MultiProcessIter, used here.)
    _loader: Any
    _runtime: Any  # the loader's LoaderRuntime (shmloader.runtime)
    _pool: Any
    _tasks: dict
    _results: dict
    _ring: Any
    _ctx: Any
    _source_done: bool
    plan: Any
    scheduler: Any
    _death_point: Any

    def _may_restart(self, worker: WorkerHandle) -> bool:
        """Whether a restart is left in the loader's budget and ``worker`` can be replaced
        exactly. An iterable dataset's shard needs its own state to resume from, unless
        the epoch has not begun loading (the new worker starts the shard as the old one
        would have) or the worker has nothing of it left to load this epoch (the next
        epoch starts it afresh)."""
        loader = self._loader
        if self._runtime.stats["worker_restarts"] >= loader.max_worker_restarts:
            return False
        if not loader.iterable or self.plan is None or self.plan.stateful:
            return True
        sched = self.scheduler
        return sched.send_seq == sched.base or not self._owes_work(worker)

    def _owes_work(self, worker: WorkerHandle) -> bool:
        """Whether ``worker`` has batches of this epoch in flight or still to be given."""
        wid = worker.id
        return bool(self.scheduler.outstanding[wid]) or (self.scheduler.active[wid] and not self._source_done)

    def _restart(self, worker: WorkerHandle, timed_out: float | None = None) -> None:
        """Replace ``worker`` (dead, or hung past the loader's timeout: ``timed_out`` s)
        by a new one with its id and the current epoch's seed, and send it the tasks the
        old one never answered, same batch numbers and indices. Raises the death error
        when no restart is left or the dataset cannot be resumed exactly."""
        loader = self._loader
        limit = loader.max_worker_restarts
        pending = sorted(seq for seq, t in self._tasks.items() if t.worker is worker)
        if not self._may_restart(worker):
            if not limit:
                raise self._death_error(worker)
            if self._runtime.stats["worker_restarts"] >= limit:
                note = (
                    f" It was not restarted: the loader already replaced max_worker_restarts={limit} "
                    "worker(s), its limit."
                )
            else:
                note = (
                    " It was not restarted: restarting a worker of an iterable dataset "
                    "(max_worker_restarts) needs a dataset with shmloader_state_dict() and "
                    "shmloader_load_state_dict(), so that its shard resumes where it was; "
                    "without them the shard would repeat or skip samples."
                    + _state.stateful_hint(loader.dataset)
                )
            if timed_out is not None:
                raise self._timeout_error(timed_out)
            raise self._death_error(worker, note)
        old_pid = worker.proc.pid
        if timed_out is not None:
            how = f"did not deliver within timeout={timed_out} s and was killed"
        else:
            worker.proc.join(0.1)
            how = describe_exit(worker.proc.exitcode)[0]
        # A worker that gets no task this epoch any more (its shard ended) starts the next
        # one afresh: a record would be read by its first iterator, the next epoch's.
        resume = self._restart_resume(worker.id, pending) if self._owes_work(worker) else None
        batch, indices, started = self._death_point(worker)
        plan = self.plan
        seed = plan.epoch_seed + worker.id  # type: ignore[union-attr]
        try:
            new = self._pool.replace(
                worker,
                self._ctx,
                lambda wid, pdeath: self._worker_config(wid, pdeath, seed, resume),
                worker_main,
            )
        except BaseException:
            self.close(graceful=False)  # no worker in its place: the epoch cannot go on
            raise
        self._runtime.stats["worker_restarts"] += 1
        # Its tasks again, in their order: a slot of the current ring is reused as it is
        # (the old worker is reaped: nothing writes it now, and the consumer hands it out
        # only on the new worker's result); a slot of a retired ring goes back, and the
        # task gets one in the current ring (the new worker knows only that one).
        for seq in pending:
            task = self._tasks[seq]
            task.worker = new
            if task.slot != wire.NO_SLOT and task.ring is self._ring:
                task.ring.states.store(task.slot, _slots.ASSIGNED)  # type: ignore[union-attr]
            else:
                _leases.give_back(task.ring, task.slot)
                task.slot = self._claim_slot(worker.id)
                task.ring = self._ring
            if loader.iterable:
                kind, payload = wire.TASK_ITER, b""
            else:
                kind, payload = wire.task_payload(task.indices)
            self._pool.send(new, wire.frame(wire.pack(kind, task.slot, seq, payload)))
        what = death_point(batch, indices, started)
        again = f"; its {len(pending)} batch(es) in flight are loaded again" if pending else ""
        warnings.warn(
            f"DataLoader worker {worker.id} (pid {old_pid}) {how}{what}. Started worker "
            f"{worker.id} again (pid {new.proc.pid}){again}: restart "
            f"{self._runtime.stats['worker_restarts']} of max_worker_restarts={limit}.",
            WorkerRestartWarning,
            stacklevel=_caller_level(),  # the loop calling next()
        )

    def _restart_hung(self, timeout: float) -> bool:
        """No result within ``timeout`` s: replace the worker that owes the batch waited
        for (in order: the due one; else the oldest one, unless some result came
        meanwhile); False where there is none (the caller raises the timeout error)."""
        owed = len(self._tasks)
        for w in self._pool.readable_now():  # results that arrived unread meanwhile
            self._receive(w)
        if self._loader.in_order:
            task = self._tasks.get(self._rcvd_seq)
        else:
            task = self._tasks[min(self._tasks)] if len(self._tasks) == owed and self._tasks else None
        if task is None:
            return bool(self._results) or not self._tasks  # it came: no worker hung
        self._restart(task.worker, timed_out=timeout)
        return True

    def _restart_resume(self, wid: int, pending: list[int]) -> dict[str, Any] | None:
        """Iterable datasets: where worker ``wid``'s shard resumes, the state it reported
        after its last batch whose result arrived (the state of a batch comes before the
        batch: one of ``pending`` is not done), or the epoch's start (the saved record
        for a resumed epoch) when none did. The states of ``pending`` batches are dropped:
        the new worker reports them again."""
        if not self._loader.iterable:
            return None
        blob = self.scheduler.shard_state_before(wid, pending)
        if blob is not None:
            return {"samples": 0, "state": pickle.loads(blob)}
        return _state.worker_resume(self.plan, wid)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning raised by its caller at the first frame
    outside this package (the training loop's ``next()``, however deep the call)."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
