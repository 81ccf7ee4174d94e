"""The DataLoader's arguments: their validation, with torch's error texts where torch has
one, and what they become (defaults filled in, a start method turned into its context).

``DataLoader.__init__`` calls :func:`check` first; nothing here keeps state.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from shmloader.batch.collate import COLLATE_MODES
from shmloader.interop import torchcompat
from shmloader.memory import sizing
from shmloader.system.segment import resolve_backend
from shmloader.tuning import autotune

OUTPUTS = ("auto", "numpy", "torch")


@dataclass
class Checked:
    """The arguments that :func:`check` fills in or rewrites; the others stay as given."""

    dataset: Any
    iterable: bool
    shuffle: bool
    batch_size: int | None
    drop_last: bool
    prefetch_factor: int | None
    output: str
    tuner: autotune.Settings | None  # num_workers or prefetch_factor was "auto"
    num_workers: int  # the count to start with ("auto": autotune's first count)


def check(
    dataset: Any,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    num_workers: int | str,
    drop_last: bool,
    timeout: float,
    generator: Any,
    prefetch_factor: int | str | None,
    persistent_workers: bool,
    seed: int | None,
    num_slots: int | None,
    slot_bytes: int | None,
    collate: str,
    max_shm_bytes: int | None,
    shm_backend: str,
    output: str,
    max_worker_restarts: int,
    prefetch_next_epoch: bool = False,
) -> Checked:
    """Validate a DataLoader's arguments (ValueError or TypeError naming the input, as
    torch's words where torch checks the same) and fill in the defaults."""
    iterable = is_iterable_dataset(dataset)
    tuner = autotune.settings(num_workers, prefetch_factor, iterable)
    if tuner is not None:
        num_workers = tuner.start_workers
        prefetch_factor = tuner.start_prefetch
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
    if prefetch_factor is None and num_workers > 0:
        prefetch_factor = sizing.DEFAULT_PREFETCH_FACTOR
    if num_workers > 0 and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
        raise ValueError(f"prefetch_factor should be a positive integer (got {prefetch_factor!r}).")
    if tuner is not None and not tuner.auto_prefetch:
        tuner.start_prefetch = tuner.max_prefetch = prefetch_factor  # (its default filled in)
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if not isinstance(prefetch_next_epoch, bool):
        raise ValueError(f"prefetch_next_epoch should be True or False (got {prefetch_next_epoch!r}).")
    if prefetch_next_epoch and not persistent_workers:
        raise ValueError(
            "prefetch_next_epoch=True needs persistent_workers=True: only workers that outlive "
            "an epoch can load the next one's first batches before its iter()."
        )
    if (
        isinstance(max_worker_restarts, bool)
        or not isinstance(max_worker_restarts, int)
        or max_worker_restarts < 0
    ):
        raise ValueError(
            "max_worker_restarts should be a non-negative integer: how many dead or hung "
            f"workers the loader replaces in its life (got {max_worker_restarts!r})."
        )
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both: seed is an int shortcut for generator.")
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
    resolve_backend(shm_backend)  # a ValueError naming the input and the choices
    if output not in OUTPUTS:
        raise ValueError(
            f"output should be 'auto', 'numpy' or 'torch' (got {output!r}): 'torch' hands "
            "out tensors sharing the slot's memory, 'auto' does so when torch is imported."
        )
    if output == "auto":
        output = "torch" if torchcompat.torch_module() is not None else "numpy"

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
    return Checked(
        dataset, iterable, shuffle, batch_size, drop_last, prefetch_factor, output, tuner, num_workers
    )


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
