"""One epoch's settings, frozen: what an iterator, its workers and its hand-out run by.

A loader's settings have two sources: its arguments as checked when it was made
(:class:`~shmloader.config.LoaderConfig`, frozen) and torch's writable attributes
(``num_workers``, ``prefetch_factor``, ``collate_fn``, ``generator``, ``in_order``,
``timeout``, ``worker_init_fn``, ``multiprocessing_context``, ``distributed``, ...),
which a user may assign between epochs as torch allows. ``DataLoader.iter()`` reads both,
once per epoch, into one :class:`EpochSettings` (the only place that reads the loader
object is :mod:`shmloader.loader`); the runtime, the iterators, the hand-out and the
workers' configs receive that snapshot, never the loader. What an epoch tells its loader
back (a tuner's counts, ``len(loader)``) goes through a :class:`LoaderReports` the loader
passes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from shmloader.sampling.position import Now


@dataclass(frozen=True, kw_only=True)
class EpochSettings:
    """A loader's settings for one epoch, read when its ``iter()`` made the iterator.

    ``num_workers`` and ``prefetch_factor``: the counts the epoch starts with (torch's
    attributes: as assigned, or the counts a tuner reached); ``most_workers``: what
    workers are told as ``get_worker_info().num_workers`` (``num_workers="auto"``: the
    most it may start). ``rank`` and ``world_size``: the loader's own sharding (1 rank
    where it does not shard); ``worker_rank`` and ``worker_world_size``: what the epoch's
    loading code is told (the same, except a torch DataPipe, sharded as torch shards it).
    The rest are the loader's attributes of the same names, as read."""

    num_workers: int
    prefetch_factor: int | None
    most_workers: int
    rank: int
    world_size: int
    worker_rank: int
    worker_world_size: int
    sharding_asked: bool  # distributed "auto"/True, or rank or world_size given
    generator: Any
    in_order: bool
    dataset: Any
    iterable: bool
    collate_fn: Any
    collate: str
    pad_value: Any
    output: str
    worker_init_fn: Any
    timeout: float
    multiprocessing_context: Any  # a context or None (the loader checked it when assigned)
    persistent_workers: bool
    prefetch_next_epoch: bool
    max_worker_restarts: int
    share_dataset: bool  # the dataset's large containers are shared before workers start
    shm_backend: str
    fixed_slot_bytes: bool  # the user chose slot_bytes

    @property
    def now(self) -> Now:
        """The part the epoch's plan reads (:mod:`shmloader.epoch.state`): counts, shard,
        generator and order."""
        return Now(
            num_workers=self.num_workers,
            rank=self.rank,
            world_size=self.world_size,
            generator=self.generator,
            in_order=self.in_order,
            prefetch_factor=self.prefetch_factor if isinstance(self.prefetch_factor, int) else 0,
        )


class LoaderReports(Protocol):
    """What an epoch tells (or asks) its loader, the only way back to it: made by
    :mod:`shmloader.loader`, which decides whether it holds the loader (a persistent
    loader's iterator must not keep it alive)."""

    def counts(self, num_workers: int, prefetch_factor: int | None) -> None:
        """The counts a tuner set: the loader reports them as ``num_workers`` and
        ``prefetch_factor`` (nothing once the loader is gone)."""

    def length(self) -> int:
        """``len(loader)``, asked now (an iterator's ``len()``)."""
