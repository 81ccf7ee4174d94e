"""The iterator of an epoch loaded in the consumer's own process (``num_workers=0``).

It makes each batch with the recipe a worker uses (:class:`~shmloader.fetch.Recipe`), so
``num_workers`` never changes a batch, and builds it in this process's memory; while it
loads, ``sample_rng`` and ``get_shard_info`` see its epoch (:mod:`shmloader.context`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shmloader import context
from shmloader import distributed as _dist
from shmloader import pinning as _pinning
from shmloader import state as _state


class InProcessIter:
    """num_workers=0: fetch and collate in this process; same batches as with workers.
    A :class:`~shmloader.state.Positioned` for state_dict()."""

    def __init__(self, loader: Any, plan: _state.EpochPlan) -> None:
        self._loader = loader
        self._seq = 0
        self.plan = plan
        self.epoch_done = False
        self._epoch_seed = epoch_seed = plan.epoch_seed
        self._shard = _dist.ShardInfo(loader.rank, loader.world_size, 0, 1)
        # What sample_rng() and get_shard_info() see in this process while we load.
        context.enter_main_epoch(epoch_seed, self._shard)
        # Applied to each batch, in order.
        self._post: list[Callable[[Any], Any]] = []
        if loader.output == "torch":
            self._post.append(_pinning.to_torch)
        if loader._pinner is not None:
            self._post.append(_pinning.pin_tree)  # no ring here: pinned per batch, as torch does
        if loader.iterable:
            self._source = _state.open_iterable(loader.dataset, plan.workers[0] if plan.workers else None)
        else:
            self._source = _state.index_sequence(loader, plan)
        self._recipe = loader._recipe()

    def __iter__(self) -> InProcessIter:
        return self

    def __next__(self) -> Any:
        context.enter_main_epoch(self._epoch_seed, self._shard)  # another loader may have run between
        try:
            batch = self._next_batch()
        except StopIteration:
            self.epoch_done = True
            context.leave_main_epoch()  # outside an epoch, sample_rng follows np.random
            raise
        stats = self._loader._stats
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
        dataset = self._loader.dataset
        return [self._seq], 0, ({0: dataset.state_dict()} if self.plan.stateful else {})

    def _next_batch(self) -> Any:
        """The next batch, made by the same recipe a worker uses (fetch.Recipe); raises
        StopIteration only when the sampler or the iterable dataset is exhausted."""
        recipe = self._recipe
        seq, self._seq = self._seq, self._seq + 1
        if self._loader.iterable:
            samples = recipe.take(self._source, seq)
            if samples is None:
                raise StopIteration
            indices = None
        else:
            indices = next(self._source)  # the sampler's end is the epoch's end
            samples = recipe.fetch(indices, seq)
        return recipe.in_memory(recipe.collate(samples, indices, seq), samples)

    def __len__(self) -> int:
        return len(self._loader)
