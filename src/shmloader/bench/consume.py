"""The benchmark's consumer: what every peer's loop does with each batch it is given.

A training step reads its batch (a host-to-device copy reads every byte of it), so a
consumer that only counts batches lets a loader gain by handing over memory nobody
reads (lazily mapped pages, a copy deferred to first touch). :func:`read_every_page`
reads one byte of every 4 KiB page of every array leaf of a batch: every page is
faulted in and pulled through the cache hierarchy once, as by a copy, for a few
hundredths of a copy's CPU. Every workload's consumer calls it, for every peer alike.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from shmloader.batch.tree import leaves as tree_leaves

PAGE = 4096  # bytes; the stride of the reads (the smallest page size of the machines we run on)

# torch dtypes numpy cannot view (bfloat16, the float8 kinds, complex32) are read as
# the signed integers of their width, by a same-size torch view.
_INT_OF_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def read_every_page(batch: Any) -> int:
    """Read one byte (or element) of every 4 KiB page of every leaf of ``batch``; returns
    how many of the values read are nonzero, plus one per scalar leaf and the length of
    each string leaf (a result depending on every read, so none can be skipped).

    ``batch`` is any batch tree (tuples, lists, dicts, namedtuples such as ``Padded``,
    the nodes :mod:`shmloader.batch.tree` walks); its leaves may be numpy arrays, CPU
    torch tensors, ``bytes`` or ``memoryview`` (read as arrays), or Python scalars and
    strings (counted: there is no page of theirs to read). A strided leaf
    is read element-wise along its last axis, so only the pages its elements lie on
    are touched.
    """
    total = 0
    for leaf in tree_leaves(batch):
        total += read_leaf(leaf)
    return total


def read_leaf(leaf: Any) -> int:
    """:func:`read_every_page` for one leaf."""
    if isinstance(leaf, np.ndarray):
        return _read_array(leaf)
    if isinstance(leaf, (bytes, bytearray)):
        return _read_array(np.frombuffer(leaf, np.uint8))
    if isinstance(leaf, memoryview):
        return _read_array(np.asarray(leaf))
    torch = sys.modules.get("torch")  # a batch holds tensors only where torch was imported
    if torch is not None and isinstance(leaf, torch.Tensor):
        return _read_array(_tensor_array(leaf))
    if isinstance(leaf, (int, float, bool, np.generic)):
        return 1
    if isinstance(leaf, str):
        return len(leaf)
    return 0  # None, a Shell, an opaque object: no memory of a batch's to read


def _tensor_array(t: Any) -> np.ndarray:
    """A numpy view of CPU tensor ``t`` (same memory, no copy)."""
    if t.device.type != "cpu":
        raise ValueError(
            f"read_every_page reads host memory; got a tensor on {t.device}. Read batches before "
            "moving them to a device."
        )
    t = t.detach().resolve_conj().resolve_neg()  # a lazy conjugate or negation: made real
    try:
        return t.numpy()
    except TypeError:  # a dtype numpy has not: a same-width integer view of the same memory
        return t.view(getattr(sys.modules["torch"], _INT_OF_WIDTH[t.element_size()])).numpy()


def _read_array(a: np.ndarray) -> int:
    """One byte per page of ``a``'s memory: ``a`` seen as rows of bytes (its largest
    contiguous block of trailing axes; the whole array when it is contiguous), a byte
    every :data:`PAGE` bytes of each row and its last byte. An array whose last axis is
    strided is read an element every page along that axis, and each row's last element.
    Returns how many of the values read are nonzero (``count_nonzero`` reads each)."""
    if a.size == 0:
        return 0
    if a.dtype.hasobject:
        return int(a.size)  # references to Python objects: no batch memory of its own to read
    if a.flags.c_contiguous or a.flags.f_contiguous:
        rows = a.reshape(-1, order="A").view(np.uint8)
    elif a.strides[-1] == a.itemsize:
        first = _contiguous_from(a)
        block = a.itemsize * int(np.prod(a.shape[first:]))
        rows = np.lib.stride_tricks.as_strided(
            a.view(np.uint8), (*a.shape[:first], block), (*a.strides[:first], 1), writeable=False
        )
    else:
        k = max(1, PAGE // abs(a.strides[-1])) if a.strides[-1] else a.shape[-1]
        return int(np.count_nonzero(a[..., ::k])) + int(np.count_nonzero(a[..., -1]))
    return int(np.count_nonzero(rows[..., ::PAGE])) + int(np.count_nonzero(rows[..., -1]))


def _contiguous_from(a: np.ndarray) -> int:
    """The first axis of the longest run of trailing axes of ``a`` laid out C-contiguously."""
    expected = a.itemsize
    first = a.ndim
    for axis in range(a.ndim - 1, -1, -1):
        if a.shape[axis] != 1 and a.strides[axis] != expected:
            break
        expected *= a.shape[axis]
        first = axis
    return first
