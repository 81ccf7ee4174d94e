"""Batch layout: a tree of leaves (shape, dtype, offset) <-> compact bytes.

A batch is a tree of dict / list / tuple / namedtuple nodes whose leaves are arrays
(placed in a slot) or other objects (pickled beside them). Its layout is a small frozen
description of that tree: the *treedef* (the nodes) and one descriptor per leaf.

On the wire a layout is split in two: its :class:`Skeleton` (the tree, and each leaf's
kind, dtype and number of dimensions) and its *numbers* (each array's offset and shape,
as int64). A worker encodes a skeleton once and writes its bytes and the numbers into the
slot; the consumer decodes each distinct skeleton once and keeps its reader, so batches
whose shapes change every time (ragged data) cost no pickling either: only their numbers
differ.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Sequence
from math import prod
from typing import Any, NamedTuple

import numpy as np

from shmloader.batch.tree import LEAF, builder, unflatten

__all__ = ["LEAF", "builder", "unflatten"]  # re-exported: the tree functions live in tree.py

# Treedefs are shmloader.batch.tree's (nested tuples, hashable so layouts can key caches).

ALIGN_BYTES = 64  # leaves start on cache-line boundaries


class ArrayLeaf(NamedTuple):
    """An array leaf placed at ``offset`` in a slot."""

    offset: int
    shape: tuple[int, ...]
    dtype: str | np.dtype  # see dtype_key: numpy's dtype.str, e.g. '|u1', '<f4', or the dtype
    # The samples were torch tensors: hand out a tensor sharing the memory. A string
    # names a torch dtype numpy lacks (e.g. "bfloat16"): ``dtype`` is then a same-size
    # integer holding its bytes, and the tensor is rebuilt with ``.view(torch.<name>)``.
    # None: a default-collated leaf of a dtype torch lacks (output="torch" refuses it).
    torch: bool | str | None


class RaggedLeaf(NamedTuple):
    """A leaf collated as a list: sample ``k``'s array at ``offsets[k]``, of ``shapes[k]``."""

    offsets: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str | np.dtype  # as ArrayLeaf.dtype
    torch: bool | str | None  # as ArrayLeaf.torch


class ObjectLeaf(NamedTuple):
    """A non-array leaf: item ``index`` of the slot's pickled object list."""

    index: int


class Layout(NamedTuple):
    """Everything needed to rebuild a batch from a slot's bytes."""

    treedef: Any
    leaves: tuple[ArrayLeaf | RaggedLeaf | ObjectLeaf, ...]


def dtype_key(dtype: np.dtype) -> str | np.dtype:
    """How a layout names ``dtype`` (``np.dtype(key)`` gives it back): its ``.str`` (short,
    and quick to compare) for numpy's own dtypes; the dtype itself where ``.str`` does not
    name it: structured dtypes (``'|V12'``) and dtypes other packages define, such as
    ml_dtypes' bfloat16 and float8 (``'<V2'``, ``'<f1'``), which a layout carries pickled."""
    if dtype.num < _USER_DTYPES and dtype.names is None:
        return dtype.str
    return dtype


_USER_DTYPES = 256  # NPY_USERDEF: numpy numbers its own dtypes below this


def align(n: int) -> int:
    """Round ``n`` up to the leaf alignment."""
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class Skeleton(NamedTuple):
    """A layout without its offsets and shapes: the treedef, and per leaf
    ``("a", dtype, ndim, torch)`` (an array), ``("r", dtype, count, ndim, torch)`` (a
    list of ``count`` arrays of ``ndim`` dimensions) or ``("o", index)`` (an object)."""

    treedef: Any
    leaves: tuple[tuple[Any, ...], ...]


def split(layout: Layout) -> tuple[Skeleton, list[int]]:
    """``layout``'s skeleton and numbers: per array its offset then its shape, per ragged
    leaf that for each of its arrays (objects have none)."""
    leaves = []
    numbers: list[int] = []
    for leaf in layout.leaves:
        kind = type(leaf)
        if kind is ArrayLeaf:
            leaves.append(("a", leaf.dtype, len(leaf.shape), leaf.torch))
            numbers.append(leaf.offset)
            numbers += leaf.shape
        elif kind is RaggedLeaf:
            ndim = len(leaf.shapes[0]) if leaf.shapes else 0
            leaves.append(("r", leaf.dtype, len(leaf.offsets), ndim, leaf.torch))
            for offset, shape in zip(leaf.offsets, leaf.shapes):
                numbers.append(offset)
                numbers += shape
        else:
            leaves.append(("o", leaf.index))
    return Skeleton(layout.treedef, tuple(leaves)), numbers


def encode(skeleton: Skeleton) -> bytes:
    """Bytes for ``skeleton`` (the trust boundary: only this loader's workers write them)."""
    return pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Skeleton:
    """The skeleton encoded in ``data``."""
    return pickle.loads(data)


# Small leaves apart: an array leaf this many times smaller than the batch's largest is
# handed out as a copy that owns its memory (see make_apart_reader), in batches whose
# array data takes at least APART_MIN_BYTES (below that, a kept leaf pins little and the
# copy would be a measurable share of the batch's cost).
APART_RATIO = 16
APART_MIN_BYTES = 64 * 1024
_APART_CHOICES = 64  # an apart reader's choices kept, one per distinct set of shapes


@functools.lru_cache(maxsize=256)
def _cached_reader(skeleton: Skeleton) -> Callable[[np.ndarray, list[Any] | None, Sequence[int]], Any]:
    return make_reader(skeleton)


@functools.lru_cache(maxsize=256)
def _cached_apart_reader(skeleton: Skeleton) -> Callable[[np.ndarray, list[Any] | None, Sequence[int]], Any]:
    return make_apart_reader(skeleton) or make_reader(skeleton)


def read_layout(layout: Layout, root: np.ndarray, objects: list[Any] | None) -> Any:
    """The batch of ``layout`` in ``root``, as views of it (readers cached per skeleton);
    in a batch of at least APART_MIN_BYTES, small leaves are copies (make_apart_reader)."""
    skeleton, numbers = split(layout)
    cached = _cached_apart_reader if root.nbytes >= APART_MIN_BYTES else _cached_reader
    return cached(skeleton)(root, objects, tuple(numbers))


def _plans(skeleton: Skeleton) -> list[tuple[int, Any, int, int, Any]]:
    """One plan per leaf of ``skeleton``: (kind, dtype, ndim, count or object index,
    to_tensor or None)."""
    torch = None
    if any(leaf[-1] for leaf in skeleton.leaves if leaf[0] != "o"):
        import torch  # only when a sample was a tensor: torch is then installed
    plans = []
    for leaf in skeleton.leaves:
        if leaf[0] == "a":
            plans.append((_ARRAY, np.dtype(leaf[1]), leaf[2], 1, _tensor_maker(torch, leaf[3])))
        elif leaf[0] == "r":
            plans.append((_RAGGED, np.dtype(leaf[1]), leaf[3], leaf[2], _tensor_maker(torch, leaf[4])))
        else:
            plans.append((_OBJECT, None, 0, leaf[1], None))
    return plans


def make_reader(skeleton: Skeleton) -> Callable[[np.ndarray, list[Any] | None, Sequence[int]], Any]:
    """A function ``(root, objects, numbers) -> batch`` that rebuilds a batch of
    ``skeleton`` from a slot's root array, as views of it (no copy), the unpickled object
    leaves and the layout's numbers (see :func:`split`)."""
    plans = _plans(skeleton)
    build = builder(skeleton.treedef)
    frombuffer = np.frombuffer
    if len(plans) == 1 and skeleton.treedef is LEAF and plans[0][0] == _ARRAY and plans[0][2] == 1:
        # One 1-d array, the batch itself (a batch of scalars): frombuffer's count is its
        # shape, no reshape and no tree to build (the most frequent small batch).
        dtype, to_tensor = plans[0][1], plans[0][4]
        if to_tensor is None:
            return lambda root, objects, numbers: frombuffer(root, dtype, numbers[1], numbers[0])
        return lambda root, objects, numbers: to_tensor(frombuffer(root, dtype, numbers[1], numbers[0]))

    def read(root: np.ndarray, objects: list[Any] | None, numbers: Sequence[int]) -> Any:
        out = []
        p = 0
        for kind, dtype, ndim, count, to_tensor in plans:
            if kind == _OBJECT:
                out.append(objects[count])  # type: ignore[index]
                continue
            views = []
            for _ in range(count):
                offset = numbers[p]
                # frombuffer on the root gives a view whose .base is the root, so the
                # root (and the slot lease tied to it) lives as long as any view does.
                if ndim == 1:  # (its count is its shape)
                    view = frombuffer(root, dtype, numbers[p + 1], offset)
                else:
                    shape = tuple(numbers[p + 1 : p + 1 + ndim])
                    view = frombuffer(root, dtype, prod(shape), offset).reshape(shape)
                p += 1 + ndim
                views.append(to_tensor(view) if to_tensor is not None else view)
            out.append(views[0] if kind == _ARRAY else views)
        return build(out)

    return read


def make_apart_reader(
    skeleton: Skeleton, pin: Callable[[Any], Any] | None = None
) -> Callable[[np.ndarray, list[Any] | None, Sequence[int]], Any] | None:
    """A reader like :func:`make_reader`'s, except that each array at least
    :data:`APART_RATIO` times smaller than the batch's largest array is a copy that owns
    its memory, not a view of the root: a loop that keeps a batch's labels (or a slice of
    them) keeps only those, not the slot that holds the images, as torch's loader, whose
    tensors own one segment each, keeps only them. ``pin``: makes a page-locked copy of a
    small leaf that is a tensor (pin_memory; torch's loader pins every tensor). None for
    a skeleton with fewer than two arrays (nothing is smaller than another). The reader
    takes ``numbers`` as a tuple (it keys the choice of leaves: the same shapes, the same
    choice, worked out once)."""
    plans = _plans(skeleton)
    if sum(count for kind, _, _, count, _ in plans if kind != _OBJECT) < 2:
        return None
    build = builder(skeleton.treedef)
    frombuffer = np.frombuffer
    chosen: dict[tuple[int, ...], tuple[bool, ...]] = {}  # numbers -> per array: copy it

    def choose(numbers: tuple[int, ...]) -> tuple[bool, ...]:
        sizes = []
        p = 0
        for kind, dtype, ndim, count, _ in plans:
            if kind == _OBJECT:
                continue
            for _ in range(count):
                sizes.append(dtype.itemsize * prod(numbers[p + 1 : p + 1 + ndim]))
                p += 1 + ndim
        small = max(sizes) // APART_RATIO
        if len(chosen) >= _APART_CHOICES:
            chosen.clear()  # stay bounded (ragged batches: new shapes every batch)
        found = chosen[numbers] = tuple(size <= small for size in sizes)
        return found

    def read(root: np.ndarray, objects: list[Any] | None, numbers: tuple[int, ...]) -> Any:
        apart = chosen.get(numbers) or choose(numbers)
        out = []
        p = a = 0
        for kind, dtype, ndim, count, to_tensor in plans:
            if kind == _OBJECT:
                out.append(objects[count])  # type: ignore[index]
                continue
            views = []
            for _ in range(count):
                offset = numbers[p]
                if ndim == 1:
                    view = frombuffer(root, dtype, numbers[p + 1], offset)
                else:
                    shape = tuple(numbers[p + 1 : p + 1 + ndim])
                    view = frombuffer(root, dtype, prod(shape), offset).reshape(shape)
                p += 1 + ndim
                if not apart[a]:  # a view of the root: it keeps the slot leased
                    views.append(to_tensor(view) if to_tensor is not None else view)
                elif to_tensor is None:
                    views.append(view.copy())
                elif pin is None:
                    views.append(to_tensor(view.copy()))
                else:
                    views.append(pin(to_tensor(view)))  # (copied straight into page-locked memory)
                a += 1
            out.append(views[0] if kind == _ARRAY else views)
        return build(out)

    return read


_ARRAY, _RAGGED, _OBJECT = 0, 1, 2


def _tensor_maker(torch: Any, tag: bool | str) -> Callable[[np.ndarray], Any] | None:
    """How a leaf's array view becomes what the batch holds: None (the array itself),
    ``torch.from_numpy``, or for a dtype numpy lacks, that viewed as the torch dtype."""
    if not tag:
        return None
    if tag is True:
        return torch.from_numpy
    dtype = getattr(torch, tag)
    from_numpy = torch.from_numpy
    return lambda view: from_numpy(view).view(dtype)
