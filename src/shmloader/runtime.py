"""The working parts of one DataLoader, in one object its iterators receive.

A :class:`LoaderRuntime` lives as long as its loader and is shared by all of the
loader's iterators (in-process or with workers, one after the other or at once): the
counters of ``stats()``, the clocks of ``stats()["time"]``, the rings and slot leases,
the CUDA pinner, the autotuner, and the epoch cursor (where the loader is between and
within epochs). It never sees the loader (so it never keeps it alive): the settings that
may change after the loader was made come in each epoch's
:class:`~shmloader.settings.EpochSettings`, made by the loader.
"""

from __future__ import annotations

import time
from typing import Any

from shmloader.batch import pinning as _pinning
from shmloader.batch import recipe as fetch
from shmloader.config import LoaderConfig
from shmloader.memory import leases as _leases
from shmloader.memory import sizing
from shmloader.memory.watch import MemoryWatch
from shmloader.sampling import draws as _draws
from shmloader.sampling.position import Cursor
from shmloader.settings import EpochSettings
from shmloader.tuning import autotune
from shmloader.tuning.timing import Timing
from shmloader.vision.torchvision_choice import ImagesChoice


def new_stats() -> dict[str, Any]:
    """The counters of ``DataLoader.stats()`` at zero: plain ints bumped on the hand-out
    path (no locks, no syscalls)."""
    return {
        "batches": 0,
        "batches_copied": 0,
        "rings_created": 0,
        "dataset": {},
        "worker_restarts": 0,  # workers replaced (max_worker_restarts), in the loader's life
        # Persistent workers (ahead.py): epochs whose first batches loaded during the last
        # one, and batches so loaded that the epoch could not use (its plan changed).
        "epochs_ahead": 0,
        "batches_ahead_dropped": 0,
    }


class LoaderRuntime:
    """What a loader's iterators work with, besides its public attributes.

    ``config``: the loader's :class:`~shmloader.config.LoaderConfig` (as checked).
    ``stats``: the counters of ``stats()`` (see :func:`new_stats`). ``timing``: where the
    time goes (:class:`~shmloader.tuning.timing.Timing`). ``pinner``: the CUDA pinner of
    ``pin_memory`` (None: off, or no CUDA). ``leases``: the rings, slot claims and leases
    (:class:`~shmloader.memory.leases.Leases`). ``tuner``: the autotuner of
    ``num_workers``/``prefetch_factor`` ``"auto"``, or None. ``cursor``: the epoch cursor
    (:class:`~shmloader.sampling.position.Cursor`). ``iterable_len``: an iterable dataset's
    length when ``len(loader)`` was last called (torch's warning compares with it).
    ``memory``: the workers' memory and the copy-on-read warning
    (:class:`~shmloader.memory.watch.MemoryWatch`)."""

    def __init__(self, config: LoaderConfig) -> None:
        """The runtime of a loader made with ``config``: no ring yet unless
        ``slot_bytes`` was given with workers (reserved now, so a too-small /dev/shm is
        an error at construction)."""
        self.config = config
        self.stats = new_stats()
        self.timing = Timing(config.most_workers)
        # (stacklevel: the warning points at the line that made the loader)
        self.pinner = _pinning.make_pinner(config.pin_memory, stacklevel=4)
        self.leases = _leases.Leases(
            config.num_slots,
            config.max_shm_bytes,
            self.pinner,
            self.stats,
            backend=config.shm_backend,
            # The default slot count adapts to the memory there; one the user gave is kept.
            min_slots=None if config.fixed_num_slots else sizing.min_num_slots(config.num_workers),
            num_workers=config.most_workers,
        )
        if config.slot_bytes is not None and config.num_workers > 0:
            self.leases.new_ring(config.num_slots, config.slot_bytes)
        # num_workers or prefetch_factor "auto": the counts in use now, tuned as epochs run.
        self.tuner = autotune.Tuner.of(config.tuner) if config.tuner is not None else None
        # Where every epoch's order and worker seeds come from, the next epoch, a loaded
        # position. Nothing is drawn here (see draws.py): torch's loader draws at iter().
        self.cursor = Cursor(
            seeds=None if config.torch_rng else _draws.SeedSource(config.seed, config.generator)
        )
        self.iterable_len: int | None = None
        self.memory = MemoryWatch(lambda: config.dataset, time.perf_counter)
        # images=: whether a torchvision folder pipeline runs fused (recognized once, here).
        self.images = ImagesChoice(config.images, config.dataset)
        self.images.writer(  # decided now too, so that stats() says it before the first epoch
            iterable=config.iterable,
            auto_collation=config.auto_collation,
            user_collate=fetch.user_collate_fn(config.collate_fn, config.auto_collation),
        )

    def recipe(self, settings: EpochSettings) -> fetch.Recipe:
        """How the batches of an epoch run by ``settings`` are made: the one recipe of the
        main process and of every worker (so num_workers never changes a batch)."""
        config = self.config
        writer = self.images.writer(
            iterable=config.iterable,
            auto_collation=config.auto_collation,
            user_collate=fetch.user_collate_fn(settings.collate_fn, config.auto_collation),
        )
        return fetch.Recipe(
            config.dataset,
            iterable=config.iterable,
            auto_collation=config.auto_collation,
            batch_size=config.batch_size,
            drop_last=config.drop_last,
            # torch's default collate (what collate_fn reports when none was given) is made
            # by shmloader's own, straight into the ring (fetch.is_torch_default).
            collate_fn=settings.collate_fn,
            collate=settings.collate,
            pad_value=settings.pad_value,
            output=settings.output,
            writer=writer,
        )
