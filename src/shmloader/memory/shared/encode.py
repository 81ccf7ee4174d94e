"""Serialize nested lists, tuples and dicts into the flat layout of :mod:`.layout`.

Children are written before their container (post-order), so a container's node is
written once, whole, with its children's references: nothing is patched afterwards.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Mapping
from typing import Any

import numpy as np

import shmloader.memory.shared.layout as L

SUPPORTED = "lists, tuples, dicts, str, bytes, int, float, bool, None, numpy arrays and numpy scalars"


class UnsupportedValue(TypeError):
    """A value share() cannot store; ``path`` says where it sits in the structure."""

    def __init__(self, what: str, remedy: str) -> None:
        super().__init__(what)
        self.what = what
        self.remedy = remedy
        self.path: list[str] = []

    def __str__(self) -> str:
        where = "".join(self.path) or "the top level"
        return f"share() cannot store {self.what} (at {where}): {self.remedy}"


class Writer:
    """Builds one buffer; :meth:`finish` returns it with the root's reference in its header."""

    def __init__(self) -> None:
        self.buf = bytearray(L.ROOT + L.REF_SIZE)
        self.buf[: L.HEADER.size] = L.MAGIC
        self._keys: dict[tuple[type, Any], bytes] = {}  # dict keys are written once each
        self._open: set[int] = set()  # containers being written: one met again is a cycle

    def finish(self, root: Any) -> bytearray:
        ref = self.ref(root)
        self.buf[L.ROOT : L.ROOT + L.REF_SIZE] = ref
        return self.buf

    def node(self, *parts: bytes | bytearray | memoryview, align: int = 8) -> int:
        """Append a node made of ``parts`` at the next multiple of ``align``; its offset."""
        buf = self.buf
        start = L.pad(len(buf), align)
        buf += bytes(start - len(buf))
        for part in parts:
            buf += part
        return start

    def ref(self, value: Any) -> bytes:
        """The 16-byte reference of ``value``, writing its node first where it needs one."""
        t = type(value)
        if t is int:
            if -(2**63) <= value < 2**63:
                return L.REF_INT.pack(L.INT, value)
            return L.REF.pack(L.BIGINT, self._bigint(value))
        if t is str:
            return L.REF.pack(L.STR, self._text(value.encode("utf-8", "surrogatepass")))
        if t is float:
            return L.REF_FLOAT.pack(L.FLOAT, value)
        if value is None:
            return L.REF.pack(L.NONE, 0)
        if t is bool:
            return L.REF.pack(L.TRUE if value else L.FALSE, 0)
        if t is bytes:
            return L.REF.pack(L.BYTES, self._text(value))
        if isinstance(value, np.generic):
            return L.REF.pack(L.SCALAR, self._array(np.asarray(value), value))
        if isinstance(value, np.ndarray):
            return L.REF.pack(L.ARRAY, self._array(value, value))
        from shmloader.memory.shared.views import SharedDict, SharedList, SharedTuple

        if isinstance(value, (list, SharedList)):  # a list subclass is stored as a list
            return L.REF.pack(L.LIST, self._guarded(self._sequence, value))
        if t is tuple or t is SharedTuple:
            return L.REF.pack(L.TUPLE, self._guarded(self._sequence, value))
        if isinstance(value, (dict, SharedDict)):  # an OrderedDict, a defaultdict: as a dict
            return L.REF.pack(L.DICT, self._guarded(self._dict, value))
        # Subclasses of the scalar types (an IntEnum, numpy.str_) are stored as their base.
        if isinstance(value, int):
            return self.ref(int(value))
        if isinstance(value, float):
            return self.ref(float(value))
        if isinstance(value, str):
            return self.ref(str.__str__(value))
        if isinstance(value, bytes):
            return self.ref(bytes(value))
        if isinstance(value, tuple):
            raise UnsupportedValue(
                f"a {t.__name__} (a tuple subclass, e.g. a namedtuple: its field names would be lost)",
                "pass tuple(value), or value._asdict() for a namedtuple.",
            )
        if isinstance(value, Mapping):
            raise UnsupportedValue(f"a {t.__name__} (a mapping that is not a dict)", "pass dict(value).")
        raise UnsupportedValue(
            f"a value of type {t.__module__}.{t.__qualname__}",
            f"it stores {SUPPORTED}. Convert the value first (e.g. a set to a sorted list).",
        )

    def _guarded(self, write: Any, value: Any) -> int:
        key = id(value)
        if key in self._open:
            raise ValueError(
                f"share() met a {type(value).__name__} that contains itself: a cyclic structure "
                "cannot be laid out flat. Break the cycle (store an index instead of the object)."
            )
        self._open.add(key)
        try:
            return write(value)
        finally:
            self._open.discard(key)

    def _text(self, data: bytes) -> int:
        return self.node(L.U64.pack(len(data)), data)

    def _bigint(self, value: int) -> int:
        data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return self._text(data)

    def _array(self, arr: np.ndarray, original: Any) -> int:
        if arr.dtype.hasobject:
            raise UnsupportedValue(
                f"a numpy {'scalar' if arr.ndim == 0 and original is not arr else 'array'} of "
                f"dtype {arr.dtype} (it holds Python objects)",
                "convert it to a list, or to an array of a numeric, string or bytes dtype.",
            )
        descr = L.dtype_description(arr.dtype)
        data = np.ascontiguousarray(arr).tobytes()
        head_len = L.ARRAY_HEAD.size + 8 * arr.ndim + L.pad(len(descr))
        start = L.pad(len(self.buf))
        data_off = L.pad(start + head_len, L.ARRAY_ALIGN)
        shape = array("Q", arr.shape).tobytes()
        head = L.ARRAY_HEAD.pack(arr.ndim, len(descr), data_off, len(data))
        descr_padded = descr + bytes(L.pad(len(descr)) - len(descr))
        gap = bytes(data_off - start - head_len)
        return self.node(head, shape, descr_padded, gap, data)

    def _sequence(self, seq: Any) -> int:
        items = seq if type(seq) in (list, tuple) else list(seq)
        n = len(items)
        types = set(map(type, items))
        if n and types == {str}:
            blobs = [s.encode("utf-8", "surrogatepass") for s in items]
            ends = array("Q", itertools.accumulate(map(len, blobs), initial=0))
            return self.node(L.SEQ_HEAD.pack(L.STRS, n), ends.tobytes(), b"".join(blobs))
        if n and types == {int}:
            try:
                values = array("q", items)
            except OverflowError:  # one beyond 64 bits: each item its own reference
                pass
            else:
                return self.node(L.SEQ_HEAD.pack(L.INTS, n), values.tobytes())
        if n and types == {float}:
            return self.node(L.SEQ_HEAD.pack(L.FLOATS, n), array("d", items).tobytes())
        refs = []
        for i, item in enumerate(items):
            try:
                refs.append(self.ref(item))
            except UnsupportedValue as exc:
                exc.path.insert(0, f"[{i}]")
                raise
        return self.node(L.SEQ_HEAD.pack(L.REFS, n), b"".join(refs))

    def _key(self, key: Any) -> bytes:
        """A dict key's reference: equal keys of one type (a dataset's dicts share their
        keys) are written once."""
        try:
            memo = (type(key), key)
            found = self._keys.get(memo)
        except TypeError:  # unhashable: dict keys never are, but a SharedDict's could be
            memo, found = None, None
        if found is None:
            found = self.ref(key)
            if memo is not None:
                self._keys[memo] = found
        return found

    def _dict(self, d: Any) -> int:
        keys = list(d.keys())
        n = len(keys)
        hashes = array("I")
        key_refs = []
        for key in keys:
            try:
                hashes.append(L.key_hash(key))
            except TypeError:
                raise UnsupportedValue(
                    f"a dict key of type {type(key).__name__} ({key!r})",
                    "dict keys may be str, bytes, int, float, bool, None, numpy scalars or tuples of them.",
                ) from None
            key_refs.append(self._key(key))
        value_refs = []
        for key, value in zip(keys, d.values()):
            try:
                value_refs.append(self.ref(value))
            except UnsupportedValue as exc:
                exc.path.insert(0, f"[{key!r}]")
                raise
        buckets = array("I")
        if n > L.SMALL_DICT:
            size = 1 << (2 * n - 1).bit_length()  # at most half full: short probes
            mask = size - 1
            buckets = array("I", bytes(4 * size))
            for entry, h in enumerate(hashes):
                i = h & mask
                while buckets[i]:
                    i = (i + 1) & mask
                buckets[i] = entry + 1
        hash_bytes = hashes.tobytes()
        return self.node(
            L.DICT_HEAD.pack(n, len(buckets)),
            hash_bytes,
            bytes(L.pad(len(hash_bytes)) - len(hash_bytes)),
            b"".join(key_refs),
            b"".join(value_refs),
            buckets.tobytes(),
        )
