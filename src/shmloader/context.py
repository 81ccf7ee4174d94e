"""Where the current code runs: the worker it is in, the epoch being loaded, its shard.

Per-process context that datasets read (``get_worker_info``, ``sample_rng``,
``get_shard_info``) and that the loader sets: in a worker, :func:`set_worker_info` at the
start of every epoch; in the main process, :func:`enter_main_epoch` /
:func:`leave_main_epoch` around each batch a ``num_workers=0`` loader loads (two loaders
may be iterated in turns, so it is set again before every batch).

Inside a worker, torch's ``torch.utils.data.get_worker_info()`` answers too, as in torch's
own workers (a torch ``WorkerInfo``: ``id``, ``num_workers``, ``seed``, ``dataset``), so a
torch ``IterableDataset`` that splits its work by it reads each sample once. It is set
wherever :func:`set_worker_info` sets ours, when torch is imported in the worker at that
moment (``"torch" in sys.modules``): always under fork when the consumer had imported it;
under spawn and forkserver when unpickling the dataset (or re-importing the main module)
imported it, which any dataset that calls torch's function at module level does. torch is
never imported here for it: a numpy-only worker stays torch-free.

This module imports nothing from the package: every other module may import it, and
no import circle can pass through it.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple


class WorkerInfo:
    """What :func:`get_worker_info` returns inside a worker: ``id``, ``num_workers``,
    ``seed`` and ``dataset`` (this worker's copy), the loader's ``rank`` and
    ``world_size``, and the global shard of this worker: ``shard_id`` (``rank *
    num_workers + id``) of ``num_shards`` (``world_size * num_workers``). Immutable."""

    __slots__ = ("dataset", "id", "num_workers", "rank", "seed", "world_size")

    def __init__(
        self, id: int, num_workers: int, seed: int, dataset: Any, rank: int = 0, world_size: int = 1
    ) -> None:
        for name, value in (
            ("id", id),
            ("num_workers", num_workers),
            ("seed", seed),
            ("dataset", dataset),
            ("rank", rank),
            ("world_size", world_size),
        ):
            object.__setattr__(self, name, value)

    @property
    def shard_id(self) -> int:
        """This worker's shard among all workers of all ranks."""
        return self.rank * self.num_workers + self.id

    @property
    def num_shards(self) -> int:
        """Workers of all ranks together."""
        return self.world_size * self.num_workers

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"WorkerInfo is immutable: cannot set {name!r}")

    def __repr__(self) -> str:
        return (
            f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed}, "
            f"rank={self.rank}, world_size={self.world_size})"
        )


class ShardInfo(NamedTuple):
    """Where the code runs in the job: this process's rank and loader worker, and the
    global shard (``rank * num_workers + worker_id`` of ``world_size * num_workers``)."""

    rank: int
    world_size: int
    worker_id: int
    num_workers: int

    @property
    def shard_id(self) -> int:
        """This shard among all workers of all ranks."""
        return self.rank * self.num_workers + self.worker_id

    @property
    def num_shards(self) -> int:
        """Workers of all ranks together."""
        return self.world_size * self.num_workers


_worker_info: WorkerInfo | None = None
# In a worker: the seed of the epoch it loads (what sample_rng draws from), where it is not
# the worker's seed minus its id (persistent workers under torch's RNG keep their seed).
_worker_epoch_seed: int | None = None
# The main process's epoch while a num_workers=0 loader loads a batch: (epoch seed, shard).
_main_epoch: tuple[int, ShardInfo] | None = None


def get_worker_info() -> WorkerInfo | None:
    """The current worker's :class:`WorkerInfo`, or None in the main process."""
    return _worker_info


def set_worker_info(info: WorkerInfo) -> None:
    """Make ``info`` what :func:`get_worker_info` returns in this (worker) process, and
    the same fields what ``torch.utils.data.get_worker_info()`` returns when torch is
    imported (see the module docstring)."""
    global _worker_info
    _worker_info = info
    set_torch_worker_info(info)


def set_worker_epoch_seed(seed: int | None) -> None:
    """In a worker: the seed of the epoch being loaded (None: the worker's seed minus its id)."""
    global _worker_epoch_seed
    _worker_epoch_seed = seed


def worker_epoch_seed() -> int | None:
    """In a worker: the seed :func:`set_worker_epoch_seed` set, or None."""
    return _worker_epoch_seed


def set_torch_worker_info(info: WorkerInfo) -> bool:
    """Set torch's worker info (``torch.utils.data._utils.worker._worker_info``, an
    instance of torch's own immutable ``WorkerInfo``) to ``info``'s ``id``,
    ``num_workers``, ``seed`` and ``dataset``, if torch is imported in this process.
    Whether it was set."""
    if "torch" not in sys.modules:
        return False
    try:
        from torch.utils.data._utils import worker as torch_worker
    except ImportError:  # a torch without that module (or a stand-in named torch)
        return False
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset
    )
    return True


def enter_main_epoch(epoch_seed: int, shard: ShardInfo) -> None:
    """The main process is loading a batch of the epoch seeded ``epoch_seed`` as ``shard``."""
    global _main_epoch
    _main_epoch = (epoch_seed, shard)


def leave_main_epoch() -> None:
    """The main process's epoch is over: ``sample_rng`` follows numpy's global RNG again."""
    global _main_epoch
    _main_epoch = None


def main_epoch() -> tuple[int, ShardInfo] | None:
    """``(epoch seed, shard)`` of the epoch the main process is loading, or None."""
    return _main_epoch
