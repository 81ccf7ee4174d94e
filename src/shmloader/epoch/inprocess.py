"""The iterator of an epoch loaded in the consumer's own process (``num_workers=0``).

It makes each batch with the recipe a worker uses (:class:`~shmloader.batch.recipe.Recipe`), so
``num_workers`` never changes a batch, and builds it in this process's memory; while it
loads, ``sample_rng`` and ``get_shard_info`` see its epoch (:mod:`shmloader.context`).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shmloader import context
from shmloader.batch import pinning as _pinning
from shmloader.batch import recipe as fetch
from shmloader.epoch import state as _state
from shmloader.sampling import distributed as _dist
from shmloader.sampling.position import EpochPlan
from shmloader.settings import EpochSettings, LoaderReports
from shmloader.workers.resume import open_iterable

if TYPE_CHECKING:
    from shmloader.runtime import LoaderRuntime


class InProcessIter:
    """num_workers=0: fetch and collate in this process; same batches as with workers.
    A :class:`~shmloader.epoch.state.Positioned` for state_dict()."""

    def __init__(
        self,
        runtime: LoaderRuntime,
        settings: EpochSettings,
        start: Callable[[Any], EpochPlan],
        reports: LoaderReports,
    ) -> None:
        """An epoch run by ``settings`` (read by the loader's ``iter()``), working with the
        loader's ``runtime``; ``start`` (state.epoch_starter) begins the epoch at the first
        ``next()``, so iter() alone moves nothing; ``reports`` answers ``len()``."""
        self._reports = reports
        self._settings = settings
        self._runtime = runtime
        self._start_epoch = start
        self._seq = 0
        self.plan: EpochPlan | None = None
        self._draws: Any = None  # the running epoch's draws (torch's RNG)
        self.epoch_done = False
        # torch's check: an iterable dataset yielding more batches than the samples its
        # __len__ reported when len(loader) was called (read as torch does, at iter()).
        self._len_limit = iterable_len_limit(runtime)
        self._recipe = runtime.recipe(settings)
        # Applied to each batch, in order.
        self._post: list[Callable[[Any], Any]] = []
        if settings.output == "torch":
            self._post.append(_pinning.to_torch)
        if runtime.pinner is not None:
            self._post.append(_pinning.pin_tree)  # no ring here: pinned per batch, as torch does

    def start(self) -> None:
        """Begin the epoch now (done by the first ``next()``; idempotent)."""
        if self.plan is None:
            self._begin()

    def _begin(self) -> None:
        config = self._runtime.config
        self.plan = plan = self._start_epoch(self)
        self._seq = 0
        self._draws = plan.draws  # (torch's RNG: the shuffle's last draw may be owed)
        self._epoch_seed = plan.sample_seed
        rank, world = self._settings.worker_rank, self._settings.worker_world_size
        self._shard = _dist.ShardInfo(rank, world, 0, 1)
        if config.iterable:
            # A torch DataPipe is seeded and sharded as torch's main process does it.
            fetch.prepare_datapipe(config.dataset, plan.shared_seed, world, rank)
            self._source = open_iterable(config.dataset, plan.workers[0] if plan.workers else None)
        else:
            self._source = _state.index_sequence(config, plan)

    def __iter__(self) -> InProcessIter:
        return self

    def __next__(self) -> Any:
        timing = self._runtime.timing  # (loading happens inside next() here: its wait)
        entered = time.perf_counter()
        timing.entered(entered, 0)
        try:
            batch = self._next()
        except BaseException:
            timing.paused()
            raise
        timing.returned(entered, time.perf_counter())
        return batch

    def _next(self) -> Any:
        if self.plan is None:
            self._begin()
        context.enter_main_epoch(self._epoch_seed, self._shard)  # another loader may have run between
        draws = self._draws
        try:
            batch = self._next_batch()
        except StopIteration:
            if draws is not None:
                draws.pay()  # torch's sampler ran out in this next()
            if self._seq == 1 and self.plan.resumed:
                # A loaded position at its epoch's end: the next epoch, in full, instead.
                self._begin()
                return self._next()
            self.epoch_done = True
            context.leave_main_epoch()  # outside an epoch, sample_rng follows np.random
            raise
        if draws is not None:
            draws.pay_due(self._seq)
        stats = self._runtime.stats
        stats["batches"] += 1
        stats["batches_copied"] += 1  # built in this process's memory, not in a ring
        for convert in self._post:
            batch = convert(batch)
        return batch

    def handed_out(self) -> int:
        """Batches handed out (or raised) this iteration, for state_dict()."""
        return self._seq

    def shard_positions(self) -> tuple[list[int], int, dict[int, Any]]:
        """Iterable datasets: this process is the one shard (see state.Positioned)."""
        dataset = self._runtime.config.dataset
        return [self._seq], 0, ({0: dataset.shmloader_state_dict()} if self.plan.stateful else {})  # type: ignore[union-attr]

    def shards_exhausted(self) -> bool:
        """Not known before StopIteration here (the end is found by asking for more)."""
        return False

    def _next_batch(self) -> Any:
        """The next batch, made by the same recipe a worker uses (fetch.Recipe); raises
        StopIteration only when the sampler or the iterable dataset is exhausted."""
        recipe = self._recipe
        seq, self._seq = self._seq, self._seq + 1
        if self._runtime.config.iterable:
            samples = recipe.take(self._source, seq)
            if samples is None:
                raise StopIteration
            if seq >= self._len_limit:
                warn_len_exceeded(self._runtime, seq + 1, num_workers=0)
            indices = None
        else:
            indices = next(self._source)  # the sampler's end is the epoch's end
            samples = recipe.fetch(indices, seq)
        return recipe.in_memory(recipe.collate(samples, indices, seq), samples)

    def __len__(self) -> int:
        return self._reports.length()


def iterable_len_limit(runtime: LoaderRuntime) -> int:
    """Batches an iterable dataset may yield before torch's warning: what its __len__
    said when ``len(loader)`` was last called (torch compares batches with samples)."""
    said = runtime.iterable_len if runtime.config.iterable else None
    return sys.maxsize if said is None else said


def warn_len_exceeded(runtime: LoaderRuntime, yielded: int, num_workers: int) -> None:
    """torch's UserWarning (same condition and text, from its iterator's ``__next__``):
    an iterable dataset yielded more than ``len(loader)`` reported (``num_workers``: the
    loader's, in use)."""
    text = (
        f"Length of IterableDataset {runtime.config.dataset} was reported to be "
        f"{runtime.iterable_len}(when accessing len(dataloader)), but {yielded} "
        "samples have been fetched. "
    )
    if num_workers > 0:
        text += (
            "For multiprocessing data-loading, this could be caused by not properly configuring "
            "the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
        )
    warnings.warn(text, UserWarning, stacklevel=3)
