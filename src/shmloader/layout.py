"""Batch layout: a tree of leaves (shape, dtype, offset) <-> compact bytes.

A batch is a tree of dict / list / tuple / namedtuple nodes whose leaves are arrays
(placed in a slot) or other objects (pickled beside them). Its layout is a small frozen
description of that tree: the *treedef* (the nodes) and one descriptor per leaf. A worker
encodes a layout once per distinct shape of batch and writes the bytes into the slot; the
consumer decodes each distinct layout once and keeps it in a cache, so the steady state
pickles nothing.
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


def encode(layout: Layout) -> bytes:
    """Bytes for ``layout`` (the trust boundary: only this loader's workers write them)."""
    return pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Layout:
    """The layout encoded in ``data``."""
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
def reader_for(layout: Layout) -> Callable[[np.ndarray, list[Any] | None], Any]:
    """The (cached) reader of ``layout``; see :func:`make_reader`."""
    return make_reader(layout)


def make_reader(layout: Layout) -> Callable[[np.ndarray, list[Any] | None], Any]:
    """A function ``(root, objects) -> batch`` that rebuilds the batch of ``layout`` from a
    slot's root array, as views of it (no copy), and the unpickled object leaves."""
    torch = None
    if any(getattr(leaf, "torch", False) for leaf in layout.leaves):
        import torch  # only when a sample was a tensor: torch is then installed
    # One plan per leaf: (kind, dtype, count or index, offset, shape, as_torch).
    plans = []
    for leaf in layout.leaves:
        if isinstance(leaf, ArrayLeaf):
            count = prod(leaf.shape)
            plans.append((_ARRAY, np.dtype(leaf.dtype), count, leaf.offset, leaf.shape, leaf.torch))
        elif isinstance(leaf, RaggedLeaf):
            parts = tuple((prod(s), o, s) for o, s in zip(leaf.offsets, leaf.shapes))
            plans.append((_RAGGED, np.dtype(leaf.dtype), parts, 0, (), leaf.torch))
        else:
            plans.append((_OBJECT, None, leaf.index, 0, (), False))
    build = builder(layout.treedef)
    frombuffer = np.frombuffer

    def read(root: np.ndarray, objects: list[Any] | None) -> Any:
        out = []
        for kind, dtype, count, offset, shape, as_torch in plans:
            if kind == _ARRAY:
                # frombuffer on the root gives a view whose .base is the root, so the
                # root (and the slot lease tied to it) lives as long as any view does.
                view = frombuffer(root, dtype, count, offset).reshape(shape)
                out.append(torch.from_numpy(view) if as_torch else view)
            elif kind == _RAGGED:
                views = [frombuffer(root, dtype, n, o).reshape(s) for n, o, s in count]
                out.append([torch.from_numpy(v) for v in views] if as_torch else views)
            else:
                out.append(objects[count])  # type: ignore[index]
        return build(out)

    return read


_ARRAY, _RAGGED, _OBJECT = 0, 1, 2
