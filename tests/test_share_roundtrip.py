"""share() gives back exactly what it was given: equal values of the same types all the way
down, dict keys included (a tuple key's items, a float key's sign), across dicts that
share a key table."""

from __future__ import annotations

import math

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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(roots)
@example([{(1,): 0}, {(1.0,): 0}])
@example([{(True, "a"): 0}, {(1, "a"): 0}])
@example([{0.0: 1}, {-0.0: 1}])
@example([{((1,),): 0}] * 20 + [{((1.0,),): 0}] * 20)  # written a column at a time
def test_share_gives_back_exactly_what_it_was_given(original):
    exact(share(original), original)


@pytest.mark.parametrize(
    ("first", "second"),
    [((1,), (1.0,)), ((True, "a"), (1, "a")), (0.0, -0.0), (((1, 2.0),), ((1.0, 2),)), (1, True)],
)
def test_dicts_with_equal_keys_of_other_types_keep_their_own(first, second):
    for rows in ([{first: "x"}, {second: "y"}], [{first: "x"}] * 20 + [{second: "y"}] * 20):
        shared = share(rows)
        for got, want in zip(shared, rows):
            exact(got, want)
