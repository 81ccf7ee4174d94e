"""Read-only views of a shared structure: each access builds its value from the segment.

A view holds its :class:`~shmloader.memory.shared.store.Store`, the offset of its node
and its length: a few words of the process's own heap. Reading an item reads the
segment's pages and writes none of them (their reference counts live in the views, not
in the data), so a forked worker that reads every item copies no page of the data.

Scalars come back as new ``str``, ``bytes``, ``int``, ``float``, ``bool`` or ``None``
objects; numpy arrays as read-only arrays over the segment (no copy); nested lists,
tuples and dicts of at most :data:`PLAIN_VALUES` values all the way down as plain
objects of the reader's own, built whole by one C call (``shmloader._shared_read``),
larger ones as views of their own. A view pickles as a plain copy of its values,
except into a process being started (a DataLoader's worker under spawn or forkserver):
there it travels as the segment's descriptor, and the child maps the same pages.
"""

from __future__ import annotations

import itertools
import operator
import struct
from array import array
from collections.abc import ItemsView, Iterator, Mapping, Sequence, ValuesView
from multiprocessing import context
from typing import Any

import numpy as np

import shmloader.memory.shared.layout as L
import shmloader.memory.shared.nesting as nesting
from shmloader._shared_read import build as _build
from shmloader._shared_read import item as _c_item
from shmloader.errors import CorruptDataError
from shmloader.memory.shared.store import Store

_CHUNK = 4096  # items decoded per read while iterating a packed list
# A container read from a view comes back as a plain list, tuple or dict, the reader's own,
# when it holds at most this many values all the way down (its items, theirs, ...; a
# packed list's numbers and strings each count): a record of a dataset is then as fast to
# use as the original. A larger one comes back as a view, whose reads cost a call each.
PLAIN_VALUES = 64
_TOO_BIG = object()  # what _build gives for a container over the budget

_unpack_u64 = L.U64.unpack_from
_unpack_i64 = L.I64.unpack_from
_unpack_f64 = L.F64.unpack_from
_unpack_pair = L.PAIR.unpack_from
_unpack_u32 = L.U32.unpack_from
_REF_SIZE = L.REF_SIZE
# The tags view_at decodes in Python: containers (as views), and what the C reader leaves to it.
_VIEWED_HERE = frozenset((L.RECORD, L.DICT, L.LIST, L.TUPLE, L.ARRAY, L.SCALAR, L.BIGINT))
_CONTAINERS = frozenset((L.RECORD, L.DICT, L.LIST, L.TUPLE))


_MAX_NDIM = 64  # numpy's own limit: a deeper array node is corrupt


def _corrupt(what: str) -> CorruptDataError:
    return CorruptDataError(
        f"a shared structure's segment is corrupt: {what}. shmloader.share() never writes "
        "this; a memfd segment is sealed, so another process of this user wrote to a "
        "'posix' segment, or share() has a bug: please report it."
    )


def _check(store: Store, off: int, length: int, what: str) -> None:
    """A CorruptDataError unless the ``length`` bytes at ``off`` lie inside the segment
    (Python ints: no sum overflows)."""
    if off < 0 or length < 0 or off + length > store.size:
        raise _corrupt(f"{what} ({length} bytes at byte {off}) lies past its end ({store.size} bytes)")


def value_at(store: Store, pos: int, limit: int) -> Any:
    """The value whose 16-byte reference is at ``pos``, in the node at ``limit``: a
    container of at most :data:`PLAIN_VALUES` values in all as a plain list, tuple or
    dict (built in one C call), a larger one as a view."""
    got = _build(store.mm, pos, PLAIN_VALUES, store.record_keys, view_at, store, _TOO_BIG, limit)
    return view_at(store, pos, limit) if got is _TOO_BIG else got


def view_at(store: Store, pos: int, limit: int | None = None) -> Any:
    """The value whose 16-byte reference is at ``pos``, a container as a view whatever
    its size. The C reader hands arrays, numpy scalars and big ints back here; every
    other scalar is its to decode. ``limit``: the offset of the node holding the
    reference (None: the root, or a leaf from the C reader). share() writes a container's
    children before it, so a container at or past ``limit`` is corrupt: no path through
    a segment loops."""
    mm = store.mm
    tag = mm[pos]
    if tag not in _VIEWED_HERE:
        return value_at(store, pos, store.size if limit is None else limit)
    off = _unpack_u64(mm, pos + 8)[0]
    if limit is not None and off >= limit and tag in _CONTAINERS:
        raise _corrupt(f"the container at byte {off} is referred to from byte {pos}, before it")
    if tag == L.RECORD:
        return SharedDict(store, off, True)
    if tag == L.DICT:
        return SharedDict(store, off)
    if tag == L.LIST:
        return SharedList(store, off)
    if tag == L.TUPLE:
        return SharedTuple(store, off)
    if tag == L.ARRAY:
        return _array(store, off)
    if tag == L.SCALAR:
        return _array(store, off)[()]
    _check(store, off, 8, "a big int's length")  # L.BIGINT
    n = _unpack_u64(mm, off)[0]
    _check(store, off + 8, n, "a big int's bytes")
    return int.from_bytes(mm[off + 8 : off + 8 + n], "little", signed=True)


def _array(store: Store, off: int) -> np.ndarray:
    """The read-only array of the node at ``off``, every field checked against the
    segment first: numpy's own check of ``offset`` against the buffer overflows."""
    mm = store.mm
    _check(store, off, L.ARRAY_HEAD.size, "an array's head")
    ndim, descr_len, data_off, _ = L.ARRAY_HEAD.unpack_from(mm, off)
    start = off + L.ARRAY_HEAD.size
    if ndim > _MAX_NDIM:
        raise _corrupt(f"an array at byte {off} has {ndim} dimensions")
    _check(store, start, 8 * ndim + descr_len, "an array's shape and dtype")
    shape = struct.unpack_from(f"={ndim}Q", mm, start)
    dtype = store.dtype(mm[start + 8 * ndim : start + 8 * ndim + descr_len])
    if dtype.hasobject:
        raise _corrupt(f"an array at byte {off} has dtype {dtype}, of Python objects")
    nbytes = dtype.itemsize
    for extent in shape:
        nbytes *= extent
    _check(store, data_off, nbytes, f"the data of an array of shape {shape} and dtype {dtype}")
    try:
        # A read-only mapping gives a read-only array: numpy refuses writes to it.
        return np.ndarray(shape, dtype, buffer=mm, offset=data_off)
    except (ValueError, TypeError) as exc:  # a subarray dtype past numpy's dimensions
        raise _corrupt(f"an array at byte {off} cannot be made ({exc})") from exc


def _utf8(data: bytes) -> str:
    try:
        return str(data, "utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise _corrupt(f"a string's bytes are not utf-8 ({exc})") from exc


def _recursion(view: Any, exc: RecursionError) -> BaseException:
    """What a RecursionError met while ``view`` was read whole stands for: a
    CorruptDataError where its containers nest deeper than share() writes (a hand-made
    chain), else ``exc`` itself (a structure as deep as its original, which Python's own
    recursive operations refuse alike)."""
    try:
        nesting.check(view._store, view._tag(), view._pos)
    except CorruptDataError as err:
        return err
    return exc


def _refuse(kind: str, what: str, remedy: str) -> TypeError:
    return TypeError(
        f"a shared {kind} is read-only (shmloader.share stores it once for every process): "
        f"it cannot {what}. {remedy}"
    )


def plain(value: Any) -> Any:
    """``value`` with every shared view in it replaced by an ordinary list, tuple or dict
    (numpy arrays copied out of the segment)."""
    if isinstance(value, (SharedList, SharedTuple, SharedDict)):
        return value.copy()
    if isinstance(value, np.ndarray):
        return value.copy()
    kind = type(value)
    if kind is list or kind is tuple:  # a small container, built plain: its arrays are views
        return kind(plain(v) for v in value)
    if kind is dict:
        return {k: plain(v) for k, v in value.items()}
    return value


def _exact_from_int64(dtype: Any) -> bool:
    """Whether casting int64 values to ``dtype`` gives what numpy gives from the Python
    ints (narrower ints raise on overflow from Python ints and wrap from int64)."""
    return dtype is None or np.dtype(dtype) in (np.dtype(np.int64), np.dtype(np.float64))


def _exact_from_float64(dtype: Any) -> bool:
    """Whether casting float64 values to ``dtype`` gives what numpy gives from the
    Python floats (to an int, those raise on overflow and float64 wraps)."""
    return dtype is None or np.dtype(dtype).kind in "fc"


class _SharedSequence(Sequence):
    """A shared list or tuple: ``len``, indexing (slices give a plain list or tuple),
    iteration, ``in``, ``index``, ``count``, ``reversed``, comparison with its kind."""

    __slots__ = ("_form", "_n", "_pos", "_store")
    _kind: type = list

    def __init__(self, store: Store, pos: int) -> None:
        self._store = store
        self._pos = pos
        _check(store, pos, L.SEQ_HEAD.size, "a list's head")
        self._form, self._n = form, n = L.SEQ_HEAD.unpack_from(store.mm, pos)
        if form > L.FLOATS:
            raise _corrupt(f"a list at byte {pos} has the unknown form {form}")
        # Its items (a STRS list: its n + 1 ends) lie in the segment: reads index them unchecked.
        _check(
            store,
            pos + L.SEQ_HEAD.size,
            (L.REF_SIZE if form == L.REFS else 8) * n + 8 * (form == L.STRS),
            "a list's items",
        )

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self._kind(self._item(i) for i in range(*index.indices(self._n)))
        # One C call: a packed item decoded, a reference's value built (as value_at).
        store = self._store
        got = _c_item(
            store.mm,
            self._pos,
            index,
            self._kind is tuple,
            PLAIN_VALUES,
            store.record_keys,
            view_at,
            store,
            _TOO_BIG,
        )
        if got is _TOO_BIG:
            i = operator.index(index)
            at = self._pos + L.SEQ_HEAD.size + L.REF_SIZE * (i + self._n if i < 0 else i)
            return view_at(store, at, self._pos)
        return got

    def _item(self, i: int) -> Any:
        form, base = self._form, self._pos + L.SEQ_HEAD.size
        if form == L.STRS:
            mm = self._store.mm
            a, b = _unpack_pair(mm, base + 8 * i)
            blob = base + 8 * (self._n + 1)
            if a > b or blob + b > self._store.size:
                raise _corrupt(f"item {i} of a list of str at byte {self._pos} lies outside it")
            return _utf8(mm[blob + a : blob + b])
        if form == L.REFS:
            return value_at(self._store, base + L.REF_SIZE * i, self._pos)
        if form == L.INTS:
            return _unpack_i64(self._store.mm, base + 8 * i)[0]
        return _unpack_f64(self._store.mm, base + 8 * i)[0]

    def __iter__(self) -> Iterator[Any]:
        form, base, n, mm = self._form, self._pos + L.SEQ_HEAD.size, self._n, self._store.mm
        if form == L.REFS:
            store = self._store
            for i in range(n):
                yield value_at(store, base + L.REF_SIZE * i, self._pos)
            return
        for lo in range(0, n, _CHUNK):
            hi = min(n, lo + _CHUNK)
            if form == L.STRS:
                ends = array("Q", mm[base + 8 * lo : base + 8 * (hi + 1)])
                blob = base + 8 * (n + 1)
                first = ends[0]
                if blob + ends[-1] > self._store.size or first > ends[-1]:
                    raise _corrupt(f"items {lo}-{hi} of a list of str at byte {self._pos} lie outside it")
                data = mm[blob + first : blob + ends[-1]]
                for a, b in itertools.pairwise(ends):
                    if a > b:
                        raise _corrupt(f"an item of a list of str at byte {self._pos} ends before it starts")
                    try:
                        item = str(data[a - first : b - first], "utf-8", "surrogatepass")
                    except UnicodeDecodeError as exc:
                        raise _corrupt(f"a string's bytes are not utf-8 ({exc})") from exc
                    yield item
            else:
                yield from array("q" if form == L.INTS else "d", mm[base + 8 * lo : base + 8 * hi])

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, _SharedSequence):
            if other._kind is not self._kind:
                return False
            if other._store is self._store and other._pos == self._pos:
                return True
        elif not isinstance(other, self._kind):
            return NotImplemented
        try:
            return len(self) == len(other) and all(a is b or a == b for a, b in zip(self, other))
        except RecursionError as exc:
            raise _recursion(self, exc) from None

    def _compare(self, other: Any, op: Any) -> Any:
        if (
            isinstance(other, (self._kind, _SharedSequence))
            and getattr(other, "_kind", self._kind) is self._kind
        ):
            try:
                return op(self._kind(self), self._kind(other))
            except RecursionError as exc:
                raise _recursion(self, exc) from None
        return NotImplemented

    def __lt__(self, other: Any) -> Any:
        return self._compare(other, operator.lt)

    def __le__(self, other: Any) -> Any:
        return self._compare(other, operator.le)

    def __gt__(self, other: Any) -> Any:
        return self._compare(other, operator.gt)

    def __ge__(self, other: Any) -> Any:
        return self._compare(other, operator.ge)

    def __add__(self, other: Any) -> Any:
        if isinstance(other, (self._kind, _SharedSequence)):
            return self._kind(self) + self._kind(other)
        return NotImplemented

    def __radd__(self, other: Any) -> Any:
        if isinstance(other, self._kind):
            return other + self._kind(self)
        return NotImplemented

    def copy(self) -> Any:
        """A plain, private copy: lists, tuples and dicts all the way down (numpy arrays
        copied out of the segment), free to change."""
        try:
            return self._kind(plain(v) for v in self)
        except RecursionError as exc:
            raise _recursion(self, exc) from None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """What ``numpy.array`` builds from the equal plain list: a list of ints or floats
        is read from the segment in one step (int64 or float64, then ``dtype``), any
        other through its plain copy. The array is the caller's own, except with
        ``copy=False`` (a read-only array over the segment, where one can be had)."""
        form = self._form
        if (form == L.INTS and _exact_from_int64(dtype)) or (form == L.FLOATS and _exact_from_float64(dtype)):
            packed = np.frombuffer(
                self._store.mm,
                np.int64 if form == L.INTS else np.float64,
                self._n,
                self._pos + L.SEQ_HEAD.size,
            )
            if dtype is None or np.dtype(dtype) == packed.dtype:
                return packed if copy is False else packed.copy()
            if copy is not False:
                return packed.astype(dtype)
        if copy is False:
            raise ValueError(
                f"numpy was asked for an array over a shared {self._kind.__name__} without a copy "
                "(copy=False), but only a list of ints (as int64) or of floats (as float64) lies "
                "in the segment as numpy reads it: pass copy=None or True."
            )
        return np.array(self.copy(), dtype=dtype)

    def __copy__(self) -> Any:
        return self  # read-only, as a tuple: a copy would be the same

    def __deepcopy__(self, memo: Any) -> Any:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        if context.get_spawning_popen() is not None:
            return (type(self), (self._store, self._pos))
        return (self._kind, (self.copy(),))

    def __repr__(self) -> str:
        try:
            head = [repr(v) for v in itertools.islice(self, 5)]
        except RecursionError as exc:
            raise _recursion(self, exc) from None
        more = ", ..." if self._n > 5 else ""
        return f"{type(self).__name__}(len={self._n}: {', '.join(head)}{more})"

    def _tag(self) -> int:
        return L.TUPLE if self._kind is tuple else L.LIST

    def __setitem__(self, index: Any, value: Any) -> None:
        raise self._refused("have items assigned")

    def __delitem__(self, index: Any) -> None:
        raise self._refused("have items deleted")

    def _refused(self, what: str) -> TypeError:
        name = self._kind.__name__
        return _refuse(
            name,
            what,
            f"Change a private copy (shared.copy(), or {name}(shared) for the top level only), "
            "or change the original and share it again.",
        )


class SharedList(_SharedSequence):
    """A read-only list in shared memory (see :func:`shmloader.share`)."""

    __slots__ = ()
    _kind = list
    __hash__ = None  # type: ignore[assignment]  # a list is not hashable

    def append(self, value: Any) -> None:
        raise self._refused("append")

    def extend(self, values: Any) -> None:
        raise self._refused("extend")

    def insert(self, index: Any, value: Any) -> None:
        raise self._refused("insert")

    def pop(self, index: Any = -1) -> Any:
        raise self._refused("pop")

    def remove(self, value: Any) -> None:
        raise self._refused("remove")

    def clear(self) -> None:
        raise self._refused("be cleared")

    def sort(self, *args: Any, **kwargs: Any) -> None:
        raise self._refused("be sorted in place (sorted(shared) gives a sorted plain list)")

    def reverse(self) -> None:
        raise self._refused("be reversed in place (reversed(shared) iterates backwards)")

    def __iadd__(self, other: Any) -> Any:
        raise self._refused("be extended with +=")

    def __imul__(self, other: Any) -> Any:
        raise self._refused("be repeated with *=")


class SharedTuple(_SharedSequence):
    """A read-only tuple in shared memory (see :func:`shmloader.share`); hashable, as a
    tuple is, with the hash of the equal tuple."""

    __slots__ = ()
    _kind = tuple

    def __hash__(self) -> int:
        try:
            return hash(tuple(self))
        except RecursionError as exc:
            raise _recursion(self, exc) from None


class SharedDict(Mapping):
    """A read-only dict in shared memory (see :func:`shmloader.share`): ``[]``, ``get``,
    ``in``, ``len``, iteration, ``keys``, ``values``, ``items``, in the original's order.

    A record (a dict whose keys sit in a key table shared with other dicts) finds a key
    through this process's index of that table, built on its first read; other dicts
    through the hashes and buckets stored with them."""

    __slots__ = ("_buckets", "_index", "_keys", "_n", "_pos", "_store", "_values_at")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, store: Store, pos: int, record: bool = False) -> None:
        self._store = store
        self._pos = pos
        _check(store, pos, L.RECORD_HEAD.size, "a dict's head")
        if record:
            # A record: its keys are its key table's, decoded once per process.
            table = _unpack_u64(store.mm, pos)[0]
            if table >= pos:
                raise _corrupt(f"the record at byte {pos} names a key table at or after it ({table})")
            found = store.tables.get(table)
            if found is None:
                found = _key_table(store, table)
            self._index, self._keys, self._n = found
            self._buckets = 0
            self._values_at = pos + L.RECORD_HEAD.size
            _check(store, self._values_at, L.REF_SIZE * self._n, "a record's values")
        else:
            self._index = self._keys = None
            self._n, self._buckets = n, buckets = L.DICT_HEAD.unpack_from(store.mm, pos)
            if buckets & (buckets - 1) or (buckets and buckets <= n) or (n > L.SMALL_DICT and not buckets):
                raise _corrupt(f"a dict at byte {pos} has {n} keys and {buckets} buckets")
            self._values_at = self._keys_at() + L.REF_SIZE * n
            _check(store, pos, self._values_at + L.REF_SIZE * n + 4 * buckets - pos, "a dict")

    def _keys_at(self) -> int:
        return self._pos + L.DICT_HEAD.size + L.pad(4 * self._n)

    def _find(self, key: Any) -> int:
        """The entry number of ``key``, or -1. A TypeError for an unhashable key."""
        if self._index is not None:
            return self._index.get(key, -1)
        try:
            h = L.key_hash(key)
        except TypeError:
            hash(key)  # unhashable: the TypeError a dict gives
            return -1  # hashable but of a type no shared dict stores
        store, n, mm = self._store, self._n, self._store.mm
        keys = self._keys_at()
        hashes = self._pos + L.DICT_HEAD.size
        if not self._buckets:
            found = struct.unpack_from(f"={n}I", mm, hashes)
            for entry, eh in enumerate(found):
                if eh == h and self._key(entry) == key:
                    return entry
            return -1
        mask = self._buckets - 1
        table = keys + 2 * _REF_SIZE * n
        i = h & mask
        unpack = _unpack_u32
        for _ in range(self._buckets):  # a table the encoder wrote has a free slot: at most half full
            slot = unpack(mm, table + 4 * i)[0]
            if not slot:
                return -1
            if slot > n:
                raise _corrupt(f"a bucket of the dict at byte {self._pos} names entry {slot - 1} of {n}")
            entry = slot - 1
            if (
                unpack(mm, hashes + 4 * entry)[0] == h
                and value_at(store, keys + _REF_SIZE * entry, self._pos) == key
            ):
                return entry
            i = (i + 1) & mask
        raise _corrupt(f"the dict at byte {self._pos} has no free bucket")

    def _key(self, entry: int) -> Any:
        if self._keys is not None:
            return self._keys[entry]
        return _key_at(self._store, self._keys_at() + L.REF_SIZE * entry, self._pos)

    def _value(self, entry: int) -> Any:
        return value_at(self._store, self._values_at + L.REF_SIZE * entry, self._pos)

    def __getitem__(self, key: Any) -> Any:
        index = self._index
        if index is not None:  # a record: one lookup in this process's index of its keys
            entry = index.get(key)
            if entry is None:
                raise KeyError(key)
            return value_at(self._store, self._values_at + L.REF_SIZE * entry, self._pos)
        entry = self._find(key)
        if entry < 0:
            raise KeyError(key)
        return self._value(entry)

    def get(self, key: Any, default: Any = None) -> Any:
        entry = self._find(key)
        return default if entry < 0 else self._value(entry)

    def __contains__(self, key: Any) -> bool:
        return self._find(key) >= 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Any]:
        if self._keys is not None:
            return iter(self._keys)
        return map(self._key, range(self._n))

    def values(self) -> ValuesView:
        return _Values(self)

    def items(self) -> ItemsView:
        return _Items(self)

    def _values(self) -> Iterator[Any]:
        store, values = self._store, self._values_at
        for entry in range(self._n):
            yield value_at(store, values + L.REF_SIZE * entry, self._pos)

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        if isinstance(other, SharedDict) and other._store is self._store and other._pos == self._pos:
            return True
        if len(self) != len(other):
            return False
        missing = object()
        try:
            for key, value in self.items():
                theirs = other.get(key, missing)
                if theirs is missing or not (value is theirs or value == theirs):
                    return False
        except RecursionError as exc:
            raise _recursion(self, exc) from None
        return True

    def __or__(self, other: Any) -> Any:
        if isinstance(other, Mapping):
            return {**self, **other}
        return NotImplemented

    def __ror__(self, other: Any) -> Any:
        if isinstance(other, Mapping):
            return {**other, **self}
        return NotImplemented

    def copy(self) -> dict:
        """A plain, private copy: dicts, lists and tuples all the way down (numpy arrays
        copied out of the segment), free to change."""
        try:
            return {plain(k): plain(v) for k, v in self.items()}
        except RecursionError as exc:
            raise _recursion(self, exc) from None

    def __copy__(self) -> SharedDict:
        return self

    def __deepcopy__(self, memo: Any) -> SharedDict:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        if context.get_spawning_popen() is not None:
            return (SharedDict, (self._store, self._pos, self._index is not None))
        return (dict, (self.copy(),))

    def __repr__(self) -> str:
        try:
            head = [f"{k!r}: {v!r}" for k, v in itertools.islice(self.items(), 5)]
        except RecursionError as exc:
            raise _recursion(self, exc) from None
        more = ", ..." if self._n > 5 else ""
        return f"SharedDict(len={self._n}: {{{', '.join(head)}{more}}})"

    def _tag(self) -> int:
        return L.RECORD if self._index is not None else L.DICT

    def _refused(self, what: str) -> TypeError:
        return _refuse(
            "dict",
            what,
            "Change a private copy (shared.copy(), or dict(shared) for the top level only), "
            "or change the original and share it again.",
        )

    def __setitem__(self, key: Any, value: Any) -> None:
        raise self._refused("have items assigned")

    def __delitem__(self, key: Any) -> None:
        raise self._refused("have items deleted")

    def __ior__(self, other: Any) -> Any:
        raise self._refused("be updated with |=")

    def pop(self, key: Any, *default: Any) -> Any:
        raise self._refused("pop")

    def popitem(self) -> Any:
        raise self._refused("popitem")

    def setdefault(self, key: Any, default: Any = None) -> Any:
        raise self._refused("setdefault")

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise self._refused("be updated")

    def clear(self) -> None:
        raise self._refused("be cleared")


def _key_table(store: Store, table: int) -> tuple[dict[Any, int], tuple[Any, ...], int]:
    """The key table at ``table`` decoded, kept in ``store.tables``: an index (key ->
    entry number: a dict's own lookup, so equal keys of other types find their entry as
    in a dict), the keys in order, and their count. The keys are decoded once per process
    for both readers: the C reader's cache (``store.record_keys``) holds the same tuple."""
    keys = store.record_keys.get(table)
    if keys is None:
        _check(store, table, 8, "a key table's count")
        n = _unpack_u64(store.mm, table)[0]
        _check(store, table + 8, L.REF_SIZE * n, "a key table")
        keys = tuple(_key_at(store, table + 8 + L.REF_SIZE * entry, table) for entry in range(n))
        store.record_keys[table] = keys
    try:
        index = {key: entry for entry, key in enumerate(keys)}
    except TypeError as exc:
        raise _corrupt(f"a key of the key table at byte {table} is unhashable ({exc})") from exc
    found = store.tables[table] = (index, keys, len(keys))
    return found


def _key_at(store: Store, pos: int, limit: int) -> Any:
    """The dict key whose reference is at ``pos``, as the original's was: a tuple key as
    a tuple (hashable, small). A CorruptDataError for a key no dict could hold."""
    # Built whole, within the segment's budget: each value an encoder writes takes 8
    # bytes or more of it, so a key that builds more was not written by one (a node
    # referenced twice per level would build 2**depth).
    key = _build(store.mm, pos, store.size // 8 + 1, store.record_keys, view_at, store, _TOO_BIG, limit)
    if key is _TOO_BIG:
        raise _corrupt(
            f"the dict key at byte {pos} holds more values than the segment has room for, "
            f"or is nested more than {L.KEY_DEPTH} deep"
        )
    if type(key) is not str:
        try:
            hash(key)
        except TypeError as exc:
            raise _corrupt(f"a dict key at byte {pos} is unhashable ({exc})") from exc
    return key


class _Values(ValuesView):
    def __iter__(self) -> Iterator[Any]:
        return self._mapping._values()


class _Items(ItemsView):
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return zip(iter(self._mapping), self._mapping._values())
