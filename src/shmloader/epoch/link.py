"""What the epoch with workers gets from its loader, without the loader: the objects of the
loader's runtime (stats, timing, leases, tuner, cursor), the epoch's frozen settings
(:class:`~shmloader.settings.EpochSettings`, which ``iter()`` read), what it reports back
(:class:`~shmloader.settings.LoaderReports`), and the loader-wide functions of
:mod:`shmloader.epoch.state`. The pieces of the epoch (:mod:`shmloader.epoch.multiprocess`)
get explicit values and objects from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from shmloader.epoch import state as _state
from shmloader.epoch.inprocess import iterable_len_limit, warn_len_exceeded
from shmloader.sampling.position import EpochPlan
from shmloader.settings import EpochSettings, LoaderReports

if TYPE_CHECKING:
    from shmloader.runtime import LoaderRuntime


class LoaderLink:
    """The one place the iterator with workers reaches its loader's parts: its runtime, the
    settings of the epoch it runs (:attr:`settings`, renewed when a persistent loader's
    ``iter()`` resets the iterator) and the loader's :class:`LoaderReports`."""

    __slots__ = ("_reports", "_runtime", "settings")

    def __init__(self, runtime: LoaderRuntime, settings: EpochSettings, reports: LoaderReports) -> None:
        self._runtime = runtime
        self._reports = reports
        self.settings = settings

    def publish_counts(self, num_workers: int, prefetch_factor: int | None) -> None:
        """The counts a tuner set, which the loader reports (``loader.num_workers``...)."""
        self._reports.counts(num_workers, prefetch_factor)

    def length(self) -> int:
        return self._reports.length()

    def len_limit(self) -> int:
        return iterable_len_limit(self._runtime)

    def warn_len_exceeded(self, yielded: int) -> None:
        warn_len_exceeded(self._runtime, yielded, self.settings.num_workers)

    def index_sequence(self, plan: EpochPlan) -> Iterator[Any] | None:
        """The epoch's index lists (None: an iterable dataset)."""
        config = self._runtime.config
        return None if config.iterable else _state.index_sequence(config, plan)

    def plan_next(self) -> tuple[EpochPlan, Iterator[Any]] | None:
        """The next epoch's plan, worked out with this epoch's settings (its real plan,
        with its own, must equal it for the tasks sent early to be used)."""
        runtime = self._runtime
        return _state.plan_ahead(runtime.config, runtime.cursor, self.settings.now)
