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
from collections.abc import Callable, Iterator
from math import prod
from typing import Any, NamedTuple

import numpy as np

# Treedef nodes (nested tuples, hashable so layouts can key caches):
#   LEAF                          a leaf
#   ("d", cls, keys, children)    a dict (cls: dict or a dict subclass)
#   ("l", children)               a list
#   ("t", children)               a tuple
#   ("n", cls, children)          a namedtuple
LEAF = None

ALIGN_BYTES = 64  # leaves start on cache-line boundaries


class ArrayLeaf(NamedTuple):
    """An array leaf placed at ``offset`` in a slot."""

    offset: int
    shape: tuple[int, ...]
    dtype: str  # numpy dtype.str, e.g. '|u1', '<f4'
    torch: bool  # the samples were torch tensors: hand out a tensor sharing the memory


class RaggedLeaf(NamedTuple):
    """A leaf collated as a list: sample ``k``'s array at ``offsets[k]``, of ``shapes[k]``."""

    offsets: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    torch: bool


class ObjectLeaf(NamedTuple):
    """A non-array leaf: item ``index`` of the slot's pickled object list."""

    index: int


class Layout(NamedTuple):
    """Everything needed to rebuild a batch from a slot's bytes."""

    treedef: Any
    leaves: tuple[ArrayLeaf | RaggedLeaf | ObjectLeaf, ...]


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


def unflatten(treedef: Any, leaves: Iterator[Any]) -> Any:
    """Rebuild the tree described by ``treedef``, taking leaves in order from ``leaves``."""
    if treedef is LEAF:
        return next(leaves)
    tag = treedef[0]
    if tag == "l":
        return [unflatten(c, leaves) for c in treedef[1]]
    if tag == "t":
        return tuple(unflatten(c, leaves) for c in treedef[1])
    if tag == "d":
        _, cls, keys, children = treedef
        items = {k: unflatten(c, leaves) for k, c in zip(keys, children)}
        return items if cls is dict else _make_mapping(cls, items)
    _, cls, children = treedef  # namedtuple
    return cls(*(unflatten(c, leaves) for c in children))


def builder(treedef: Any) -> Callable[[list[Any]], Any]:
    """A function ``leaves -> tree`` equal to ``unflatten(treedef, iter(leaves))``, made
    once per layout: for a flat tree (every child a leaf, the common case) it is one call,
    without unflatten's walk. ``leaves`` must be a fresh list (a flat list tree is it)."""
    if treedef is LEAF:
        return lambda leaves: leaves[0]
    flat = all(child is LEAF for child in treedef[-1])
    if not flat:
        return lambda leaves: unflatten(treedef, iter(leaves))
    tag = treedef[0]
    if tag == "l":
        return lambda leaves: leaves
    if tag == "t":
        return tuple
    if tag == "n":
        cls = treedef[1]
        return lambda leaves: cls(*leaves)
    _, cls, keys, _ = treedef
    if cls is dict:
        return lambda leaves: dict(zip(keys, leaves))
    return lambda leaves: _make_mapping(cls, dict(zip(keys, leaves)))


def _make_mapping(cls: type, items: dict) -> Any:
    try:
        return cls(items)
    except TypeError:  # a subclass whose constructor takes other arguments
        return items


@functools.lru_cache(maxsize=256)
def _cached_reader(skeleton: Skeleton) -> Callable[[np.ndarray, list[Any] | None, list[int]], Any]:
    return make_reader(skeleton)


def read_layout(layout: Layout, root: np.ndarray, objects: list[Any] | None) -> Any:
    """The batch of ``layout`` in ``root``, as views of it (readers cached per skeleton)."""
    skeleton, numbers = split(layout)
    return _cached_reader(skeleton)(root, objects, numbers)


def make_reader(skeleton: Skeleton) -> Callable[[np.ndarray, list[Any] | None, list[int]], Any]:
    """A function ``(root, objects, numbers) -> batch`` that rebuilds a batch of
    ``skeleton`` from a slot's root array, as views of it (no copy), the unpickled object
    leaves and the layout's numbers (see :func:`split`)."""
    torch = None
    if any(leaf[-1] is True for leaf in skeleton.leaves if leaf[0] != "o"):
        import torch  # only when a sample was a tensor: torch is then installed
    # One plan per leaf: (kind, dtype, ndim, count or object index, as_torch).
    plans = []
    for leaf in skeleton.leaves:
        if leaf[0] == "a":
            plans.append((_ARRAY, np.dtype(leaf[1]), leaf[2], 1, leaf[3]))
        elif leaf[0] == "r":
            plans.append((_RAGGED, np.dtype(leaf[1]), leaf[3], leaf[2], leaf[4]))
        else:
            plans.append((_OBJECT, None, 0, leaf[1], False))
    build = builder(skeleton.treedef)
    frombuffer = np.frombuffer

    def read(root: np.ndarray, objects: list[Any] | None, numbers: list[int]) -> Any:
        out = []
        p = 0
        for kind, dtype, ndim, count, as_torch in plans:
            if kind == _OBJECT:
                out.append(objects[count])  # type: ignore[index]
                continue
            views = []
            for _ in range(count):
                offset = numbers[p]
                shape = tuple(numbers[p + 1 : p + 1 + ndim])
                p += 1 + ndim
                # frombuffer on the root gives a view whose .base is the root, so the
                # root (and the slot lease tied to it) lives as long as any view does.
                view = frombuffer(root, dtype, prod(shape), offset).reshape(shape)
                views.append(torch.from_numpy(view) if as_torch else view)
            out.append(views[0] if kind == _ARRAY else views)
        return build(out)

    return read


_ARRAY, _RAGGED, _OBJECT = 0, 1, 2
