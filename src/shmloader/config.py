"""The DataLoader's arguments, frozen and keyword-only: checked once, with torch's error
texts where torch checks the same, and filled in (defaults, "auto" counts, the samplers
the loader makes for itself, a start method turned into its context).

Two types: :class:`LoaderArguments` holds the arguments as given (``num_workers`` and
``prefetch_factor`` may be ``"auto"``), :class:`LoaderConfig` as checked (counts, the
tuner's settings beside them). ``DataLoader.__init__`` makes ``LoaderArguments(...)`` and
keeps its ``checked()``: the arguments the loader runs by; every check is made there.
Nothing here keeps state; the objects the loader works with are :mod:`shmloader.runtime`'s.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any

from shmloader.batch import recipe as fetch
from shmloader.batch.collate import COLLATE_MODES
from shmloader.interop import torchcompat
from shmloader.memory import sizing
from shmloader.sampling import distributed as _dist
from shmloader.sampling import draws as _draws
from shmloader.sampling.sampler import LoaderBatchSampler, RandomSampler, SequentialSampler
from shmloader.system.segment import resolve_backend
from shmloader.tuning import autotune
from shmloader.vision.torchvision_choice import check_mode as _check_images

OUTPUTS = ("auto", "numpy", "torch")


@dataclass(frozen=True, kw_only=True)
class _Arguments:
    """The arguments whose type is the same as given and as checked."""

    dataset: Any
    batch_size: int | None = 1
    shuffle: bool | None = None
    sampler: Any = None
    batch_sampler: Any = None
    collate_fn: Any = None
    pin_memory: bool = False
    drop_last: bool = False
    timeout: float = 0
    worker_init_fn: Any = None
    multiprocessing_context: Any = None
    generator: Any = None
    persistent_workers: bool = False
    pin_memory_device: str = ""
    in_order: bool = True
    seed: int | None = None
    slot_bytes: int | None = None
    collate: str = "stack"
    pad_value: Any = 0
    copy: bool = False
    max_shm_bytes: int | None = None
    shm_backend: str = "auto"
    output: str = "auto"
    distributed: Any = False
    rank: int | None = None
    world_size: int | None = None
    max_worker_restarts: int = 0
    prefetch_next_epoch: bool = False
    share_dataset: bool = False
    images: str = "auto"


@dataclass(frozen=True, kw_only=True)
class LoaderConfig(_Arguments):
    """A DataLoader's arguments as checked and filled in (:meth:`LoaderArguments.checked`),
    under the constructor's names: every argument validated, ``shuffle`` a bool,
    ``num_workers`` and ``prefetch_factor`` the counts to start with (``tuner`` holds
    what ``"auto"`` asked for), ``sampler`` and ``batch_sampler`` the ones the loader
    iterates (made by it when not given), ``collate_fn`` torch's default where none was
    given, ``num_slots`` and ``output`` resolved, ``multiprocessing_context`` a context
    or None."""

    num_workers: int = 0
    prefetch_factor: int | None = None
    num_slots: int = 1  # (always filled in: the given count, or the default for the counts)
    iterable: bool = False  # an iterable-style dataset
    tuner: autotune.Settings | None = None  # num_workers or prefetch_factor was "auto"
    torch_rng: bool = False  # torch's RNG decides orders and seeds (shmloader.sampling.draws)
    own_shuffle: bool = False  # the loader made the RandomSampler: it draws the order
    own_batching: bool = False  # the loader made the batch sampler: positions count samples
    fixed_num_slots: bool = False  # num_slots was given (the default adapts to the memory)

    @property
    def auto_collation(self) -> bool:
        """Whether samples are batched: batch_size or batch_sampler was given."""
        return self.batch_sampler is not None or self.batch_size is not None

    @property
    def most_workers(self) -> int:
        """The most workers the loader may run (``"auto"``: its bound)."""
        return self.tuner.max_workers if self.tuner is not None else self.num_workers


@dataclass(frozen=True, kw_only=True)
class LoaderArguments(_Arguments):
    """A DataLoader's arguments as given, under the constructor's names and with its
    defaults (``num_workers`` and ``prefetch_factor`` may be ``"auto"``); :meth:`checked`
    turns them into the :class:`LoaderConfig` the loader runs by."""

    num_workers: int | str = 0
    prefetch_factor: int | str | None = None
    num_slots: int | None = None

    def checked(self) -> LoaderConfig:
        """These arguments validated and filled in (see :class:`LoaderConfig`). Raises
        ValueError or TypeError naming the argument, in torch's words where torch checks
        the same, in the order torch checks them."""
        iterable = is_iterable_dataset(self.dataset)
        asked = autotune.settings(self.num_workers, self.prefetch_factor, iterable)
        num_workers = _checked_num_workers(self.num_workers if asked is None else asked.start_workers)
        _check_timeout(self.timeout)
        prefetch_factor = _checked_prefetch(
            self.prefetch_factor if asked is None else asked.start_prefetch, num_workers
        )
        tuner = _tuner_settings(asked, prefetch_factor)
        _check_lifetimes(self, num_workers)
        _check_memory(self)
        _check_share_dataset(self)
        _check_images(self.images)
        output = _resolved_output(self)
        dataset, shuffle, batch_size, drop_last = _checked_sampling(self, iterable)
        context = mp_context(self.multiprocessing_context, num_workers)
        torch_rng = _draws.uses_torch_rng(self.seed, self.generator)  # a TypeError for a bad generator
        _dist.detect(self.distributed, self.rank, self.world_size)  # read again at each epoch
        auto_collation = self.batch_sampler is not None or batch_size is not None
        if self.output == "auto" and fetch.user_collate_fn(self.collate_fn, auto_collation):
            # "auto": tensors exactly where torch makes them (its default collate and
            # convert); a collate_fn's output is torch's as it is returned, numpy included.
            output = "numpy"
        most_workers = tuner.max_workers if tuner is not None else num_workers
        most_prefetch = tuner.max_prefetch if tuner is not None else prefetch_factor
        same = {f.name: getattr(self, f.name) for f in fields(_Arguments)}
        filled = LoaderConfig(
            **{
                **same,
                "dataset": dataset,
                "shuffle": shuffle,
                "batch_size": batch_size,
                "drop_last": drop_last,
                "multiprocessing_context": context,
                # None: the default collate (torch reports its default_collate/default_convert).
                "collate_fn": self.collate_fn
                if self.collate_fn is not None
                else torchcompat.default_collate_of(auto_collation),
                # (Sized for the most workers and prefetch "auto" may reach: slots nothing
                # writes take no memory where rings are sparse.)
                "output": output,
            },
            num_slots=self.num_slots
            or sizing.default_num_slots(most_workers, most_prefetch or sizing.DEFAULT_PREFETCH_FACTOR),
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            iterable=iterable,
            tuner=tuner,
            torch_rng=torch_rng,
            own_shuffle=not iterable and self.sampler is None and shuffle,
            own_batching=not iterable and self.batch_sampler is None,
            fixed_num_slots=self.num_slots is not None,
        )
        return _with_samplers(filled)


def _checked_num_workers(num_workers: int | str) -> int:
    """``num_workers`` (a count: ``"auto"`` was replaced by its start), checked as torch checks it."""
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; use num_workers=0 to disable "
            f"multiprocessing (got num_workers={num_workers!r})."
        )
    return num_workers


def _check_timeout(timeout: float) -> None:
    if timeout < 0:
        raise ValueError(f"timeout option should be non-negative (got timeout={timeout!r}).")


def _checked_prefetch(prefetch_factor: int | str | None, num_workers: int) -> int | None:
    """``prefetch_factor`` to start with (``"auto"`` was replaced by its start), checked as
    torch checks it, its default filled in: None without workers."""
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing. Let "
            "num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if prefetch_factor is None:
        return sizing.DEFAULT_PREFETCH_FACTOR if num_workers > 0 else None
    if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
        raise ValueError(f"prefetch_factor should be a positive integer (got {prefetch_factor!r}).")
    return prefetch_factor


def _tuner_settings(asked: autotune.Settings | None, prefetch_factor: int | None) -> autotune.Settings | None:
    """The tuner's settings as checked: a ``prefetch_factor`` that is not ``"auto"`` is the
    checked one (its default filled in), at the start and as the bound."""
    if asked is None or asked.auto_prefetch:
        return asked
    return replace(asked, start_prefetch=prefetch_factor, max_prefetch=prefetch_factor)


def _check_share_dataset(given: LoaderArguments) -> None:
    if not isinstance(given.share_dataset, bool):
        raise ValueError(
            f"share_dataset should be True or False (got {given.share_dataset!r}): True stores the "
            "dataset's large lists, tuples and dicts once in shared memory before workers start."
        )


def _check_lifetimes(given: LoaderArguments, num_workers: int) -> None:
    """Workers kept between epochs, loading ahead, and restarted: what each needs."""
    if given.persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if not isinstance(given.prefetch_next_epoch, bool):
        raise ValueError(f"prefetch_next_epoch should be True or False (got {given.prefetch_next_epoch!r}).")
    if given.prefetch_next_epoch and not given.persistent_workers:
        raise ValueError(
            "prefetch_next_epoch=True needs persistent_workers=True: only workers that outlive "
            "an epoch can load the next one's first batches before its iter()."
        )
    restarts = given.max_worker_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(
            "max_worker_restarts should be a non-negative integer: how many dead or hung "
            f"workers the loader replaces in its life (got {restarts!r})."
        )
    if given.seed is not None and given.generator is not None:
        raise ValueError("pass either seed or generator, not both: seed is an int shortcut for generator.")


def _check_memory(given: LoaderArguments) -> None:
    """The ring's size, the collate mode for ragged samples, and where rings live."""
    num_slots, slot_bytes, max_shm_bytes = given.num_slots, given.slot_bytes, given.max_shm_bytes
    if num_slots is not None and (not isinstance(num_slots, int) or num_slots < 1):
        raise ValueError(f"num_slots should be a positive integer (got {num_slots!r}).")
    if slot_bytes is not None and (not isinstance(slot_bytes, int) or slot_bytes < 1):
        raise ValueError(f"slot_bytes should be a positive integer number of bytes (got {slot_bytes!r}).")
    if given.collate not in COLLATE_MODES:
        raise ValueError(
            f"collate should be one of {', '.join(map(repr, COLLATE_MODES))} (got {given.collate!r}): "
            "'stack' for equal shapes, 'pad' or 'list' for ragged samples."
        )
    if max_shm_bytes is not None and (not isinstance(max_shm_bytes, int) or max_shm_bytes < 1):
        raise ValueError(f"max_shm_bytes should be a positive integer (got {max_shm_bytes!r}).")
    resolve_backend(given.shm_backend)  # a ValueError naming the input and the choices


def _resolved_output(given: LoaderArguments) -> str:
    """``output`` checked, "auto" made "torch" where torch is imported, else "numpy"."""
    if given.output not in OUTPUTS:
        raise ValueError(
            f"output should be 'auto', 'numpy' or 'torch' (got {given.output!r}): 'torch' hands "
            "out tensors sharing the slot's memory, 'auto' does so when torch is imported."
        )
    if given.output == "auto":
        return "torch" if torchcompat.torch_module() is not None else "numpy"
    return given.output


def _checked_sampling(given: LoaderArguments, iterable: bool) -> tuple[Any, bool, int | None, bool]:
    """``dataset``, ``shuffle``, ``batch_size`` and ``drop_last`` as the loader uses them,
    checked against the dataset's kind and the samplers as torch checks them (a DataPipe
    graph's shufflers follow ``shuffle``)."""
    dataset, shuffle, sampler, batch_sampler = (
        given.dataset,
        given.shuffle,
        given.sampler,
        given.batch_sampler,
    )
    batch_size, drop_last = given.batch_size, given.drop_last
    if iterable:
        if torchcompat.is_datapipe(dataset):
            if shuffle is not None:  # as torch: the DataPipe graph's shufflers follow it
                torch = torchcompat.torch_module()
                dataset = torch.utils.data.graph_settings.apply_shuffle_settings(dataset, shuffle=shuffle)
        elif shuffle not in (False, None):
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
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
            )
        batch_size = None
        drop_last = False
    elif batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
        )
    return dataset, shuffle, batch_size, drop_last


def _with_samplers(config: LoaderConfig) -> LoaderConfig:
    """``config`` with the samplers the loader iterates: a map-style dataset's default
    sampler (random with ``shuffle``, drawing from the loader's torch generator as
    torch's does, else sequential) and batch sampler (a :class:`LoaderBatchSampler`,
    which the loader binds to its epochs). An iterable dataset has none."""
    if config.iterable:
        return config
    sampler = config.sampler
    if sampler is None:
        if config.shuffle:  # (as torch's: the loader's torch generator is the sampler's)
            generator = config.generator if config.torch_rng else None
            sampler = RandomSampler(config.dataset, generator=generator)
        else:
            sampler = SequentialSampler(config.dataset)
    batch_sampler = config.batch_sampler
    if config.batch_size is not None and batch_sampler is None:
        batch_sampler = LoaderBatchSampler(sampler, config.batch_size, config.drop_last)
    return replace(config, sampler=sampler, batch_sampler=batch_sampler)


def mp_context(context: Any, num_workers: int) -> Any:
    """``multiprocessing_context`` as the loader keeps it: None, or a context (a start
    method's name turned into its context), checked as torch checks it."""
    if context is None:
        return None
    if num_workers == 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}"
        )
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                f"multiprocessing_context option should specify a valid start method in "
                f"{methods!r}, but got multiprocessing_context={context!r}"
            )
        context = multiprocessing.get_context(context)
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a "
            f"string specifying the start method, but got multiprocessing_context={context}"
        )
    return context


def warn_if_more_workers_than_cores(num_workers: int) -> None:
    """torch's warning when a loader will start more workers than this process may run
    on cores (its CPU affinity): they would only slow each other down."""
    cores = autotune.usable_cores()
    if num_workers > cores:
        warnings.warn(
            f"This DataLoader will create {num_workers} worker processes in total. Our suggested "
            f"max number of worker in current system is {cores}, which is smaller than what this "
            "DataLoader is going to create. Please be aware that excessive worker creation might "
            "get DataLoader running slow or even freeze, lower the worker number to avoid "
            "potential slowness/freeze if necessary.",
            stacklevel=3,
        )


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is iterable-style (torch's or shmloader's IterableDataset, or
    an object with ``__iter__`` and no ``__getitem__``)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    from shmloader.dataset import IterableDataset

    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")
