"""shmloader.share: read-only shared structures equal to their originals, refusing writes,
reaching workers under every start method, and costing forked workers no copied pages."""

from __future__ import annotations

import copy
import os
import pickle

import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmloader import CorruptDataError, DataLoader, share
from shmloader.memory.shared import SharedDict, SharedList, SharedTuple, views

# --- values and types ----------------------------------------------------------------------

leaves = (
    st.none()
    | st.booleans()
    | st.integers()  # beyond 64 bits too
    | st.floats(allow_nan=False)  # NaN equals nothing, not even itself
    | st.text()
    | st.binary()
)
keys = st.text(max_size=8) | st.integers() | st.booleans() | st.tuples(st.integers(), st.text(max_size=3))
structures = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=12)
        | st.lists(inner, max_size=6).map(tuple)
        | st.dictionaries(keys, inner, max_size=12)  # past 8 keys: the bucket table
    ),
    max_leaves=60,
)
containers = st.lists(structures) | st.lists(structures).map(tuple) | st.dictionaries(keys, structures)


VIEWS = (SharedList, SharedTuple, SharedDict)


def plain_same(value, original) -> None:
    """``value`` is an ordinary object equal to ``original``, of its types all the way down
    (no view inside)."""
    assert type(value) is type(original)
    if type(original) in (list, tuple):
        assert len(value) == len(original)
        for a, b in zip(value, original):
            plain_same(a, b)
    elif type(original) is dict:
        assert list(value) == list(original) and [type(k) for k in value] == [type(k) for k in original]
        for k, v in original.items():
            plain_same(value[k], v)
    else:
        assert value == original


def same(view, original, top: bool = True) -> None:
    """``view`` stands for ``original``: at the top, a view of the same kind; below it,
    such a view or (a small container: views.PLAIN_VALUES) an equal plain container;
    equal values of the same types, all the way down."""
    if not top and type(original) in (list, tuple, dict) and not isinstance(view, VIEWS):
        plain_same(view, original)
        assert count_values(original) <= views.PLAIN_VALUES
        return
    if type(original) is list:
        assert type(view) is SharedList and len(view) == len(original)
        assert list(view) == original
        for a, b in zip(view, original):
            same(a, b, False)
        for i in range(-len(original), len(original)):
            same(view[i], original[i], False)
    elif type(original) is tuple:
        assert type(view) is SharedTuple and tuple(view) == original
        try:
            assert hash(view) == hash(original)
        except TypeError:  # a tuple holding a list: neither hashes
            with pytest.raises(TypeError):
                hash(view)
        for a, b in zip(view, original):
            same(a, b, False)
    elif type(original) is dict:
        assert type(view) is SharedDict and len(view) == len(original)
        assert list(view) == list(original)
        assert [type(k) for k in view] == [type(k) for k in original]
        for k, v in original.items():
            assert k in view
            same(view[k], v, False)
            same(view.get(k), v, False)
        for (vk, vv), (ok, ov) in zip(view.items(), original.items()):
            assert vk == ok
            same(vv, ov, False)
    else:
        assert type(view) is type(original) and view == original


def count_values(value) -> int:
    """At least the values a reader counts against views.PLAIN_VALUES in ``value``: itself,
    its items and theirs (a dict's values; its keys may count too)."""
    if type(value) in (list, tuple):
        return 1 + sum(count_values(v) for v in value)
    if type(value) is dict:
        return 1 + sum(count_values(v) for v in value.values())
    return 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(containers)
def test_shared_equals_original(original):
    shared = share(original)
    assert shared == original and original == shared
    assert shared == original
    same(shared, original)
    assert share(shared) is shared
    plain = shared.copy()
    assert type(plain) is type(original) and plain == original
    # Pickled outside a process start: a plain copy, which needs no segment.
    back = pickle.loads(pickle.dumps(shared))
    assert type(back) is type(original) and back == original
    assert copy.deepcopy(shared) is shared


numeric_lists = (
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=8)
    | st.lists(st.floats(allow_nan=False, width=64), max_size=8)
    | st.lists(st.integers(-9, 9) | st.floats(-9, 9) | st.booleans(), max_size=8)  # mixed: references
    | st.lists(st.lists(st.floats(-9, 9), min_size=3, max_size=3), max_size=4)  # nested: 2-d
    | st.lists(st.text(max_size=3), max_size=4)
)


@settings(max_examples=100, deadline=None)
@given(
    numeric_lists,
    st.sampled_from([None, np.float16, np.float32, np.float64, np.complex128, np.int32, np.int64]),
)
def test_numpy_builds_from_a_shared_list_what_it_builds_from_the_original(original, dtype):
    shared = share({"v": original, "t": tuple(original)})
    for view, plain in ((shared["v"], original), (shared["t"], tuple(original))):
        try:
            want = np.array(plain, dtype=dtype)
        except (ValueError, OverflowError) as exc:  # e.g. text as float32: the same error
            with pytest.raises(type(exc)):
                np.array(view, dtype=dtype)
            continue
        got = np.array(view, dtype=dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert got.flags.writeable  # the caller's own array, never the segment's pages
        assert np.asarray(view).dtype == np.asarray(plain).dtype
    # Lists of over views.PLAIN_VALUES values: views, whose __array__ numpy calls.
    n = views.PLAIN_VALUES + 1
    big = share([[float(i) for i in range(n)], list(range(n)), ["a"] * n])
    over = np.array(big[0], copy=False)  # no copy asked: the segment's floats, read-only
    assert over.tolist() == [float(i) for i in range(n)] and not over.flags.writeable
    assert np.array(big[1], dtype=np.int64, copy=False).tolist() == list(range(n))
    for view, dtype in ((big[2], None), (big[1], np.float32)):
        with pytest.raises(ValueError, match="copy=False"):
            np.array(view, dtype=dtype, copy=False)


def test_mixed_kinds_and_lookups():
    original = {
        "paths": ["a/b.jpg", "é\ud800", ""],  # a lone surrogate survives
        "labels": [1, -(2**63), 2**63 - 1],
        "big": [2**64, -(2**70)],
        "floats": [0.5, -0.0, float("inf")],
        "kinds": [None, True, False, b"\x00b", 3, 2.5, "s"],
        1: "one",
        (1, "a"): "tuple key",
        None: "none",
    }
    shared = share(original)
    same(shared, original)
    # Equal keys find each other, whatever their type, as in a dict.
    assert shared[1.0] == shared[True] == shared[np.int64(1)] == "one"
    assert shared[(1, "a")] == "tuple key" and shared[None] == "none"
    assert "missing" not in shared and shared.get("missing", 7) == 7
    assert frozenset() not in shared  # hashable, of a type never stored: absent
    with pytest.raises(TypeError):
        shared[["unhashable"]]
    with pytest.raises(KeyError):
        shared["missing"]
    assert shared["paths"][0:2] == ["a/b.jpg", "é\ud800"] and type(shared["paths"][0:2]) is list
    assert "a/b.jpg" in shared["paths"] and shared["paths"].index("") == 2
    assert shared["labels"].count(1) == 1 and next(reversed(shared["labels"])) == 2**63 - 1
    with pytest.raises(IndexError):
        shared["labels"][3]
    assert shared["kinds"] != original["kinds"][:-1] and shared["kinds"] != tuple(original["kinds"])
    assert share((1, 2)) != [1, 2] and share([1, 2]) != (1, 2)
    assert share([1, 2]) < [1, 3] and share((1,)) + (2,) == (1, 2)  # noqa: RUF005 (the operator is what is tested)


def test_big_dict_lookup():
    original = {f"images/{i:07d}.jpg": i for i in range(5000)}
    shared = share(original)
    assert all(shared[k] == v for k, v in original.items())
    assert "images/9999999.jpg" not in shared and shared == original


# --- columns written in bulk: records sharing key tables, lists of lists ---------------------

record_values = (
    leaves | st.lists(st.floats(allow_nan=False), max_size=5) | st.lists(leaves, max_size=4).map(tuple)
)
records = st.lists(
    st.fixed_dictionaries(
        {"path": st.text(), "label": st.integers()},
        optional={
            "ann": st.fixed_dictionaries({"box": st.lists(st.floats(allow_nan=False), max_size=4)}),
            7: record_values,
        },
    ),
    min_size=16,
    max_size=40,
)
columns = st.lists(record_values | st.dictionaries(keys, record_values, max_size=3), min_size=16, max_size=40)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records | columns | st.lists(records, min_size=1, max_size=3))
def test_columns_written_in_bulk_equal_their_original(original):
    shared = share(original)
    assert shared == original and original == shared
    same(shared, original)
    back = pickle.loads(pickle.dumps(shared))
    assert type(back) is list and back == original


def _dataset(n: int):
    return [
        {
            "path": f"/data/é/{i:08d}.jpg" if i % 3 else f"/data/{i}\ud800.jpg",
            "label": i % 1000,
            "ann": {"bbox": [1.0 * i, 2.0, 3.0, 4.0][: 1 + i % 4], "area": 12.0, "iscrowd": i % 2 == 0},
            "extra": [None, 2**70, b"raw", np.float32(1.5), (i, str(i))][i % 5],
        }
        for i in range(n)
    ]


def test_records_share_one_key_table():
    original = _dataset(1000)
    original[5] = {"label": 5, "path": "reordered", "ann": {}, "extra": None}  # same keys, other order
    original[6] = {"path": "fewer"}
    original[7] = {1: "int", 2.5: "float", (1, "a"): "tuple"}
    original[8] = {True: "bool", 1.5: "float", (1, "a"): "tuple"}  # equal to 7's keys but True, not 1
    original[10]["extra"] = list(range(views.PLAIN_VALUES))  # over the budget: a view
    shared = share(original)
    same(shared, original)
    assert [list(r) for r in shared] == [list(r) for r in original]
    assert type(shared[11]) is dict and shared[11] == original[11]  # small: a plain dict
    rec = shared[10]
    assert type(rec) is SharedDict and rec == original[10] and dict(rec) == original[10]
    assert "path" in rec and "nope" not in rec and rec.get("nope", 3) == 3 and frozenset() not in rec
    with pytest.raises(KeyError):
        rec["nope"]
    with pytest.raises(TypeError):
        rec[["unhashable"]]
    assert rec["ann"]["bbox"] == [10.0, 2.0, 3.0] and type(rec["ann"]["iscrowd"]) is bool
    assert next(iter(rec.items())) == ("path", "/data/é/00000010.jpg")
    assert shared[7][1.0] == shared[7][True] == "int" and shared[8][1] == "bool"
    assert [type(k) for k in shared[8]] == [bool, float, tuple]
    assert type(shared[3]["extra"]) is np.float32 and shared[1]["extra"] == 2**70
    assert shared[1] != shared[2] and shared[1] == original[1] and shared[5] == original[5]
    assert pickle.loads(pickle.dumps(shared[10])) == original[10]
    # One key table for the many records with the same keys: few decoded by the reads above.
    # White-box (the store's key-table cache has no public view): few tables decoded.
    assert len(shared._store.tables) <= 8


def test_key_tables_past_the_limit_and_big_dicts():
    from shmloader.memory.shared import layout

    n = layout.MAX_TABLES + 50
    original = [{f"k{i}": i, "v": [i]} for i in range(n)]  # a key tuple each: past the limit
    original.append({f"key{i}": i for i in range(layout.RECORD_KEYS + 1)})
    original.append({(i, -i): float(i) for i in range(3000)} | {None: 0, b"b": 1, 2**70: 2})
    shared = share(original)
    same(shared, original)
    assert shared[-1][(7, -7)] == 7.0 and shared[-1][2**70] == 2 and shared[-1][b"b"] == 1
    assert shared[n - 1] == {f"k{n - 1}": n - 1, "v": [n - 1]}


def test_lists_of_lists_and_tuples():
    original = [
        [[float(i)] * (i % 5) for i in range(50)],
        [list(range(i % 7)) for i in range(50)],
        [(i, f"s{i}", None, [i, 2**64]) for i in range(50)],
        [[[j, [j]] for j in range(i % 3)] for i in range(50)],
        [[] for _ in range(20)],
        [{} for _ in range(20)],
        [(1.0, 2) for _ in range(20)],
    ]
    shared = share(original)
    same(shared, original)
    # Each list of 50 is a view; each item a small container: plain, of its own types.
    assert type(shared[2]) is SharedList and shared[2][3] == (3, "s3", None, [3, 2**64])
    assert type(shared[2][3]) is tuple and type(shared[2][3][3]) is list


@pytest.mark.parametrize(
    ("where", "message"),
    [(57, r"builtins\.set \(at \[57\]\['ann'\]\['bbox'\]\[2\]\)"), (3, r"at \[3\]\['ann'\]\['bbox'\]\[2\]")],
)
def test_unsupported_values_in_bulk_columns_are_named_with_their_place(where, message):
    original = _dataset(100)
    original[where]["ann"]["bbox"] = [1.0, 2.0, {3.0}]
    with pytest.raises(TypeError, match=message):
        share(original)


def test_cycles_and_shared_containers_in_bulk_columns():
    a: list = []
    a.extend([a] * 20)
    with pytest.raises(ValueError, match="contains itself"):
        share(a)
    records = [{"i": i, "next": []} for i in range(30)]
    records[17]["next"].append(records)
    with pytest.raises(ValueError, match="contains itself"):
        share(records)
    b: dict = {"x": [1, 2]}
    deep = [[b, [[b]]] for _ in range(20)]
    b["x"].append(deep)
    with pytest.raises(ValueError, match="contains itself"):
        share({"deep": deep})
    # The same container met at two levels, without a cycle: stored twice, equal.
    x = [1.0, "x"]
    shared_twice = [[x, [x], {"x": x}] for _ in range(20)]
    assert share(shared_twice) == shared_twice


def _read_shared(shared, q) -> None:
    """In a spawned process: what arrived, and its values as plain objects."""
    q.put((type(shared).__name__, list(shared) if isinstance(shared, SharedDict) else None, shared.copy()))


@pytest.mark.timeout(120)
def test_records_travel_to_a_spawned_process():
    import multiprocessing as mp

    original = _dataset(40)
    shared = share(original)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    big = share({"records": original, "big": {f"k{i}": i for i in range(views.PLAIN_VALUES + 1)}})
    for view, want, keys in ((shared, original, None), (big["big"], big["big"].copy(), list(big["big"]))):
        p = ctx.Process(target=_read_shared, args=(view, q))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0
        assert got == (type(view).__name__, keys, want)


def test_numpy_arrays_are_read_only_views():
    arrays = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(6, dtype=">i4").reshape(2, 3).T,  # big-endian, not contiguous
        np.zeros((2, 0)),
        np.array(["ab", "c"]),
        np.array([(1.5, 2)], dtype=[("x", "<f4"), ("y", "u1")]),
        np.array(np.datetime64("2024-01-02")),
    ]
    shared = share({"arrays": arrays, "scalars": [np.float16(1.5), np.int64(-3), np.bool_(True)]})
    for got, want in zip(shared["arrays"], arrays):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        assert not got.flags.writeable and not got.flags.owndata
    view = shared["arrays"][0]
    assert np.shares_memory(view, shared["arrays"][0])  # zero copy: both over the segment
    with pytest.raises(ValueError):
        view[0, 0] = 1
    for got, want in zip(shared["scalars"], [np.float16(1.5), np.int64(-3), np.bool_(True)]):
        assert type(got) is type(want) and got == want
    assert not np.shares_memory(shared.copy()["arrays"][0], view)
    with pytest.raises(TypeError, match="Python objects"):
        share([np.array([object()])])


@pytest.mark.parametrize(
    "write",
    [
        lambda s: s["l"].append(1),
        lambda s: s["l"].extend([1]),
        lambda s: s["l"].insert(0, 1),
        lambda s: s["l"].pop(),
        lambda s: s["l"].remove(1),
        lambda s: s["l"].clear(),
        lambda s: s["l"].sort(),
        lambda s: s["l"].reverse(),
        lambda s: s["l"].__setitem__(0, 5),
        lambda s: s["l"].__delitem__(0),
        lambda s: s["l"].__iadd__([1]),
        lambda s: s["t"].__setitem__(0, 5),
        lambda s: s.__setitem__("x", 1),
        lambda s: s.__delitem__("l"),
        lambda s: s.pop("l"),
        lambda s: s.popitem(),
        lambda s: s.setdefault("x", 1),
        lambda s: s.update(x=1),
        lambda s: s.clear(),
        lambda s: s.__ior__({"x": 1}),
    ],
)
def test_writes_raise_type_error_naming_the_remedy(write):
    # Over views.PLAIN_VALUES values each, so reads give views (smaller: plain copies).
    big = [1, 2, *range(views.PLAIN_VALUES)]
    original = {"l": big, "t": tuple(big)}
    shared = share(original)
    with pytest.raises(TypeError, match=r"read-only .* private copy \(shared\.copy\(\)"):
        write(shared)
    assert shared == original


def test_augmented_assignment_leaves_the_view_unchanged():
    big = list(range(views.PLAIN_VALUES + 1))
    shared = share({"l": big})
    items = shared["l"]
    with pytest.raises(TypeError):
        items += [2]
    assert shared["l"] == big


def test_small_containers_come_back_as_private_plain_copies():
    """A record read from a shared list is an ordinary dict, built on each read: changing
    it changes neither the segment nor the next read (as in a forked worker, where a
    change to a record stays in that worker's copy)."""
    small = {"path": "a.jpg", "ann": {"bbox": [1.0, 2.0, 3.0, 4.0], "tags": ("x", "y")}}
    shared = share([small, {"k": list(range(views.PLAIN_VALUES))}])
    rec = shared[0]
    assert type(rec) is dict and type(rec["ann"]["bbox"]) is list and rec == small
    rec["ann"]["bbox"].append(5.0)
    rec["path"] = "b.jpg"
    assert shared[0] == small and shared[0] is not shared[0]
    assert copy.deepcopy(shared[0]) == small  # what detectron2-style mappers do first
    assert type(shared[1]) is SharedDict and type(shared[1]["k"]) is SharedList
    with pytest.raises(TypeError, match="read-only"):
        shared[1]["k"].append(1)
    arrays = share([{"a": np.arange(3.0)}])[0]
    assert not arrays["a"].flags.writeable  # an array inside stays a view of the segment
    with pytest.raises(ValueError):
        arrays["a"][0] = 1.0


def test_a_corrupt_segment_gives_value_error_not_a_stray_read():
    from shmloader._shared_read import build

    good = share([{"path": "p", "n": [1.0, 2.0]}])
    # White-box: the C reader is called as the views call it, with their private store.
    mm = bytearray(good._store.mm)
    for offset in range(len(mm)):
        for byte in (0xFF, 0x7F):
            bad = bytearray(mm)
            bad[offset] = byte
            try:
                build(bytes(bad), 8, views.PLAIN_VALUES, {}, views.view_at, good._store, None, len(bad))
                build(bytes(bad), 8 + 32, views.PLAIN_VALUES, {}, views.view_at, good._store, None, len(bad))
            except CorruptDataError:
                pass  # refused with the one error; anything else (a crash) fails the test
    # A list whose item is itself (no encoder writes one: children come before their
    # container): refused, whatever the budget.
    from shmloader.memory.shared import layout as L

    cycle = L.MAGIC + L.REF.pack(L.LIST, 24) + L.SEQ_HEAD.pack(L.REFS, 1) + L.REF.pack(L.LIST, 24)
    too_big = object()
    with pytest.raises(CorruptDataError, match="at or after itself"):
        build(cycle, 8, 10**9, {}, views.view_at, good._store, too_big, len(cycle))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1, 2}, r"builtins\.set \(at \['a'\]\[1\]\)"),
        (complex(1, 2), r"builtins\.complex"),
        (os.stat_result(range(10)), r"tuple subclass"),
    ],
)
def test_unsupported_values_are_named_with_their_place(value, message):
    with pytest.raises(TypeError, match=message):
        share({"a": [0, value]})


def test_share_takes_containers_only():
    with pytest.raises(TypeError, match="takes a list, a tuple or a dict"):
        share("text")
    a = []
    a.append(a)
    with pytest.raises(ValueError, match="contains itself"):
        share(a)


# --- through a DataLoader ---------------------------------------------------------------------


def _records(n: int):
    paths = [f"images/{i:06d}/é{i % 7}.jpg" for i in range(n)]
    labels = [i % 10 for i in range(n)]
    anns = [{"box": [float(i), 0.5 * i, 2.0, 3.0], "cls": i % 3, "crowd": i % 5 == 0} for i in range(n)]
    return paths, labels, anns


class Annotated:
    """A map-style dataset whose metadata are Python objects (or shared views of them)."""

    def __init__(self, paths, labels, anns):
        self.paths, self.labels, self.anns = paths, labels, anns

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        ann = self.anns[i]
        box = np.asarray(ann["box"], dtype=np.float32)
        # The kind of the worker's list says how it arrived: SharedList (the descriptor)
        # or list (the data pickled).
        return {
            "path": self.paths[i],
            "label": self.labels[i],
            "ann": ann,
            "box": box,
            "kind": type(self.paths).__name__,
        }


def _python(batch):
    """A batch as plain Python values, for comparing loaders' outputs."""
    if hasattr(batch, "numpy") and not isinstance(batch, np.ndarray):
        batch = batch.numpy()
    if isinstance(batch, np.ndarray):
        return batch.tolist()
    if isinstance(batch, dict):
        return {k: _python(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_python(v) for v in batch)
    return batch


def _batches(loader):
    out = []
    for batch in loader:
        batch = _python(batch)
        batch.pop("kind")
        out.append(batch)
    return out


@pytest.mark.timeout(120)
def test_loader_batches_match_the_plain_dataset(method):
    plain = Annotated(*_records(40))
    shared = Annotated(*(share(x) for x in _records(40)))
    kw = {"batch_size": 4, "num_workers": 2, "multiprocessing_context": method, "output": "numpy"}
    kinds = []
    for batch in DataLoader(shared, **kw):
        kinds += batch["kind"]
    assert set(kinds) == {"SharedList"}  # the workers got views, not copies of the data
    assert _batches(DataLoader(shared, **kw)) == _batches(DataLoader(plain, **kw))


@pytest.mark.timeout(120)
def test_loader_batches_match_torch(method):
    torch = pytest.importorskip("torch")
    shared = Annotated(*(share(x) for x in _records(24)))
    plain = Annotated(*_records(24))
    kw = {"batch_size": 4, "num_workers": 2, "multiprocessing_context": method}
    ours = _batches(DataLoader(shared, output="numpy", **kw))
    theirs = _batches(torch.utils.data.DataLoader(shared, **kw))
    assert ours == theirs
    if method == "fork":  # (torch over the plain records: the same under every start method)
        assert theirs == _batches(torch.utils.data.DataLoader(plain, **kw))


# --- what it is for: no copied pages ----------------------------------------------------------


class Toucher:
    """Sample k: the growth of the worker's private memory (USS) while it reads every path,
    label and annotation field once."""

    def __init__(self, paths, labels, anns):
        self.paths, self.labels, self.anns = paths, labels, anns

    def __len__(self):
        return 2

    def __getitem__(self, k):
        me = psutil.Process()
        before = me.memory_full_info().uss
        total = 0
        for p in self.paths:
            total += len(p)
        for label in self.labels:
            total += label
        for ann in self.anns:
            total += ann["cls"] + len(ann["box"])
        return me.memory_full_info().uss - before


@pytest.mark.timeout(300)
def test_forked_workers_copy_far_less_when_shared():
    records = _records(200_000)
    plain = Toucher(*records)
    shared = Toucher(*(share(x) for x in records))
    kw = {"batch_size": 1, "num_workers": 2, "multiprocessing_context": "fork", "output": "numpy"}
    plain_growth = [int(b[0]) for b in DataLoader(plain, **kw)]
    shared_growth = [int(b[0]) for b in DataLoader(shared, **kw)]
    # Reading the plain objects writes their reference counts: their pages are copied.
    assert min(plain_growth) > 20 * 2**20, plain_growth
    assert max(shared_growth) < 0.25 * min(plain_growth), (shared_growth, plain_growth)
