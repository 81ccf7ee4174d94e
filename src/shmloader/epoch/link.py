"""The one place the epoch with workers reads its loader (and reports to it): the loader's
arguments it works with, the objects of the loader's runtime (stats, timing, leases,
tuner), and the loader-wide functions of :mod:`shmloader.epoch.state`. The pieces of the
epoch (:mod:`shmloader.epoch.multiprocess`) get explicit values and objects from here and
never see the loader.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmloader.batch.handout import Handout
from shmloader.epoch import state as _state
from shmloader.epoch.crew import WorkerSpec
from shmloader.epoch.inprocess import iterable_len_limit, warn_len_exceeded
from shmloader.memory.leases import Leases
from shmloader.memory.watch import MemoryWatch
from shmloader.sampling.position import EpochPlan
from shmloader.system.startmethod import worker_context
from shmloader.tuning.autotune import Tuner
from shmloader.tuning.timing import Timing

if TYPE_CHECKING:
    from shmloader.runtime import LoaderRuntime


@dataclass(frozen=True)
class Settings:
    """The loader's arguments an iterator works with, read once, when it is made."""

    num_workers: int  # in use now (a tuner may raise it)
    prefetch_factor: int
    in_order: bool
    iterable: bool
    timeout: float
    max_worker_restarts: int
    persistent_workers: bool
    prefetch_next_epoch: bool
    share_dataset: bool  # the dataset's large containers are shared before workers start
    shm_backend: str
    fixed_slot_bytes: bool
    context: Any  # the multiprocessing context workers start from


class LoaderLink:
    """The one place the iterator reads (and reports to) its loader: settings, the objects
    of the loader's runtime, and the loader-wide functions of :mod:`shmloader.epoch.state`."""

    __slots__ = ("_loader", "_runtime")

    def __init__(self, loader: Any, runtime: LoaderRuntime) -> None:
        self._loader = loader  # (a weak proxy for a persistent loader's iterator)
        self._runtime = runtime

    def settings(self) -> Settings:
        loader = self._loader
        ctx = worker_context(loader.multiprocessing_context)
        return Settings(
            num_workers=loader.num_workers,
            prefetch_factor=loader.prefetch_factor,
            in_order=loader.in_order,
            iterable=loader.iterable,
            timeout=loader.timeout,
            max_worker_restarts=loader.max_worker_restarts,
            persistent_workers=bool(loader.persistent_workers),
            prefetch_next_epoch=bool(loader.prefetch_next_epoch),
            share_dataset=bool(self._runtime.config.share_dataset),
            shm_backend=loader.shm_backend,
            fixed_slot_bytes=loader.slot_bytes is not None,
            context=ctx,
        )

    def worker_spec(self) -> WorkerSpec:
        """What workers start with; read as each epoch begins (the rank may change)."""
        loader = self._loader
        rank, world = self._runtime.worker_shard()
        tuner = self._runtime.tuner
        return WorkerSpec(
            dataset=loader.dataset,
            recipe=self._runtime.recipe(),
            worker_init_fn=loader.worker_init_fn,
            fixed_slot_bytes=loader.slot_bytes is not None,
            rank=rank,
            world_size=world,
            shm_backend=loader.shm_backend,
            num_workers=loader.num_workers if tuner is None else tuner.settings.max_workers,
        )

    def handout(self, copy: bool) -> Handout:
        return Handout(self._loader, self._runtime, copy)

    def dataset(self) -> Any:
        return self._loader.dataset

    def stats(self) -> dict[str, Any]:
        return self._runtime.stats

    def timing(self) -> Timing:
        return self._runtime.timing

    def tuner(self) -> Tuner | None:
        return self._runtime.tuner

    def leases(self) -> Leases:
        return self._runtime.leases

    def memory(self) -> MemoryWatch:
        return self._runtime.memory

    def publish_counts(self, num_workers: int, prefetch_factor: int | None) -> None:
        """The counts a tuner set, which the loader reports (``loader.num_workers``...)."""
        self._loader.num_workers = num_workers
        self._loader.prefetch_factor = prefetch_factor

    def length(self) -> int:
        return len(self._loader)

    def len_limit(self) -> int:
        return iterable_len_limit(self._runtime)

    def warn_len_exceeded(self, yielded: int) -> None:
        warn_len_exceeded(self._runtime, yielded, self._loader.num_workers)

    def index_sequence(self, plan: EpochPlan) -> Iterator[Any] | None:
        """The epoch's index lists (None: an iterable dataset)."""
        return None if self._loader.iterable else _state.index_sequence(self._runtime.config, plan)

    def plan_next(self) -> tuple[EpochPlan, Iterator[Any]] | None:
        runtime = self._runtime
        return _state.plan_ahead(runtime.config, runtime.cursor, runtime.now())
