"""Numbers and tensors as torch's ``default_collate`` batches them (for collate.py).

- A batch of numbers becomes one array of the dtype torch gives it: Python ints int64,
  floats float64 (float32 when a Python int comes first: ``torch.tensor``'s inference),
  bools bool, numpy scalars their dtype, mixed kinds promoted as torch promotes. An int
  that int64 cannot hold is an error naming the field and the sample (torch raises
  ``ValueError``), never a float64 or uint64 that loses it.
- A tensor's data is viewed as a numpy array (bfloat16 and float8, which numpy lacks, as
  same-size integers plus the torch dtype's name).
- Anything else at a leaf (None included) is a :class:`BatchTypeError`, as torch raises
  ``TypeError``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from shmloader.batch.tree import path_text as _path_text
from shmloader.errors import BatchLayoutError, BatchTypeError


def torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def tensor_array(t: Any) -> tuple[np.ndarray, bool | str]:
    """A CPU tensor's data as a numpy array sharing its memory, and the leaf's torch tag:
    True, or for a dtype numpy lacks (bfloat16, float8) the torch dtype's name, the array
    then holding the raw bytes as same-size integers (rebuilt with ``.view(dtype)``)."""
    if t.is_nested:  # torch's default_collate refuses them with this sentence
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default "
            "collate_fn; please provide a custom collate_fn to handle them appropriately."
        )
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    try:
        return t.numpy(), True
    except TypeError:  # numpy has no such dtype
        raw = _RAW_INT.get(t.element_size())
        if raw is None:
            raise
        torch = sys.modules["torch"]
        return t.view(getattr(torch, raw)).numpy(), str(t.dtype).removeprefix("torch.")


_RAW_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

# Python and numpy scalar types the default collate batches into an array.
# A batch whose first value is one of these becomes one array (torch's collate has no
# rule for a Python complex first: TypeError; one later in the batch promotes, as there).
NUMBER_TYPES = (bool, int, float, np.bool_, np.number)
_ANY_NUMBER = (*NUMBER_TYPES, complex)
TEXT_TYPES = (str, bytes)  # np.str_ and np.bytes_ subclass these: a list, as in torch
# The dtype torch's collate infers for a Python scalar in a batch whose first sample is not
# a Python float (torch.tensor / torch.as_tensor of the list); a float first makes float64.
_PY_SCALAR_DTYPES = {
    bool: np.dtype(np.bool_),
    int: np.dtype(np.int64),
    float: np.dtype(np.float32),  # torch's default dtype
    complex: np.dtype(np.complex64),  # torch's default complex dtype
}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def unsupported(context: Any, path: tuple, name: str, value: Any) -> BatchTypeError:
    what = "None" if value is None else f"a {type(value).__name__} ({value!r:.60})"
    return BatchTypeError(
        f"{context}: field {_path_text(path)} of {name} is {what}; the default collate "
        "batches arrays, tensors, numbers, str/bytes, dicts, lists and tuples (torch's "
        "default_collate raises TypeError too). Return such values from __getitem__, register "
        "a function for its type in shmloader.default_collate_fn_map (docs/collate.md), or "
        "pass a collate_fn that handles this one (e.g. one that filters out None samples)."
    )


def _scalar_dtype(values: list, types: set) -> np.dtype | None:
    """The dtype torch's default_collate gives a batch of numbers of several ``types``
    (None when one of them is not a number): a Python float first makes float64; else
    each value's own dtype (Python int: int64, float: torch's default float32, bool:
    bool), the highest kind (bool < int < float < complex) winning as torch promotes."""
    if not all(issubclass(t, _ANY_NUMBER) for t in types):
        return None
    if type(values[0]) is float:
        return np.dtype(np.float64)
    dtypes = []
    for t in types:
        d = _number_dtype(t)
        if d is None:
            return None
        dtypes.append(d)
    return _promoted(dtypes)


def _number_dtype(t: type) -> np.dtype | None:
    """The dtype ``torch.as_tensor`` gives a number of type ``t`` (None: not a number)."""
    if t in _PY_SCALAR_DTYPES:
        return _PY_SCALAR_DTYPES[t]
    if issubclass(t, (np.bool_, np.number)):
        return np.dtype(t)
    if issubclass(t, bool):  # bool/int/float subclasses: their base's dtype
        return _PY_SCALAR_DTYPES[bool]
    if issubclass(t, (int, float, complex)):
        return _PY_SCALAR_DTYPES[next(b for b in (int, float, complex) if issubclass(t, b))]
    return None


def _list_dtype(v: list | tuple) -> np.dtype | None:
    """The dtype ``torch.as_tensor`` gives a (nested) list of numbers and arrays: their
    dtypes promoted (an empty list: torch's default float32); None when something in it
    is neither (or the lists are ragged: numpy then says so)."""
    dtypes: set[np.dtype] = set()
    stack = [v]
    while stack:
        for x in stack.pop():
            if isinstance(x, (list, tuple)):
                stack.append(x)
            elif isinstance(x, (np.ndarray, np.generic)):
                if x.dtype.kind not in _CATEGORY:
                    return None
                dtypes.add(x.dtype)
            else:
                d = _number_dtype(type(x))
                if d is None:
                    return None
                dtypes.add(d)
    return _promoted(list(dtypes)) if dtypes else _PY_SCALAR_DTYPES[float]


_CATEGORY = {"b": 0, "i": 1, "u": 1, "f": 2, "c": 3}
_USER_DTYPES = 256  # NPY_USERDEF: dtypes numbered from here are other packages' (ml_dtypes)


def _promoted(dtypes: list[np.dtype]) -> np.dtype:
    """torch's promotion of tensors of ``dtypes`` (all of one rank): the highest kind
    (bool < int < float < complex) wins, and within it the widest, so int64 with
    float16 gives float16 where numpy would give float64."""
    top = max(_CATEGORY[d.kind] for d in dtypes)
    return np.result_type(*[d for d in dtypes if _CATEGORY[d.kind] == top])


def stack_values(values: list, path: tuple, context: Any, sample_name: Callable[[int], str]) -> list:
    """The values of a field whose first is an array and whose others are not all arrays
    of its dtype, as torch's default_collate stacks them: each made a tensor
    (``torch.as_tensor``: numbers and numpy scalars too), the dtypes promoted (int8 with
    a Python int gives int64, int8 with int16 int16, float32 with a float64 array
    float64, a float64 array with a float32 tensor float64). Returned as arrays of that
    dtype; unchanged when a value is neither an array, a CPU tensor of a numpy dtype nor a
    number (the stack then refuses it, naming the sample)."""
    dtypes = set()
    tensor_type = torch_tensor_type()
    if tensor_type is not None and any(isinstance(v, tensor_type) for v in values):
        values = [_tensor_as_array(v) if isinstance(v, tensor_type) else v for v in values]
    for v in values:
        if isinstance(v, (np.ndarray, np.generic)):
            if v.dtype.kind not in _CATEGORY or v.dtype.num >= _USER_DTYPES:
                return values  # str, bytes, datetime, ml_dtypes' bfloat16...: torch refuses these
            dtypes.add(v.dtype)
        else:
            d = _list_dtype(v) if isinstance(v, (list, tuple)) else _number_dtype(type(v))
            if d is None:
                return values
            dtypes.add(d)
    dtype = _promoted(list(dtypes))
    if dtype == np.int64:
        _check_int64(values, path, context, sample_name)
    try:
        return [np.asarray(v, dtype) for v in values]
    except ValueError:  # a ragged list: the stack refuses it, naming the sample
        return values


def _tensor_as_array(t: Any) -> Any:
    """A tensor among arrays, as ``torch.as_tensor`` of the arrays meets it in torch's
    collate: its data as an array where numpy has its dtype and it needs no autograd
    graph; else the tensor itself (the stack then refuses it, naming the sample)."""
    if t.requires_grad:
        return t
    try:
        arr, tag = tensor_array(t)
    except (TypeError, RuntimeError):
        return t
    return arr if tag is True else t


def scalar_array(values: list, path: tuple, context: Any, sample_name: Callable[[int], str]) -> np.ndarray:
    """The array of a batch of numbers, with torch's default_collate dtypes; an error
    naming the sample for a value that dtype cannot hold, or for a non-number."""
    # Fast path, one C pass: for a Python bool, int or float first, numpy's own
    # inference agrees with torch's whenever it gives one of these dtypes.
    first = type(values[0])
    fits = _FAST_DTYPES.get(first)
    if first is bool and not set(map(type, values)) <= _PY_INT_BOOL:
        # torch.tensor refuses a bool first with arrays or numpy scalars after it (numpy
        # takes them): checked only where a bool comes first, so ints and floats pay nothing.
        fits = None
    if fits is not None:
        try:
            arr = np.array(values)
        except (OverflowError, TypeError, ValueError):
            arr = None
        if arr is not None and arr.dtype in fits and arr.ndim == 1:
            return arr
    count = len(values)
    if (
        fits is None
        and issubclass(first, _NUMPY_NUMBERS)
        and (count == 1 or list(map(type, values)).count(first) == count)
    ):
        # numpy scalars of one type: torch.as_tensor keeps their dtype, as numpy does.
        dtype = _SCALAR_DTYPES.get(first)
        if dtype is None:  # (np.dtype of a type costs as much as the array below)
            dtype = _SCALAR_DTYPES[first] = np.dtype(first)
        try:
            return np.fromiter(values, dtype, count)
        except TypeError:  # timedelta64: its type's dtype has no unit (np.array finds it)
            return np.array(values, dtype)
    types = set(map(type, values))
    # Mixed types, or a value that does not fit: torch's rule, checked value by value.
    dtype = _scalar_dtype(values, types)
    if dtype is None:
        bad = next((i for i, v in enumerate(values) if not isinstance(v, _ANY_NUMBER)), 0)
        raise unsupported(context, path, sample_name(bad), values[bad])
    if dtype == np.int64:
        _check_int64(values, path, context, sample_name)
    try:
        return np.array(values, dtype)
    except (OverflowError, TypeError, ValueError):
        _check_int64(values, path, context, sample_name)
        raise BatchLayoutError(
            f"{context}: the numbers of field {_path_text(path)} cannot share one dtype "
            f"({sorted(t.__name__ for t in types)}). Return one type of number per field."
        ) from None


_PY_INT_BOOL = frozenset({bool, int})
_NUMPY_NUMBERS = (np.bool_, np.number)
_SCALAR_DTYPES: dict[type, np.dtype] = {}  # numpy scalar type -> its dtype (a few dozen at most)
_FAST_DTYPES = {
    int: (np.dtype(np.int64),),
    bool: (np.dtype(np.bool_), np.dtype(np.int64)),
    float: (np.dtype(np.float64),),
}


def _check_int64(values: list, path: tuple, context: Any, sample_name: Callable[[int], str]) -> None:
    """Raise, naming the sample, when a Python int of ``values`` does not fit int64."""
    for i, v in enumerate(values):
        if isinstance(v, int) and not _INT64_MIN <= v <= _INT64_MAX:
            raise BatchLayoutError(
                f"{context}: field {_path_text(path)} of {sample_name(i)} is the int {v}, "
                "which no integer dtype of the batch holds: Python ints collate to int64 "
                "(-2**63 .. 2**63-1), as in torch's default_collate (which raises ValueError). "
                "Return it as a float, a string, or split it into smaller ints."
            )
