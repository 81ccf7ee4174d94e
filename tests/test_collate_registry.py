"""The collate registry (issue #28): a type -> function map the default collate looks
values up in, as torch's ``collate_fn_map`` (exact type, then isinstance in the map's
order), which users extend with their own types."""

from __future__ import annotations

import numpy as np
import pytest

import shmloader
from shmloader import BatchTypeError, collate, default_collate_fn_map
from shmloader.batch.collate import lookup

from . import registered_types as R
from .datasets import NumpyLoader as DataLoader


def check_intervals(batches, workers):
    seen = []
    for batch in batches:
        span = batch["span"]
        assert type(span) is R.Intervals
        assert span.lo.dtype == np.int32 and span.hi.dtype == np.int32
        np.testing.assert_array_equal(span.hi, 2 * span.lo)
        np.testing.assert_array_equal(span.lo, batch["label"])
        assert span.worker in workers
        seen += batch["label"].tolist()
    assert seen == list(range(10))


def test_registered_type_collates_in_workers(method):
    loader = DataLoader(R.IntervalDataset(10), batch_size=4, num_workers=2, multiprocessing_context=method)
    check_intervals(loader, workers={0, 1})


def test_registered_type_collates_in_process():
    check_intervals(DataLoader(R.IntervalDataset(10), batch_size=4), workers={-1})


class Unknown:
    pass


def test_unregistered_type_is_an_error_as_before():
    with pytest.raises(BatchTypeError, match=r"cannot collate batch 0 .*field \['x'\].*a Unknown"):
        next(iter(DataLoader([{"x": Unknown()}, {"x": Unknown()}], batch_size=2)))
    with pytest.raises(BatchTypeError, match="default_collate_fn_map"):
        collate([Unknown(), Unknown()], collate_fn_map=default_collate_fn_map)


def test_a_removed_entry_is_an_error_again():
    fn_map = dict(default_collate_fn_map)
    del fn_map[R.Interval]
    with pytest.raises(BatchTypeError):
        collate([R.Interval(0, 1)], collate_fn_map=fn_map)
    assert collate([R.Interval(0, 1)], collate_fn_map=default_collate_fn_map).worker == -1


class Base:
    pass


class Child(Base):
    pass


class Grandchild(Child):
    pass


def test_lookup_takes_the_exact_type_then_isinstance_in_the_maps_order():
    def base(batch, *, collate_fn_map):
        return "base"

    def child(batch, *, collate_fn_map):
        return "child"

    fn_map = {Base: base, Child: child}
    assert lookup(fn_map, Child()) is child  # exact type, although Base comes first
    assert lookup(fn_map, Grandchild()) is base  # the first key it is an instance of
    assert lookup({Child: child, Base: base}, Grandchild()) is child
    assert lookup({(int, Base): base}, Grandchild()) is base  # a tuple of types as a key
    assert lookup(fn_map, Unknown()) is None


def test_a_users_entry_overrides_a_built_in_one():
    def small_ints(batch, *, collate_fn_map):
        return np.array(batch, np.int8)

    fn_map = {**default_collate_fn_map, int: small_ints}
    out = collate([{"a": 1, "b": 2.0}, {"a": 3, "b": 4.0}], collate_fn_map=fn_map)
    assert out["a"].dtype == np.int8 and out["a"].tolist() == [1, 3]
    assert out["b"].dtype == np.float64  # floats keep the built-in rule


def test_a_function_collates_parts_of_its_batch_through_the_map():
    calls = []

    def pairs(batch, *, collate_fn_map):
        calls.append(len(batch))
        return {"lo": collate([v.lo for v in batch], collate_fn_map=collate_fn_map), "n": len(batch)}

    out = collate(
        [R.Interval(1, 2), R.Interval(3, 4)], collate_fn_map={**default_collate_fn_map, R.Interval: pairs}
    )
    assert calls == [2]
    assert out["lo"].tolist() == [1, 3] and out["lo"].dtype == np.int64 and out["n"] == 2


def test_without_a_map_only_containers_and_tensors_have_rules():
    with pytest.raises(BatchTypeError):
        collate([1, 2])

    def stacked(batch, *, collate_fn_map):
        return np.stack(batch)

    out = collate([[np.zeros(2)], [np.ones(2)]], collate_fn_map={np.ndarray: stacked})
    assert type(out) is list and len(out) == 1
    np.testing.assert_array_equal(out[0], [[0, 0], [1, 1]])


def test_a_built_in_entry_is_a_collate_function():
    arrays = [np.arange(3), np.arange(3) + 1]
    out = default_collate_fn_map[np.ndarray](arrays, collate_fn_map=default_collate_fn_map)
    np.testing.assert_array_equal(out, np.stack(arrays))
    assert default_collate_fn_map[float]([1.0, 2.5], collate_fn_map={}).dtype == np.float64


def test_loader_batches_equal_collate_of_the_samples():
    samples = [{"x": np.full(3, i, np.float32), "y": i, "t": f"s{i}"} for i in range(4)]
    batch = next(iter(DataLoader(samples, batch_size=4)))
    expected = collate(samples, collate_fn_map=default_collate_fn_map)
    np.testing.assert_array_equal(batch["x"], expected["x"])
    np.testing.assert_array_equal(batch["y"], expected["y"])
    assert batch["t"] == expected["t"] == ["s0", "s1", "s2", "s3"]


def test_tensors_collate_without_an_entry_and_through_one_when_given():
    torch = pytest.importorskip("torch")
    out = collate([torch.ones(2), torch.zeros(2)])
    assert torch.equal(out, torch.stack([torch.ones(2), torch.zeros(2)]))

    def summed(batch, *, collate_fn_map):
        return torch.stack(batch).sum(0)

    out = collate([torch.ones(2), torch.ones(2)], collate_fn_map={torch.Tensor: summed})
    assert torch.equal(out, torch.full((2,), 2.0))


def test_public_names():
    assert {"collate", "default_collate_fn_map"} <= set(shmloader.__all__)
