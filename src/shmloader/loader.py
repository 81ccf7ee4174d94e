"""DataLoader and its iterators.

The consumer side of the data path: pick a FREE slot, send (slot, batch number, sample
indices) to a worker, wait on every worker's socket and process sentinel at once, and
when a slot comes back READY hand out numpy views of it. A slot returns to FREE only
when the last view of it dies (a lease on the batch's root array, see leases.py).

``_MultiProcessIter`` is the glue: the workers are a :class:`~shmloader.pool.WorkerPool`
(start, watch, stop, death and timeout errors), which worker loads which batch and the
order they are handed out in is a :class:`~shmloader.scheduler.Scheduler`, the frames and
the slot header are :mod:`shmloader.wire`'s, the rings and slot leases are
:mod:`shmloader.leases`'.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import select
import sys
import time
import weakref
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from shmloader import _slots, context, fetch, wire
from shmloader import distributed as _dist
from shmloader import leases as _leases
from shmloader import pinning as _pinning
from shmloader import state as _state
from shmloader.collate import COLLATE_MODES
from shmloader.errors import LoaderTimeoutError, RingLimitError, ShmSpaceError, WorkerDiedError, WorkerError
from shmloader.layout import decode, make_reader
from shmloader.pool import WorkerHandle, WorkerPool, short_indices
from shmloader.ring import Ring, attach_fd
from shmloader.sampler import BatchSampler, RandomSampler, SequentialSampler
from shmloader.scheduler import Scheduler
from shmloader.worker import WorkerConfig, WorkerFailure, worker_main

_LAYOUT_CACHE_SIZE = 1024  # readers kept, one per distinct batch structure (skeleton)


class DataLoader:
    """Loads batches from ``dataset`` with worker processes writing into a shared-memory ring.

    A drop-in for ``torch.utils.data.DataLoader``'s common use: the same arguments, the
    same validation and the same meaning. Batches are numpy arrays (torch tensors where
    the samples were tensors) that view the ring's memory: zero copies after the worker
    wrote them. A batch's slot is reused only once no array viewing it is alive.

    Extra keyword arguments: ``seed`` (an int alternative to ``generator``), ``num_slots``
    (slots in the ring; default ``num_workers * prefetch_factor + 4``; the ring doubles
    them when the consumer holds every slot), ``slot_bytes`` (bytes per slot; default
    sized from the first batch, and a later batch that does not fit makes the ring grow to
    larger slots; when given, a batch that does not fit is an error), ``max_shm_bytes``
    (the bound on all growth; default half of /dev/shm's free space), ``copy`` (batches
    own their memory instead of viewing the ring), ``collate`` and ``pad_value`` (ragged
    samples: ``"stack"``, ``"pad"`` or ``"list"``).

    Training (docs/training.md): ``output="torch"`` hands out tensors sharing the slot;
    ``pin_memory=True`` page-locks the ring once (CUDA only); ``distributed="auto"``
    (default), ``rank`` and ``world_size`` give each rank a disjoint share of every epoch;
    :meth:`set_epoch`, :meth:`state_dict` and :meth:`load_state_dict` give exact resume.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Iterable[Any] | None = None,
        batch_sampler: Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        in_order: bool = True,
        seed: int | None = None,
        num_slots: int | None = None,
        slot_bytes: int | None = None,
        collate: str = "stack",
        pad_value: Any = 0,
        copy: bool = False,
        max_shm_bytes: int | None = None,
        output: str = "numpy",
        distributed: Any = "auto",
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                "num_workers option should be non-negative; use num_workers=0 to disable "
                f"multiprocessing (got num_workers={num_workers!r})."
            )
        if timeout < 0:
            raise ValueError(f"timeout option should be non-negative (got timeout={timeout!r}).")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing. Let "
                "num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
            )
        if prefetch_factor is None:
            prefetch_factor = 2
        if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
            raise ValueError(f"prefetch_factor should be a positive integer (got {prefetch_factor!r}).")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if seed is not None and generator is not None:
            raise ValueError(
                "pass either seed or generator, not both: seed is an int shortcut for generator."
            )
        if num_slots is not None and (not isinstance(num_slots, int) or num_slots < 1):
            raise ValueError(f"num_slots should be a positive integer (got {num_slots!r}).")
        if slot_bytes is not None and (not isinstance(slot_bytes, int) or slot_bytes < 1):
            raise ValueError(f"slot_bytes should be a positive integer number of bytes (got {slot_bytes!r}).")
        if collate not in COLLATE_MODES:
            raise ValueError(
                f"collate should be one of {', '.join(map(repr, COLLATE_MODES))} (got {collate!r}): "
                "'stack' for equal shapes, 'pad' or 'list' for ragged samples."
            )
        if max_shm_bytes is not None and (not isinstance(max_shm_bytes, int) or max_shm_bytes < 1):
            raise ValueError(f"max_shm_bytes should be a positive integer (got {max_shm_bytes!r}).")
        if output not in ("numpy", "torch"):
            raise ValueError(
                f"output should be 'numpy' or 'torch' (got {output!r}): 'torch' hands out "
                "tensors sharing the slot's memory."
            )

        self.iterable = _is_iterable_dataset(dataset)
        if self.iterable:
            if shuffle not in (False, None):
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified shuffle option, "
                    f"but got shuffle={shuffle}"
                )
            if sampler is not None:
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified sampler option, "
                    f"but got sampler={sampler}"
                )
            if batch_sampler is not None:
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified batch_sampler option, "
                    f"but got batch_sampler={batch_sampler}"
                )
        elif not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"dataset of type {type(dataset).__name__} has neither __getitem__ (map-style) "
                "nor __iter__ (iterable-style); give it one of them."
            )
        shuffle = bool(shuffle)
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                    "sampler, and drop_last"
                )
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError(
                "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
            )

        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.persistent_workers = persistent_workers
        self.in_order = in_order
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.num_slots = num_slots or _leases.default_num_slots(num_workers, prefetch_factor)
        self.slot_bytes = slot_bytes
        self.collate = collate
        self.pad_value = pad_value
        self.copy = copy
        self.generator = generator
        # Every epoch's order and worker seeds are functions of (_seed, epoch): see state.py.
        # With a generator, _seed is drawn from it again at each iter() (as torch's sampler
        # and base seed are), so g.manual_seed(0) before each epoch repeats the order.
        self._draw_seed = _seed_source(seed, generator)
        self._reseed_each_epoch = generator is not None
        self._seed = self._draw_seed()
        self._rng = (
            generator if isinstance(generator, np.random.Generator) else np.random.default_rng(self._seed)
        )
        self._next_epoch = 0  # the epoch the next iter() loads (set_epoch, or one more)
        self._resume: dict | None = None  # a loaded position, for the next iter()
        self._plan: _state.EpochPlan | None = None
        self._live_iter: weakref.ref | None = None
        self.output = output
        self.rank, self.world_size = _dist.detect(distributed, rank, world_size)
        self._own_shuffle = not self.iterable and sampler is None and shuffle
        self._own_batching = not self.iterable and batch_sampler is None

        if self.iterable:
            self.sampler = None
            self.batch_sampler = None
            self.batch_size = batch_size
        else:
            if sampler is None:
                sampler = (
                    RandomSampler(dataset, generator=self._rng) if shuffle else SequentialSampler(dataset)
                )
            if batch_size is not None and batch_sampler is None:
                batch_sampler = BatchSampler(sampler, batch_size, drop_last)
            self.sampler = sampler
            self.batch_sampler = batch_sampler
            self.batch_size = batch_size
        # Counters for stats(): plain ints bumped on the hand-out path (no locks, no syscalls).
        self._stats: dict[str, Any] = {"batches": 0, "batches_copied": 0, "rings_created": 0, "dataset": {}}
        self._pinner = _pinning.make_pinner(pin_memory)  # None: off, or no CUDA (warned)
        # The rings (current and retired), slot claims and leases; see leases.py.
        self._leases = _leases.Leases(
            self.num_slots,
            max_shm_bytes if max_shm_bytes is not None else _leases.default_max_shm_bytes(),
            self._pinner,
            self._stats,
        )
        if slot_bytes is not None and num_workers > 0:
            # Sized by the user: reserve it now, so a too-small /dev/shm is an error here.
            self._leases.new_ring(self.num_slots, slot_bytes)
        self._persistent_iter: _MultiProcessIter | None = None

    @property
    def _auto_collation(self) -> bool:
        """Whether samples are batched: batch_size or batch_sampler was given."""
        if self.iterable:
            return self.batch_size is not None
        return self.batch_sampler is not None

    def __len__(self) -> int:
        if self.iterable:
            n = len(self.dataset)
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        if self.world_size > 1 and not _dist.is_presharded(self.sampler):
            return _state.sharded_len(self)  # this rank's share
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
        epoch_seed = _state.begin_epoch(self).epoch_seed  # sets self._plan
        if self.num_workers == 0:
            it: Any = _SingleProcessIter(self, epoch_seed)
        elif self.persistent_workers:
            it = self._persistent_iter
            if it is None or it.closed:
                it = self._persistent_iter = _MultiProcessIter(self, epoch_seed, copy)
            else:
                it.reset(epoch_seed, copy)
        else:
            it = _MultiProcessIter(self, epoch_seed, copy)
        self._live_iter = weakref.ref(it)  # the iterator state_dict() describes
        return it

    def stats(self) -> dict[str, Any]:
        """Counters of this loader, as plain data: ``batches`` handed out, of which
        ``batches_copied`` did not come as views of the ring (each worker's first batch,
        which sizes the ring, and batches that outgrew their slot: views of a one-off
        segment each; ``copy=True``; main-process loading), ``rings_created`` (the first
        ring, then one per growth), the current ring's ``num_slots`` and ``slot_bytes``,
        ``pinned_shm_bytes``, and ``dataset``: the sum over all workers of the dataset's
        own ``stats()`` counters, when it has one (e.g. ``shmloader.vision.ImageFolder``
        counts files skipped under ``on_error="skip"``)."""
        out = dict(self._stats)
        dataset = dict(out["dataset"])
        if self.num_workers == 0 and callable(getattr(self.dataset, "stats", None)):
            dataset = dict(self.dataset.stats())  # loaded in this process: its own counters
        out["dataset"] = dataset
        ring = self._leases.current
        out["num_slots"] = ring.num_slots if ring is not None else 0
        out["slot_bytes"] = ring.slot_bytes if ring is not None else 0
        out["pinned_shm_bytes"] = self.pinned_shm_bytes()
        return out

    def set_epoch(self, epoch: int) -> None:
        """Load epoch ``epoch`` on the next ``iter()`` (as ``DistributedSampler.set_epoch``):
        its order and seeds are functions of the loader's seed and ``epoch``, the same on
        every rank. Without it, epochs count up from 0 by themselves."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative integer (got {epoch!r}).")
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None  # moving to another epoch than the loaded one
        self._next_epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, as plain Python data (safe in a torch checkpoint).

        Take it at any point, mid-epoch included: after :meth:`load_state_dict` a new
        loader yields exactly the batches not handed out yet, with the same contents
        (batches prefetched by workers are produced again). For map-style datasets it is
        the same on every rank at a step all ranks reached (save it from rank 0), and it
        survives a change of ``num_workers`` and of the world size: the rest of the epoch
        is split between the new ranks. Iterable datasets resume shard by shard (same
        rank, world size and ``num_workers``)."""
        return _state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) on the next ``iter()``. The
        loader adopts the saved seed, so the order and random draws match the saved run."""
        _state.load_state_dict(self, state)

    @property
    def ring(self) -> Ring | None:
        """The shared-memory ring new batches go to, once a multi-worker iteration has
        created it."""
        return self._leases.current

    @property
    def _ring(self) -> Ring | None:
        """The current ring (as ``ring``), for the iterators."""
        return self._leases.current

    @property
    def max_shm_bytes(self) -> int:
        """The bound on the shared memory of all this loader's rings together (default:
        half of /dev/shm's free space when the loader was made)."""
        return self._leases.max_shm_bytes

    @max_shm_bytes.setter
    def max_shm_bytes(self, value: int) -> None:
        self._leases.max_shm_bytes = value

    def pinned_shm_bytes(self) -> int:
        """Bytes of shared memory this loader's rings hold now: the current ring, and
        retired rings that batches the consumer still references keep alive."""
        return self._leases.pinned_bytes()

    def _index_sequence(self) -> Iterator[Any]:
        """This epoch's tasks: index lists (auto-collation) or single indices, this
        rank's share of what is left of the epoch (see state.index_sequence)."""
        return _state.index_sequence(self, self._plan)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Stop persistent workers now (they also stop when the loader is collected)."""
        if self._persistent_iter is not None:
            self._persistent_iter.close()
            self._persistent_iter = None

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _is_iterable_dataset(dataset: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    from shmloader.dataset import IterableDataset

    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def _seed_source(seed: int | None, generator: Any) -> Callable[[], int]:
    """A function drawing the loader's seed: from ``generator`` (a numpy or torch
    Generator) at each call; else ``seed``, or (like torch's loader, following the global
    RNG the user seeded) one draw from torch's global RNG when torch is imported, numpy's
    otherwise."""
    if isinstance(generator, np.random.Generator):
        return lambda: int(generator.integers(0, 2**62))
    if generator is not None:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a numpy.random.Generator or a torch.Generator, got "
                f"{type(generator).__name__}; or pass seed=<int>."
            )
        return lambda: _fold(int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()))
    if seed is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        else:
            seed = int(np.random.randint(0, 2**62, dtype=np.int64))
    fixed = _fold(seed)
    return lambda: fixed


def _fold(seed: int) -> int:
    """A seed below 2**62 (the loader's seeds always were), drawn from ``seed``."""
    return int(np.random.default_rng(seed & (2**64 - 1)).integers(0, 2**62))


# ---------------------------------------------------------------------------------------


class _SingleProcessIter:
    """num_workers=0: fetch and collate in this process; same batches as with workers."""

    def __init__(self, loader: DataLoader, epoch_seed: int) -> None:
        self._loader = loader
        self._seq = 0
        self._plan = plan = loader._plan
        self._epoch_done = False
        self._epoch_seed = epoch_seed
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
            self._source = _state.open_iterable(loader.dataset, plan.workers[0] if plan is not None else None)
        else:
            self._source = loader._index_sequence()
        self._recipe = fetch.Recipe(
            loader.dataset,
            iterable=loader.iterable,
            auto_collation=loader._auto_collation,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            collate_fn=loader.collate_fn,
            collate=loader.collate,
            pad_value=loader.pad_value,
            output=loader.output,
        )

    def __iter__(self) -> _SingleProcessIter:
        return self

    def __next__(self) -> Any:
        context.enter_main_epoch(self._epoch_seed, self._shard)  # another loader may have run between
        try:
            batch = self._next_batch()
        except StopIteration:
            self._epoch_done = True
            context.leave_main_epoch()  # outside an epoch, sample_rng follows np.random
            raise
        stats = self._loader._stats
        stats["batches"] += 1
        stats["batches_copied"] += 1  # built in this process's memory, not in a ring
        for convert in self._post:
            batch = convert(batch)
        return batch

    def _batches_handed_out(self) -> int:
        """Batches handed out (or raised) this iteration, for state_dict()."""
        return self._seq

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


# ---------------------------------------------------------------------------------------


_WorkerHandle = WorkerHandle  # (the pool's)


class _Task:
    """One batch sent to a worker: its slot is in ``ring`` (the ring current when it was
    sent; a ring that grows since keeps serving the tasks given before)."""

    __slots__ = ("indices", "ring", "seq", "slot", "worker")

    def __init__(self, seq: int, worker: _WorkerHandle, slot: int, indices: Any, ring: Ring | None) -> None:
        self.seq = seq
        self.worker = worker
        self.slot = slot
        self.indices = indices
        self.ring = ring


_live_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_iterators() -> None:
    for it in list(_live_iterators):
        it.close()


def _forget_workers_after_fork() -> None:
    """In a copy of the consumer made by os.fork(): the workers are not its children.
    multiprocessing still lists them, and at the copy's exit its atexit hook would
    SIGTERM them (killing the real consumer's epoch) and fail to join them."""
    children = getattr(multiprocessing.process, "_children", None)
    if children is None:
        return
    for it in list(_live_iterators):
        for w in getattr(it, "_workers", ()):
            children.discard(w.proc)


os.register_at_fork(after_in_child=_forget_workers_after_fork)


class _MultiProcessIter:
    """Iterator over one epoch with worker processes (reused across epochs when persistent)."""

    def __init__(self, loader: DataLoader, epoch_seed: int, copy: bool) -> None:
        self._loader = loader
        self._copy = copy
        self._pid = os.getpid()
        self.closed = False
        # Start, watch (sockets and sentinels in one poll), stop; _workers is its list.
        self._pool = WorkerPool()
        self._workers = self._pool.workers
        self._readers: dict[bytes, Callable[[np.ndarray, Any, list[int]], Any]] = {}
        self._ring_wanted = 0  # bytes a batch that came outside the ring needs: a ring to make
        ctx = loader.multiprocessing_context
        if ctx is None or isinstance(ctx, str):
            ctx = multiprocessing.get_context(ctx)
        self._ctx = ctx
        # A ring whose descriptor is closed (this process was forked from the one that
        # made it) cannot be handed to new workers: the first batch sizes a new one.
        ring = loader._ring
        self._ring = ring if ring is not None and ring.fd is not None else None
        # Round robin, reordering and the position for state_dict: state.py reads
        # scheduler.handed_out(), .handed_out_per_worker() and .shard_states_handed_out().
        # Its results dict is this iterator's _results for its whole life.
        self.scheduler = Scheduler(loader.num_workers, loader.in_order, wire.RES_ITER_END)
        self._results = self.scheduler.results
        self._begin_epoch(epoch_seed)
        _live_iterators.add(self)
        try:
            self._start_workers(epoch_seed)
            self._dispatch()
        except BaseException:
            self.close()
            raise

    # --- set-up -------------------------------------------------------------------------

    def _begin_epoch(self, epoch_seed: int) -> None:
        loader = self._loader
        self._epoch_seed = epoch_seed
        self._source = None if loader.iterable else loader._index_sequence()
        self._source_done = False
        self._tasks: dict[int, _Task] = {}
        self._plan = plan = loader._plan
        self._epoch_done = False
        # Iterable datasets, for state_dict(): the round robin starts where the saved run
        # would have gone on.
        self.scheduler.begin_epoch(plan.start_worker if plan is not None else 0)

    @property
    def _send_seq(self) -> int:
        """The next batch number to send."""
        return self.scheduler.send_seq

    @property
    def _rcvd_seq(self) -> int:
        """In order: the next batch number to hand out."""
        return self.scheduler.rcvd_seq

    def _start_workers(self, epoch_seed: int) -> None:
        loader = self._loader

        def config(wid: int, use_pdeathsig: bool) -> WorkerConfig:
            return WorkerConfig(
                worker_id=wid,
                num_workers=loader.num_workers,
                seed=epoch_seed + wid,
                dataset=loader.dataset,
                iterable=loader.iterable,
                auto_collation=loader._auto_collation,
                batch_size=loader.batch_size,
                collate=loader.collate,
                pad_value=loader.pad_value,
                drop_last=loader.drop_last,
                collate_fn=loader.collate_fn,
                worker_init_fn=loader.worker_init_fn,
                ring=self._ring,
                fixed_slot_bytes=loader.slot_bytes is not None,
                parent_pid=os.getpid(),
                use_pdeathsig=use_pdeathsig,
                rank=loader.rank,
                world_size=loader.world_size,
                resume=_state.worker_resume(self._plan, wid),
                report_state=self._plan is not None and self._plan.stateful,
            )

        self._pool.start(self._ctx, loader.num_workers, config, worker_main)

    # --- dispatch -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Send tasks until every worker has prefetch_factor of them (one each before the
        ring exists: the first results size it)."""
        if self._ring_wanted:
            if self._tasks or self._results:
                return  # __next__ makes the ring after handing out the batch that asked
            self._make_wanted_ring()
        loader = self._loader
        per_worker = loader.prefetch_factor if self._ring is not None else 1
        workers = self._workers
        # Batches dispatched and not yet handed out, received or not: this bounds the
        # slots in use by the loader, whatever order the workers finish in.
        cap = per_worker * len(workers)
        sched = self.scheduler
        while not self._source_done and len(self._tasks) + len(self._results) < cap:
            wid = sched.pick(cap)
            if wid is None:
                if not sched.any_active():
                    self._source_done = True
                return
            worker = workers[wid]
            if loader.iterable:
                kind, payload, indices = wire.TASK_ITER, b"", None
            else:
                try:
                    indices = next(self._source)  # type: ignore[arg-type]
                except StopIteration:
                    self._source_done = True
                    return
                kind, payload = _task_payload(indices)
            slot = self._claim_slot()
            seq = sched.assign(wid)
            task = _Task(seq, worker, slot, indices, self._ring)
            self._tasks[seq] = task
            if not worker.writer.send(wire.frame(wire.pack(kind, slot, seq, payload))):
                self._pool.queued(worker)  # a big task: the rest goes out on POLLOUT
            if not sched.any_active():
                return

    def _claim_slot(self) -> int:
        """A slot for the next task (NO_SLOT before the first batch sized the ring). The
        leases may hand back a new ring (grown, or the old one shared with a forked
        child): the workers get it before the task that uses it."""
        if self._ring is None:
            return wire.NO_SLOT
        ring, slot = self._loader._leases.claim(self._send_seq)
        if ring is not self._ring and ring is not None:
            self._adopt_ring(ring)
        return slot

    # --- receive ------------------------------------------------------------------------

    def __iter__(self) -> _MultiProcessIter:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        if self.closed:
            raise StopIteration
        try:
            if self._ring_wanted:
                self._make_wanted_ring()
            item = self._next_result()
            if item is not None and not self._ring_wanted:
                # (A ring to make waits for the next call: this batch goes out first.)
                self._dispatch()
        except (WorkerDiedError, LoaderTimeoutError):
            # Dead or hung workers: do not wait for a busy one to finish its batch
            # (a timeout would otherwise surface only after pool.JOIN_TIMEOUT_S more).
            self.close(graceful=False)
            raise
        except (RingLimitError, ShmSpaceError):
            self.close()  # the epoch cannot go on: leave nothing running
            raise
        if item is None:
            self._end_epoch()
            raise StopIteration
        kind, task, payload = item
        return self._materialize(kind, task, payload)

    def _next_result(self) -> tuple[int, _Task, bytes] | None:
        """The next result to hand out, waiting for it; None at the end of the epoch."""
        pop = self.scheduler.pop
        while True:
            item = pop()
            if item is not None:
                return item  # type: ignore[return-value]
            if not self._tasks:
                self._dispatch()
                if not self._tasks:
                    return None
            self._wait()

    def _wait(self) -> None:
        """Block until at least one worker message or exit, and handle it; queued task
        bytes are written as the sockets take them, meanwhile."""
        timeout = self._loader.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        pool = self._pool
        due = self._tasks.get(self._rcvd_seq) if self._loader.in_order else None
        events = pool.wait(due.worker if due is not None else None, deadline)
        if events is None:
            raise self._timeout_error(timeout)
        dead = []
        owners = pool.fd_owner
        for fd, mask in events:
            worker, is_sentinel = owners.get(fd, (None, False))
            if worker is None:
                continue
            if is_sentinel:
                dead.append(worker)
            elif mask != select.POLLOUT:
                self._receive(worker)
        for worker in dead:
            self._drain(worker)
            wid = worker.id
            if self.scheduler.outstanding[wid] or (self.scheduler.active[wid] and not self._source_done):
                raise self._death_error(worker)
            pool.forget(worker)

    def _receive(self, worker: _WorkerHandle) -> bool:
        """Read what ``worker`` sent (one read: its socket is non-blocking) and handle
        every message completed; False at EOF (the worker is gone)."""
        try:
            messages = worker.reader.read()
        except OSError:
            messages = None
        if messages is None:
            # EOF can be seen twice (its poll event, then _drain when the sentinel
            # fires in the same round): forget_fd is idempotent.
            self._pool.forget_fd(worker.fd)
            return False
        for msg in messages:
            self._handle(worker, msg)
        return True

    def _handle(self, worker: _WorkerHandle, msg: bytes) -> None:
        """Act on one message from ``worker``."""
        kind, _slot, seq = wire.unpack(msg)
        if kind >= wire.RES_INIT_ERROR:  # rare kinds, behind one comparison
            if kind == wire.RES_SHARD_STATE:
                self._shard_state(worker, seq, wire.body(msg))
                return
            if kind == wire.RES_STATS:
                counts = self._loader._stats["dataset"]
                for name, gained in pickle.loads(wire.body(msg)).items():
                    counts[name] = counts.get(name, 0) + gained
                return
            self._init_failed(worker, wire.body(msg))
            return
        task = self._tasks.pop(seq, None)
        if task is None:  # a result from before a reset; already discarded
            if kind == wire.RES_SEGMENT:
                os.close(worker.reader.take_fd())
            return
        self.scheduler.answered(worker.id)
        if kind == wire.RES_READY:
            payload = b""
        else:
            payload = wire.body(msg)
            _leases.give_back(task.ring, task.slot)
            task.slot = wire.NO_SLOT
            if kind == wire.RES_SEGMENT or kind == wire.RES_PICKLED:
                needed = wire.needed_bytes(payload)
                if kind == wire.RES_SEGMENT:
                    # The batch's own segment, mapped here (not pre-faulted: only what the
                    # consumer reads comes in); its descriptor is closed at once.
                    task.ring = attach_fd(worker.reader.take_fd(), 1, needed, populate=False)
                    task.slot = 0
                ring = self._ring
                if ring is None or (needed > ring.slot_bytes and self._loader.slot_bytes is None):
                    # The first batch sizes the ring; a batch that outgrew its slot makes
                    # a ring of larger slots. Made at the next __next__, after this batch
                    # is handed out (reserving a ring takes tens of ms).
                    self._ring_wanted = max(self._ring_wanted, needed)
            elif kind == wire.RES_ITER_END:
                self.scheduler.ended(worker.id, seq)  # tasks sent from now on skip it
        self.scheduler.put(seq, (kind, task, payload))

    def _init_failed(self, worker: _WorkerHandle, payload: bytes) -> None:
        """worker_init_fn raised: the worker sent that before reading any task (its
        header carries no batch number) and exits. It answers for every task it was
        given: the error takes the place of the first one, the others are dropped, and
        the worker's exit is then expected (no WorkerDiedError)."""
        mine = sorted(seq for seq, t in self._tasks.items() if t.worker is worker)
        tasks = [self._tasks.pop(seq) for seq in mine]
        for task in tasks:
            _leases.give_back(task.ring, task.slot)
            task.slot = wire.NO_SLOT
        self.scheduler.retire(worker.id)
        seq = mine[0] if mine else self._rcvd_seq
        task = tasks[0] if tasks else _Task(seq, worker, wire.NO_SLOT, None, None)
        self.scheduler.put(seq, (wire.RES_INIT_ERROR, task, payload))

    def _drain(self, worker: _WorkerHandle) -> None:
        """Handle everything ``worker`` sent before it exited."""
        while self._pool.has_input(worker) and self._receive(worker):
            pass

    def _make_wanted_ring(self) -> None:
        """Make the ring that a batch from outside it asked for (the first one, or one with
        larger slots: the old ring retires as its batches die); hand it to the workers."""
        wanted, self._ring_wanted = self._ring_wanted, 0
        self._adopt_ring(self._loader._leases.ring_for_batch(wanted, self._ring))

    def _adopt_ring(self, ring: Ring) -> None:
        """Make ``ring`` this iterator's ring and hand it to every worker. Tasks sent
        before keep their old ring: each worker reads its socket in order, so it finishes
        them before it switches."""
        self._ring = ring
        message = wire.ring_frame(ring.num_slots, ring.slot_bytes)
        for w in self._workers:
            if w.proc.is_alive():  # (a dead worker is reported by its sentinel)
                self._pool.send(w, message, ring.fd)

    # --- position, for DataLoader.state_dict() -------------------------------------------

    # The position, for state.py (until it calls self.scheduler's public methods).

    def _shard_state(self, worker: _WorkerHandle, seq: int, blob: bytes) -> None:
        """A worker's dataset state after batch ``seq`` (see Scheduler.keep_shard_state)."""
        self.scheduler.keep_shard_state(worker.id, seq, blob)

    def _batches_handed_out(self) -> int:
        """Results handed out (or raised) this epoch: Scheduler.handed_out."""
        return self.scheduler.handed_out()

    def _handed_out_per_worker(self) -> tuple[list[int], int]:
        """Scheduler.handed_out_per_worker."""
        return self.scheduler.handed_out_per_worker()

    def _shard_states_handed_out(self) -> dict[int, bytes]:
        """Scheduler.shard_states_handed_out."""
        return self.scheduler.shard_states_handed_out()

    # --- hand-out -----------------------------------------------------------------------

    def _materialize(self, kind: int, task: _Task, payload: bytes) -> Any:
        if kind == wire.RES_READY:
            return self._from_slot(task)
        if kind == wire.RES_SEGMENT:
            batch = self._from_slot(task, segment=True)
            task.ring = None  # the segment lives as long as the batch's views, no longer
            if self._loader._pinner is not None:
                batch = _pinning.pin_tree(batch)  # not in a registered ring: pinned by copy
            return batch
        if kind == wire.RES_PICKLED:
            self._loader._stats["batches"] += 1
            self._loader._stats["batches_copied"] += 1
            batch = pickle.loads(wire.pickled_batch(payload))
            if self._loader.output == "torch":
                batch = _pinning.to_torch(batch)
            if self._loader._pinner is not None:
                batch = _pinning.pin_tree(batch)  # not in the ring: pinned by copy
            return batch
        failure: WorkerFailure = pickle.loads(payload)
        if kind == wire.RES_INIT_ERROR:
            self.close()
        raise _rebuild(failure, task.seq)

    def _from_slot(self, task: _Task, segment: bool = False) -> Any:
        """The batch in ``task``'s slot, as views of it (or a copy, with copy=True);
        ``segment``: the slot is a one-off segment's, not the ring's."""
        ring = task.ring
        slot = task.slot
        states = ring.states  # type: ignore[union-attr]
        states.store(slot, _slots.HELD)
        root = np.frombuffer(ring.slot_buffer(slot), np.uint8)  # type: ignore[union-attr]
        # Leased before anything can raise: the slot returns to FREE when the root dies,
        # i.e. when the last view of it does, or when this returns (copy=True: the batch
        # does not view the root) or raises. Every view keeps the mapping alive (its .base
        # chain ends at the mapping's owner).
        _leases.lease(root, ring, slot, None if segment or self._copy else self._loader._pinner)
        data_end, lo, llen, ooff, olen, seq, count = wire.read_header(ring, slot)
        if seq != task.seq:
            raise RuntimeError(f"slot {slot} holds batch {seq}, expected {task.seq}")
        key = root[lo : lo + llen].tobytes()
        reader = self._readers.get(key)
        if reader is None:
            if len(self._readers) >= _LAYOUT_CACHE_SIZE:
                self._readers.clear()  # stay bounded (one per batch structure)
            skeleton = decode(key)
            if self._loader.output == "torch":
                skeleton = _pinning.torch_skeleton(skeleton)
            reader = self._readers[key] = make_reader(skeleton)
        numbers = np.frombuffer(root, np.int64, count, wire.numbers_offset(lo, llen)).tolist()
        objects = pickle.loads(root[ooff : ooff + olen].tobytes()) if olen else None
        stats = self._loader._stats
        stats["batches"] += 1
        if segment:
            stats["batches_copied"] += 1  # not in the ring (in its own segment)
        if self._copy:
            # Batches that own their memory: one copy of the slot's data, and the
            # slot is free again at once (the root dies as this returns).
            batch = reader(root[:data_end].copy(), objects, numbers)
            stats["batches_copied"] += not segment
            return batch
        return reader(root, objects, numbers)

    # --- errors -------------------------------------------------------------------------

    def _death_error(self, worker: _WorkerHandle) -> WorkerDiedError:
        pending = sorted(t.seq for t in self._tasks.values() if t.worker is worker)
        task = self._tasks.get(pending[0]) if pending else None
        return self._pool.death_error(worker, pending[0] if pending else None, task and task.indices)

    def _timeout_error(self, timeout: float) -> LoaderTimeoutError:
        # Results that arrived unread while waiting on one worker: those workers are not busy.
        for worker in self._pool.readable_now():
            self._receive(worker)
        waiting = min(self._tasks) if self._tasks else self._rcvd_seq
        task = self._tasks.get(waiting)
        busy = [t.worker for t in self._tasks.values()]
        return self._pool.timeout_error(timeout, waiting, task and task.indices, busy)

    # --- epochs and shutdown ------------------------------------------------------------

    def _end_epoch(self) -> None:
        self._epoch_done = True
        if not self._loader.persistent_workers:
            self.close()

    def reset(self, epoch_seed: int, copy: bool) -> None:
        """Persistent workers: start a new epoch on the same workers and ring."""
        self._copy = copy
        # Results still owed by the workers must come back before their slots are reused.
        while self._tasks:
            self._wait()
        for _, task, _ in self._results.values():
            _leases.give_back(task.ring, task.slot)
        self._begin_epoch(epoch_seed)
        for w in self._workers:
            self._pool.send(w, wire.epoch_frame(epoch_seed + w.id))
        try:
            self._dispatch()
        except (RingLimitError, ShmSpaceError):
            self.close()  # as in __next__: the epoch cannot start, leave nothing running
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop and reap every worker, return unused slots; idempotent. ``graceful``:
        give workers pool.JOIN_TIMEOUT_S to finish their batch and exit, else kill them."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self._pid:
            return  # a forked copy of the consumer: the workers are not ours to stop
        self._pool.stop(graceful)
        # The workers are gone: slots they were given but we never handed out are free.
        for task in self._tasks.values():
            _leases.give_back(task.ring, task.slot)
        for _, task, _ in self._results.values():
            _leases.give_back(task.ring, task.slot)
        self._tasks.clear()
        self._results.clear()  # (the scheduler's)
        self._pool.release()
        _live_iterators.discard(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _task_payload(indices: Any) -> tuple[int, bytes]:
    """A batch's sample indices as a task: int64 bytes when they are integers (bools and
    other ``__index__`` types count as ints, as in Python's own indexing), else the
    pickled list of keys, which reach the dataset as they were given."""
    if type(indices) is list:  # a batch sampler's list
        try:
            return wire.TASK_INDICES, array("q", indices).tobytes()
        except (TypeError, OverflowError):  # str, tuple, float... keys; ints beyond int64
            return wire.TASK_KEYS, pickle.dumps(indices)
    try:  # an array, a tuple, a range...
        arr = np.asarray(indices) if len(indices) else np.empty(0, np.int64)
    except ValueError:  # ragged keys (tuples of different lengths)
        return wire.TASK_KEYS, pickle.dumps(list(indices))
    kind = arr.dtype.kind if arr.ndim == 1 else ""
    if kind == "i" or (kind == "u" and (not len(arr) or int(arr.max()) < 2**63)):
        return wire.TASK_INDICES, arr.astype(np.int64, copy=False).tobytes()
    return wire.TASK_KEYS, pickle.dumps(list(indices))


def _rebuild(failure: WorkerFailure, seq: int) -> BaseException:
    """The worker's exception in the consumer: its own type where it can be rebuilt."""
    where = f" while {failure.where}" if failure.where else ""
    batch = f" batch {seq}" if failure.where != "running worker_init_fn" else ""
    indices = f" (sample indices {short_indices(failure.indices)})" if failure.indices is not None else ""
    text = (
        f"Caught {failure.type_name} in DataLoader worker {failure.worker_id}{where}{batch}"
        f"{indices}.\nOriginal {failure.traceback}"
    )
    exc: BaseException | None = None
    if failure.pickled is not None:
        try:
            original = pickle.loads(failure.pickled)
            exc = type(original)(text)
        except Exception:
            exc = None
    if exc is None:
        exc = WorkerError(text)
    exc.worker_id = failure.worker_id  # type: ignore[attr-defined]
    exc.indices = failure.indices  # type: ignore[attr-defined]
    exc.worker_traceback = failure.traceback  # type: ignore[attr-defined]
    return exc
