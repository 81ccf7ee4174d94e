"""Worker restarts (``max_worker_restarts``): a dead or hung worker is replaced, and the
epoch still yields exactly the batches an undisturbed run yields.

The replacement gets the dead worker's id and the current epoch's seed, and the tasks the
old one never answered go to it again with the same batch numbers and indices, in their
order (:meth:`~shmloader.epoch.inflight.InFlight.requeue`). A slot is handed out only on a
worker's result, so one the dead worker was writing is never handed out half-written. An
iterable dataset's shard resumes from the state its worker reported after its last batch
that arrived (so restarts need ``shmloader_state_dict()`` and ``shmloader_load_state_dict()``
there). See docs/restart.md.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from collections.abc import Callable
from typing import Any

from shmloader.epoch import state as _state
from shmloader.epoch.crew import Crew
from shmloader.epoch.inflight import InFlight
from shmloader.errors import WorkerRestartWarning, WorkerStartError
from shmloader.transport.failures import describe_exit
from shmloader.workers.pool import WorkerHandle, death_point

# Forked workers replaced for being stuck in their fork (Restarts.replace_stuck) before an
# iterator gives up: a retry usually forks while no thread holds the lock; every retry
# stuck means some thread holds it most of the time.
STUCK_STARTS_LIMIT = 3


class Restarts:
    """The restart policy of one iterator: whether a lost worker may be replaced, and the
    replacement. ``stats``: the loader's counters (``worker_restarts`` counts over its life);
    ``abort``: stops the iterator where no worker could be started in the lost one's place."""

    __slots__ = ("_abort", "_crew", "_dataset", "_inflight", "_iterable", "_stats", "_stuck_starts", "limit")

    def __init__(
        self,
        limit: int,
        iterable: bool,
        dataset: Any,
        stats: dict[str, Any],
        inflight: InFlight,
        crew: Crew,
        abort: Callable[[], None],
    ) -> None:
        self.limit = limit  # max_worker_restarts
        self._iterable = iterable
        self._dataset = dataset  # (named in the refusal for an iterable dataset without state)
        self._stats = stats
        self._inflight = inflight
        self._crew = crew
        self._abort = abort
        self._stuck_starts = 0  # workers replaced for being stuck in their fork (replace_stuck)

    def refusal(self, worker: WorkerHandle) -> str | None:
        """None where ``worker`` may be replaced now; else why not, as a sentence for its
        death error ("" where restarts are off)."""
        if not self.limit:
            return ""
        if self._stats["worker_restarts"] >= self.limit:
            return (
                f" It was not restarted: the loader already replaced max_worker_restarts={self.limit} "
                "worker(s), its limit."
            )
        if self._resumable(worker):
            return None
        return (
            " It was not restarted: restarting a worker of an iterable dataset "
            "(max_worker_restarts) needs a dataset with shmloader_state_dict() and "
            "shmloader_load_state_dict(), so that its shard resumes where it was; "
            "without them the shard would repeat or skip samples." + _state.stateful_hint(self._dataset)
        )

    def _resumable(self, worker: WorkerHandle) -> bool:
        """Whether a new worker can go on exactly where ``worker`` was. An iterable dataset's
        shard needs its own state to resume from, unless the epoch has not begun loading
        (the new worker starts the shard as the old one would have) or the worker has
        nothing of it left to load this epoch (the next epoch starts it afresh)."""
        plan = self._inflight.plan
        if not self._iterable or plan is None or plan.stateful:
            return True
        return not self._inflight.began_loading() or not self._inflight.owes_work(worker)

    def replace(self, worker: WorkerHandle, timed_out: float | None = None) -> None:
        """Replace ``worker`` (dead, or hung past the loader's timeout: ``timed_out`` s) by a
        new one with its id and the epoch's seed, give it the tasks the old one never
        answered, and warn. Call only where :meth:`refusal` said None."""
        old_pid = worker.proc.pid
        if timed_out is not None:
            how = f"did not deliver within timeout={timed_out} s and was killed"
        else:
            worker.proc.join(0.1)
            how = describe_exit(worker.proc.exitcode)[0]
        batch, indices, started = self._inflight.death_point(worker)
        new, again = self._start_again(worker)
        self._stats["worker_restarts"] += 1
        again_text = f"; its {again} batch(es) in flight are loaded again" if again else ""
        warnings.warn(
            f"DataLoader worker {worker.id} (pid {old_pid}) {how}{death_point(batch, indices, started)}. "
            f"Started worker {worker.id} again (pid {new.proc.pid}){again_text}: restart "
            f"{self._stats['worker_restarts']} of max_worker_restarts={self.limit}.",
            WorkerRestartWarning,
            stacklevel=_caller_level(),  # the loop calling next()
        )

    def replace_stuck(self, worker: WorkerHandle, waited_s: float) -> None:
        """Replace ``worker``, forked ``waited_s`` s ago and stuck inside its fork since (it
        never ran code of its own: see pool.FORK_START_DEADLINE_S), as :meth:`replace`
        does, whatever ``max_worker_restarts`` says (it loaded nothing, so a new worker
        yields exactly what it would have), and warn. After STUCK_STARTS_LIMIT of them in
        this iterator, stop it and raise WorkerStartError instead."""
        self._stuck_starts += 1
        old_pid = worker.proc.pid
        why = (
            "A forked child copies only the forking thread: a lock another thread of this "
            "process held at the fork stays locked in it (CPython gh-112275, fixed in Python "
            "3.11.8 and absent from 3.12, or a library's at-fork handler)."
        )
        if self._stuck_starts > STUCK_STARTS_LIMIT:
            self._abort()
            raise WorkerStartError(
                f"DataLoader worker {worker.id} (pid {old_pid}) was stuck in its fork: none of "
                f"its code ran within {waited_s:g} s, and {STUCK_STARTS_LIMIT} workers of this "
                f"iterator were replaced for that already. {why} Pass "
                "multiprocessing_context='forkserver' (or 'spawn') so that workers are not "
                "forked from this process, or upgrade Python where it is the cause.",
                worker_id=worker.id,
                pid=old_pid,
            )
        new, again = self._start_again(worker)
        again_text = f"; its {again} batch(es) in flight go to the new one" if again else ""
        warnings.warn(
            f"DataLoader worker {worker.id} (pid {old_pid}) was stuck in its fork: none of its "
            f"code ran within {waited_s:g} s, so it was killed. Started worker {worker.id} again "
            f"(pid {new.proc.pid}){again_text}; not counted in max_worker_restarts. {why} "
            "multiprocessing_context='forkserver' avoids it.",
            WorkerRestartWarning,
            stacklevel=_caller_level(),
        )

    def _start_again(self, worker: WorkerHandle) -> tuple[WorkerHandle, int]:
        """Start a worker in ``worker``'s place and send it the tasks ``worker`` never
        answered; the new worker and how many of this epoch's tasks it got."""
        inflight = self._inflight
        # A worker that gets no task this epoch any more (its shard ended) starts the next
        # one afresh: a record would be read by its first iterator, the next epoch's.
        pending = inflight.owed_by(worker, this_epoch=True)
        resume = self._resume(worker.id, pending) if inflight.owes_work(worker) else None
        try:
            new = self._crew.replace(worker, inflight.epoch_plan(), resume)
        except BaseException:
            self._abort()  # no worker in its place: the epoch cannot go on
            raise
        return new, inflight.requeue(worker, new)

    def _resume(self, wid: int, pending: list[int]) -> dict[str, Any] | None:
        """Iterable datasets: where worker ``wid``'s shard resumes, the state it reported
        after its last batch whose result arrived (the state of a batch comes before the
        batch: one of ``pending`` is not done), or the epoch's start (the saved record for
        a resumed epoch) when none did. The states of ``pending`` batches are dropped: the
        new worker reports them again."""
        if not self._iterable:
            return None
        blob = self._inflight.shard_state_before(wid, pending)
        if blob is not None:
            return {"samples": 0, "state": pickle.loads(blob)}
        return _state.worker_resume(self._inflight.plan, wid)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning raised by its caller at the first frame
    outside this package (the training loop's ``next()``, however deep the call)."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
