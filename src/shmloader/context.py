"""Where the current code runs: the worker it is in, the epoch being loaded, its shard.

Per-process context that datasets read (``get_worker_info``, ``sample_rng``,
``get_shard_info``) and that the loader sets: in a worker, :func:`set_worker_info` at the
start of every epoch; in the main process, :func:`enter_main_epoch` /
:func:`leave_main_epoch` around each batch a ``num_workers=0`` loader loads (two loaders
may be iterated in turns, so it is set again before every batch).

This module imports nothing from the package: every other module may import it, and
no import circle can pass through it.
"""

from __future__ import annotations

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
# The main process's epoch while a num_workers=0 loader loads a batch: (epoch seed, shard).
_main_epoch: tuple[int, ShardInfo] | None = None


def get_worker_info() -> WorkerInfo | None:
    """The current worker's :class:`WorkerInfo`, or None in the main process."""
    return _worker_info


def set_worker_info(info: WorkerInfo) -> None:
    """Make ``info`` what :func:`get_worker_info` returns in this (worker) process."""
    global _worker_info
    _worker_info = info


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
