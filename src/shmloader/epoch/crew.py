"""Starting an iterator's workers: all of them as its first epoch begins, one more for the
tuner, one in place of a dead or hung one; and the config each is started with: the
epoch's :class:`~shmloader.settings.EpochSettings` and its recipe, nothing else.

Every config is made before the first fork (:meth:`~shmloader.workers.pool.WorkerPool.start`)
and each worker gets tasks as soon as it runs, while the next one is forked. A task may
make a new ring meanwhile (the old one grew, or a fork saw a batch held in it): the
configs of the workers not started yet take it (:class:`~shmloader.epoch.rings.RingKeeper`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from shmloader.batch.recipe import Recipe
from shmloader.epoch import state as _state
from shmloader.epoch.rings import RingKeeper
from shmloader.memory.watch import MemoryWatch
from shmloader.sampling.position import EpochPlan
from shmloader.settings import EpochSettings
from shmloader.workers.pool import WorkerHandle, WorkerPool
from shmloader.workers.worker import WorkerConfig, worker_main


class Crew:
    """Starts the workers of one pool from ``ctx`` (a multiprocessing context) with the
    settings and recipe of the running epoch (:meth:`epoch_began` sets them), and tells
    ``memory`` (the loader's :class:`~shmloader.memory.watch.MemoryWatch`) of each worker
    it starts or replaces."""

    __slots__ = ("_ctx", "_memory", "_pool", "_rings", "recipe", "settings")

    def __init__(self, pool: WorkerPool, ctx: Any, rings: RingKeeper, memory: MemoryWatch) -> None:
        self._pool = pool
        self._ctx = ctx
        self._rings = rings
        self._memory = memory
        self.settings: EpochSettings | None = None
        self.recipe: Recipe | None = None

    def epoch_began(self, settings: EpochSettings, recipe: Recipe) -> None:
        """Workers started from now on (first ones, added, replaced) run by ``settings``
        and make batches by ``recipe``."""
        self.settings = settings
        self.recipe = recipe

    def slot_bytes_ahead(self) -> int:
        """The bytes a slot of the epoch's recipe needs, where known before any batch is
        made, else 0 (:meth:`~shmloader.batch.recipe.Recipe.slot_bytes_ahead`)."""
        if self.recipe is None:
            raise RuntimeError("an epoch's recipe is known once it began")
        return self.recipe.slot_bytes_ahead()

    def config(self, wid: int, use_pdeathsig: bool, plan: EpochPlan, resume: dict | None) -> WorkerConfig:
        """The config of worker ``wid`` in the epoch of ``plan`` (``resume``: where its
        iterable shard resumes)."""
        s, recipe = self.settings, self.recipe
        if s is None or recipe is None:
            raise RuntimeError("workers are started once an epoch began: it sets their settings")
        return WorkerConfig(
            worker_id=wid,
            num_workers=s.most_workers,
            seed=plan.epoch_seed + wid,
            dataset=s.dataset,
            recipe=recipe,
            worker_init_fn=s.worker_init_fn,
            ring=self._rings.for_new_worker(),
            fixed_slot_bytes=s.fixed_slot_bytes,
            parent_pid=os.getpid(),
            use_pdeathsig=use_pdeathsig,
            rank=s.worker_rank,
            world_size=s.worker_world_size,
            resume=resume,
            epoch_seed=plan.sample_seed,
            shared_seed=plan.shared_seed,
            report_state=plan.stateful,
            shm_backend=s.shm_backend,
        )

    def start(self, count: int, plan: EpochPlan, started: Callable[[], None]) -> None:
        """Start ``count`` workers for the epoch of ``plan``, calling ``started()`` as each
        one runs (to give it tasks while the next is forked)."""
        rings = self._rings

        def config(wid: int, use_pdeathsig: bool) -> WorkerConfig:
            made = self.config(wid, use_pdeathsig, plan, _state.worker_resume(plan, wid))
            rings.starting(wid, made)
            return made

        def one_started() -> None:
            for w in self._pool.workers:
                rings.started(w.id)
                self._memory.started(w.id, w.proc.pid)
            started()

        try:
            self._pool.start(self._ctx, count, config, worker_main, started=one_started)
        finally:
            rings.forget_starting()

    def add(self, wid: int, plan: EpochPlan) -> WorkerHandle:
        """Start worker ``wid`` mid-epoch (the pool grows); nothing is sent to it."""
        new = self._pool.add(
            self._ctx, wid, lambda w, pdeath: self.config(w, pdeath, plan, None), worker_main
        )
        self._memory.started(new.id, new.proc.pid)
        return new

    def replace(self, old: WorkerHandle, plan: EpochPlan, resume: dict | None) -> WorkerHandle:
        """Reap ``old`` (killed first if it still runs) and start a worker with its id in its
        place, for the epoch of ``plan``; nothing is sent to it."""
        self._memory.stopped(old.proc.pid)
        new = self._pool.replace(
            old, self._ctx, lambda wid, pdeath: self.config(wid, pdeath, plan, resume), worker_main
        )
        self._memory.started(new.id, new.proc.pid)
        return new

    def stopping(self) -> None:
        """The pool's workers are being stopped: no longer the loader's to watch."""
        for w in self._pool.workers:
            self._memory.stopped(w.proc.pid)
