"""``num_workers="auto"`` and ``prefetch_factor="auto"`` acting on a running epoch: the
tuner's decisions (:class:`~shmloader.tuning.autotune.Tuner`) applied through the pool and
what is in flight.

A worker more is started at once, mid-epoch (map-style datasets: its id is the next one,
its seed the epoch's plus its id), and given tasks; a larger prefetch sends tasks at once.
While the next epoch's tasks go out early (:mod:`shmloader.epoch.ahead`) the pool stays as
it is.
"""

from __future__ import annotations

from collections.abc import Callable

from shmloader.epoch.crew import Crew
from shmloader.epoch.inflight import InFlight
from shmloader.epoch.rings import RingKeeper
from shmloader.tuning.autotune import Room, Tuner
from shmloader.tuning.timing import Timing
from shmloader.workers.pool import WorkerPool


class Tuning:
    """Applies ``tuner``'s decisions to one iterator. ``publish(num_workers,
    prefetch_factor)``: the counts in use now, for the loader to report; ``abort``: stops
    the iterator where a new worker could not start."""

    __slots__ = (
        "_abort",
        "_backend",
        "_crew",
        "_inflight",
        "_pool",
        "_publish",
        "_rings",
        "_timing",
        "tuner",
    )

    def __init__(
        self,
        tuner: Tuner,
        timing: Timing,
        pool: WorkerPool,
        crew: Crew,
        inflight: InFlight,
        rings: RingKeeper,
        shm_backend: str,
        publish: Callable[[int, int | None], None],
        abort: Callable[[], None],
    ) -> None:
        self.tuner = tuner
        self._timing = timing
        self._pool = pool
        self._crew = crew
        self._inflight = inflight
        self._rings = rings
        self._backend = shm_backend
        self._publish = publish
        self._abort = abort

    def epoch_began(self) -> None:
        """An epoch begins: the tuner's first window begins with its batches."""
        self.tuner.window = None
        self.tuner.due = 0.0

    def tune(self, now: float) -> None:
        """Decide on the window that ends ``now`` and apply it: a worker more, or a larger
        prefetch."""
        inflight = self._inflight
        if inflight.next_plan is not None:
            return
        tuner = self.tuner
        action = tuner.decide(now, self._timing, Room(self._rings.ring, self._backend))
        if action == "worker":
            self._add_worker()
        elif action == "prefetch" and tuner.prefetch is not None:
            inflight.prefetch_factor = tuner.prefetch
            self._publish(inflight.num_workers, tuner.prefetch)
            inflight.fill()

    def _add_worker(self) -> None:
        """Start one more worker and give it tasks."""
        inflight = self._inflight
        wid = len(self._pool.workers)
        try:
            self._crew.add(wid, inflight.epoch_plan())
        except BaseException:
            self._abort()
            raise
        count = wid + 1
        inflight.num_workers = count
        inflight.scheduler.grow(count)
        self._timing.num_workers = count
        self._publish(count, inflight.prefetch_factor)
        inflight.fill()
