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
from shmloader.tuning.counts import WorkerCounts
from shmloader.tuning.timing import Timing


class Tuning:
    """Applies ``tuner``'s decisions to one iterator, whose worker count and prefetch
    depth are ``counts`` (the tuner raises them; this starts the worker and tells what is
    in flight). ``publish(num_workers, prefetch_factor)``: the counts in use now, for the
    loader to report; ``abort``: stops the iterator where a new worker could not start."""

    __slots__ = (
        "_abort",
        "_backend",
        "_counts",
        "_crew",
        "_inflight",
        "_publish",
        "_rings",
        "_timing",
        "tuner",
    )

    def __init__(
        self,
        tuner: Tuner,
        counts: WorkerCounts,
        timing: Timing,
        crew: Crew,
        inflight: InFlight,
        rings: RingKeeper,
        shm_backend: str,
        publish: Callable[[int, int | None], None],
        abort: Callable[[], None],
    ) -> None:
        self.tuner = tuner
        self._counts = counts
        self._timing = timing
        self._crew = crew
        self._inflight = inflight
        self._rings = rings
        self._backend = shm_backend
        self._publish = publish
        self._abort = abort

    def epoch_began(self) -> None:
        """An epoch begins: the tuner tunes this iterator's counts, its first window
        beginning with the epoch's batches."""
        self.tuner.epoch_began(self._counts)

    def tune(self, now: float) -> None:
        """Decide on the window that ends ``now`` and apply it: a worker more, or a larger
        prefetch."""
        inflight = self._inflight
        if inflight.next_plan is not None:
            return
        action = self.tuner.decide(now, self._timing, Room(self._rings.ring, self._backend), self._counts)
        if action == "worker":
            self._add_worker()
        elif action == "prefetch":
            self._publish(self._counts.workers, self._counts.prefetch)
            inflight.fill()

    def _add_worker(self) -> None:
        """Start the worker the tuner just counted (its id: the count less one) and give it
        tasks."""
        counts = self._counts
        try:
            self._crew.add(counts.workers - 1, self._inflight.epoch_plan())
        except BaseException:
            self._abort()
            raise
        self._publish(counts.workers, counts.prefetch)
        self._inflight.workers_added()
