"""Samples for the differential suite against torch (tests/test_torch_parity.py).

A *schema* is a random sample structure: a tree of containers (:class:`Node`) whose
leaves (:class:`Leaf`) say what kind of value they hold. :func:`make_samples` draws a
small dataset from a schema with a numpy generator: hypothesis draws and shrinks the
schema and the generator's seed, and the values come from the seed, which is cheaper than
drawing every array through hypothesis. Also here: the datasets and the collate_fn the
cases use (module level, so that workers can import them).
"""

from __future__ import annotations

import math
from collections import OrderedDict, UserList, defaultdict, deque, namedtuple
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Module-level namedtuples: a batch's structure travels from workers by reference, and a
# namedtuple class must be importable for that.
Pair = namedtuple("Pair", "a b")
Triple = namedtuple("Triple", "x y z")
Single = namedtuple("Single", "v")
NAMEDTUPLES = (Single, Pair, Triple)


class Record(dict):
    """A dict subclass a dataset might return (module level, for the same reason)."""


class Noted(dict):
    """A dict subclass whose instances have an attribute (torch's collate keeps the first
    sample's: it copies that sample's dict)."""


class Tagged(UserList):
    """A UserList subclass whose instances have an attribute."""


class Row(list):
    """A list subclass whose instances have an attribute."""


class Listing(defaultdict):
    """A defaultdict subclass (copied by torch's collate with its default_factory)."""


class Keyed(dict):
    """A dict subclass whose constructor takes another argument, kept as an attribute
    (torch's collate never calls the constructor: it copies the first sample's)."""

    def __init__(self, key: str, items: Any = ()) -> None:
        super().__init__(items)
        self.key = key


# numpy dtypes torch holds, native and big-endian (torch refuses a non-native byte order:
# see Rule 5 in test_torch_parity.py).
NATIVE_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
BIG_ENDIAN_DTYPES = (">i2", ">i4", ">i8", ">u4", ">f4", ">f8", ">c8", ">c16")
NUMPY_SCALAR_DTYPES = ("bool", "int16", "int64", "uint8", "float16", "float32", "float64", "complex64")
TORCH_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    *(d for d in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, d)),
)

# --- schemas ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """A leaf of a schema: ``kind`` is one of ``np`` (an array: ``dtype``, ``shape``,
    ``layout`` in c/fortran/strided/neg), ``npscalar``, ``tensor`` (``dtype`` a torch
    dtype name), ``int`` (``span``: small, huge63 = [2**63, 2**64), huge64 >= 2**64,
    neghuge < -2**63; huge values are put in one sample only, as a real dataset would),
    ``float``, ``bool``, ``complex``, ``str``, ``bytes``, ``none``."""

    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    layout: str = "c"
    span: str = "small"


@dataclass(frozen=True)
class Node:
    """A container of a schema: ``kind`` is dict, odict (OrderedDict), ddict (a
    defaultdict), record (a dict subclass), noted (a dict subclass with an attribute),
    tuple, list, namedtuple, deque (with a maxlen), userlist (a UserList subclass with an
    attribute) or row (a list subclass with an attribute)."""

    kind: str
    children: tuple[Any, ...]
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mutation:
    """One sample differs from the schema at one leaf (the error paths): ``what`` is
    ``none`` (the value is None), ``shape`` (an array of another shape), ``dtype`` (an
    array or tensor of another dtype), ``kind`` (a value of a neighbouring kind: an int
    for a float, a tensor for an array, ...), ``kind2`` (a farther kind: a number as a
    string, an array as a list) or ``wrap`` (the value in a list)."""

    sample: int
    leaf: int
    what: str


def leaves_of(schema: Any) -> list[Leaf]:
    if isinstance(schema, Leaf):
        return [schema]
    return [leaf for c in schema.children for leaf in leaves_of(c)]


def make_samples(schema: Any, n: int, seed: int, mutation: Mutation | None = None) -> list[Any]:
    """``n`` samples of ``schema``, values drawn from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    nleaves = len(leaves_of(schema))
    huge_at = {i: int(rng.integers(n)) for i in range(nleaves)}  # the sample of a huge int
    samples = []
    for s in range(n):
        counter = iter(range(nleaves))

        def build(node: Any, s: int = s, counter: Any = counter) -> Any:
            if isinstance(node, Leaf):
                i = next(counter)
                what = mutation.what if mutation and mutation.sample == s and mutation.leaf == i else None
                return leaf_value(node, rng, huge=huge_at[i] == s, mutate=what)
            values = [build(c) for c in node.children]
            if node.kind == "dict":
                return dict(zip(node.keys, values))
            if node.kind == "odict":
                return OrderedDict(zip(node.keys, values))
            if node.kind == "ddict":
                return defaultdict(list, zip(node.keys, values))
            if node.kind == "record":
                return Record(zip(node.keys, values))
            if node.kind == "tuple":
                return tuple(values)
            if node.kind == "list":
                return values
            if node.kind == "deque":
                return deque(values, maxlen=len(values) + 1)
            if node.kind in ("noted", "userlist", "row"):
                out = {"noted": Noted, "userlist": Tagged, "row": Row}[node.kind](
                    zip(node.keys, values) if node.kind == "noted" else values
                )
                out.note = f"sample {s}"  # (torch's batch has the first sample's)
                return out
            return NAMEDTUPLES[len(values) - 1](*values)

        samples.append(build(schema))
    return samples


def leaf_value(leaf: Leaf, rng: np.random.Generator, huge: bool, mutate: str | None) -> Any:
    """One value of ``leaf`` (or its mutation)."""
    if mutate == "none":
        return None
    if mutate in ("kind", "kind2", "wrap"):
        value = leaf_value(leaf, rng, huge, None)
        if mutate == "wrap":
            return [value]
        return _other_kind(value) if mutate == "kind" else _far_kind(value)
    kind = leaf.kind
    if kind == "np":
        dtype, shape = np.dtype(leaf.dtype), leaf.shape
        if mutate == "shape":
            shape = (*shape, 1) if len(shape) < 3 else shape[:-1]
        if mutate == "dtype":
            dtype = np.dtype("int32" if dtype != np.dtype("int32") else "int64")
        return _array(rng, dtype, shape, leaf.layout)
    if kind == "npscalar":
        return _array(rng, np.dtype(leaf.dtype), (), "c")[()]
    if kind == "tensor":
        dtype = getattr(torch, leaf.dtype)
        shape = leaf.shape
        if mutate == "shape":
            shape = (*shape, 1) if len(shape) < 3 else shape[:-1]
        if mutate == "dtype":
            dtype = torch.int32 if dtype != torch.int32 else torch.int64
        values = torch.from_numpy(rng.normal(0, 50, shape).astype(np.float64))
        if dtype == torch.bool:
            return values > 0
        if dtype.is_complex:
            return values.to(dtype) * (1 + 1j)
        if not dtype.is_floating_point:
            return values.clamp(0 if dtype == torch.uint8 else -100, 100).to(dtype)
        return values.to(dtype)
    if kind == "int":
        if huge and leaf.span == "huge63":
            return 2**63 + int(rng.integers(0, 2**62))
        if huge and leaf.span == "huge64":
            return 2**64 + int(rng.integers(0, 2**62))
        if huge and leaf.span == "neghuge":
            return -(2**63) - 1 - int(rng.integers(0, 2**62))
        return int(rng.integers(-(2**40), 2**40)) if rng.random() < 0.5 else int(rng.integers(-3, 4))
    if kind == "float":
        special = (math.nan, math.inf, -math.inf, -0.0, 1e-310)
        return special[int(rng.integers(5))] if rng.random() < 0.2 else float(rng.normal(0, 1e3))
    if kind == "bool":
        return bool(rng.random() < 0.5)
    if kind == "complex":
        return complex(float(rng.normal(0, 10)), float(rng.normal(0, 10)))
    if kind == "str":
        return "".join(rng.choice(list("ab é中\n"), int(rng.integers(0, 5))).tolist())
    if kind == "bytes":
        return bytes(rng.integers(0, 256, int(rng.integers(0, 5))).astype(np.uint8).tolist())
    assert kind == "none"
    return None


def _other_kind(value: Any) -> Any:
    """``value`` as a neighbouring kind of leaf."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(value.dtype.newbyteorder("=")))
    if isinstance(value, torch.Tensor):
        try:
            return value.numpy()
        except TypeError:  # bfloat16, float8: no numpy dtype
            return value.to(torch.float32).numpy()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return float(value)
    if isinstance(value, float):
        return int(value) if math.isfinite(value) else True
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return 7
    return "none"


def _far_kind(value: Any) -> Any:
    """``value`` as a less related kind of leaf (numbers as strings, arrays as lists)."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return str(value)
    return 1.5


def _array(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...], layout: str) -> np.ndarray:
    """An array of ``shape`` and ``dtype``, laid out as ``layout`` says: c (contiguous),
    fortran (transposed strides), strided (every other element of a larger array) or neg
    (negative strides)."""
    full = shape
    if layout == "strided" and shape:
        full = (shape[0] * 2, *shape[1:])
    raw = rng.normal(0, 100, full)
    if dtype.kind == "b":
        a = raw > 0
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = np.clip(raw, max(info.min, -1000), min(info.max, 1000)).astype(np.int64)
    elif dtype.kind == "c":
        a = raw + 1j * rng.normal(0, 100, full)
    else:
        a = raw
        if a.size and rng.random() < 0.3:
            a.flat[0] = (math.nan, math.inf, -0.0)[int(rng.integers(3))]
    a = np.asarray(a).astype(dtype)
    if layout == "strided" and shape:
        return a[::2]
    if layout == "fortran" and a.ndim >= 2:
        return np.asfortranarray(a)
    if layout == "neg" and a.ndim >= 1:
        return a[::-1]
    return a


def identity_collate(batch: Any) -> Any:
    """A user collate_fn that returns what it gets: torch hands it out unchanged."""
    return batch


def has_big_endian(tree: Any) -> bool:
    """Whether ``tree`` holds an array in non-native byte order."""
    if isinstance(tree, np.ndarray):
        return not tree.dtype.isnative
    if isinstance(tree, dict):
        return any(has_big_endian(v) for v in tree.values())
    if isinstance(tree, (list, tuple, deque, UserList)):
        return any(has_big_endian(v) for v in tree)
    return False


class IterableSamples(torch.utils.data.IterableDataset):
    """An iterable dataset over a list (torch's class, which both loaders accept)."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __iter__(self) -> Any:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)


class SampleError(Exception):
    """An exception of the user's own (one message argument: both loaders rebuild it)."""


class RaisingSamples:
    """A map-style dataset over a list whose ``__getitem__`` raises ``raise_at[index]``
    for some indices (a failing decode, a missing file)."""

    def __init__(self, samples: list[Any], raise_at: dict[int, type]) -> None:
        self.samples = samples
        self.raise_at = raise_at

    def __getitem__(self, index: int) -> Any:
        if index in self.raise_at:
            raise self.raise_at[index](f"sample {index} cannot be loaded")
        return self.samples[index]

    def __len__(self) -> int:
        return len(self.samples)
