"""Serialize nested lists, tuples and dicts into the flat layout of :mod:`.layout`.

Children are written before their container, so a container's node is written once,
whole, with its children's references: nothing is patched afterwards.

Values are written a *column* at a time: the items of a list, and across the rows of a
list of records, the values of one key in every record (all the paths, then all the
labels, ...). A column's values of one type are written by a few calls over the whole
column (one utf-8 encoding of all its strings, one array of all its ints), and its
containers a level at a time: every record of a column in one array of nodes, every
list in another. Per value, Python runs a few iterations of C loops instead of a few
calls. Anything unusual (a subclass, bytes, a numpy array, a big int) is written one
value at a time, as is any column where something goes wrong: the value-by-value walk
names the place of an unsupported value and finds cycles.

A container met again (the same object, by identity, as pickle's memo finds it) is
written once and referenced from each place: a structure that shares sub-containers
costs its size, not the size of its expansion. The value-by-value walk remembers every
container it wrote; a column written in bulk that meets one written before (or the same
one twice) is written value by value instead.
"""

from __future__ import annotations

import gc
import itertools
import struct
import sys
import zlib
from array import array
from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any

import numpy as np

import shmloader.memory.shared.layout as L

SUPPORTED = "lists, tuples, dicts, str, bytes, int, float, bool, None, numpy arrays and numpy scalars"

# Below this many values a column is written value by value: numpy's per-call cost
# would outweigh its per-value gain.
_BULK = 16
_CRC_S = zlib.crc32(b"s")  # a str key's canonical bytes start with b"s" (layout.key_bytes)
_U64 = np.uint64
_SCALARS = {str, int, float, bool, type(None), bytes}
# share() takes structures nested up to layout.MAX_NESTING deep (pickle's own limit lies
# below): the walk recurses a few Python frames per level, so the recursion limit is raised
# to that while it runs (Python-to-Python calls do not grow the C stack).
_FRAMES_PER_LEVEL = 6
_MAX_NESTING = L.MAX_NESTING
_DONE_RUNS = 16  # runs of written containers' ids kept apart before they are merged


def _word(head: bytes) -> np.uint64:
    """The 8 bytes ``head`` as a native u64, to fill a column of node heads."""
    return np.frombuffer(head, _U64)[0]


_FORM_WORD = {form: _word(struct.pack("=B7x", form)) for form in (L.REFS, L.INTS, L.FLOATS)}


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


class _TooDeep(RecursionError):
    """A structure nested deeper than :data:`layout.MAX_NESTING`: readers take a deeper
    segment for a corrupt one, so share() writes none."""

    def __init__(self) -> None:
        super().__init__(
            f"share() met a structure nested more than {L.MAX_NESTING} levels deep: "
            "store deeper levels apart (a list of nodes and their children's indices)."
        )


class _Retry(Exception):
    """A column written in bulk met something it leaves to the value-by-value walk (an
    unsupported value, a container seen at two levels: maybe a cycle)."""


class _Twice(_Retry):
    """A column written in bulk holds one container more than once: its distinct
    containers are written once each (see :meth:`Writer._once`)."""


def _bad_key(key: Any) -> UnsupportedValue:
    return UnsupportedValue(
        f"a dict key of type {type(key).__name__} ({key!r})",
        f"dict keys may be str, bytes, int, float, bool, None, numpy scalars or tuples of them "
        f"(nested at most {L.KEY_DEPTH} deep).",
    )


class Writer:
    """Builds one buffer; :meth:`finish` returns it with the root's reference in its header."""

    def __init__(self) -> None:
        self.buf = bytearray(L.ROOT + L.REF_SIZE)
        self.buf[: L.HEADER.size] = L.MAGIC
        self._tables: dict[Any, int] = {}  # a key tuple -> its key table's offset
        self._open: set[int] = set()  # containers being written: one met again is a cycle
        self._bulk_depth = 0  # columns being written in bulk, one inside another
        self._levels: list[np.ndarray] = []  # the ids of the containers of those columns
        # Containers written value by value: id -> (their reference, the container, kept
        # alive so that its id names it until the end).
        self._written: dict[int, tuple[bytes, Any]] = {}
        # The ids of every container written so far (sorted runs; the latest ones written
        # value by value are in _written_ids until a column is written in bulk), and the
        # containers written in bulk, kept alive.
        self._done: list[np.ndarray] = []
        self._written_ids: list[int] = []
        self._alive: list[Any] = []
        self._keys_depth = 0  # > 0 while dict keys are written: written whole, no memo
        self._nesting = 0  # containers open on the path being written (a level in bulk: one)

    def finish(self, root: Any) -> bytearray:
        # The walk makes millions of short-lived tuples and lists and no cycle: the cyclic
        # garbage collector, run on every few hundred of them, would only traverse the
        # caller's (large) structure again and again.
        collecting = gc.isenabled()
        gc.disable()
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, _stack_depth() + _FRAMES_PER_LEVEL * L.MAX_NESTING + 100))
        try:
            ref = self.ref(root)
        except _TooDeep:
            raise
        except RecursionError as exc:  # more frames a level than foreseen: the same limit
            raise _TooDeep() from exc
        finally:
            sys.setrecursionlimit(limit)
            if collecting:
                gc.enable()
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

    # --- one value at a time -----------------------------------------------------------

    def ref(self, value: Any) -> bytes:
        """The 16-byte reference of ``value``, writing its node first where it needs one."""
        t = type(value)
        if t is int:
            if -(2**63) <= value < 2**63:
                return L.REF_INT.pack(L.INT, value)
            return L.REF.pack(L.BIGINT, self._bigint(value))
        if t is str:
            data = value.encode("utf-8", "surrogatepass")
            if len(data) < L.SPAN_MAX:
                start = len(self.buf)
                self.buf += data
                return L.REF_SPAN.pack(L.SPAN, len(data), start)
            return L.REF.pack(L.STR, self._text(data))
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
            return self._container(value, L.LIST, self._sequence)
        if t is tuple or t is SharedTuple:
            return self._container(value, L.TUPLE, self._sequence)
        if isinstance(value, (dict, SharedDict)):  # an OrderedDict, a defaultdict: as a dict
            return self._container(value, None, self._dict)
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

    def _container(self, value: Any, tag: int | None, write: Any) -> bytes:
        """The reference of a list, tuple or dict: the one written already where this
        object was met before (outside dict keys, which a reader builds whole)."""
        key = id(value)
        if not self._keys_depth:
            found = self._written.get(key)
            if found is not None:
                return found[0]
        if tag is None:
            ref = L.REF.pack(*self._guarded(write, value))
        else:
            ref = L.REF.pack(tag, self._guarded(write, value))
        if not self._keys_depth:
            self._written[key] = (ref, value)
            self._written_ids.append(key)
        return ref

    def _guarded(self, write: Any, value: Any) -> Any:
        key = id(value)
        if key in self._open:
            raise ValueError(
                f"share() met a {type(value).__name__} that contains itself: a cyclic structure "
                "cannot be laid out flat. Break the cycle (store an index instead of the object)."
            )
        if self._nesting >= _MAX_NESTING:  # (self._deeper(), inlined: once per container)
            raise _TooDeep()
        self._nesting += 1
        self._open.add(key)
        try:
            return write(value)
        finally:
            self._open.discard(key)
            self._nesting -= 1

    def _deeper(self) -> None:
        """One more container (or level of containers) open on the path being written:
        a _TooDeep past :data:`layout.MAX_NESTING`. The caller closes it (``_nesting -= 1``)."""
        if self._nesting >= L.MAX_NESTING:
            raise _TooDeep()
        self._nesting += 1

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
            data, ends = self._utf8(items)
            return self.node(L.SEQ_HEAD.pack(L.STRS, n), ends.tobytes(), data)
        if n and types == {int}:
            try:
                values = array("q", items)
            except OverflowError:  # one beyond 64 bits: each item its own reference
                pass
            else:
                return self.node(L.SEQ_HEAD.pack(L.INTS, n), values.tobytes())
        if n and types == {float}:
            return self.node(L.SEQ_HEAD.pack(L.FLOATS, n), array("d", items).tobytes())
        refs = self._column(items, lambda i: f"[{i}]")
        return self.node(L.SEQ_HEAD.pack(L.REFS, n), refs.tobytes())

    def _dict(self, d: Any) -> tuple[int, int]:
        """Write ``d``: a record where its key tuple has (or may get) a key table, else a
        dict node with its own keys. Its tag and offset."""
        keys = list(d.keys())
        values = list(d.values())
        table = self._table(keys) if len(keys) <= L.RECORD_KEYS else None
        if table is None:
            return L.DICT, self._plain_dict(keys, values)
        refs = self._column(values, lambda i: f"[{keys[i]!r}]")
        return L.RECORD, self.node(L.RECORD_HEAD.pack(table, len(keys)), refs.tobytes())

    def _table(self, keys: list[Any] | tuple[Any, ...], memo: Any = None) -> int | None:
        """The offset of the key table of ``keys`` (written now if new), or None where
        the buffer holds its share of key tables already. ``memo``: how the tuple is
        remembered, where the caller knows it (see :meth:`_memo`)."""
        if memo is None:
            memo = self._memo(tuple(keys))
        found = self._tables.get(memo)
        if found is not None or len(self._tables) >= L.MAX_TABLES:
            return found
        for key in keys:
            try:
                L.key_bytes(key)
            except TypeError:
                raise _bad_key(key) from None
        self._keys_depth += 1
        try:
            refs = b"".join(map(self.ref, keys))
        finally:
            self._keys_depth -= 1
        found = self._tables[memo] = self.node(L.U64.pack(len(keys)), refs)
        return found

    @staticmethod
    def _memo(keys: tuple[Any, ...]) -> Any:
        """How a key tuple is remembered: as itself where its keys are all str; else with
        their types all the way down, since ``1``, ``1.0`` and ``True`` (and ``(1,)`` and
        ``(1.0,)``, ``0.0`` and ``-0.0``) are equal but are stored apart."""
        for key in keys:
            if type(key) is not str:
                return keys, tuple(map(_exact, keys))
        return keys

    def _plain_dict(self, keys: list[Any], values: list[Any]) -> int:
        """A dict node carrying its own keys, hashes and buckets."""
        n = len(keys)
        if n and all(type(k) is str for k in keys):
            blobs = [k.encode("utf-8", "surrogatepass") for k in keys]
            hashes = array("I", [zlib.crc32(b, _CRC_S) for b in blobs])
        else:
            hashes = array("I")
            for key in keys:
                try:
                    hashes.append(L.key_hash(key))
                except TypeError:
                    raise _bad_key(key) from None
        self._keys_depth += 1
        try:
            key_refs = self._column(keys, lambda i: f"[{keys[i]!r}] (key)")
        finally:
            self._keys_depth -= 1
        value_refs = self._column(values, lambda i: f"[{keys[i]!r}]")
        buckets = _buckets(hashes) if n > L.SMALL_DICT else array("I")
        hash_bytes = hashes.tobytes()
        return self.node(
            L.DICT_HEAD.pack(n, len(buckets)),
            hash_bytes,
            bytes(L.pad(len(hash_bytes)) - len(hash_bytes)),
            key_refs.tobytes(),
            value_refs.tobytes(),
            buckets.tobytes(),
        )

    # --- a column at a time ------------------------------------------------------------

    def _column(self, values: list[Any] | tuple[Any, ...], where: Callable[[int], str]) -> np.ndarray:
        """The references of ``values`` (an array of :data:`layout.REF_DTYPE`), their
        nodes written. ``where(i)``: the place of value ``i`` in its container, for
        errors."""
        if len(values) >= _BULK:
            if self._bulk_depth:
                return self._bulk(values)
            self._bulk_depth = 1
            self._flush_written()
            done = list(self._done)
            try:
                return self._bulk(values)
            except (_Retry, UnsupportedValue):
                # Written one by one instead: the walk names the place of what cannot be
                # stored, tells a cycle from a container met twice, and references a
                # container written before. (What this try wrote stays unreferenced.)
                self._done = done
            finally:
                self._bulk_depth = 0
        refs = []
        for i, value in enumerate(values):
            try:
                refs.append(self.ref(value))
            except UnsupportedValue as exc:
                exc.path.insert(0, where(i))
                raise
        return np.frombuffer(b"".join(refs), L.REF_DTYPE)

    def _bulk(self, values: list[Any] | tuple[Any, ...]) -> np.ndarray:
        n = len(values)
        out = np.zeros(n, L.REF_DTYPE)
        kinds = set(map(type, values))
        if len(kinds) == 1:
            self._typed(kinds.pop(), values, out)
            return out
        types = list(map(type, values))
        for kind in kinds:
            idx = np.array([i for i, t in enumerate(types) if t is kind], np.intp)
            part = np.zeros(len(idx), L.REF_DTYPE)
            self._typed(kind, itemgetter(*idx)(values) if len(idx) > 1 else [values[idx[0]]], part)
            out[idx] = part
        return out

    def _typed(self, kind: type, values: Any, out: np.ndarray) -> None:
        """Fill ``out`` with the references of ``values``, every one of type ``kind``."""
        if kind is str:
            data, ends = self._utf8(values)
            if len(values) and int(np.diff(ends).max()) >= L.SPAN_MAX:
                out[:] = np.frombuffer(b"".join(map(self.ref, values)), L.REF_DTYPE)
                return
            start = len(self.buf)
            self.buf += data
            out["tag"] = L.SPAN
            out["len"] = np.diff(ends)
            out["payload"] = ends[:-1] + start
        elif kind is int:
            try:
                ints = array("q", values)
            except OverflowError:  # one beyond 64 bits: a node of its own
                out[:] = np.frombuffer(b"".join(map(self.ref, values)), L.REF_DTYPE)
                return
            out["tag"] = L.INT
            out["payload"] = np.frombuffer(ints, _U64)
        elif kind is float:
            out["tag"] = L.FLOAT
            out["payload"] = np.frombuffer(array("d", values), _U64)
        elif kind is bool:
            out["tag"] = L.FALSE + np.frombuffer(array("b", values), np.uint8)
        elif kind is type(None):
            out["tag"] = L.NONE
        elif kind is dict:
            tags, offsets = self._once(self._records, values)
            out["tag"] = tags
            out["payload"] = offsets
        elif kind is list or kind is tuple:
            out["tag"] = L.LIST if kind is list else L.TUPLE
            out["payload"] = self._once(self._sequences, values)
        else:  # subclasses, bytes, numpy values, shared views: one by one
            out[:] = np.frombuffer(b"".join(map(self.ref, values)), L.REF_DTYPE)

    def _enter(self, containers: Any) -> None:
        """Mark a level of containers as being written (until :meth:`_leave`). One met
        before (an ancestor, a container written already or at another level, the same
        one twice in this level) is left to the value-by-value walk, which tells a cycle
        from a structure that merely shares a container, and references what it wrote
        before. Levels are kept as sorted arrays of ids: sets of a million ids cost
        several times more to build and to search."""
        ids = np.fromiter(map(id, containers), np.int64, len(containers))
        if self._open and np.isin(ids, np.fromiter(self._open, np.int64, len(self._open))).any():
            raise _Retry
        ids.sort()
        if len(ids) > 1 and (ids[1:] == ids[:-1]).any():
            raise _Twice
        for level in itertools.chain(self._levels, self._done):
            at = np.searchsorted(level, ids)
            if (level[np.minimum(at, len(level) - 1)] == ids).any():
                raise _Retry
        self._levels.append(ids)
        self._alive.append(containers)

    def _once(self, write: Callable[[Any], Any], containers: Any) -> Any:
        """``write(containers)`` (a column of containers, its result an array per
        container, or a tuple of them), each distinct container written once where the
        column holds one several times (records sharing one sub-dict: one node, many
        references)."""
        self._deeper()  # the column is one level of containers
        try:
            return write(containers)
        except _Twice:
            ids = np.fromiter(map(id, containers), np.int64, len(containers))
            _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
            got = write([containers[i] for i in first])
            return tuple(part[inverse] for part in got) if isinstance(got, tuple) else got[inverse]
        finally:
            self._nesting -= 1

    def _leave(self) -> None:
        """The level entered last is written: its containers join those done."""
        self._done.append(self._levels.pop())
        if len(self._done) > _DONE_RUNS:
            self._done = [np.sort(np.concatenate(self._done))]

    def _flush_written(self) -> None:
        """The containers written value by value since the last call join those done."""
        if self._written_ids:
            self._done.append(np.sort(np.array(self._written_ids, np.int64)))
            self._written_ids.clear()
            if len(self._done) > _DONE_RUNS:
                self._done = [np.sort(np.concatenate(self._done))]

    def _records(self, dicts: Any) -> tuple[np.ndarray, np.ndarray]:
        """Write a column of dicts: those with the same key tuple as records sharing one
        key table, their values a column per key. Their tags and offsets."""
        n = len(dicts)
        tags = np.empty(n, np.uint8)
        offsets = np.empty(n, _U64)
        self._enter(dicts)
        try:
            first = tuple(dicts[0])
            if self._memo(first) is first and all(map(first.__eq__, map(tuple, dicts))):
                # One key tuple, of str keys: the common case, in one pass.
                groups: dict[Any, Any] = {first: range(n)}
            else:
                sigs = list(map(tuple, dicts))
                if any(type(k) is not str for k in itertools.chain.from_iterable(set(sigs))):
                    sigs = [self._memo(s) for s in sigs]
                groups = {}
                for i, sig in enumerate(sigs):
                    groups.setdefault(sig, []).append(i)
            for memo, rows in groups.items():
                if len(groups) == 1:
                    idx: Any = slice(None)
                    group = dicts
                else:
                    idx = np.asarray(rows, np.intp)
                    group = [dicts[i] for i in rows]
                keys = list(group[0].keys())
                table = self._table(keys, memo) if len(keys) <= L.RECORD_KEYS else None
                if table is None:
                    tags[idx] = L.DICT
                    offsets[idx] = [self._plain_dict(list(d.keys()), list(d.values())) for d in group]
                    continue
                k = len(keys)
                words = np.empty((len(group), 2 + 2 * k), _U64)
                words[:, 0] = table
                words[:, 1] = k
                for j, key in enumerate(keys):
                    col = self._bulk(list(map(itemgetter(key), group)))
                    words[:, 2 + 2 * j : 4 + 2 * j] = col.view(_U64).reshape(-1, 2)
                start = self.node(words.data.cast("B"))
                tags[idx] = L.RECORD
                offsets[idx] = start + 8 * words.shape[1] * np.arange(len(group), dtype=_U64)
        finally:
            self._leave()
        return tags, offsets

    def _sequences(self, seqs: Any) -> np.ndarray:
        """Write a column of lists (or of tuples): as packed floats or ints where all
        their items are, else as references, a column of all their items. Their offsets."""
        m = len(seqs)
        flat = list(itertools.chain.from_iterable(seqs))
        kinds = set(map(type, flat))
        # Sequences of scalars contain no container, so none of them is an ancestor of
        # another container: they need no marking.
        nested = not kinds <= _SCALARS
        if nested:
            self._enter(seqs)
        try:
            lens = np.fromiter(map(len, seqs), np.int64, m)
            form, data, per = L.REFS, None, 2
            if kinds == {float}:
                form, data, per = L.FLOATS, np.frombuffer(array("d", flat), _U64), 1
            elif kinds == {int}:
                try:
                    data = np.frombuffer(array("q", flat), _U64)
                    form, per = L.INTS, 1
                except OverflowError:
                    pass
            if data is None:
                data = self._bulk(flat).view(_U64) if flat else np.empty(0, _U64)
            sizes = 2 + per * lens
            starts = np.zeros(m, np.int64)
            np.cumsum(sizes[:-1], out=starts[1:])
            words = np.zeros(int(sizes.sum()), _U64)
            words[starts] = _FORM_WORD[form]
            words[starts + 1] = lens
            if m and (lens == lens[0]).all():
                words.reshape(m, -1)[:, 2:] = data.reshape(m, -1)
            elif len(data):
                first = np.zeros(m, np.int64)  # each sequence's first item in ``flat``
                np.cumsum(lens[:-1], out=first[1:])
                dest = np.repeat(starts + 2 - per * first, lens * per) + np.arange(len(data))
                words[dest] = data
            start = self.node(words.data.cast("B"))
        finally:
            if nested:
                self._leave()
        return (start + 8 * starts).astype(_U64)

    @staticmethod
    def _utf8(strs: Any) -> tuple[bytes, np.ndarray]:
        """The utf-8 of ``strs`` concatenated, and the n + 1 end offsets of each in it."""
        n = len(strs)
        joined = "".join(strs)
        ends = np.zeros(n + 1, _U64)
        if joined.isascii():  # one encoding, the lengths already known
            data = joined.encode("ascii")
            np.cumsum(np.fromiter(map(len, strs), np.int64, n), out=ends[1:])
        else:
            blobs = [s.encode("utf-8", "surrogatepass") for s in strs]
            data = b"".join(blobs)
            np.cumsum(np.fromiter(map(len, blobs), np.int64, n), out=ends[1:])
        return data, ends


def _stack_depth() -> int:
    """The frames on this thread's stack now."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return depth


def _exact(key: Any) -> Any:
    """What tells ``key`` from the keys equal to it that a dict stores apart: its type,
    a tuple's items' (recursively), a float's sign bit."""
    kind = type(key)
    if kind is tuple:
        return kind, tuple(map(_exact, key))
    if kind is float:
        return kind, L.F64.pack(key)
    return kind


def _buckets(hashes: array) -> array:
    """The bucket table of a dict with these key hashes: a power of two at most half full,
    each entry (its number + 1) in the first free slot from ``hash & mask`` on (linear
    probing). Placed a round at a time for all entries: where several want one free slot
    the first entry takes it and the others move on, so every entry sits at the end of
    a run of full slots from its own, which is all a lookup needs."""
    n = len(hashes)
    size = 1 << (2 * n - 1).bit_length()
    mask = size - 1
    table = np.zeros(size, np.uint32)
    slot = np.frombuffer(hashes, np.uint32).astype(np.int64) & mask
    pending = np.arange(n)
    while len(pending):
        want = slot[pending]
        free = np.flatnonzero(table[want] == 0)
        taken, first = np.unique(want[free], return_index=True)  # ``pending`` is sorted
        winners = free[first]
        table[taken] = pending[winners] + 1
        lost = np.ones(len(pending), bool)
        lost[winners] = False
        pending = pending[lost]
        slot[pending] = (slot[pending] + 1) & mask
    return array("I", table.tobytes())
