"""share() gives back exactly what it was given: equal values of the same types all the way
down, dict keys included (a tuple key's items, a float key's sign), across dicts that
share a key table."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shmloader import share
from shmloader.memory.shared import SharedDict, SharedList, SharedTuple

SEQUENCES = {list: SharedList, tuple: SharedTuple}


def exact(got, want) -> None:
    """``got`` is ``want``'s value with its types, all the way down, keys included (a view
    stands for the container of its kind)."""
    kind = type(want)
    if kind in (list, tuple):
        assert type(got) in (kind, SEQUENCES[kind]), (type(got), kind)
        assert len(got) == len(want)
        for i, item in enumerate(want):
            exact(got[i], item)
        for a, b in zip(got, want):
            exact(a, b)
    elif kind is dict:
        assert type(got) in (dict, SharedDict), type(got)
        assert len(got) == len(want)
        for got_key, want_key in zip(got, want):
            exact(got_key, want_key)
        for key, value in want.items():
            assert key in got
            exact(got[key], value)
            exact(got.get(key), value)
        for (gk, gv), (wk, wv) in zip(got.items(), want.items()):
            exact(gk, wk)
            exact(gv, wv)
    elif kind is np.ndarray:
        assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    elif isinstance(want, np.generic):
        assert type(got) is kind and got.dtype == want.dtype and got.tobytes() == want.tobytes()
    elif kind is float:
        assert type(got) is float and (got == want or (math.isnan(got) and math.isnan(want)))
        assert math.copysign(1.0, got) == math.copysign(1.0, want)
    else:
        assert type(got) is kind and got == want, (got, want)


scalar_keys = (
    st.integers()
    | st.integers(-(2**200), 2**200)
    | st.floats(allow_nan=False)
    | st.booleans()
    | st.text(max_size=4)
    | st.binary(max_size=4)
    | st.none()
    | st.sampled_from([0, 1, 0.0, -0.0, 1.0, True, False])  # equal keys of other types
)
keys = st.recursive(scalar_keys, lambda inner: st.tuples(inner) | st.tuples(inner, inner), max_leaves=4)
arrays = hnp.arrays(
    st.sampled_from([np.dtype(t) for t in ("i1", "u2", "i4", "i8", "f4", "f8", "?", "S3", "U2")]),
    hnp.array_shapes(min_dims=0, max_dims=3, max_side=3),
)
numpy_scalars = st.builds(
    lambda t, v: t(v),
    st.sampled_from([np.int8, np.int64, np.uint32, np.float32, np.float64, np.bool_]),
    st.integers(0, 100),
)
leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**300), 2**300)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | arrays
    | numpy_scalars
)
structures = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=6)
        # Dicts in a column (a dataset's records): their key tuples share key tables.
        | st.lists(st.dictionaries(keys, inner, min_size=1, max_size=3), min_size=2, max_size=20)
    ),
    max_leaves=40,
)
roots = st.lists(structures) | st.lists(structures).map(tuple) | st.dictionaries(keys, structures)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(roots)
@example([{(1,): 0}, {(1.0,): 0}])
@example([{(True, "a"): 0}, {(1, "a"): 0}])
@example([{0.0: 1}, {-0.0: 1}])
@example([{((1,),): 0}] * 20 + [{((1.0,),): 0}] * 20)  # written a column at a time
def test_share_gives_back_exactly_what_it_was_given(original):
    shared = share(original)
    exact(shared, original)
    # == as between the original and an equal copy of it (pickle's): arrays compare
    # elementwise, so where that raises or is False (an array's NaN), so may this.
    try:
        expected = pickle.loads(pickle.dumps(original)) == original
    except ValueError:
        return
    assert (shared == original) is expected
    assert (original == shared) is expected


@pytest.mark.parametrize(
    ("first", "second"),
    [((1,), (1.0,)), ((True, "a"), (1, "a")), (0.0, -0.0), (((1, 2.0),), ((1.0, 2),)), (1, True)],
)
def test_dicts_with_equal_keys_of_other_types_keep_their_own(first, second):
    for rows in ([{first: "x"}, {second: "y"}], [{first: "x"}] * 20 + [{second: "y"}] * 20):
        shared = share(rows)
        for got, want in zip(shared, rows):
            exact(got, want)


# --- whatever pickle takes ------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda k: {k: 1, "x": 2}, lambda k: {k * i: i for i in range(1, 300)}])
def test_int_keys_of_any_size(make):
    """An int key of over 4,300 digits (str() of it raises): stored, found, given back."""
    key = 10**5000 + 1
    original = make(key)
    for shared in (share(original), share([original] * 20)[7]):
        exact(shared, original)
        assert key in shared and shared[key] == original[key] and shared.get(key) == original[key]
        assert key + 1 not in shared


def _nested(depth: int):
    value: object = "leaf"
    for level in range(depth):
        value = (
            [value, level] if level % 3 == 0 else ({"k": value, "n": level} if level % 3 == 1 else (value,))
        )
    return value


def test_structures_nested_as_deep_as_pickle_takes():
    """900 levels of lists, dicts and tuples (pickle's own limit here is about 500 lists;
    share() stopped at about 250)."""
    original = _nested(900)
    shared = share([original])
    got, want = shared[0], original
    for level in reversed(range(900)):
        if level % 3 == 0:
            assert got[1] == want[1] == level
            got, want = got[0], want[0]
        elif level % 3 == 1:
            assert got["n"] == want["n"] == level
            got, want = got["k"], want["k"]
        else:
            got, want = got[0], want[0]
    assert got == want == "leaf"


def _doubling(depth: int, width: int):
    """A list of ``width`` references to one list, and so on ``depth`` levels down:
    width**depth paths over depth containers."""
    value: object = [1.5, "x"]
    for _ in range(depth):
        value = [value] * width
    return value


def _records_over(depth: int):
    """Records whose fields reference the records below, in several columns."""
    value: object = [1, 2]
    for _ in range(depth):
        value = [{"a": value, "b": value, "c": {"d": value}} for _ in range(20)]
    return value


def _walk_same(got, want, rng) -> None:
    """``got`` equals ``want`` along random paths down to the leaves of a structure too
    big to compare whole."""
    for _ in range(20):
        g, w = got, want
        while isinstance(w, (dict, list)) and w:
            assert len(g) == len(w)
            step = rng.choice(sorted(w)) if isinstance(w, dict) else rng.randrange(len(w))
            g, w = g[step], w[step]
        exact(g, w)


@pytest.mark.parametrize(
    ("make", "depth", "bound"),
    [
        (lambda d: _doubling(d, 2), 18, 1 << 16),
        (lambda d: _doubling(d, 20), 6, 1 << 16),
        (_records_over, 5, 1 << 17),
    ],
    ids=["narrow", "wide", "records"],
)
def test_a_container_referenced_from_many_places_is_stored_once(make, depth, bound):
    """As pickle's memo does: the segment holds each container once, not every path to it
    (2**18 and 20**6 paths here)."""
    import random

    original = make(depth)
    shared = share(original)
    assert len(shared._store.mm) < bound
    _walk_same(shared, original, random.Random(0))


def test_sharing_is_linear_far_past_what_an_expansion_could_hold():
    """2**60 paths: written in milliseconds, read back along any path."""
    import random

    original = _doubling(60, 2)
    shared = share(original)
    assert len(shared._store.mm) < 1 << 16
    _walk_same(shared, original, random.Random(1))
    deep = _records_over(40)
    _walk_same(share(deep), deep, random.Random(2))


def test_records_sharing_one_sub_dict_store_it_once():
    """A column of records whose field is one dict (a default, a class table): one node
    referenced from each record, written in bulk."""
    meta = {"classes": [f"class {i}" for i in range(50)], "version": 3}
    rows = [{"path": f"p{i}", "meta": meta} for i in range(2000)]
    shared = share(rows)
    assert len(shared._store.mm) < 2000 * 100  # the 50 names once (~900 bytes), not 2,000 times
    exact(shared, rows)
