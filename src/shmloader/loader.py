"""The DataLoader: epochs, state and statistics.

Its arguments are checked once into a frozen :class:`~shmloader.config.LoaderConfig`;
what it works with (counters, clocks, rings and leases, pinning, autotune, the epoch
cursor) is one :class:`~shmloader.runtime.LoaderRuntime`, which its iterators receive.
This is the only module that reads the loader object: each ``iter()`` reads the config
and torch's writable attributes into one frozen
:class:`~shmloader.settings.EpochSettings`, which its epoch runs by, and hands the
iterator a narrow :class:`~shmloader.settings.LoaderReports` for what it tells back. An
epoch is loaded by :class:`~shmloader.epoch.inprocess.InProcessIter` (``num_workers=0``)
or :class:`~shmloader.epoch.multiprocess.MultiProcessIter` (workers writing into the
ring), with one recipe (:mod:`shmloader.batch.recipe`): ``num_workers`` never changes a
batch. Rings and leases: :mod:`shmloader.memory.leases`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from shmloader.batch import recipe as fetch
from shmloader.config import LoaderArguments, LoaderConfig, mp_context, warn_if_more_workers_than_cores
from shmloader.epoch import state as _state
from shmloader.epoch.inprocess import InProcessIter
from shmloader.epoch.multiprocess import MultiProcessIter
from shmloader.interop import torchcompat
from shmloader.memory.ring import Ring
from shmloader.runtime import LoaderRuntime
from shmloader.sampling import distributed as _dist
from shmloader.sampling.position import Now
from shmloader.settings import EpochSettings

# What torch's DataLoader refuses to change after construction (the epoch plan reads them).
_FIXED_AFTER_INIT = frozenset(
    {"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"}
)

T_co = TypeVar("T_co", covariant=True)


class DataLoader(Generic[T_co]):
    """Loads batches from ``dataset`` with worker processes writing into a shared-memory ring.

    A drop-in for ``torch.utils.data.DataLoader``'s common use: the same arguments, the
    same validation and the same meaning. Batches are numpy arrays (torch tensors where
    the samples were tensors) that view the ring's memory: zero copies after the worker
    wrote them. A batch's slot is reused only once no array viewing it is alive; in a
    batch of 64 KiB or more, arrays much smaller than its largest (labels beside images)
    are copies of their own, so a loop that keeps them keeps no slot (docs/kept-batches.md).

    Randomness (docs/randomness.md): without ``seed``, torch's RNG decides as in torch's
    loader, bit for bit and at the same moments (``generator`` a ``torch.Generator``, or
    torch's global RNG; nothing is drawn when the loader is made); ``seed=<int>`` (or a
    numpy ``Generator`` as ``generator``) makes every epoch's order and worker seeds
    functions of that seed and the epoch.

    Extra keyword arguments: ``seed`` (see above), ``num_slots``
    (slots in the ring; default ``num_workers * prefetch_factor + 4``; the ring doubles
    them when the consumer holds every slot, and goes back to the first ring's count once
    the held batches are gone: at the next epoch's start, or mid-epoch), ``slot_bytes``
    (bytes per slot; default sized from the first batch, and a later batch that does not
    fit makes the ring grow to larger slots; when given, a batch that does not fit is an
    error), ``max_shm_bytes``
    (the bound on all of the loader's rings; default half of the memory the backend can
    give: the machine's available memory, the container's cgroup headroom and, for
    ``posix``, /dev/shm's free space, when the loader is made; a ring also leaves a margin
    of what is there when it is made for the processes' own memory (a batch per worker,
    plus 32 MiB) rather than let a cgroup's OOM killer end a process later; where the
    default ring does not fit, the first ring gets fewer slots, down to ``num_workers + 2``,
    with one :class:`~shmloader.errors.RingSizeWarning`; where even that does not fit the
    error names the limit that binds),
    ``shm_backend`` (where rings live: ``"auto"``, the default, is ``"memfd"`` on Linux
    (``memfd_create``: charged to the process's memory, so a small /dev/shm such as
    Docker's 64 MB limits nothing) falling back to ``"posix"`` where the system refuses it,
    and $SHMLOADER_SHM_BACKEND where set; ``"posix"``: ``shm_open`` in /dev/shm), ``copy`` (batches
    own their memory instead of viewing the ring), ``collate`` and ``pad_value`` (ragged
    samples: ``"stack"``, ``"pad"`` or ``"list"``).

    ``output``: ``"auto"`` (default) hands out torch tensors exactly where torch's
    ``default_collate`` would (sharing the slot's memory) when torch is imported in the
    process when the loader is made, numpy arrays otherwise, and a ``collate_fn``'s output
    as it returns it (its numpy arrays stay numpy arrays, as in torch; ``output`` then
    reads ``"numpy"``); ``"torch"`` or ``"numpy"`` choose (``"torch"`` also makes a
    collate_fn's numeric arrays tensors). Where torch is imported the loader is also an
    instance of ``torch.utils.data.DataLoader`` and its samplers of torch's samplers (see
    :mod:`shmloader.interop.torchcompat`), so training frameworks treat it as one.

    ``images``: ``"auto"`` (default) runs a torchvision ``ImageFolder``/``DatasetFolder``
    whose transform is a recognized ``Compose`` fused in the workers (region JPEG decoding,
    Pillow's resize reproduced, the tensor ops written into the batch), with torch's
    batches bit for bit, random draws included; ``"fast"`` also decodes JPEGs at reduced
    scale and resamples with torch (close to torchvision's pixels, not equal);
    ``"python"`` never fuses. ``stats()["images"]`` says whether it runs fused and why not
    (docs/vision.md).

    Training (docs/training.md): ``pin_memory=True`` page-locks the ring once (CUDA only);
    :meth:`set_epoch`, :meth:`state_dict` and :meth:`load_state_dict` give exact resume.

    Sharding across ranks: by default (``distributed=False``) as torch's loader, only a
    ``DistributedSampler`` shards (one given as ``sampler``, or in a ``batch_sampler``, as
    Lightning and Fabric inject); nothing is read from the environment or
    ``torch.distributed`` (a torch DataPipe is sharded by ``torch.distributed``'s group, as
    torch shards it). Opt in to the loader's own sharding with ``distributed="auto"``
    (``torch.distributed``'s rank and world size when it is initialized, else ``RANK`` and
    ``WORLD_SIZE``; True: the same, and an error when neither is there) or explicit
    ``rank`` and ``world_size``: each rank then gets a disjoint share of every epoch's
    global order, as a ``DistributedSampler`` over it (the rank and world size are read when
    an epoch starts, so a loader made before ``torch.distributed`` is initialized shards
    once it is). Turn it on only where no other code splits the data: a dataset already
    split per rank, or a validation set every rank should see whole, would lose samples.

    ``max_worker_restarts`` (default 0: a worker that dies ends the epoch with
    :class:`~shmloader.errors.WorkerDiedError`, one that passes ``timeout`` with
    :class:`~shmloader.errors.LoaderTimeoutError`, as torch's): up to this many times in
    the loader's life (all epochs and iterators together), a worker that dies (a signal
    such as the OOM killer's SIGKILL, a segfault, ``os._exit``) or hangs past ``timeout``
    is reaped (killed first if hung) and replaced by a new one with the same worker id and
    the current epoch's seed, which loads its batches in flight again, same batch numbers
    and indices: the epoch yields the batches an undisturbed run yields, wherever the
    dataset's randomness is per sample (:func:`shmloader.sample_rng`) or absent. Each
    restart gives a :class:`~shmloader.errors.WorkerRestartWarning` and counts in
    ``stats()["worker_restarts"]``; the death after the last allowed restart is today's
    error. An iterable dataset's worker is restarted only where the dataset has
    ``shmloader_state_dict``/``shmloader_load_state_dict`` (below): its shard resumes from
    the state it reported after its last batch received (without them,
    ``WorkerDiedError``). See docs/restart.md.

    Dataset methods the loader calls beyond torch's (``__getitem__``, ``__getitems__``,
    ``__iter__``, ``__len__``): only these, under names no dataset has by accident, so a
    dataset's own ``stats()`` or ``state_dict()`` is never called. ``shmloader_stats()``:
    a dict of int counters, read in each worker after every batch and summed into
    ``stats()["dataset"]``. ``shmloader_state_dict()`` and
    ``shmloader_load_state_dict(state)``, both or neither, on an iterable dataset: its
    position, saved in each worker after every batch (for :meth:`state_dict` and
    ``max_worker_restarts``) and loaded before ``iter()`` to resume a shard.

    ``prefetch_next_epoch`` (default False; needs ``persistent_workers=True``): the
    workers load the next epoch's first batches while the last ones of this epoch are
    consumed, so the next epoch's first ``next()`` does not wait for a worker. torch loads
    nothing of an epoch before its ``iter()``, and neither does the default. Opt in only
    where nothing the samples read changes between epochs: those batches are made
    *before* the loop's per-epoch code runs, so a dataset that reads state the loop sets
    for the epoch (a ``multiprocessing.Value`` holding the epoch, a curriculum stage,
    ``dataset.set_epoch``, a changed transform) gives them the old epoch's state. Only the
    loader's own ``set_epoch`` and a changed dataset length are seen (the prefetched
    batches are then dropped). It applies to map-style datasets batched by the loader, with
    its own shuffle or a ``SequentialSampler`` and no ``generator=``; elsewhere nothing is
    prefetched. ``stats()["epochs_ahead"]`` counts the epochs that began so.

    ``share_dataset`` (default False; docs/share.md): before the first worker starts,
    replace the dataset's large Python containers (its attributes, or its attributes'
    attributes, that are lists, tuples or dicts of 16 MiB or more of Python objects) with
    :func:`shmloader.share` views of them, in place: read-only, equal values, stored once
    in shared memory, so forked workers copy no page of them by reading them and spawned
    workers receive a descriptor instead of the pickled data. ``stats()["memory"]["shared"]``
    names what was replaced, ``["not_shared"]`` what was left and why (a subclass, a value
    share() cannot store). Writing to a replaced attribute's contents raises TypeError.
    Without it the loader only watches: a :class:`~shmloader.errors.CopyOnReadWarning`
    says when workers' private memory grows as copy-on-read makes it grow.

    ``num_workers="auto"`` and ``prefetch_factor="auto"`` (docs/autotune.md): start with
    one worker and a prefetch of 2, and add workers mid-epoch while the training loop
    waits, the workers are busy and a core is free (up to the cores this process may use,
    and what the ring and memory hold), or raise the prefetch while the loop waits and the
    workers are not busy; ``num_workers`` and ``prefetch_factor`` then report the counts in
    use. An iterable dataset's ``"auto"`` workers are the cores, from the start.
    """

    _initialized = False  # set at the end of __init__: then _FIXED_AFTER_INIT is fixed

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # With torch imported: an instance of torch's DataLoader too (torchcompat.py).
        return object.__new__(torchcompat.flavoured(cls, "DataLoader"))

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Iterable[Any] | None = None,
        batch_sampler: Iterable[list[Any]] | None = None,
        num_workers: int | str = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | str | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        num_slots: int | None = None,
        slot_bytes: int | None = None,
        collate: str = "stack",
        pad_value: Any = 0,
        copy: bool = False,
        max_shm_bytes: int | None = None,
        shm_backend: str = "auto",
        output: str = "auto",
        distributed: Any = False,
        rank: int | None = None,
        world_size: int | None = None,
        max_worker_restarts: int = 0,
        prefetch_next_epoch: bool = False,
        share_dataset: bool = False,
        images: str = "auto",
    ) -> None:
        config = LoaderArguments(
            dataset=dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
            seed=seed,
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            collate=collate,
            pad_value=pad_value,
            copy=copy,
            max_shm_bytes=max_shm_bytes,
            shm_backend=shm_backend,
            output=output,
            distributed=distributed,
            rank=rank,
            world_size=world_size,
            max_worker_restarts=max_worker_restarts,
            prefetch_next_epoch=prefetch_next_epoch,
            share_dataset=share_dataset,
            images=images,
        ).checked()
        self._config = config
        self._set_public_attributes(config)
        self._runtime = LoaderRuntime(config)
        self._persistent_iter: MultiProcessIter | None = None
        self._bind_batch_sampler(config)
        self._initialized = True
        warn_if_more_workers_than_cores(config.num_workers)

    def _bind_batch_sampler(self, config: LoaderConfig) -> None:
        """Make the batch sampler the loader made for itself, iterated by anything but the
        loader, yield the loader's next epoch: its whole global order (rank 0 of 1). It
        gets the config and the cursor, not the loader (whose ring and workers must go
        when it is dropped)."""
        if not config.own_batching or config.batch_sampler is None:
            return  # no batch sampler, or the user's
        whole = Now(num_workers=config.num_workers, generator=config.generator)
        upcoming = functools.partial(_state.upcoming_batches, config, self._runtime.cursor, whole)
        config.batch_sampler.follow(upcoming)

    def _set_public_attributes(self, config: LoaderConfig) -> None:
        """torch's public attributes, and shmloader's, from ``config``.

        They hold the constructor's arguments under their own names (torch's do):
        frameworks re-create a loader from them with another sampler (Lightning's
        DistributedSampler injection), so each must mean what it meant here. Those not
        fixed after construction may be set later, as torch allows; ``num_workers`` and
        ``prefetch_factor`` report the counts in use ("auto" tunes them)."""
        self.iterable = config.iterable
        self.dataset = config.dataset
        self.num_workers = config.num_workers
        self.prefetch_factor = config.prefetch_factor
        self.pin_memory = config.pin_memory
        self.pin_memory_device = config.pin_memory_device
        self.timeout = config.timeout
        self.worker_init_fn = config.worker_init_fn
        self._mp_context = config.multiprocessing_context  # checked: a context, or None
        self.persistent_workers = config.persistent_workers
        self.prefetch_next_epoch = config.prefetch_next_epoch
        self.share_dataset = config.share_dataset
        self.images = config.images
        self.in_order = config.in_order
        self.max_worker_restarts = config.max_worker_restarts
        self.collate_fn = config.collate_fn
        self.drop_last = config.drop_last
        self.shm_backend = config.shm_backend
        self.num_slots = config.num_slots
        self.slot_bytes = config.slot_bytes
        self.collate = config.collate
        self.pad_value = config.pad_value
        self.copy = config.copy
        self.generator = config.generator
        self.seed = config.seed
        self.output = config.output
        # Rank and world size are read at each epoch (and len()), not frozen here: a loader
        # made before torch.distributed is initialized shards once it is.
        self.distributed = config.distributed
        self.sampler = config.sampler
        self.batch_sampler = config.batch_sampler
        self.batch_size = config.batch_size

    @property
    def config(self) -> LoaderConfig:
        """The loader's arguments as checked and filled in when it was made
        (:class:`~shmloader.config.LoaderConfig`): ``config.num_workers`` is the count it
        started with, ``num_workers`` the one in use."""
        return self._config

    @property
    def runtime(self) -> LoaderRuntime:
        """What the loader and its iterators work with (:class:`~shmloader.runtime.LoaderRuntime`):
        counters, clocks, rings and leases, the CUDA pinner, the autotuner, the epoch
        cursor. For integrations and tests; its parts are not a stable API."""
        return self._runtime

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIXED_AFTER_INIT and self._initialized:
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized: "
                "make a new loader with the new value."
            )
        object.__setattr__(self, name, value)

    @property
    def multiprocessing_context(self) -> Any:
        """The ``multiprocessing`` context workers start from (None: the platform's default);
        a start method name given to the constructor is turned into its context."""
        return self._mp_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        self._mp_context = mp_context(context, self.num_workers)

    @property
    def rank(self) -> int:
        """The rank whose share of each epoch the loader loads, read now: ``rank=`` if
        given, else with ``distributed="auto"`` (or True) torch.distributed's or the
        ``RANK`` environment variable's, else 0 (the default: the loader does not shard;
        a ``DistributedSampler`` may)."""
        return self.epoch_settings().rank

    @property
    def world_size(self) -> int:
        """Ranks the loader splits each epoch between, read now (as :attr:`rank`); 1 where
        it does not shard by itself (the default, and outside a distributed job)."""
        return self.epoch_settings().world_size

    @property
    def _IterableDataset_len_called(self) -> int | None:
        """torch's (private) name for an iterable dataset's length at the last
        ``len(loader)``, None before it."""
        return self._runtime.iterable_len

    @property
    def _auto_collation(self) -> bool:
        """torch's (private) name for whether samples are batched (a ``batch_size`` or a
        ``batch_sampler``)."""
        return self._config.auto_collation

    @property
    def _index_sampler(self) -> Any:
        """torch's (private) name for what yields each fetch's indices: the batch sampler
        when batching, else the sampler (None for an iterable dataset, which has neither
        here; torch's is an endless sampler of Nones)."""
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    @property
    def _dataset_kind(self) -> int:
        """torch's (private) ``_DatasetKind``: 0 for a map-style dataset, 1 for an iterable one."""
        return 1 if self.iterable else 0

    def __len__(self) -> int:
        if self.iterable:
            # What torch records for its warning when an iterable dataset yields more
            # (the iterators compare their batches with it).
            n = self._runtime.iterable_len = len(self.dataset)
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        sharded = self.batch_sampler if self.batch_sampler is not None else self.sampler
        world = self.world_size
        if not _dist.is_presharded(sharded) and world > 1:
            return _state.sharded_len(self._config, world)  # this rank's share
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return self.iter()

    def iter(self, *, copy: bool | None = None) -> Iterator[Any]:
        """An iterator over one epoch, like ``iter(loader)``; ``copy`` overrides the
        loader's ``copy`` for this epoch (True: batches own their memory and release
        their slot at once, for consumers that keep them)."""
        copy = self.copy if copy is None else copy
        config, runtime = self._config, self._runtime
        cursor = runtime.cursor
        # The epoch runs by the settings read now (as torch's iterator reads its loader's
        # attributes at iter()); nothing else moves until the iterator's first next(): it
        # calls ``start`` then (the epoch begins, workers start or persistent ones switch).
        settings = self.epoch_settings()
        now = settings.now
        if self.persistent_workers:
            # The loader keeps this iterator (and its workers) between epochs, so the
            # iterator reports to the loader through a weak reference: no reference cycle,
            # and a dropped loader stops its workers at once, not at the next cyclic gc.
            # The epoch handed out holds the loader, for as long as the caller holds it.
            kept = self._persistent_iter
            new_workers = kept is None or kept.closed
            # Under torch's RNG, what torch draws as it makes (or resets) its iterator.
            draws = _state.draw_for_iter(config, cursor, now, new_workers)
            start = _state.epoch_starter(config, cursor, lambda: now, draws)
            if new_workers:
                reports = _Reports(self, weak=True)
                kept = self._persistent_iter = MultiProcessIter(runtime, settings, start, copy, reports)
            else:
                kept.reset(start, copy, settings)
            # pending: state_dict() describes the epoch it will begin
            _state.attach(cursor, kept, draws)
            return _PersistentEpoch(kept, self)
        draws = _state.draw_for_iter(config, cursor, now, True)
        start = _state.epoch_starter(config, cursor, lambda: now, draws)
        if settings.num_workers == 0:
            it: Any = InProcessIter(runtime, settings, start, _Reports(self, weak=False))
        else:
            it = MultiProcessIter(runtime, settings, start, copy, _Reports(self, weak=False))
        _state.attach(cursor, it, draws)
        return it

    def epoch_settings(self) -> EpochSettings:
        """The settings an epoch begun now would run by (each ``iter()`` reads them so,
        once): the loader's arguments as checked, and torch's attributes as assigned
        since (``num_workers``, ``prefetch_factor``, ``collate_fn``, ``generator``,
        ``in_order``, ``timeout``, ``worker_init_fn``, ``multiprocessing_context``, ...),
        with the rank and world size read now (:attr:`rank`)."""
        config = self._config
        rank, world = _dist.detect(self.distributed, config.rank, config.world_size)
        if config.iterable and fetch.is_datapipe(config.dataset):
            worker_rank, worker_world = _dist.datapipe_shard(self.distributed, config.rank, config.world_size)
        else:
            worker_rank, worker_world = rank, world
        tuner = config.tuner
        return EpochSettings(
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            most_workers=self.num_workers if tuner is None else tuner.max_workers,
            rank=rank,
            world_size=world,
            worker_rank=worker_rank,
            worker_world_size=worker_world,
            sharding_asked=_dist.asked(self.distributed, config.rank, config.world_size),
            generator=self.generator,
            in_order=self.in_order,
            dataset=self.dataset,
            iterable=self.iterable,
            collate_fn=self.collate_fn,
            collate=self.collate,
            pad_value=self.pad_value,
            output=self.output,
            worker_init_fn=self.worker_init_fn,
            timeout=self.timeout,
            multiprocessing_context=self.multiprocessing_context,
            persistent_workers=bool(self.persistent_workers),
            prefetch_next_epoch=bool(self.prefetch_next_epoch),
            max_worker_restarts=self.max_worker_restarts,
            share_dataset=bool(config.share_dataset),
            shm_backend=self.shm_backend,
            fixed_slot_bytes=self.slot_bytes is not None,
        )

    def stats(self) -> dict[str, Any]:
        """Counters of this loader, as plain data: ``batches`` handed out, of which
        ``batches_copied`` did not come as views of the ring (each worker's first batch,
        which sizes the ring unless a write-into dataset declared it, and batches that
        outgrew their slot: views of a one-off segment each; ``copy=True``; main-process
        loading; not a batch whose small leaves alone are copies), ``rings_created`` (the
        first ring, then one per growth or shrink), ``worker_restarts`` (dead or hung workers replaced
        under ``max_worker_restarts``), ``epochs_ahead`` (``prefetch_next_epoch``: epochs whose
        first batches loaded while the last one's were consumed) and
        ``batches_ahead_dropped`` (so loaded, and not used: ``set_epoch`` or a changed
        dataset gave the epoch another plan), the current ring's ``num_slots`` and ``slot_bytes``,
        ``pinned_shm_bytes``, ``images``: ``images=``'s ``mode``, whether the fused
        torchvision path is ``active``, the ``reason`` when not, the ``fused`` and
        ``fell_back`` sample counts and ``fallback_share``, ``dataset``: the sum over all
        workers of the dataset's ``shmloader_stats()`` counters, when it has that method (e.g.
        ``shmloader.vision.ImageFolder`` counts files skipped under ``on_error="skip"``;
        a method named ``stats`` is the dataset's own, never called), and ``time``: where the time went
        over the loader's life (see :mod:`shmloader.tuning.timing`): ``start_s`` (the first ``next()``
        of each epoch: workers starting), ``wait_s`` (the training loop inside the other
        ``next()`` calls), ``loop_s`` (between ``next()`` calls), ``waited_share``,
        ``ready_batches_mean`` (batches already loaded at each ``next()``), per worker
        ``fetch_s``, ``collate_s`` and ``idle_s`` (``workers``),
        ``workers_busy_share``, and ``verdict``: one line saying whether the loop is
        data-bound or compute-bound and what to change; with ``num_workers`` or
        ``prefetch_factor`` ``"auto"``, ``autotune``: the counts in use and the changes
        made (see :mod:`shmloader.tuning.autotune`); ``memory``: the running workers'
        memory (``uss``, ``pss``, ``private`` and its ``growth`` since each started), the
        parent's, the peaks, and what ``share_dataset`` replaced (see
        :meth:`shmloader.memory.watch.MemoryWatch.report`; it reads /proc once per worker
        when its last reading is over a second old: call it per epoch, not per batch)."""
        runtime = self._runtime
        out = dict(runtime.stats)
        dataset = dict(out["dataset"])
        if self.num_workers == 0 and callable(getattr(self.dataset, "shmloader_stats", None)):
            dataset = dict(self.dataset.shmloader_stats())  # loaded in this process: its own counters
        out["images"] = runtime.images.report(dataset)  # (takes its counters out of dataset's)
        out["dataset"] = dataset
        ring = runtime.leases.current
        out["num_slots"] = ring.num_slots if ring is not None else 0
        out["slot_bytes"] = ring.slot_bytes if ring is not None else 0
        out["pinned_shm_bytes"] = self.pinned_shm_bytes()
        out["time"] = runtime.timing.report(in_process=self.num_workers == 0)
        out["memory"] = runtime.memory.report()
        if runtime.tuner is not None:
            out["autotune"] = runtime.tuner.report()
        return out

    def set_epoch(self, epoch: int) -> None:
        """Load epoch ``epoch`` when the next epoch begins (the first ``next()`` after
        ``iter()``), as ``DistributedSampler.set_epoch``: with ``seed=`` its order and seeds
        are functions of the loader's seed and ``epoch``, the same on every rank (under
        torch's RNG they are drawn at ``iter()``, whatever the epoch); a sampler with
        ``set_epoch`` is given it. Without it, epochs count up from 0 by themselves."""
        _state.set_epoch(self._runtime.cursor, epoch)

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, as plain Python data (safe in a torch checkpoint).

        Take it at any point, mid-epoch included: after :meth:`load_state_dict` a new
        loader yields exactly the batches not handed out yet, with the same contents
        (batches prefetched by workers are produced again). For map-style datasets it is
        the same on every rank at a step all ranks reached (save it from rank 0; without
        ``seed=``, where the ranks' generators agree, as they must for sharding), and it
        survives a change of ``num_workers`` and of the world size: the rest of the epoch
        is split between the new ranks. Iterable datasets resume shard by shard (same
        rank, world size and ``num_workers``)."""
        it = self._persistent_iter
        kept = self.persistent_workers and it is not None and not it.closed
        return _state.state_dict(self._config, self._runtime.cursor, self.epoch_settings().now, kept)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) when the next epoch begins (the
        first ``next()`` after ``iter()``); a state saved after an epoch's last batch
        continues with the next epoch, in full. The loader adopts the saved seed (or what
        torch's RNG drew for the saved epoch) and puts its ``torch.Generator`` back where
        the saved run's was, so the order and random draws of this epoch and the following
        ones match the saved run's."""
        runtime = self._runtime
        _state.load_state_dict(self._config, runtime.cursor, self.epoch_settings().now, state, self.shutdown)

    @property
    def ring(self) -> Ring | None:
        """The shared-memory ring new batches go to, once a multi-worker iteration has
        created it."""
        return self._runtime.leases.current

    @property
    def max_shm_bytes(self) -> int:
        """The bound on the shared memory of all this loader's rings together (default:
        half of /dev/shm's free space when the loader was made)."""
        return self._runtime.leases.max_shm_bytes

    @max_shm_bytes.setter
    def max_shm_bytes(self, value: int) -> None:
        self._runtime.leases.max_shm_bytes = value

    def pinned_shm_bytes(self) -> int:
        """Bytes of shared memory this loader's rings hold now: the current ring, and
        retired rings that batches the consumer still references keep alive."""
        return self._runtime.leases.pinned_bytes()

    def shutdown(self) -> None:
        """Stop persistent workers now (they also stop when the loader is collected)."""
        if self._persistent_iter is not None:
            self._persistent_iter.close()
            self._persistent_iter = None

    @property
    def persistent_iterator(self) -> MultiProcessIter | None:
        """The iterator a ``persistent_workers`` loader keeps between epochs (its
        ``workers``, ``worker_pids()``, ``prefetching_next_epoch``), or None: before the
        first epoch with workers, after :meth:`shutdown`, without persistent workers."""
        return self._persistent_iter

    @property
    def _iterator(self) -> MultiProcessIter | None:
        """torch's (private) name for the iterator a ``persistent_workers`` loader keeps
        between epochs, None when there is none; code written for torch's loader stops
        its workers with ``loader._iterator._shutdown_workers()`` and ``loader._iterator =
        None`` (Lightning's loops, torch's own tests)."""
        return self._persistent_iter

    @_iterator.setter
    def _iterator(self, value: None) -> None:
        if value is not None:
            raise ValueError("only None can be assigned to _iterator (it stops the persistent workers)")
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


class _Reports:
    """What an epoch tells its loader (a :class:`~shmloader.settings.LoaderReports`): the
    counts a tuner set, and ``len(loader)``. ``weak``: for a persistent loader's iterator,
    which the loader keeps, so it must not keep the loader (a dropped loader stops its
    workers at once); an iterator of one epoch holds its loader, as it did."""

    __slots__ = ("_loader",)

    def __init__(self, loader: DataLoader, weak: bool) -> None:
        self._loader: Callable[[], DataLoader | None] = weakref.ref(loader) if weak else lambda: loader

    def counts(self, num_workers: int, prefetch_factor: int | None) -> None:
        loader = self._loader()
        if loader is not None:
            loader.num_workers = num_workers
            loader.prefetch_factor = prefetch_factor

    def length(self) -> int:
        loader = self._loader()
        if loader is None:
            raise ReferenceError("the DataLoader of this iterator was garbage collected")
        return len(loader)


class _PersistentEpoch:
    """One epoch of a ``persistent_workers`` loader: its iterator (which the loader keeps
    between epochs and which sees the loader only weakly), and the loader, held for as
    long as the caller holds the epoch (``for b in DataLoader(...)`` works while nothing
    else holds the loader). Everything else is the iterator's."""

    __slots__ = ("_it", "_loader")

    def __init__(self, it: MultiProcessIter, loader: DataLoader) -> None:
        self._it = it
        self._loader = loader

    def __iter__(self) -> _PersistentEpoch:
        return self

    def __next__(self) -> Any:
        return self._it.__next__()

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)
