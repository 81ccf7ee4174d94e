"""The worker count and prefetch depth of one running epoch, stored in one place.

An iterator with workers starts from the counts its epoch was given (``num_workers`` and
``prefetch_factor`` as read when it was made); with ``"auto"`` the tuner
(:class:`~shmloader.tuning.autotune.Tuner`) raises them mid-epoch through
:meth:`WorkerCounts.add_worker` and :meth:`WorkerCounts.raise_prefetch`, the only writers.
What bounds the tasks in flight (:class:`~shmloader.epoch.inflight.InFlight`), the round
robin (:class:`~shmloader.epoch.scheduler.Scheduler`) and the time report's verdict
(:class:`~shmloader.tuning.timing.Timing`) read the same object, so a change is seen by
all of them at once. The loader's ``num_workers``/``prefetch_factor`` (torch's attributes)
are told of a change by the epoch (:mod:`shmloader.epoch.tuning`), not stored here.
"""

from __future__ import annotations


class WorkerCounts:
    """``workers``: the worker processes an epoch loads with; ``prefetch``: the tasks each
    may have in flight (None only for a tuner's counts of a loader without workers). Both
    only grow."""

    __slots__ = ("_prefetch", "_workers")

    def __init__(self, workers: int, prefetch: int | None) -> None:
        if workers < 0:
            raise ValueError(f"a worker count cannot be negative (got {workers}).")
        self._workers = workers
        self._prefetch = prefetch

    @property
    def workers(self) -> int:
        """The worker count in use now."""
        return self._workers

    @property
    def prefetch(self) -> int | None:
        """The prefetch depth in use now (tasks in flight per worker)."""
        return self._prefetch

    def add_worker(self) -> int:
        """One worker more; returns the new count."""
        self._workers += 1
        return self._workers

    def raise_prefetch(self) -> int:
        """One task more in flight per worker; returns the new depth."""
        if self._prefetch is None:
            raise ValueError("the prefetch depth cannot be raised: this loader has no prefetch (no workers).")
        self._prefetch += 1
        return self._prefetch

    def __repr__(self) -> str:
        return f"WorkerCounts(workers={self._workers}, prefetch={self._prefetch})"
