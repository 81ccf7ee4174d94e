"""The batch recipe against torch's DataLoader (the oracle), with 0 and 2 workers.

Issue 12 items 3, 4, 5 (no silent end of epoch, no silent precision loss, None samples),
10 (num_workers never changes a batch: one recipe, collate_fn output passed through) and
11 (batch_size=None scalars, bf16/float8 tensors, ``generator=`` reseeded per epoch).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np
import pytest

from shmloader import DataLoader
from shmloader.errors import BatchLayoutError, BatchTypeError, StrayStopIteration

torch = pytest.importorskip("torch")
TorchLoader = torch.utils.data.DataLoader

WORKERS = pytest.mark.parametrize("nw", [0, 2])


class Items:
    """A map-style dataset over a list of samples (module level: picklable)."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class StopsAt:
    """Sample 5's __getitem__ raises StopIteration (a next() on an exhausted iterator)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            next(iter(()))
        return i


def stops_on_six(samples):
    if 6 in samples:
        raise StopIteration
    return samples


def sum_and_tuple(samples):
    return {"n": sum(samples), "t": (1, 2)}


def reversed_arrays(samples):
    return [np.arange(3)[::-1] + s for s in samples]


def mixed_leaves(samples):
    return {
        "x": np.arange(3) + samples[0],
        "s": "abc",
        "u": np.array(["a", "b"]),
        "f": 1.5,
        "none": None,
        "np": np.float32(2),
    }


class P(NamedTuple):
    a: object
    b: object


def to_plain(x):
    """A batch as comparable plain data: arrays and tensors as (kind, dtype, list)."""
    if isinstance(x, torch.Tensor):
        return (
            "array",
            str(x.dtype).replace("torch.", ""),
            x.float().tolist() if x.dtype in _F8 else x.tolist(),
        )
    if isinstance(x, np.ndarray):
        return ("array", str(x.dtype), x.tolist())
    if isinstance(x, dict):
        return (type(x).__name__, {k: to_plain(v) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return (type(x).__name__, [to_plain(v) for v in x])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [to_plain(v) for v in x])
    return (type(x).__name__, x)


_F8 = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def run(loader):
    """(batches, exception) of one epoch."""
    out = []
    try:
        for b in loader:
            out.append(b)
    except Exception as exc:
        return out, exc
    return out, None


# --- item 3: an epoch ends only when the sampler does ----------------------------------


@WORKERS
def test_int_beyond_int64_is_an_error_not_the_end_of_the_epoch(nw):
    items = [0, 1, 2, 3, 2**64, 5, 6, 7]
    theirs, t_exc = run(TorchLoader(Items(items), batch_size=2))
    ours, exc = run(DataLoader(Items(items), batch_size=2, num_workers=nw))
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs] == [[0, 1], [2, 3]]
    assert isinstance(t_exc, ValueError) and isinstance(exc, ValueError)
    assert isinstance(exc, BatchLayoutError)
    assert "batch 2" in str(exc) and "sample index 4" in str(exc) and str(2**64) in str(exc)


@WORKERS
def test_int_beyond_int64_inside_a_dict_names_the_field(nw):
    items = [{"x": 0}, {"x": 2**64}]
    _, t_exc = run(TorchLoader(Items(items), batch_size=2))
    ours, exc = run(DataLoader(Items(items), batch_size=2, num_workers=nw))
    assert ours == [] and isinstance(t_exc, ValueError) and isinstance(exc, BatchLayoutError)
    assert "['x']" in str(exc) and "sample index 1" in str(exc)


@WORKERS
def test_stop_iteration_from_getitem_is_an_error(nw):
    # torch's loader ends the epoch silently here ([[0, 1], [2, 3]], no error): the one
    # place this loader deliberately differs, as an epoch must end only with its sampler.
    theirs, t_exc = run(TorchLoader(StopsAt(), batch_size=2))
    assert len(theirs) == 2 and t_exc is None
    ours, exc = run(DataLoader(StopsAt(), batch_size=2, num_workers=nw))
    assert [b.tolist() for b in ours] == [[0, 1], [2, 3]]
    assert isinstance(exc, StrayStopIteration) and isinstance(exc, RuntimeError)
    assert "batch 2" in str(exc) and "[4, 5]" in str(exc)


@WORKERS
def test_stop_iteration_from_collate_fn_is_an_error(nw):
    ours, exc = run(DataLoader(Items(list(range(8))), batch_size=2, num_workers=nw, collate_fn=stops_on_six))
    assert ours == [[0, 1], [2, 3], [4, 5]]
    assert isinstance(exc, StrayStopIteration) and "batch 3" in str(exc) and "[6, 7]" in str(exc)


def stopping_init(worker_id: int) -> None:
    raise StopIteration


def test_stop_iteration_from_worker_init_fn_is_an_error():
    # Rebuilt in the consumer as its own type, a StopIteration raised from __next__ would
    # end the epoch silently, with no batch at all.
    loader = DataLoader(Items(list(range(8))), batch_size=2, num_workers=2, worker_init_fn=stopping_init)
    ours, exc = run(loader)
    assert ours == [] and isinstance(exc, StrayStopIteration) and "worker_init_fn" in str(exc)


def test_stop_iteration_from_a_dataset_that_is_iterable_is_an_error():
    class Iter(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    ours, exc = run(DataLoader(Iter(), batch_size=2, collate_fn=stops_on_six))
    assert len(ours) == 3 and isinstance(exc, StrayStopIteration)


# --- item 4: no silent precision loss ----------------------------------------------------


@WORKERS
@pytest.mark.parametrize("items", [[0, 2**63 + 1], [2**63, 2**63], [0, -(2**63) - 1]])
def test_ints_no_int64_holds_are_an_error(nw, items):
    _, t_exc = run(TorchLoader(Items(items), batch_size=2))
    ours, exc = run(DataLoader(Items(items), batch_size=2, num_workers=nw))
    assert ours == [] and isinstance(t_exc, ValueError) and isinstance(exc, BatchLayoutError)
    assert "sample index 1" in str(exc) or "sample index 0" in str(exc)


@WORKERS
def test_int64_bounds_are_kept_exactly(nw):
    items = [2**63 - 1, -(2**63)]
    (ours,) = DataLoader(Items(items), batch_size=2, num_workers=nw, output="numpy")
    (theirs,) = TorchLoader(Items(items), batch_size=2)
    assert ours.dtype == np.int64 and ours.tolist() == theirs.tolist() == items


# --- item 5: None samples ----------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(
    "items",
    [
        [None, np.zeros(2)],
        [None, 1],
        [{"a": None, "b": 1}] * 2,
        [(None, 1)] * 2,
        [object()] * 2,
        [1, "a"],
        [{"a": 1}, [1]],
        [torch.zeros(2), np.zeros(2, np.float32)],
        [1j, 2j],
    ],
)
def test_none_and_other_objects_are_a_type_error_as_in_torch(nw, items):
    _, t_exc = run(TorchLoader(Items(items), batch_size=2))
    ours, exc = run(DataLoader(Items(items), batch_size=2, num_workers=nw))
    assert ours == [] and isinstance(t_exc, TypeError)
    assert (
        isinstance(exc, BatchTypeError) and isinstance(exc, TypeError) and isinstance(exc, BatchLayoutError)
    )
    assert "sample index 0" in str(exc) or "sample index 1" in str(exc)


# --- item 10: num_workers never changes a batch ----------------------------------------


@WORKERS
def test_collate_fn_output_is_passed_through_as_torch_does(nw):
    theirs = list(TorchLoader(Items([1, 2, 3, 4]), batch_size=2, collate_fn=sum_and_tuple))
    ours = list(DataLoader(Items([1, 2, 3, 4]), batch_size=2, num_workers=nw, collate_fn=sum_and_tuple))
    assert ours == theirs == [{"n": 3, "t": (1, 2)}, {"n": 7, "t": (1, 2)}]
    assert type(ours[0]["n"]) is int and type(ours[0]["t"]) is tuple


@WORKERS
@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_non_numeric_leaves_pass_through_with_torch_output(nw, output):
    (ours,) = DataLoader(Items([0, 1]), batch_size=2, num_workers=nw, collate_fn=mixed_leaves, output=output)
    array = torch.Tensor if output == "torch" else np.ndarray
    assert isinstance(ours["x"], array) and ours["x"].tolist() == [0, 1, 2]
    assert ours["s"] == "abc" and ours["f"] == 1.5 and ours["none"] is None
    assert isinstance(ours["u"], np.ndarray) and ours["u"].tolist() == ["a", "b"]
    assert type(ours["np"]) is np.float32


@WORKERS
def test_torch_output_of_a_collate_fn_with_negative_strides(nw):
    out = list(
        DataLoader(Items([0, 1]), batch_size=2, num_workers=nw, collate_fn=reversed_arrays, output="torch")
    )
    assert [[t.tolist() for t in b] for b in out] == [[[2, 1, 0], [3, 2, 1]]]
    assert all(isinstance(t, torch.Tensor) for t in out[0])


SAMPLES = {
    "ints": [0, 1, 2, 3],
    "floats": [0.5, 1.5, 2.5, 3.5],
    "bools": [True, False, True, True],
    "mixed int float": [1, 2.5, 3, 4],
    "float int": [2.5, 1, 3, 4],
    "numpy scalars": [np.float16(1), np.float16(2), np.float16(3), np.float16(4)],
    "numpy int and int": [np.int8(1), 300, 2, 3],
    "arrays": [np.arange(3, dtype=np.int16) + i for i in range(4)],
    "bool arrays": [np.array([True, False])] * 4,
    "complex arrays": [np.ones(2, np.complex64) * i for i in range(4)],
    "0-d arrays": [np.array(i, np.float32) for i in range(4)],
    "zero-size": [np.zeros((0, 3))] * 4,
    "non-contiguous": [np.arange(12.0).reshape(3, 4)[:, ::2] + i for i in range(4)],
    "str": ["a", "b", "c", "d"],
    "bytes": [b"a", b"b", b"c", b"d"],
    "namedtuple": [P(i, float(i)) for i in range(4)],
    "ordered dict": [collections.OrderedDict(a=i, b=[i, "x"]) for i in range(4)],
    "tuples": [(i, (np.ones(2) * i, "s")) for i in range(4)],
    "nested": [{"a": [P(np.ones(1) * i, {"c": i})], "t": (i, i * 0.5)} for i in range(4)],
    "default dict": [collections.defaultdict(list, a=i) for i in range(4)],
    "extra keys later": [{"a": i} if i % 2 == 0 else {"a": i, "b": 0} for i in range(4)],
    "tensors": [torch.arange(3) + i for i in range(4)],
    "bf16": [torch.full((2,), i + 0.5, dtype=torch.bfloat16) for i in range(4)],
    "float8": [torch.full((2,), float(i)).to(torch.float8_e4m3fn) for i in range(4)],
}


@WORKERS
@pytest.mark.parametrize("batch_size", [2, None])
@pytest.mark.parametrize("name", list(SAMPLES))
def test_default_collate_and_convert_match_torch(nw, batch_size, name):
    items = SAMPLES[name]
    theirs = [to_plain(b) for b in TorchLoader(Items(items), batch_size=batch_size)]
    ours = [
        to_plain(b) for b in DataLoader(Items(items), batch_size=batch_size, num_workers=nw, output="torch")
    ]
    assert ours == theirs
    if batch_size is None:  # Python scalars come back as themselves, as in torch
        plain = list(DataLoader(Items(items), batch_size=None, num_workers=nw))
        torch_plain = list(TorchLoader(Items(items), batch_size=None))
        assert [type(b) for b in plain if not isinstance(b, (np.ndarray, torch.Tensor))] == [
            type(b) for b in torch_plain if not isinstance(b, torch.Tensor)
        ]


def test_bf16_batch_is_a_bf16_tensor_with_workers():
    items = [torch.full((2, 3), i + 0.5, dtype=torch.bfloat16) for i in range(4)]
    out = list(DataLoader(Items(items), batch_size=2, num_workers=2))
    assert all(b.dtype == torch.bfloat16 and b.shape == (2, 2, 3) for b in out)
    assert torch.equal(torch.cat(out), torch.stack(items))


# --- item 11: generator= reseeded before each epoch repeats the order --------------------


@WORKERS
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_reseeding_the_generator_repeats_the_order(nw, kind):
    def order(loader, g):
        if kind == "torch":
            g.manual_seed(0)
        else:
            g.bit_generator.state = np.random.default_rng(0).bit_generator.state
        return [b.tolist() for b in loader]

    g = torch.Generator() if kind == "torch" else np.random.default_rng(0)
    dl = DataLoader(Items(list(range(16))), batch_size=4, shuffle=True, generator=g, num_workers=nw)
    first, second = order(dl, g), order(dl, g)
    assert first == second
    assert sorted(i for b in first for i in b) == list(range(16))
    assert [b.tolist() for b in dl] != first, "without a reseed, the next epoch draws a new order"
    if kind == "torch":  # the property torch users rely on
        tg = torch.Generator()
        tdl = TorchLoader(Items(list(range(16))), batch_size=4, shuffle=True, generator=tg)
        assert order(tdl, tg) == order(tdl, tg)


class NumpyOnly:
    """Samples with leaves torch has no dtype for (issue item 8's trigger)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": np.float32(i), "u": np.array(["a"]), "t": np.array(["2026-12-01"], "datetime64[D]")}


@WORKERS
def test_default_collate_refuses_numpy_only_dtypes_with_torch_output_as_torch_does(nw):
    _, t_exc = run(TorchLoader(NumpyOnly(), batch_size=2))
    ours, exc = run(DataLoader(NumpyOnly(), batch_size=2, num_workers=nw, output="torch"))
    assert ours == [] and isinstance(t_exc, TypeError)
    assert isinstance(exc, BatchTypeError) and "output='torch'" in str(exc)
    (first, *_), _ = run(DataLoader(NumpyOnly(), batch_size=2, num_workers=nw, output="numpy"))  # a superset
    assert first["u"].dtype == "<U1" and first["t"].dtype == "datetime64[D]"


@WORKERS
def test_missing_key_is_a_key_error_as_in_torch(nw):
    items = [{"a": 1}, {"b": 1}]
    _, t_exc = run(TorchLoader(Items(items), batch_size=2))
    _, exc = run(DataLoader(Items(items), batch_size=2, num_workers=nw))
    assert isinstance(t_exc, KeyError) and isinstance(exc, KeyError) and isinstance(exc, BatchLayoutError)
    assert str(exc).startswith("cannot collate batch 0") or "cannot collate batch 0" in str(exc)


@WORKERS
def test_a_generator_loader_resumes_mid_epoch_exactly(nw):
    def loader(seed):
        g = torch.Generator().manual_seed(seed)
        return DataLoader(Items(list(range(24))), batch_size=4, shuffle=True, generator=g, num_workers=nw)

    a = loader(0)
    list(a)  # epoch 0
    it = iter(a)  # epoch 1: a seed drawn from the generator again
    head = [next(it).tolist() for _ in range(2)]
    state = a.state_dict()
    rest = [b.tolist() for b in it]
    b = loader(123)  # another generator state: the saved seed wins for the resumed epoch
    b.load_state_dict(state)
    assert [x.tolist() for x in b] == rest
    assert sorted(i for batch in head + rest for i in batch) == list(range(24))


# --- issue 27 ------------------------------------------------------------------------------

# (the differential helpers of tests/test_torch_parity.py: torch's loader is the oracle)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import parity  # noqa: E402
from tests import parity_samples as ps  # noqa: E402

_HYPOTHESIS = {"deadline": None, "derandomize": True, "database": None}


@st.composite
def _rows_that_add_up(draw: st.DrawFn) -> dict:
    """A well-formed batch, then one whose samples' first dimensions differ but add up to
    the batch's rows (2, 1, 3 rows in a batch of 3 samples of 2): numpy or tensors, bare,
    in a dict or in a tuple."""
    batch = draw(st.integers(2, 4))
    rows = draw(st.integers(1, 3))
    trailing = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    counts = [rows] * batch
    i, j = draw(st.permutations(range(batch)))[:2]
    moved = draw(st.integers(1, rows))
    counts[i] += moved
    counts[j] -= moved
    tensors = draw(st.booleans())
    where = draw(st.sampled_from(("bare", "dict", "tuple")))
    samples = []
    for k, count in enumerate([rows] * batch + counts):
        array = np.arange(count * int(np.prod(trailing)), dtype=np.float32).reshape(count, *trailing) + k
        value = torch.from_numpy(array) if tensors else array
        samples.append({"bare": value, "dict": {"x": value, "i": k}, "tuple": (value, k)}[where])
    return {"samples": samples, "batch_size": batch, "output": draw(st.sampled_from(("numpy", "torch")))}


def _check_rows_refused(case: dict, nw: int) -> None:
    case = dict(case)
    samples = case.pop("samples")
    failure = parity.parity_failure(samples, num_workers=nw, check_main_process=nw > 0, **case)
    assert failure is None, failure
    (ours,) = parity.run_ours(samples, num_workers=nw, **case)
    assert len(ours.batches) == 1 and isinstance(ours.error, BatchLayoutError)
    assert "differs between samples" in str(ours.error) and "shape" in str(ours.error)


@settings(max_examples=40, **_HYPOTHESIS)
@given(case=_rows_that_add_up())
def test_ragged_rows_that_add_up_are_refused_as_torch_does(case):
    """Issue 27 item 1: samples of 2, 1 and 3 rows of D make 6 rows, as 3 samples of 2
    do; each sample's shape is checked, and the batch is refused as torch refuses it
    (RuntimeError; ours a BatchLayoutError naming the two shapes), never merged."""
    _check_rows_refused(case, 0)


@pytest.mark.timeout(120)
@settings(max_examples=12, **_HYPOTHESIS)
@given(case=_rows_that_add_up())
def test_ragged_rows_that_add_up_are_refused_in_workers(case):
    """Issue 27 item 1, with 2 workers (the slot's concatenate is the same code)."""
    _check_rows_refused(case, 2)


def numpy_collate(samples):
    """A user collate_fn returning numpy arrays (big-endian, float16, bool, 0-d), a
    numpy scalar, a tensor and containers: torch hands all of it out as it is."""
    samples = samples if isinstance(samples, list) else [samples]  # (batch_size=None: one)
    x = np.stack([np.full(3, s, np.float32) for s in samples])
    return {
        "x": x,
        "be": x.astype(">f4"),
        "half": x.astype(np.float16),
        "flags": x > 1,
        "zero_d": np.array(len(samples)),
        "scalar": np.int64(7),
        "tensor": torch.from_numpy(x.copy()),
        "list": [x.astype(np.int16), "s"],
        "deque": collections.deque([x.astype(">i4")], maxlen=3),
    }


@WORKERS
@pytest.mark.parametrize("batch_size", [2, None])
def test_output_auto_hands_out_a_collate_fns_numpy_arrays_as_torch_does(nw, batch_size):
    """Issue 27 item 4: with torch imported, the default output ("auto") hands out tensors
    exactly where torch does: a collate_fn's numpy arrays stay numpy arrays, big-endian
    ones included (they were refused: torch cannot view them as tensors)."""
    failure = parity.parity_failure(
        list(range(4)),
        num_workers=nw,
        output="auto",
        batch_size=batch_size,
        collate_fn=numpy_collate,
        check_main_process=nw > 0,
    )
    assert failure is None, failure
    loader = DataLoader(
        Items(list(range(4))), batch_size=batch_size, num_workers=nw, collate_fn=numpy_collate
    )
    assert loader.output == "numpy"  # nothing is converted: what a rebuilt loader keeps
    first = next(iter(loader))
    assert type(first["x"]) is np.ndarray and first["be"].dtype == np.dtype(">f4")
    assert isinstance(first["tensor"], torch.Tensor) and type(first["deque"][0]) is np.ndarray
    del first
    assert DataLoader(Items([0])).output == "torch"  # the default collate: torch's tensors


_CONTAINERS = {
    "deque": lambda i: collections.deque([np.ones(2) * i, i], maxlen=4),
    "UserList": lambda i: collections.UserList([np.ones(2) * i, float(i)]),
    "UserDict": lambda i: collections.UserDict(a=i, b=np.ones(1) * i),
    "range": lambda i: range(3),
    "dict subclass": lambda i: ps.Record(a=i),
    "dict subclass with an attribute": lambda i: _noted(ps.Noted(a=np.ones(2) * i, b=i), i),
    "UserList subclass with an attribute": lambda i: _noted(ps.Tagged([np.ones(2) * i, i]), i),
    "list subclass with an attribute": lambda i: _noted(ps.Row([np.ones(2) * i, i]), i),
    "defaultdict subclass": lambda i: ps.Listing(list, a=i),
    "dict subclass with a constructor argument": lambda i: ps.Keyed(f"k{i}", {"a": i}),
    "nested": lambda i: {"q": collections.deque([i, {"z": collections.UserList([np.ones(1) * i])}])},
}


def _noted(node, i):
    node.note = f"sample {i}"
    return node


@WORKERS
@pytest.mark.parametrize("output", ["numpy", "torch"])
@pytest.mark.parametrize("batch_size", [2, None])
@pytest.mark.parametrize("name", list(_CONTAINERS))
def test_containers_are_collated_as_torch_collates_them(nw, output, batch_size, name):
    """Issue 27 item 15a: torch's collate (and convert) rebuilds a mapping or mutable
    sequence as a copy of the first sample's (its type, its attributes, a deque's
    maxlen), another sequence as ``type(items)`` or a list: so must we (they were
    refused, or lost their attributes)."""
    samples = [_CONTAINERS[name](i) for i in range(4)]
    failure = parity.parity_failure(
        samples, num_workers=nw, output=output, batch_size=batch_size, check_main_process=nw > 0
    )
    assert failure is None, failure


def _grad_samples():
    return [torch.full((2,), float(i), requires_grad=True) for i in range(4)]


@pytest.mark.parametrize("batch_size", [2, None])
def test_requires_grad_is_kept_in_the_main_process_as_torch_keeps_it(batch_size):
    """Issue 27 item 15b: torch's collate stacks tensors that require grad with
    ``torch.stack``: the batch requires grad and gradients flow back to the samples."""
    grads = []
    for make in (TorchLoader, DataLoader):
        samples = _grad_samples()
        batch = next(iter(make(samples, batch_size=batch_size)))
        assert batch.requires_grad, make
        (batch * torch.arange(1.0, 3.0)).sum().backward()
        grads.append([None if s.grad is None else s.grad.tolist() for s in samples])
    assert grads[1] == grads[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [2, None])
def test_requires_grad_in_workers_as_torch(batch_size):
    """Issue 27 item 15b, with workers: torch's worker refuses to stack tensors that
    require grad (RuntimeError), and sends one that is a batch (batch_size=None) with its
    requires_grad; so do we (the batch was silently detached)."""
    samples = _grad_samples()
    kw = {"batch_size": batch_size, "num_workers": 2, "multiprocessing_context": "fork"}
    theirs, t_exc = run(TorchLoader(samples, **kw))
    ours, exc = run(DataLoader(samples, **kw))
    if batch_size is None:
        assert t_exc is None and exc is None
        assert [(b.requires_grad, b.tolist()) for b in ours] == [
            (b.requires_grad, b.tolist()) for b in theirs
        ]
    else:
        assert theirs == ours == [] and isinstance(t_exc, RuntimeError)
        assert isinstance(exc, RuntimeError) and isinstance(exc, BatchLayoutError)
        assert "require grad" in str(exc) and "detach" in str(exc)


_ML_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "int4"]


@WORKERS
@pytest.mark.parametrize("batch_size", [2, None])
@pytest.mark.parametrize("name", _ML_DTYPES)
def test_ml_dtypes_arrays_round_trip_or_fail_naming_the_dtype(nw, batch_size, name):
    """Issue 27 item 15c: numpy arrays of ml_dtypes' dtypes (as JAX uses) come back with
    their dtype and bytes (they failed with "cannot cast ... to V2"); where torch must make
    a tensor of one (its default collate, output="torch") it cannot, and raises
    TypeError: so do we, naming the dtype and the remedy."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = np.dtype(getattr(ml_dtypes, name))
    items = [{"v": (np.arange(6).reshape(2, 3) % 4 + i % 2).astype(dtype), "i": i} for i in range(4)]
    ours, exc = run(DataLoader(Items(items), batch_size=batch_size, num_workers=nw, output="numpy"))
    assert exc is None
    want = items if batch_size is None else [[items[0], items[1]], [items[2], items[3]]]
    for got, samples in zip(ours, want):
        expected = samples["v"] if batch_size is None else np.stack([s["v"] for s in samples])
        assert got["v"].dtype == dtype and got["v"].shape == expected.shape
        assert got["v"].tobytes() == expected.tobytes()
    del ours, got
    if batch_size is None:
        return  # (torch's default_convert: a TypeError; ours keeps the array, as for datetime64)
    _, t_exc = run(TorchLoader(Items(items), batch_size=batch_size))
    _, exc = run(DataLoader(Items(items), batch_size=batch_size, num_workers=nw, output="torch"))
    assert isinstance(t_exc, TypeError) and isinstance(exc, BatchTypeError)
    assert name in str(exc) and "ml_dtypes" in str(exc) and "output='numpy'" in str(exc)


@WORKERS
def test_numpy_scalars_of_a_unit_dtype_keep_it(nw):
    """numpy timedelta64 scalars (torch has no such dtype: a superset) batch into an array
    of their unit, as numpy scalars of one type batch into their dtype."""
    items = [np.timedelta64(i, "ms") for i in range(4)]
    ours = [b.tolist() for b in DataLoader(Items(items), batch_size=2, num_workers=nw, output="numpy")]
    assert ours == [items[:2], items[2:]]
    (one,) = DataLoader(Items(items[:1]), batch_size=1, num_workers=nw, output="numpy")
    assert one.dtype == np.dtype("m8[ms]")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name", ["nested", "dict subclass with an attribute", "UserList subclass with an attribute"]
)
def test_containers_cross_every_start_method(method, name):
    """Issue 27 item 15a: a "c" node's shell (the copy of the first sample's container)
    travels pickled beside the slot's arrays, from workers of every start method."""
    samples = [_CONTAINERS[name](i) for i in range(4)]
    failure = parity.parity_failure(
        samples, num_workers=2, output="torch", batch_size=2, ours_kw={"multiprocessing_context": method}
    )
    assert failure is None, failure
