"""Collation: samples -> leaves -> a destination (a ring slot, or new arrays).

``gather`` walks the samples of one batch like torch's ``default_collate`` does (per
node, not per sample, with its types: see the docstring), checking that they agree, and
returns the batch's treedef and its leaves. Which rule a node follows is looked up by the
type of its first value in a type -> function registry, :data:`default_collate_fn_map`
(torch's ``collate_fn_map``: exact type, then isinstance in the map's order), which users
extend with their own types; :func:`collate` collates a list of samples with any map.
``flatten_tree`` gives the leaves of a batch that is already collated (a collate_fn's
output, or a ``batch_size=None`` sample), placed by the one rule of :func:`slot_leaf`.
``plan`` lays the array leaves out and ``copy_leaves`` copies each one exactly once into
its destination: a slot of the ring in a worker (zero further copies), or fresh memory in
the main process. ``fetch.Recipe`` drives both paths, so ``num_workers=0`` gives the same
batches as workers do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from math import prod
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from shmloader.batch import tree as _tree
from shmloader.batch.layout import (
    LEAF,
    ArrayLeaf,
    Layout,
    ObjectLeaf,
    RaggedLeaf,
    align,
    dtype_key,
    read_layout,
)
from shmloader.batch.pinning import torch_can_hold
from shmloader.batch.scalars import (
    TEXT_TYPES,
    scalar_array,
    stack_values,
    tensor_array,
    torch_tensor_type,
    unsupported,
)
from shmloader.context import get_worker_info
from shmloader.errors import BatchKeyError, BatchLayoutError, BatchTypeError


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
_DTYPE_OF = attrgetter("dtype")


_path_text = _tree.path_text


def _object_array_error(path: tuple, context: Any) -> BatchLayoutError:
    return BatchTypeError(
        f"{context}: the value at {_path_text(path)} is a numpy array of dtype object, which "
        "cannot be placed in shared memory. Return a numeric array, or a list/str if the "
        "field holds Python objects."
    )


# --- the registry ---------------------------------------------------------------------

CollateFn = Callable[..., Any]
"""A collate function: ``fn(batch, *, collate_fn_map)`` -> the collated value of
``batch`` (one field of every sample of a batch), as torch's ``collate_fn_map`` holds."""


def lookup(collate_fn_map: Mapping[Any, CollateFn], value: Any) -> CollateFn | None:
    """The function of ``collate_fn_map`` for ``value``: the entry of its exact type, else
    the first entry (in the map's order) whose key ``value`` is an instance of (a key may
    be a tuple of types); None when no entry fits. torch's ``collate`` looks up so."""
    fn = collate_fn_map.get(type(value))
    if fn is not None:
        return fn
    for key, fn in collate_fn_map.items():
        if isinstance(value, key):
            return fn
    return None


class Rule:
    """A built-in entry of :data:`default_collate_fn_map`: how one field of a batch whose
    first value is of the entry's type becomes leaves, which the loader copies straight
    into a slot (no batch is made in between). Called as every function of the map is
    (``rule(batch, collate_fn_map=...)``), it gives that field collated in fresh memory."""

    __slots__ = ("gather", "name")

    def __init__(self, name: str, gather: Callable[[Gathering, Any, tuple], Any]) -> None:
        self.name = name
        # gather(gathering, values, path): adds the field's leaves to the gathering and
        # returns the field's treedef node.
        self.gather = gather

    def __call__(self, batch: Sequence[Any], *, collate_fn_map: Mapping[Any, CollateFn] | None = None) -> Any:
        return _collated(batch, collate_fn_map, self)

    def __repr__(self) -> str:
        return f"<shmloader collate rule: {self.name}>"


class Gathering:
    """The walk over one batch's samples (the default collate), per node of the samples'
    tree rather than per sample: the node's function from ``collate_fn_map``
    (:func:`lookup` on the node's first value), else tensors and containers (mappings,
    namedtuples, sequences) by the built-in rules, else a :class:`BatchTypeError`.
    ``leaves``: the batch's leaves, in treedef order. ``context`` names the batch in an
    error message, and called with a sample's position, that sample (one object: its text
    is made only for an error)."""

    __slots__ = ("collate_fn_map", "context", "leaves", "mode", "pad_value", "tensor_type")

    def __init__(
        self,
        indices: Sequence[Any] | None,
        batch_no: int | None,
        collate_fn_map: Mapping[Any, CollateFn],
        mode: str = "stack",
        pad_value: Any = 0,
    ) -> None:
        self.collate_fn_map = collate_fn_map
        self.context = _LazyContext(batch_no, indices)
        self.leaves: list[Leaf] = []
        self.mode = mode
        self.pad_value = pad_value
        self.tensor_type = torch_tensor_type()

    def walk(self, values: list | tuple, path: tuple) -> Any:
        """Add the leaves of ``values`` (the field at ``path`` of every sample) and return
        the field's treedef node."""
        fn = lookup(self.collate_fn_map, values[0])
        if fn is None:
            return self.structure(values, path)
        if type(fn) is Rule:
            return fn.gather(self, values, path)
        return self.placed(fn(values, collate_fn_map=self.collate_fn_map), path)

    def placed(self, collated: Any, path: tuple) -> Any:
        """A user function's output for the field at ``path``, as a collate_fn's output
        is placed (:func:`slot_leaf`): arrays and plain tensors in the slot, anything else
        pickled beside them; its containers kept as they are."""
        treedef, values = _tree.flatten(collated)
        self.leaves.extend(slot_leaf(v, path) for v in values)
        return treedef

    def structure(self, values: list | tuple, path: tuple) -> Any:
        """A field no entry of the map takes: tensors (torch is not imported to put its
        type in the map), then containers; anything else is a :class:`BatchTypeError`."""
        first = values[0]
        tensor_type = self.tensor_type
        if tensor_type is not None and isinstance(first, tensor_type):
            return _gather_tensors(self, values, path)
        kind = _tree.node_kind(first)
        if kind is None:
            raise unsupported(self.context, path, self.context(0), first)
        # A "c" node (a deque, a UserList, a dict subclass with attributes) is rebuilt
        # from a copy of the first sample's (its shell, a leaf before its items), as
        # torch's collate rebuilds it; where it cannot be copied, torch makes a plain
        # dict or list, and so does this.
        shell = _tree.Shell.of(first) if kind == _tree.CLONE else None
        if shell is not None:
            self.leaves.append(Leaf(path, shell, "object", (), None))
        if kind == _tree.DICT or (kind == _tree.CLONE and isinstance(first, Mapping)):
            return self.mapping(values, path, kind, shell is not None)
        return self.sequence(values, path, kind, shell is not None)

    def mapping(self, values: list | tuple, path: tuple, kind: str, cloned: bool) -> Any:
        """A field of mappings: one child per key of the first."""
        context = self.context
        first = values[0]
        keys = tuple(first.keys())
        ftype = type(first)
        # (One C pass counting matches; the loop names the culprit.)
        if list(map(type, values)).count(ftype) != len(values):
            for i, v in enumerate(values):
                if type(v) is not ftype and not isinstance(v, Mapping):
                    raise _structure_error(context, path, context(0), first, context(i), v)
        try:
            children = tuple(self.walk([v[k] for v in values], (*path, k)) for k in keys)
        except KeyError as exc:
            raise BatchKeyError(
                f"{context}: the samples' dicts at {_path_text(path)} have different keys "
                f"({exc.args[0]!r} is missing from one). Give every sample the same keys."
            ) from None
        if cloned:
            return (_tree.CLONE, keys, children)
        return (_tree.DICT, dict if kind == _tree.CLONE else _tree.mapping_type(first), keys, children)

    def sequence(self, values: list | tuple, path: tuple, kind: str, cloned: bool) -> Any:
        """A field of sequences (list, tuple, namedtuple, deque...). torch's collate checks
        only that the others have the first's length, then zips them: an array or tensor
        row by row (ndim >= 1) goes as a list does."""
        context = self.context
        first = values[0]
        ftype, n = type(first), len(first)
        tensor_type = self.tensor_type
        sized = (Sequence, np.ndarray, *(() if tensor_type is None else (tensor_type,)))
        # (One C pass each counting matches, the common case; the loop names the culprit.)
        count = len(values)
        if list(map(type, values)).count(ftype) != count or list(map(len, values)).count(n) != count:
            for i, v in enumerate(values):
                # (type(v) is ftype first: no isinstance call per sample in the common case)
                if type(v) is not ftype and (
                    not isinstance(v, sized) or isinstance(v, TEXT_TYPES) or getattr(v, "ndim", 1) == 0
                ):
                    raise _structure_error(context, path, context(0), first, context(i), v)
                if len(v) != n:
                    raise _structure_error(context, path, context(0), first, context(i), v)
        children = tuple(self.walk(col, (*path, j)) for j, col in enumerate(zip(*values)))
        if kind == _tree.NAMEDTUPLE:
            return (_tree.NAMEDTUPLE, ftype, children)
        if cloned:
            return (_tree.CLONE, None, children)
        if kind == _tree.SEQUENCE:
            return (_tree.SEQUENCE, ftype, children)
        return (_tree.LIST, children)  # tuples become lists, as torch's default_collate does


def _gather_arrays(gathering: Gathering, values: list | tuple, path: tuple) -> Any:
    """Arrays: stacked (``mode="stack"``, or 0-d arrays); with ``mode="pad"`` or
    ``"list"`` arrays of ndim >= 1 padded to the batch's largest shape (a :class:`Padded`
    node) or placed one by one."""
    context = gathering.context
    leaves = gathering.leaves
    mode = gathering.mode
    first = values[0]
    if first.dtype.hasobject:
        raise _object_array_error(path, context)
    shape, dtype = first.shape, first.dtype
    if mode == "stack" or first.ndim == 0:
        # Dtypes are checked here: where they differ, or a number sits among the
        # arrays, torch promotes, and so does this. Then each sample's first
        # dimension: write_leaf concatenates the samples into the batch's rows,
        # which checks their other dimensions and ndim but only the total of
        # their first ones, so (2, D), (1, D), (3, D) would fill 3 rows of 2.
        # (Each check is one C pass over the samples, counting matches.)
        count = len(values)
        try:
            same = list(map(_DTYPE_OF, values)).count(dtype) == count
        except AttributeError:  # a Python number
            same = False
        if not same:
            values = stack_values(values, path, context, context)
            first = values[0]
            dtype = first.dtype
        if shape:
            try:
                rows = list(map(len, values)).count(shape[0]) == count
            except TypeError:  # a number (a 0-d value) among the arrays
                rows = False
            if not rows:
                raise _stack_mismatch(context, path, context, values)
        leaves.append(
            Leaf(path, values, "stack", (len(values), *shape), dtype, _numpy_only(dtype), namer=context)
        )
        return LEAF
    # One pass each for dtypes and ndims (not a loop of checks per sample).
    try:
        same = {v.dtype for v in values} == {dtype} and {v.ndim for v in values} == {first.ndim}
    except AttributeError:  # not an array
        same = False
    if not same:
        for i, v in enumerate(values):
            if not isinstance(v, np.ndarray) or v.ndim != first.ndim or v.dtype != dtype:
                raise _mismatch(context, path, context(0), first, context(i), v)
    if mode == "list":
        shapes = [v.shape for v in values]
        leaves.append(Leaf(path, values, "list", None, dtype, _numpy_only(dtype), shapes=shapes))
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
    top_shape = (len(values), *top)
    leaves.append(
        Leaf(path, values, "pad", top_shape, dtype, _numpy_only(dtype), pad_value=gathering.pad_value)
    )
    leaves.append(Leaf((*path, "lengths"), lengths, "copy", lengths.shape, lengths.dtype))
    return ("n", Padded, (LEAF, LEAF))


def _gather_numbers(gathering: Gathering, values: list | tuple, path: tuple) -> Any:
    """Numbers (Python's and numpy's scalars): one array of torch's dtype for them."""
    arr = scalar_array(values, path, gathering.context, gathering.context)
    gathering.leaves.append(Leaf(path, arr, "copy", arr.shape, arr.dtype))
    return LEAF


def _gather_text(gathering: Gathering, values: list | tuple, path: tuple) -> Any:
    """str and bytes, as torch's collate gives them: the batch's list, or a field's
    column, which is a tuple for list/tuple samples (their columns come from zip)."""
    gathering.leaves.append(Leaf(path, values, "object", (len(values),), None))
    return LEAF


def _gather_tensors(gathering: Gathering, values: list | tuple, path: tuple) -> Any:
    """Tensors: their data viewed as arrays and gathered as arrays are (the leaves then
    tagged to be handed out as tensors), or stacked with their autograd graph where one
    requires grad (:func:`_stack_with_grad`)."""
    context = gathering.context
    tensor_type = gathering.tensor_type
    first = values[0]
    if type(first) is not tensor_type and gathering.mode == "stack":
        kept = _stack_subclass(values)
        if kept is not None:
            gathering.leaves.append(Leaf(path, kept, "object", (), None))
            return LEAF
    tag: bool | str | None = None
    arrays = []
    grad = False
    for i, v in enumerate(values):
        if not isinstance(v, tensor_type):  # torch.stack refuses it too (TypeError)
            raise _structure_error(context, path, context(0), first, context(i), v)
        grad = grad or v.requires_grad
        v, v_tag = tensor_array(v)
        if tag is None:
            tag = v_tag
        elif v_tag != tag:  # a dtype numpy lacks (its raw bytes) beside another: never mixed
            raise _mismatch(context, path, context(0), first, context(i), values[i])
        arrays.append(v)
    if grad and gathering.mode == "stack":
        stacked = _stack_with_grad(values, path, context)
        if stacked is not None:
            gathering.leaves.append(Leaf(path, stacked, "object", (), None))
            return LEAF
    start = len(gathering.leaves)
    node = _gather_arrays(gathering, arrays, path)
    for leaf in gathering.leaves[start:]:
        # (pad's lengths are int64 in any case: never viewed as another dtype)
        leaf.torch = True if leaf.kind == "copy" else tag
    return node


_ARRAYS = Rule("numpy arrays", _gather_arrays)
_NUMBERS = Rule("numbers", _gather_numbers)
_TEXT = Rule("str and bytes", _gather_text)

default_collate_fn_map: dict[type | tuple[type, ...], CollateFn] = {
    np.ndarray: _ARRAYS,
    (np.bool_, np.number): _NUMBERS,
    float: _NUMBERS,
    int: _NUMBERS,
    str: _TEXT,
    bytes: _TEXT,
}
"""The type -> function registry of the loader's default collate (torch's
``default_collate_fn_map``). Add an entry to collate a type of your own: ``fn(batch, *,
collate_fn_map)`` gets one field of every sample of a batch (a list or tuple whose first
value is of the type) and returns its collated value, whose arrays and plain tensors go
into the slot and whose other values are pickled beside them. A value's entry is that of
its exact type, else the first (in insertion order) it is an instance of; a value without
one is a tensor or a container (collated by the built-in rules) or an error. Workers look
it up in their own process: register at import of the module that defines the dataset,
so that workers started by spawn or forkserver register too. See docs/collate.md."""


def collate(batch: Sequence[Any], *, collate_fn_map: Mapping[Any, CollateFn] | None = None) -> Any:
    """``batch`` (a sequence of samples) collated as the loader's default collate
    collates (``collate="stack"``), with ``collate_fn_map`` deciding per type (see
    :data:`default_collate_fn_map`; None: no entries, so only tensors and containers have
    rules, as in torch's ``collate``). Returns the batch in fresh memory: numpy arrays,
    tensors where the samples held tensors. Raises :class:`BatchTypeError` or
    :class:`BatchLayoutError` for values it cannot collate, as the loader does. A function
    of the map may call it on a part of its batch, passing its ``collate_fn_map`` on."""
    return _collated(batch, collate_fn_map, None)


def _collated(batch: Sequence[Any], collate_fn_map: Mapping[Any, CollateFn] | None, root: Rule | None) -> Any:
    """``batch`` collated in fresh memory, its root by ``root`` where given (a rule called
    as a function), else by the map's lookup."""
    gathering = Gathering(None, None, {} if collate_fn_map is None else collate_fn_map)
    if len(batch) == 0:
        raise BatchLayoutError(f"{gathering.context}: the batch has no samples; collate got an empty batch.")
    samples = list(batch)
    treedef = gathering.walk(samples, ()) if root is None else root.gather(gathering, samples, ())
    layout, data_bytes, objects = plan(treedef, gathering.leaves)
    return build_in_memory(layout, data_bytes, objects, copy_leaves(gathering.leaves))


def gather(
    samples: Sequence[Any],
    indices: Sequence[Any] | None,
    batch_no: int | None,
    mode: str = "stack",
    pad_value: Any = 0,
    collate_fn_map: Mapping[Any, CollateFn] | None = None,
) -> tuple[Any, list[Leaf]]:
    """Transpose ``samples`` into a treedef and leaves (the default collate), the types of
    their values looked up in ``collate_fn_map`` (None: :data:`default_collate_fn_map` as
    it is at the call).

    Types follow torch's ``default_collate``: numbers become one array (Python ints
    int64, floats float64, bools bool, numpy scalars their dtype), arrays and tensors are
    stacked, str/bytes give a list, dicts (and subclasses), namedtuples and lists keep
    their type, tuples become lists; a type with an entry in the map goes through it;
    anything else (None included) is a :class:`BatchTypeError`. ``mode`` says what
    happens to array fields whose shapes differ between samples: ``"stack"`` refuses them,
    ``"pad"`` pads every array field of ndim >= 1 to the batch maximum (a :class:`Padded`
    of values and lengths), ``"list"`` gives every such field as a list of per-sample
    arrays. Raises :class:`BatchLayoutError` naming the batch, the field path and the two
    differing shapes, dtypes or structures.
    """
    if collate_fn_map is None:
        collate_fn_map = default_collate_fn_map
    gathering = Gathering(indices, batch_no, collate_fn_map, mode, pad_value)
    if mode not in COLLATE_MODES:
        raise ValueError(f"collate must be one of {COLLATE_MODES}, got {mode!r}")
    if len(samples) == 0:
        raise BatchLayoutError(
            f"{gathering.context}: the batch has no samples; a sampler yielded an empty batch."
        )
    treedef = gathering.walk(list(samples), ())
    return treedef, gathering.leaves


def _stack_with_grad(values: list, path: tuple, context: Any) -> Any:
    """Tensors of which one requires grad, stacked as torch's collate stacks them: in the
    main process ``torch.stack``, whose batch requires grad and keeps the samples'
    autograd graph (None where it refuses them: the caller's checks then name the
    culprit); in a worker an error, as torch's (whose stack into shared memory refuses
    them), unless grad is off there."""
    torch = sys.modules["torch"]
    if get_worker_info() is not None:
        if not torch.is_grad_enabled():
            return None  # (torch's worker stacks them without grad then: as the slot does)
        raise BatchLayoutError(
            f"{context}: the tensors of field {_path_text(path)} require grad, and a worker "
            "cannot send a batch that keeps their autograd graph (torch's DataLoader raises "
            "RuntimeError for them in a worker too). Detach them in the dataset "
            "(tensor.detach()), or load with num_workers=0, where the batch keeps the graph."
        )
    try:
        return torch.stack(list(values), 0)
    except (RuntimeError, TypeError):
        return None


# Tensor subclass -> whether torch.stack of its instances keeps the subclass (decided by the
# first batch of it: most subclasses, torchvision's tv_tensors among them, stack to a plain
# tensor, which then takes the slot's path without a stack each batch).
_SUBCLASS_KEPT: dict[type, bool] = {}


def _stack_subclass(values: list | tuple) -> Any:
    """Tensors whose first is of a ``torch.Tensor`` subclass, stacked as torch's collate
    stacks them (``torch.stack``, whose result keeps the subclass where its
    ``__torch_function__`` does), when the result is of a subclass: the batch then travels
    as an object, as torch's keeps it. None where the stack gives a plain tensor, or
    refuses the values, or one requires grad (the slot's path decides those)."""
    cls = type(values[0])
    if _SUBCLASS_KEPT.get(cls) is False or any(getattr(v, "requires_grad", False) for v in values):
        return None
    torch = sys.modules["torch"]
    try:
        stacked = torch.stack(list(values), 0)
    except (RuntimeError, TypeError):
        return None
    if len(_SUBCLASS_KEPT) >= 1024:
        _SUBCLASS_KEPT.clear()  # stay bounded (classes made in a loop)
    kept = _SUBCLASS_KEPT[cls] = type(stacked) is not torch.Tensor
    return stacked if kept else None


def _numpy_only(dtype: np.dtype) -> bool | None:
    """A default-collated array leaf's torch tag: False, or None for a dtype torch has no
    tensor for (str, bytes, datetime...): output="torch" then refuses the batch with a
    TypeError, as torch's collate does (a collate_fn's arrays pass through instead)."""
    return False if torch_can_hold(dtype) else None


def converted(value: Any) -> Any:
    """One leaf as torch's ``default_convert`` gives it (``batch_size=None`` without a
    collate_fn), on the numpy side: a numpy scalar becomes a 0-d array; anything else
    (arrays, tensors, Python numbers, str, None...) is kept as it is."""
    return np.asarray(value) if isinstance(value, (np.bool_, np.number)) else value


def slot_leaf(value: Any, path: tuple) -> Leaf:
    """THE rule for a leaf of an already collated tree (a user collate_fn's output, or a
    converted sample): a numpy array of a non-object dtype or a plain dense tensor goes
    into the slot (zero copy for the consumer); anything else travels as an object,
    pickled beside the arrays and unchanged (torch passes a collate_fn's output through
    untouched), among them every tensor a slot's plain buffer cannot give back as it was
    (see :func:`plain_tensor`: sparse, nested, quantized, a subclass, one that requires
    grad), or whose strides a slot's C-ordered copy would change (channels_last,
    transposed, expanded: torch's workers share the tensor's storage, strides and all).
    A numpy array travels as torch's workers send it, pickled: in the slot as a C-ordered
    copy, or as an object where it is Fortran-ordered (its pickle keeps that order).
    ``path``: where the leaf sits, for an error message."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or (value.flags.f_contiguous and not value.flags.c_contiguous):
            return Leaf(path, value, "object", (), None)
        return Leaf(path, value, "copy", value.shape, value.dtype)
    tensor_type = torch_tensor_type()
    if tensor_type is not None and isinstance(value, tensor_type):
        if not plain_tensor(value, tensor_type) or not value.is_contiguous():
            return Leaf(path, value, "object", (), None)
        try:
            arr, tag = tensor_array(value)
        except (TypeError, RuntimeError):  # a dtype or storage with no numpy view
            return Leaf(path, value, "object", (), None)
        return Leaf(path, arr, "copy", arr.shape, arr.dtype, torch=tag)
    return Leaf(path, value, "object", (), None)


def plain_tensor(value: Any, tensor_type: type) -> bool:
    """Whether the tensor ``value`` is exactly what the consumer rebuilds from a slot's
    bytes (``torch.from_numpy``): a ``torch.Tensor`` itself (not a subclass such as
    ``nn.Parameter``), strided (not sparse, not nested), not quantized, not requiring
    grad. Any other tensor must travel pickled, as torch's workers send it, or it would
    come back changed or fail (``can't convert Sparse layout tensor to numpy``)."""
    if type(value) is not tensor_type or value.requires_grad:
        return False
    torch = sys.modules["torch"]
    return value.layout == torch.strided and not value.is_nested and not value.is_quantized


def flatten_tree(tree: Any, *, convert: bool = False) -> tuple[Any, list[Leaf]]:
    """Leaves of an already collated tree (a user collate_fn's output, or with ``convert``
    an unbatched sample, which first goes through :func:`converted`, its tuples becoming
    lists as in torch's ``default_convert``), placed by :func:`slot_leaf`; no new axis."""
    treedef, values = _tree.flatten(tree, tuples_as_lists=convert)
    if convert:
        values = [converted(v) for v in values]
    return treedef, [slot_leaf(v, (i,)) for i, v in enumerate(values)]


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
            specs.append(RaggedLeaf(tuple(offsets), tuple(leaf.shapes), dtype_key(leaf.dtype), leaf.torch))
        else:
            specs.append(ArrayLeaf(offset, leaf.shape, dtype_key(leaf.dtype), leaf.torch))
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
                # expand_dims, whose cost dominates for many small arrays.
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
    # (The namer is the batch's context too: its str() names the batch.)
    error = _stack_mismatch(leaf.namer, leaf.path, leaf.namer, leaf.values)
    return error or BatchLayoutError(f"cannot collate field {_path_text(leaf.path)}: {exc}")


def _stack_mismatch(
    context: Any, path: tuple, sample_name: Callable[[int], str], values: list
) -> BatchLayoutError | None:
    """The error naming the first sample of ``values`` that is not an array of the first
    one's shape and dtype (None if they all are)."""
    first = values[0]
    for i, v in enumerate(values):
        if not isinstance(v, np.ndarray) or v.shape != first.shape or v.dtype != first.dtype:
            return _mismatch(context, path, sample_name(0), first, sample_name(i), v)
    return None


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


class _LazyContext:
    """ "cannot collate batch N (sample indices ...)", formatted only for an error message
    (gather runs once per batch; the text is needed once per bad batch); called with a
    sample's position in the batch, that sample's name (a leaf's ``namer``)."""

    __slots__ = ("batch_no", "indices")

    def __init__(self, batch_no: int | None, indices: Sequence[Any] | None) -> None:
        self.batch_no = batch_no
        self.indices = indices

    def __call__(self, i: int) -> str:
        indices = self.indices
        if indices is not None and i < len(indices):
            return f"sample index {indices[i]!r}"
        return f"sample #{i} of the batch"

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

    # Another kind of value (a dict where a list was, a leaf where a tensor was) is a
    # TypeError in torch's collate, as here; the same kind of another length a ValueError.
    same_kind = isinstance(b, (Mapping, tuple, list)) and isinstance(a, (Mapping, tuple, list))
    error = (
        BatchLayoutError if same_kind and isinstance(a, Mapping) == isinstance(b, Mapping) else BatchTypeError
    )
    return error(
        f"{context}: the samples' structure differs at {_path_text(path)}: {name_a} is "
        f"{kind(a)}, {name_b} is {kind(b)}. Return the same structure from every sample."
    )
