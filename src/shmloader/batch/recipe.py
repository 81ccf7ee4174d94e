"""The one batch recipe: indices -> samples -> leaves -> fill, for both paths.

The main process (``num_workers=0``) and every worker make a batch with the same
:class:`Recipe`, so ``num_workers`` never changes a batch:

- auto-collation without a collate_fn: :func:`~shmloader.batch.collate.gather` (torch's
  ``default_collate`` types), or the write-into protocol when the dataset has it;
- a user ``collate_fn``: its output as it is (torch passes it through untouched); arrays
  and plain tensors in it travel in the slot, every other leaf as an object (torch's
  ``default_collate`` / ``default_convert`` given explicitly count as no collate_fn:
  :func:`is_torch_default`);
- ``batch_size=None`` without a collate_fn: each sample through torch's
  ``default_convert`` (:func:`~shmloader.batch.collate.converted`).

A worker writes :meth:`Batch.fill`'s arrays into its slot; the main process builds the
same batch in its own memory with :meth:`Recipe.in_memory`.

An epoch ends only when its sampler (or iterable dataset) is exhausted: a
``StopIteration`` raised by the dataset, ``collate_fn`` or ``write_sample`` while a batch
is made becomes a :class:`~shmloader.errors.StrayStopIteration` naming the batch and its
samples, never the end of the epoch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from shmloader.batch import writeinto
from shmloader.batch.collate import (
    Leaf,
    build_in_memory,
    converted,
    copy_leaves,
    default_collate_fn_map,
    flatten_tree,
    gather,
    plan,
)
from shmloader.batch.pinning import numpy_only_error
from shmloader.batch.placement import Placements
from shmloader.batch.scalars import torch_tensor_type
from shmloader.batch.tree import tree_map
from shmloader.errors import BatchKeyError, BatchTypeError, StrayStopIteration
from shmloader.interop.torchcollate import honoured_map

_AS_IS = object()  # Batch.tree when the batch must be built from its leaves


class Batch(NamedTuple):
    """One made batch: its treedef and leaves (laid out by ``collate.plan``), the filler
    that writes its arrays into views of a slot, and ``tree``: the batch itself when the
    main process hands it out as it is (a collate_fn's output, a converted sample)."""

    treedef: Any
    leaves: list[Leaf]
    fill: Callable[[list[Any]], None]
    tree: Any = _AS_IS


class Recipe:
    """How one loader makes its batches (built from the loader's arguments, the same in
    the main process and in every worker)."""

    def __init__(
        self,
        dataset: Any,
        *,
        iterable: bool,
        auto_collation: bool,
        batch_size: int | None,
        drop_last: bool,
        collate_fn: Callable[[Any], Any] | None,
        collate: str,
        pad_value: Any,
        output: str = "numpy",
        writer: Any = None,
    ) -> None:
        self.dataset = dataset
        self.iterable = iterable
        self.auto_collation = auto_collation
        self.want = (batch_size or 1) if auto_collation else 1  # samples per batch (iterable)
        self.batch_size = batch_size if auto_collation else None  # None: a batch_sampler's sizes
        self.drop_last = drop_last and auto_collation
        # torch's own default_collate (batches) or default_convert (batch_size=None),
        # passed explicitly (e.g. a framework rebuilding the loader from its collate_fn
        # attribute, which reports them when the user gave none): the same as none, so
        # the batch takes the default path (the ring, the write-into protocol), whose
        # types are torch's (the parity suites); ``output`` decides tensors or numpy.
        if is_torch_default(collate_fn, auto_collation):
            collate_fn = None
        self.collate_fn = collate_fn
        self.mode = collate
        self.pad_value = pad_value
        self.output = output  # in_memory only: a worker's slot is read by the consumer
        # The write-into protocol (map-style, default collate, dataset implements it), or
        # ``writer`` in the dataset's place (images=: shmloader.vision.torchvision_fused).
        self.writer = writer if writer is not None else dataset
        self.spec = writeinto.spec_for(
            self.writer, iterable=iterable, auto_collation=auto_collation, collate_fn=collate_fn
        )
        self.collate_fn_map: dict[Any, Any] | None = None  # the default collate's: begin_epoch()
        self.begin_epoch()

    def begin_epoch(self) -> None:
        """Read the default collate's type registry for the epoch beginning in this
        process: shmloader's :data:`~shmloader.batch.collate.default_collate_fn_map`, with
        the types registered in torch's ``default_collate_fn_map`` (see
        :mod:`shmloader.interop.torchcollate`); not per batch."""
        self.collate_fn_map = honoured_map(default_collate_fn_map)

    def __getstate__(self) -> dict[str, Any]:
        # The registry is read where the recipe is used (a worker registers at its own
        # imports, and its registered functions need not pickle).
        return {**self.__dict__, "collate_fn_map": None}

    def slot_bytes_ahead(self) -> int:
        """The slot bytes a full batch takes, where they are known before any batch is
        made (the write-into protocol declares every array's shape and dtype, and the
        batch size is fixed); else 0. The same placement a worker makes of that batch."""
        if self.spec is None or not self.batch_size:
            return 0
        treedef, specs = self.spec
        placed = Placements(1).of(treedef, writeinto.plan_leaves(treedef, specs, self.batch_size))
        return placed.content.total if placed.content is not None else 0

    # --- samples ------------------------------------------------------------------------

    def fetch(self, indices: Sequence[Any], seq: int | None) -> Any:
        """The samples of ``indices`` (map-style); None when the write-into protocol
        writes them in place. As torch's fetcher: when batching, ``__getitems__(indices)``
        where the dataset has it, its return value as it is (a ``collate_fn`` gets it
        unchanged); else ``dataset[i]`` for each index (with ``batch_size=None``, ``indices``
        is the one index in a list, which may itself be a list: a ``BatchSampler`` given as
        ``sampler``)."""
        if self.spec is not None:
            return None
        dataset = self.dataset
        try:
            if self.auto_collation:
                getitems = getattr(dataset, "__getitems__", None)
                if getitems:
                    return getitems(indices)
            return [dataset[i] for i in indices]
        except StopIteration as exc:
            raise _stray(exc, "fetching", seq, indices) from exc

    def take(self, iterator: Iterator[Any], seq: int | None) -> list[Any] | None:
        """The next batch's samples from an iterable dataset's ``iterator``; None when it
        is exhausted (a last short batch is dropped with ``drop_last``)."""
        samples = []
        want = self.want
        for sample in iterator:  # the iterator's own StopIteration: its end, legitimately
            samples.append(sample)
            if len(samples) == want:
                return samples
        if not samples or self.drop_last:
            return None
        return samples

    # --- batch --------------------------------------------------------------------------

    def collate(self, samples: list[Any] | None, indices: Sequence[Any] | None, seq: int | None) -> Batch:
        """The batch of ``samples`` (of sample ``indices`` when map-style; ``samples`` is
        None under the write-into protocol), ``seq`` naming it in errors."""
        try:
            if self.spec is not None and indices is not None:
                treedef, specs = self.spec
                leaves = writeinto.plan_leaves(treedef, specs, len(indices))
                write = writeinto.writer(self.writer, treedef, indices)
                return Batch(treedef, leaves, _guarded(write, "writing samples (write_sample)", seq, indices))
            assert samples is not None
            if not self.auto_collation:  # one sample
                sample = samples[0]
                if self.collate_fn is not None:
                    tree = self.collate_fn(sample)
                    treedef, leaves = flatten_tree(tree)
                else:
                    treedef, leaves = flatten_tree(sample, convert=True)
                    tree = _AS_IS
            elif self.collate_fn is not None:
                tree = self.collate_fn(samples)
                treedef, leaves = flatten_tree(tree)
            else:
                if type(samples) is not list:  # a __getitems__'s own return value
                    samples = _listed(samples, indices, seq)
                treedef, leaves = gather(
                    samples, indices, seq, self.mode, self.pad_value, self.collate_fn_map
                )
                tree = _AS_IS
        except StopIteration as exc:
            raise _stray(exc, "collating", seq, indices) from exc
        return Batch(treedef, leaves, copy_leaves(leaves), tree)

    def in_memory(self, batch: Batch, samples: list[Any] | None) -> Any:
        """``batch`` in this process's memory (main-process loading): the same values,
        types and containers a worker's slot gives."""
        if batch.tree is not _AS_IS:
            return batch.tree  # a collate_fn's output, as torch hands it out
        if not self.auto_collation and self.collate_fn is None:
            assert samples is not None
            return tree_map(converted, samples[0], tuples_as_lists=True, as_torch_copies=True)
        if self.output == "torch":  # as the consumer's torch_skeleton refuses a slot's batch
            for leaf in batch.leaves:
                if leaf.torch is None:
                    raise numpy_only_error(leaf.dtype)
        layout, data_bytes, objects = plan(batch.treedef, batch.leaves)
        return build_in_memory(layout, data_bytes, objects, batch.fill)


def is_datapipe(dataset: Any) -> bool:
    """Whether ``dataset`` is a torch DataPipe (False without torch imported, or for a
    torch without DataPipes)."""
    if sys.modules.get("torch") is None:
        return False
    try:
        from torch.utils.data import IterDataPipe, MapDataPipe
    except ImportError:  # a torch without DataPipes
        return False
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def prepare_datapipe(
    dataset: Any, shared_seed: int, num_shards: int, shard_id: int, datapipe: bool | None = None
) -> None:
    """For a torch DataPipe, what torch's loader does at the start of an epoch: seed the
    graph's random nodes (``shuffle()``...) from ``shared_seed``, one seed for every
    process that reads a shard of the epoch (so they all shuffle alike), and set its
    ``sharding_filter()`` nodes to shard ``shard_id`` of ``num_shards``, so each sample is
    read once. torch numbers a worker's shard ``worker_id * world_size + rank`` of
    ``world_size * num_workers``, and the main process's (``num_workers=0``) ``rank`` of
    ``world_size``. Does nothing for other datasets, or without torch imported.
    ``datapipe``: :func:`is_datapipe` of ``dataset`` where already known (None: asked here)."""
    if not (is_datapipe(dataset) if datapipe is None else datapipe):
        return
    import torch
    from torch.utils.data import IterDataPipe
    from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

    apply_sharding(dataset, num_shards, shard_id)
    if isinstance(dataset, IterDataPipe):
        apply_random_seed(dataset, torch.Generator().manual_seed(shared_seed))


def is_torch_default(collate_fn: Any, auto_collation: bool) -> bool:
    """Whether ``collate_fn`` is what torch's DataLoader uses when given none: torch's
    ``default_collate`` when samples are batched, ``default_convert`` when they are not
    (``batch_size=None``). Either one in the other place is a user function like any
    other (torch calls it as given). False without torch imported."""
    if collate_fn is None:
        return False
    torch_collate = sys.modules.get("torch.utils.data._utils.collate")
    if torch_collate is None:
        return False
    default = torch_collate.default_collate if auto_collation else torch_collate.default_convert
    return collate_fn is default


def user_collate_fn(collate_fn: Any, auto_collation: bool) -> bool:
    """Whether ``collate_fn`` is the user's own: given, and not torch's default for
    ``auto_collation`` (:func:`is_torch_default`). Its output is handed out as it is."""
    return collate_fn is not None and not is_torch_default(collate_fn, auto_collation)


def _listed(samples: Any, indices: Any, seq: int | None) -> list[Any]:
    """What ``__getitems__`` returned, as the list of samples the default collate takes:
    torch's ``default_collate`` indexes and iterates it, so a tuple, an array or another
    sequence of samples gives its items; a mapping (torch: ``KeyError: 0``) or a tensor
    (torch: ``TypeError`` from ``torch.stack``) is an error, as there."""
    where = f"batch {seq}" if seq is not None else "a batch"
    advice = (
        "torch's default_collate takes a list of samples: return one from __getitems__, or "
        "pass a collate_fn that takes what it returns (it gets it unchanged)."
    )
    if isinstance(samples, Mapping):
        raise BatchKeyError(
            f"__getitems__ returned a {type(samples).__name__} for {where} (sample indices "
            f"{list(indices)[:8]}), which the default collate cannot read as samples; {advice}"
        )
    tensor_type = torch_tensor_type()
    if (tensor_type is not None and isinstance(samples, tensor_type)) or not isinstance(samples, Iterable):
        raise BatchTypeError(
            f"__getitems__ returned a {type(samples).__name__} for {where} (sample indices "
            f"{list(indices)[:8]}), which the default collate cannot read as samples; {advice}"
        )
    return list(samples)


def _guarded(fill: Callable[[list[Any]], None], where: str, seq: int | None, indices: Any) -> Callable:
    def guarded(views: list[Any]) -> None:
        try:
            fill(views)
        except StopIteration as exc:
            raise _stray(exc, where, seq, indices) from exc

    return guarded


def _stray(exc: StopIteration, where: str, seq: int | None, indices: Any) -> StrayStopIteration:
    batch = f"batch {seq}" if seq is not None else "a batch"
    if indices is not None:
        shown = list(indices[:8])
        more = f" (+{len(indices) - 8} more)" if len(indices) > 8 else ""
        batch += f" (sample indices {shown}{more})"
    detail = f": {exc}" if str(exc) else ""
    return StrayStopIteration(
        f"StopIteration{detail} was raised while {where} {batch}. An epoch ends only when its "
        "sampler is exhausted, so this is an error rather than the end of the epoch: find "
        "what raised it in the traceback (a next() on an exhausted iterator in __getitem__ "
        "or collate_fn), and catch it there."
    )
