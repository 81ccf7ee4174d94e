"""Collation: samples -> leaves -> a destination (a ring slot, or new arrays).

``gather`` walks the samples of one batch like torch's ``default_collate`` does (per
node, not per sample), checking that they agree, and returns the batch's treedef and its
leaves. ``place`` then lays the array leaves out and copies each one exactly once into
its destination: a slot of the ring in a worker (zero further copies), or freshly
allocated arrays when loading in the main process. Both paths share this code, so
``num_workers=0`` gives the same batches as workers do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from math import prod
from typing import Any, NamedTuple

import numpy as np

from shmloader.errors import BatchLayoutError
from shmloader.layout import LEAF, ArrayLeaf, Layout, ObjectLeaf, RaggedLeaf, align, read_layout


class Leaf:
    """One leaf of a batch before placement.

    ``kind`` says how ``values`` become the leaf's array:

    - ``"stack"``: a list of equal-shape arrays, stacked along a new first axis;
    - ``"copy"``: one array (already batched, or an unbatched sample), copied as it is;
    - ``"pad"``: a list of arrays of one ndim, each written into the top-left corner of
      its row of a batch-maximum shape filled with ``pad_value``;
    - ``"list"``: a list of arrays of any shapes, each placed on its own (``shapes``);
    - ``"object"``: Python objects, pickled beside the arrays (``dtype`` is None).
    """

    __slots__ = ("dtype", "kind", "namer", "pad_value", "path", "shape", "shapes", "torch", "values")

    def __init__(self, path, values, kind, shape, dtype, torch=False, pad_value=0, shapes=None, namer=None):
        self.path = path
        self.values = values
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self.torch = torch
        self.pad_value = pad_value
        self.shapes = shapes
        self.namer = namer  # "stack" leaves: names sample i, for an error message

    @property
    def nbytes(self) -> int:
        if self.dtype is None:
            return 0
        if self.kind == "list":
            return sum(prod(s) for s in self.shapes) * self.dtype.itemsize
        return prod(self.shape) * self.dtype.itemsize


class Padded(NamedTuple):
    """A ragged leaf collated with ``collate="pad"``: ``values`` padded to the batch's
    largest shape, and ``lengths``, each sample's own shape (int64 of shape (batch,)
    for 1-d samples, (batch, ndim) otherwise)."""

    values: Any
    lengths: Any


COLLATE_MODES = ("stack", "pad", "list")


def _path_text(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<sample>"


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def _tensor_to_numpy(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy()


def _object_array_error(path: tuple, context: str) -> BatchLayoutError:
    return BatchLayoutError(
        f"{context}: the value at {_path_text(path)} is a numpy array of dtype object, which "
        "cannot be placed in shared memory. Return a numeric array, or a list/str if the "
        "field holds Python objects."
    )


def gather(
    samples: Sequence[Any],
    indices: Sequence[Any] | None,
    batch_no: int | None,
    mode: str = "stack",
    pad_value: Any = 0,
) -> tuple[Any, list[Leaf]]:
    """Transpose ``samples`` into a treedef and leaves (the default collate).

    ``mode`` says what happens to array fields whose shapes differ between samples:
    ``"stack"`` refuses them, ``"pad"`` pads every array field of ndim >= 1 to the batch
    maximum (a :class:`Padded` of values and lengths), ``"list"`` gives every such field
    as a list of per-sample arrays. Raises :class:`BatchLayoutError` naming the batch,
    the field path and the two differing shapes, dtypes or structures.
    """
    tensor_type = _torch_tensor_type()
    leaves: list[Leaf] = []
    context = _LazyContext(batch_no, indices)

    def sample_name(i: int) -> str:
        if indices is not None and i < len(indices):
            return f"sample index {indices[i]!r}"
        return f"sample #{i} of the batch"

    sample_name.context = context  # type: ignore[attr-defined]

    def walk(values: list, path: tuple) -> Any:
        first = values[0]
        if isinstance(first, np.ndarray):
            if first.dtype.hasobject:
                raise _object_array_error(path, context)
            shape, dtype = first.shape, first.dtype
            if mode == "stack" or first.ndim == 0:
                # Not checked sample by sample here (a Python loop per sample costs more
                # than the copy for small leaves): the strict copy in write_leaf refuses
                # any other shape or dtype, and explain_stack_failure names the culprit.
                leaves.append(Leaf(path, values, "stack", (len(values), *shape), dtype, namer=sample_name))
                return LEAF
            # One pass each for dtypes and ndims (not a loop of checks per sample).
            try:
                same = {v.dtype for v in values} == {dtype} and {v.ndim for v in values} == {first.ndim}
            except AttributeError:  # not an array
                same = False
            if not same:
                for i, v in enumerate(values):
                    if not isinstance(v, np.ndarray) or v.ndim != first.ndim or v.dtype != dtype:
                        raise _mismatch(context, path, sample_name(0), first, sample_name(i), v)
            if mode == "list":
                leaves.append(Leaf(path, values, "list", None, dtype, shapes=[v.shape for v in values]))
                return LEAF
            if first.ndim == 1:  # sequences: (batch,) lengths, and the longest one
                sizes = list(map(len, values))
                top = (max(sizes),)
                lengths = np.array(sizes, np.int64)
            else:
                count = len(values) * first.ndim
                lengths = np.fromiter(chain.from_iterable(v.shape for v in values), np.int64, count)
                lengths = lengths.reshape(len(values), -1)
                top = tuple(lengths.max(axis=0).tolist())
            leaves.append(Leaf(path, values, "pad", (len(values), *top), dtype, pad_value=pad_value))
            leaves.append(Leaf((*path, "lengths"), lengths, "copy", lengths.shape, lengths.dtype))
            return ("n", Padded, (LEAF, LEAF))
        if isinstance(first, (bool, int, float, complex, np.generic)) and not isinstance(
            first, (np.str_, np.bytes_, np.object_)
        ):
            try:
                arr = np.asarray(values)
            except (ValueError, TypeError) as exc:
                raise _mismatch(context, path, sample_name(0), first, "another sample", exc) from None
            if arr.dtype.hasobject or arr.ndim != 1:
                bad = next(i for i, v in enumerate(values) if type(v) is not type(first))
                raise _mismatch(context, path, sample_name(0), first, sample_name(bad), values[bad])
            leaves.append(Leaf(path, arr, "copy", arr.shape, arr.dtype))
            return LEAF
        if tensor_type is not None and isinstance(first, tensor_type):
            arrays = [_tensor_to_numpy(v) if isinstance(v, tensor_type) else v for v in values]
            start = len(leaves)
            node = walk(arrays, path)
            for leaf in leaves[start:]:
                leaf.torch = True
            return node
        if isinstance(first, Mapping):
            keys = tuple(first.keys())
            ftype, n = type(first), len(keys)
            for i, v in enumerate(values):
                if (type(v) is not ftype and not isinstance(v, Mapping)) or len(v) != n:
                    raise _structure_error(context, path, sample_name(0), first, sample_name(i), v)
            try:
                children = tuple(walk([v[k] for v in values], (*path, k)) for k in keys)
            except KeyError as exc:
                raise BatchLayoutError(
                    f"{context}: the samples' dicts at {_path_text(path)} have different keys "
                    f"({exc.args[0]!r} is missing from one). Give every sample the same keys."
                ) from None
            return ("d", type(first), keys, children)
        if isinstance(first, (tuple, list)):
            ftype, n = type(first), len(first)
            for i, v in enumerate(values):
                if (type(v) is not ftype and not isinstance(v, (tuple, list))) or len(v) != n:
                    raise _structure_error(context, path, sample_name(0), first, sample_name(i), v)
            children = tuple(walk(list(col), (*path, j)) for j, col in enumerate(zip(*values)))
            if isinstance(first, tuple) and hasattr(first, "_fields"):
                return ("n", type(first), children)
            return ("l", children)  # tuples become lists, as torch's default_collate does
        # str, bytes, None and other objects: the batch holds a list of them.
        leaves.append(Leaf(path, list(values), "object", (len(values),), None))
        return LEAF

    if mode not in COLLATE_MODES:
        raise ValueError(f"collate must be one of {COLLATE_MODES}, got {mode!r}")
    if len(samples) == 0:
        raise BatchLayoutError(f"{context}: the batch has no samples; a sampler yielded an empty batch.")
    treedef = walk(list(samples), ())
    return treedef, leaves


def flatten_tree(tree: Any) -> tuple[Any, list[Leaf]]:
    """Leaves of an already collated tree (a user collate_fn's output, or an unbatched
    sample), kept as they are: no new axis. Node types are preserved."""
    tensor_type = _torch_tensor_type()
    leaves: list[Leaf] = []

    def walk(node: Any, path: tuple) -> Any:
        if isinstance(node, np.ndarray):
            if node.dtype.hasobject:
                raise _object_array_error(path, "the collated batch")
            leaves.append(Leaf(path, node, "copy", node.shape, node.dtype))
            return LEAF
        if isinstance(node, (bool, int, float, complex, np.generic)) and not isinstance(
            node, (np.str_, np.bytes_, np.object_)
        ):
            arr = np.asarray(node)
            leaves.append(Leaf(path, arr, "copy", arr.shape, arr.dtype))
            return LEAF
        if tensor_type is not None and isinstance(node, tensor_type):
            walk(_tensor_to_numpy(node), path)
            leaves[-1].torch = True
            return LEAF
        if isinstance(node, Mapping):
            keys = tuple(node.keys())
            return ("d", type(node), keys, tuple(walk(node[k], (*path, k)) for k in keys))
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return ("n", type(node), tuple(walk(v, (*path, j)) for j, v in enumerate(node)))
        if isinstance(node, (tuple, list)):
            tag = "t" if isinstance(node, tuple) else "l"
            return (tag, tuple(walk(v, (*path, j)) for j, v in enumerate(node)))
        leaves.append(Leaf(path, node, "object", (), None))
        return LEAF

    treedef = walk(tree, ())
    return treedef, leaves


def plan(treedef: Any, leaves: list[Leaf]) -> tuple[Layout, int, list[Any]]:
    """Lay out ``leaves``: returns the layout, the bytes the array data needs, and the
    object values to be pickled beside them."""
    specs: list[ArrayLeaf | ObjectLeaf | RaggedLeaf] = []
    objects: list[Any] = []
    offset = 0
    for leaf in leaves:
        if leaf.dtype is None:
            specs.append(ObjectLeaf(len(objects)))
            objects.append(leaf.values)
        elif leaf.kind == "list":
            offsets = []
            for shape in leaf.shapes:
                offsets.append(offset)
                offset = align(offset + prod(shape) * leaf.dtype.itemsize)
            specs.append(RaggedLeaf(tuple(offsets), tuple(leaf.shapes), leaf.dtype.str, leaf.torch))
        else:
            specs.append(ArrayLeaf(offset, leaf.shape, leaf.dtype.str, leaf.torch))
            offset = align(offset + leaf.nbytes)
    return Layout(treedef, tuple(specs)), offset, objects


def write_leaf(leaf: Leaf, dst: Any) -> None:
    """Copy ``leaf``'s values into ``dst``: an array of the leaf's shape and dtype, or
    for a ``"list"`` leaf, the list of per-sample arrays."""
    kind = leaf.kind
    if kind == "stack":
        # casting="no" makes a sample of another dtype an error, as another shape is.
        try:
            if dst.ndim > 1:
                # Stacking B arrays of shape (n, ...) is concatenating them along axis 0
                # into (B*n, ...): the same bytes, without np.stack's per-array
                # expand_dims (3x faster for many small arrays).
                flat = dst.reshape(dst.shape[0] * dst.shape[1], *dst.shape[2:])
                np.concatenate(leaf.values, out=flat, casting="no")
            elif dst.shape[0]:
                np.stack(leaf.values, out=dst, casting="no")
        except (ValueError, TypeError) as exc:
            raise explain_stack_failure(leaf, exc) from None
    elif kind == "copy":
        np.copyto(dst, leaf.values, casting="no")
    elif kind == "pad":
        pad = leaf.pad_value
        if dst.ndim == 2 and dst.flags.c_contiguous:
            # Sequences: one fill of the whole leaf (a memset-speed pass), then one slice
            # assignment per row; two per row (prefix, then tail) cost twice the Python.
            dst.fill(pad)
            flat = dst.reshape(-1)  # slices of the flat view: no row view per sample
            width = dst.shape[1]
            start = 0
            for value in leaf.values:
                flat[start : start + len(value)] = value
                start += width
        else:
            for row, value in zip(dst, leaf.values):
                if value.shape == row.shape:
                    row[...] = value
                else:
                    row.fill(pad)
                    row[tuple(map(slice, value.shape))] = value
    else:  # list
        for row, value in zip(dst, leaf.values):
            row[...] = value


def explain_stack_failure(leaf: Leaf, exc: Exception) -> BatchLayoutError:
    """The error for a stacked leaf whose samples disagree: which two, and how."""
    sample_name = leaf.namer
    first = leaf.values[0]
    for i, v in enumerate(leaf.values):
        if not isinstance(v, np.ndarray) or v.shape != first.shape or v.dtype != first.dtype:
            return _mismatch(sample_name.context, leaf.path, sample_name(0), first, sample_name(i), v)
    return BatchLayoutError(f"cannot collate field {_path_text(leaf.path)}: {exc}")


def array_views(layout: Layout, buf: np.ndarray) -> list[Any]:
    """Writable views of each array leaf of ``layout`` in the uint8 buffer ``buf``: an
    array per array leaf, a list of arrays per ragged leaf, None per object leaf."""
    views: list[Any] = []
    for spec in layout.leaves:
        kind = type(spec)
        if kind is ArrayLeaf:
            count = prod(spec.shape)
            views.append(np.frombuffer(buf, np.dtype(spec.dtype), count, spec.offset).reshape(spec.shape))
        elif kind is RaggedLeaf:
            dtype = np.dtype(spec.dtype)
            views.append(
                [
                    np.frombuffer(buf, dtype, prod(shape), off).reshape(shape)
                    for off, shape in zip(spec.offsets, spec.shapes)
                ]
            )
        else:
            views.append(None)
    return views


def copy_leaves(leaves: list[Leaf]) -> Callable[[list[np.ndarray | None]], None]:
    """A filler that copies gathered ``leaves`` into their views."""

    def fill(views: list[np.ndarray | None]) -> None:
        for leaf, view in zip(leaves, views):
            if view is not None:
                write_leaf(leaf, view)

    return fill


def build_in_memory(
    layout: Layout, data_bytes: int, objects: list[Any], fill: Callable[[list[np.ndarray | None]], None]
) -> Any:
    """The batch in fresh process memory (main-process loading, or a batch that does not
    go through a slot): the same layout and filler as the ring path, so the same values."""
    buf = np.empty(max(data_bytes, 1), np.uint8)
    fill(array_views(layout, buf))
    return read_layout(layout, buf, objects)


def build_arrays(treedef: Any, leaves: list[Leaf]) -> Any:
    """The gathered batch as new arrays: same values as the ring path."""
    layout, data_bytes, objects = plan(treedef, leaves)
    return build_in_memory(layout, data_bytes, objects, copy_leaves(leaves))


class _LazyContext:
    """ "cannot collate batch N (sample indices ...)", formatted only for an error message
    (gather runs once per batch; the text is needed once per bad batch)."""

    __slots__ = ("batch_no", "indices")

    def __init__(self, batch_no: int | None, indices: Sequence[Any] | None) -> None:
        self.batch_no = batch_no
        self.indices = indices

    def __str__(self) -> str:
        where = f"batch {self.batch_no}" if self.batch_no is not None else "a batch"
        if self.indices is not None:
            shown = list(self.indices[:8])
            more = f" (+{len(self.indices) - 8} more)" if len(self.indices) > 8 else ""
            where += f" (sample indices {shown}{more})"
        return f"cannot collate {where}"


def _describe(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"an array of shape {v.shape} and dtype {v.dtype}"
    if isinstance(v, BaseException):
        return f"values numpy cannot combine ({v})"
    return f"{type(v).__name__} {v!r:.60}"


def _mismatch(context, path, name_a, a, name_b, b) -> BatchLayoutError:
    return BatchLayoutError(
        f"{context}: field {_path_text(path)} differs between samples: {name_a} has "
        f"{_describe(a)}, {name_b} has {_describe(b)}. Samples of one batch must agree in "
        "shape and dtype: resize, crop or pad them in the dataset, or pass a collate_fn "
        "that handles ragged data."
    )


def _structure_error(context, path, name_a, a, name_b, b) -> BatchLayoutError:
    def kind(v: Any) -> str:
        n = len(v) if isinstance(v, (Mapping, tuple, list)) else None
        return f"a {type(v).__name__}" + (f" of {n} items" if n is not None else "")

    return BatchLayoutError(
        f"{context}: the samples' structure differs at {_path_text(path)}: {name_a} is "
        f"{kind(a)}, {name_b} is {kind(b)}. Return the same structure from every sample."
    )
