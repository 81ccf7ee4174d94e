"""Differential tests: shmloader.DataLoader against torch.utils.data.DataLoader.

Hypothesis draws a sample structure (dicts, OrderedDicts, dict subclasses with and
without attributes, tuples, lists, list and UserList subclasses with attributes, deques
with a maxlen, namedtuples, nested) whose leaves are numpy arrays of every dtype torch
holds (bool, float16, complex, big-endian, 0-d, zero-size, Fortran-ordered, strided,
negative strides), numpy scalars, Python ints (huge ones too: >= 2**63, >= 2**64,
< -2**63), floats (nan, inf, -0.0, subnormal), bools, complex numbers, strings, bytes,
None, and torch tensors (bfloat16 and float8 included); then a tiny dataset of 4-7
samples of it (sometimes with one sample that differs at one leaf: a None, another shape,
another dtype, another kind of value, the value in a list), a batch_size (None, 1, 3),
drop_last and output ("numpy", "torch", "auto"), and loads one epoch with both loaders.
Sampling is sequential, so batch k is the same samples in both.

Comparison rules (each check says which rule it applies):

1. Both epochs give the same number of batches, and end the same way: the sampler
   exhausted, or the same kind of exception (rules 6-8) after the same batches. An epoch
   that ends early without an error is a failure (no silent truncation).
2. ``output="numpy"``: a leaf that torch hands out as a tensor and whose samples were not
   tensors is a numpy array here, of the numpy dtype of torch's dtype (``NUMPY_OF_TORCH``
   in tests/parity.py: float32 <-> float32, bool <-> bool, ...), the same shape and the
   same bytes (NaNs by their bits, -0.0 is not 0.0). README, "Migration": "batch type:
   numpy.ndarray views of the ring; torch.Tensor when the samples were tensors".
3. A leaf whose samples were tensors is a tensor in both outputs, of torch's dtype, shape
   and bytes; the batch's first sample decides, as in both collates (README, same row;
   docs/training.md, "Torch tensors": "Samples that are torch tensors ... come back as
   tensors, whatever output says").
4. ``output="torch"``, and ``output="auto"`` without a user collate_fn: every leaf torch
   hands out as a tensor is a tensor here, same dtype, shape and bytes (docs/training.md,
   "Torch tensors"); ``output="auto"`` with a user collate_fn hands out what it returned,
   numpy arrays as numpy arrays, as torch does. In every output, every other node is
   what torch gives, of the same type and attributes: dict / OrderedDict / defaultdict /
   dict subclasses (same key order), list (tuples are collated to lists, README
   "Migration"), namedtuple, deque (its maxlen), list and UserList subclasses;
   strings and bytes as lists of them (torch's collate_str_fn returns the column it gets:
   a list below a dict, a tuple below a sequence; we always give a list: parity finding P11);
   Python ints, floats, bools, None where torch leaves them as they are
   (``batch_size=None``, a user ``collate_fn``): the same type and value.
5. Numpy layouts torch cannot express: torch refuses arrays with negative strides
   (``ValueError``: ``as_tensor`` cannot view them), a limit of viewing that we do not have
   (every leaf is copied into the slot), so torch is given those arrays copied. Big-endian
   arrays: with ``output="numpy"`` torch is given them in native byte order and our dtype
   is compared up to byte order (a numpy batch keeps its samples' dtype); with
   ``output="torch"`` torch's own refusal (``ValueError``) is expected of us. Neither is
   written in README or docs yet (parity finding P10).
6. Exceptions: ours must be an instance of the builtin class torch raised (``TypeError``,
   ``ValueError``, ``RuntimeError``...); our errors derive from those builtins
   (src/shmloader/errors.py). Where torch raises at batch k, we raise at batch k too.
7. Documented kinds: samples that cannot be stacked (another shape, another structure, a
   ``None``) are a ``BatchLayoutError`` (a ``ValueError``) where torch raises
   ``RuntimeError``, and a ``None`` in a batch is a ``BatchLayoutError`` where torch raises
   ``TypeError`` (README, "Reliability", rows "Samples of different shapes or dtypes in one
   batch" and "__getitem__ returns None").
8. Documented: samples whose tensors have different dtypes are a ``BatchLayoutError``
   where torch promotes them to a common dtype (README, "Migration", row "arrays of
   different dtypes in one field"). Arrays are promoted as torch does (a field whose first
   sample is an array: the others' dtypes, numbers and lists too), checked without this
   exemption by test_mixed_dtypes_are_promoted_as_torch_does.
9. ``num_workers`` never changes a batch: with 2 workers every batch is the same as with 0
   (types, dtypes, shapes, bytes) and an epoch ends with the same exception type.
10. The oracle is torch's loader with ``num_workers=0``: its workers run the same collate
    function and re-raise its exceptions with their type, and it costs no process.

The drawn cases also vary the loader around the batch: a sampler (a permutation with a
repeat), a batch sampler (ragged, possibly an index out of range), an iterable dataset
(main process), ``copy=True``, a user collate_fn (identity), a ``__getitem__`` that raises
(ValueError, KeyError, ZeroDivisionError, an exception class of the user's), and, with
workers, a second epoch through persistent workers.

Cost: bounded numbers of examples (``settings`` below): a main-process example costs
about 0.02 s, a worker example about 0.15 s (fork, 4-7 samples), on the 2-core CI machine.
``SHMLOADER_PARITY_SCALE=10`` runs ten times as many examples (locally).
"""

from __future__ import annotations

import os
from collections import OrderedDict, defaultdict

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import shmloader  # noqa: E402
from tests import parity  # noqa: E402
from tests import parity_samples as ps  # noqa: E402
from tests.parity_samples import Leaf, Mutation, Node  # noqa: E402

_SCALE = float(os.environ.get("SHMLOADER_PARITY_SCALE", "1"))

# derandomize: the examples are a function of the test's code, so CI runs the same ones
# on every run (a failure there reproduces here with the same command, and a green run
# is not luck of the draw); no example database is written, and no explain phase (it
# writes patch files into the checkout and costs a rerun of each failure).
_SETTINGS = {
    "phases": [Phase.explicit, Phase.generate, Phase.shrink],
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


# --- strategies ---------------------------------------------------------------------------

_INT_SPANS = ("small", "small", "huge63", "huge64", "neghuge")
_shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)
_np_leaf = st.builds(
    Leaf,
    kind=st.just("np"),
    dtype=st.sampled_from(ps.NATIVE_DTYPES + ps.BIG_ENDIAN_DTYPES),
    shape=_shapes,
    layout=st.sampled_from(("c", "c", "fortran", "strided", "neg")),
)
_leaf = st.one_of(
    _np_leaf,
    st.builds(Leaf, kind=st.just("npscalar"), dtype=st.sampled_from(ps.NUMPY_SCALAR_DTYPES)),
    st.builds(
        Leaf,
        kind=st.just("tensor"),
        dtype=st.sampled_from(ps.TORCH_DTYPES),
        shape=st.lists(st.integers(0, 3), max_size=2).map(tuple),
    ),
    st.builds(Leaf, kind=st.just("int"), span=st.sampled_from(_INT_SPANS)),
    st.sampled_from([Leaf("float"), Leaf("bool"), Leaf("complex"), Leaf("str"), Leaf("bytes"), Leaf("none")]),
)
_KEYS = ("x", "a", "m")  # not sorted: key order must be kept


def _node(children: st.SearchStrategy) -> st.SearchStrategy:
    kids = st.lists(children, min_size=1, max_size=3).map(tuple)
    return st.one_of(
        kids.map(lambda c: Node("dict", c, _KEYS[: len(c)])),
        kids.map(lambda c: Node("odict", c, _KEYS[: len(c)])),
        kids.map(lambda c: Node("ddict", c, _KEYS[: len(c)])),
        kids.map(lambda c: Node("record", c, _KEYS[: len(c)])),
        kids.map(lambda c: Node("tuple", c)),
        kids.map(lambda c: Node("list", c)),
        kids.map(lambda c: Node("namedtuple", c)),
        kids.map(lambda c: Node("deque", c)),
        kids.map(lambda c: Node("noted", c, _KEYS[: len(c)])),
        kids.map(lambda c: Node("userlist", c)),
        kids.map(lambda c: Node("row", c)),
    )


_schema = st.recursive(_leaf, _node, max_leaves=5)


@st.composite
def _case(draw: st.DrawFn, num_workers: int) -> dict:
    schema = draw(_schema)
    n = draw(st.integers(4, 7))
    mutation = None
    if draw(st.integers(0, 3)) == 0:
        mutation = Mutation(
            sample=draw(st.integers(0, n - 1)),
            leaf=draw(st.integers(0, len(ps.leaves_of(schema)) - 1)),
            what=draw(st.sampled_from(("none", "shape", "dtype", "kind", "kind2", "wrap"))),
        )
    samples = ps.make_samples(schema, n, draw(st.integers(0, 2**32 - 1)), mutation)
    loader = {
        "batch_size": draw(st.sampled_from((None, 1, 3))),
        "drop_last": draw(st.booleans()),
        "output": draw(st.sampled_from(("numpy", "torch", "auto"))),
        "ours_kw": {"copy": draw(st.booleans())},  # copy=True must not change a batch either
    }
    how = draw(st.sampled_from(("sequential",) * 6 + ("sampler", "batch_sampler", "iterable")))
    if how == "sampler":  # a permutation, with a repeat: the sampler's order, not the dataset's
        order = draw(st.permutations(range(n)))
        loader["sampler"] = [*order, order[0]]
    elif how == "batch_sampler":  # ragged batches of any indices
        # (n: an index out of range, which both re-raise from the dataset as IndexError)
        loader["batch_sampler"] = draw(
            st.lists(st.lists(st.integers(0, n), min_size=1, max_size=3), min_size=1, max_size=4)
        )
    elif how == "iterable" and num_workers == 0:  # with workers, every worker yields every sample
        loader["iterable"] = True
    # A user collate_fn: torch hands out its result unchanged (rule 4). Not with big-endian
    # arrays and output="torch": torch has no tensor for them (rule 5); output="auto"
    # hands them out as the collate_fn returns them, as torch does.
    big_endian_tensors = loader["output"] == "torch" and any(map(ps.has_big_endian, samples))
    if draw(st.integers(0, 4)) == 0 and not big_endian_tensors:
        loader["collate_fn"] = ps.identity_collate
    if how != "iterable" and draw(st.integers(0, 7)) == 0:  # __getitem__ raises for one index
        errors = (ValueError, KeyError, ZeroDivisionError, ps.SampleError)
        loader["raise_at"] = {draw(st.integers(0, n - 1)): draw(st.sampled_from(errors))}
    if num_workers and draw(st.booleans()):  # a second epoch through the same workers and ring
        loader["ours_kw"]["persistent_workers"] = True
        loader["epochs"] = 2
    return {"samples": samples, **loader}


def _check(case: dict, num_workers: int) -> None:
    case = dict(case)
    failure = parity.parity_failure(
        case.pop("samples"), num_workers=num_workers, check_main_process=num_workers > 0, **case
    )
    assert failure is None, failure


# --- the differential tests ---------------------------------------------------------------


@settings(max_examples=int(400 * _SCALE), **_SETTINGS)
@given(case=_case(num_workers=0))
def test_main_process_matches_torch(case: dict) -> None:
    """num_workers=0: the same batches, types, dtypes and exceptions as torch (rules 1-8)."""
    _check(case, num_workers=0)


@pytest.mark.timeout(120)
# No shrinking here: a worker example costs ~0.15 s and a shrink can take hundreds of
# them; the drawn cases are small already (4-7 samples), and the main-process test
# shrinks the same strategies.
@settings(max_examples=int(60 * _SCALE), **{**_SETTINGS, "phases": [Phase.explicit, Phase.generate]})
@given(case=_case(num_workers=2))
def test_workers_match_torch_and_main_process(case: dict) -> None:
    """num_workers=2 matches torch (rules 1-8) and never changes a batch (rule 9)."""
    _check(case, num_workers=2)


# --- targeted cases -----------------------------------------------------------------------


def _user_collate(samples: list) -> dict:
    # Module level: a worker under spawn could import it (these tests use fork).
    return {"n": sum(samples), "t": (1, 2), "f": 0.5, "s": "x", "none": None, "arr": np.arange(len(samples))}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("output", ["numpy", "torch", "auto"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_user_collate_fn_output_is_kept(num_workers: int, output: str) -> None:
    """A collate_fn's result is handed out as torch hands it out: Python scalars, tuples,
    strings and None unchanged (rule 4); a numpy array stays an array with output="numpy"
    and "auto" (as in torch) and becomes a tensor with output="torch" (docs/training.md,
    "Torch tensors")."""
    samples = [1, 2, 3, 4, 5]
    kw = {"batch_size": 2, "collate_fn": _user_collate}
    failure = parity.parity_failure(samples, num_workers=num_workers, output=output, **kw)
    assert failure is None, failure


@pytest.mark.timeout(60)
@pytest.mark.parametrize("output", ["numpy", "torch"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_unbatched_python_scalars_are_kept(num_workers: int, output: str) -> None:
    """batch_size=None: torch hands out each sample through default_convert, which leaves
    Python ints, floats, bools, strings and None as they are and turns tuples into lists
    (rule 4)."""
    samples = [3, 2.5, True, "s", None, (1, 2.0), {"k": (7, "v")}, 2**70]
    assert parity.run_torch(samples, batch_size=None).error is None  # the oracle loads them all
    failure = parity.parity_failure(samples, num_workers=num_workers, output=output, batch_size=None)
    assert failure is None, failure


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_generator_reseeded_repeats_the_order(num_workers: int) -> None:
    """``g.manual_seed(0)`` before each epoch repeats torch's shuffled order; it must
    repeat ours too (the generator is read at each epoch, not once)."""

    def epochs(make_loader) -> list[list[int]]:
        g = torch.Generator()
        loader = make_loader(g)
        orders = []
        try:
            for _ in range(3):
                g.manual_seed(0)
                orders.append([int(x) for b in loader for x in np.asarray(b).reshape(-1)])
        finally:
            getattr(loader, "shutdown", lambda: None)()
        return orders

    data = list(range(12))
    torch_orders = epochs(
        lambda g: torch.utils.data.DataLoader(data, batch_size=3, shuffle=True, generator=g)
    )
    assert torch_orders[0] == torch_orders[1] == torch_orders[2]  # the oracle's behaviour
    kw = {"batch_size": 3, "shuffle": True, "num_workers": num_workers}
    if num_workers:
        kw["multiprocessing_context"] = "fork"
    ours = epochs(lambda g: shmloader.DataLoader(data, generator=g, **kw))
    assert sorted(ours[0]) == data
    assert ours[0] == ours[1] == ours[2], f"torch repeats {torch_orders[0]}; ours gives {ours}"


# Numpy dtypes torch has no tensor for: torch's collate raises TypeError for them.
_NUMPY_ONLY = {
    "str": np.array(["ab", "c"]),
    "bytes": np.array([b"ab", b"c"]),
    "datetime64": np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[D]"),
    "timedelta64": np.array([1, 2], dtype="timedelta64[s]"),
    "longdouble": np.array([1.5, 2.5], dtype=np.longdouble),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", sorted(_NUMPY_ONLY))
def test_numpy_only_dtypes(name: str, num_workers: int) -> None:
    """Arrays of a dtype torch cannot hold, batched: torch raises TypeError. With
    output="torch" we cannot hand out a tensor either and must raise the same kind (rule 6).
    With output="numpy" the batch is the stacked numpy array (README, "Migration": numpy
    batches; parity finding P8: not written down yet)."""
    samples = [{"v": _NUMPY_ONLY[name], "i": i} for i in range(4)]
    assert isinstance(parity.run_torch(samples, batch_size=2).error, TypeError)
    failure = parity.parity_failure(samples, num_workers=num_workers, output="torch", batch_size=2)
    assert failure is None, failure
    (ours,) = parity.run_ours(samples, num_workers=num_workers, output="numpy", batch_size=2)
    got = [(b["v"].dtype, b["v"].tolist(), b["i"].tolist()) for b in ours.batches]
    error = ours.describe()
    del ours  # no batch kept alive past the test (the leak check would see its memory)
    want = [
        (np.dtype(_NUMPY_ONLY[name].dtype), np.stack([_NUMPY_ONLY[name]] * 2).tolist(), [k, k + 1])
        for k in (0, 2)
    ]
    assert got == want, error


def test_ordered_dict_and_key_order_survive() -> None:
    """A reminder that the comparison itself can fail: a deliberately wrong batch (keys
    reordered, a tuple for a list, float64 for float32) is caught by compare_batch."""
    theirs = OrderedDict(b=torch.zeros(2), a=[torch.ones(1)])
    for wrong in (
        OrderedDict(a=[np.ones(1, np.float32)], b=np.zeros(2, np.float32)),
        OrderedDict(b=np.zeros(2, np.float32), a=(np.ones(1, np.float32),)),
        OrderedDict(b=np.zeros(2), a=[np.ones(1, np.float32)]),
        {"b": np.zeros(2, np.float32), "a": [np.ones(1, np.float32)]},
    ):
        with pytest.raises(parity.Mismatch):
            parity.compare_batch(wrong, theirs, as_torch=False, tensors=set())
    right = OrderedDict(b=np.zeros(2, np.float32), a=[np.ones(1, np.float32)])
    parity.compare_batch(right, theirs, as_torch=False, tensors=set())


_MISMATCHED = {
    "keys differ": [{"a": 1}, {"b": 1}],
    "extra key": [{"a": 1}, {"a": 1, "b": 2}],
    "dict then list": [{"a": 1}, [1]],
    "list then dict": [[1], {"a": 1}],
    "lengths differ": [[1, 2], [1]],
    "leaf then list": [{"x": 1}, {"x": [1]}],
    "int then str": [1, "a"],
    "float then bytes": [1.5, b"a"],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", list(_MISMATCHED))
def test_samples_that_do_not_match(name: str, num_workers: int) -> None:
    """Samples of one batch that differ in structure or kind: torch's exception kind, or
    a BatchLayoutError where README documents one (rules 6, 7)."""
    failure = parity.parity_failure(
        _MISMATCHED[name] * 2, num_workers=num_workers, output="numpy", batch_size=2
    )
    assert failure is None, failure


def _failures(samples: list, num_workers: int, *, batch_sizes: tuple, outputs: tuple) -> list[str]:
    """What differs from torch for each batch size and output (every combination is run,
    so one failing test reports all of them)."""
    failures = []
    for batch_size in batch_sizes:
        for output in outputs:
            failure = parity.parity_failure(
                samples, num_workers=num_workers, output=output, batch_size=batch_size
            )
            if failure is not None:
                failures.append(f"batch_size={batch_size}, output={output}: {failure}")
    return failures


_LOW_PRECISION = [d for d in ("bfloat16", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, d)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dtype", _LOW_PRECISION)
def test_low_precision_tensors(dtype: str, num_workers: int) -> None:
    """bfloat16 and float8 tensors have no numpy dtype; torch collates them, so must we
    (rule 3: tensors in both outputs)."""
    samples = [{"t": torch.full((2,), float(i), dtype=getattr(torch, dtype)), "i": i} for i in range(4)]
    failures = _failures(samples, num_workers, batch_sizes=(None, 2), outputs=("numpy", "torch"))
    assert not failures, "\n".join(failures)


_BIG_INTS = {
    "2**63 + 1 beside 0": [0, 1, 2**63 + 1, 3],
    "2**63 alone": [2**63] * 4,
    "2**64": [0, 1, 2**64, 3],
    "-(2**63) - 1": [0, 1, -(2**63) - 1, 3],
    "2**64 in a dict": [{"n": 0}, {"n": 1}, {"n": 2**64}, {"n": 3}],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", list(_BIG_INTS))
def test_ints_outside_int64(name: str, num_workers: int) -> None:
    """Python ints no int64 holds: batched, torch raises ValueError at that batch (after the
    batches before it: no silent end of epoch, no float64); unbatched, it hands the int
    out as it is (rules 1, 4, 6)."""
    failures = _failures(_BIG_INTS[name], num_workers, batch_sizes=(None, 1, 2), outputs=("numpy",))
    assert not failures, "\n".join(failures)


_NONES = {
    "None sample first": [None, 1, 2, 3],
    "None sample later": [1, None, 2, 3],
    "None field first": [{"a": None}, {"a": 1}, {"a": 2}, {"a": 3}],
    "field always None": [{"a": None, "b": i} for i in range(4)],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", list(_NONES))
def test_none_in_a_batch(name: str, num_workers: int) -> None:
    """A None in a batched sample: torch raises TypeError or RuntimeError; README promises
    a BatchLayoutError (rule 7)."""
    failure = parity.parity_failure(_NONES[name], num_workers=num_workers, output="numpy", batch_size=2)
    assert failure is None, failure


_SPECIAL_FIELDS = {
    "defaultdict samples": [defaultdict(list, a=i) for i in range(4)],
    "dict subclass samples": [ps.Record(a=i) for i in range(4)],
    "int then float": [1, 2.5, 3, 4.5],
    "numpy float32 then float": [np.float32(1.5), 2.5] * 2,
    "Python complex": [1j, 2j] * 2,
    "tensor then array": [torch.zeros(2), np.zeros(2, np.float32)] * 2,
    "array then tensor": [np.zeros(2, np.float32), torch.zeros(2)] * 2,
    "bool then 0-d array": [False, np.array(True)] * 2,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", list(_SPECIAL_FIELDS))
def test_special_fields(name: str, num_workers: int) -> None:
    """Sample types and mixes where torch's collate has a definite answer (a container type
    it keeps, the dtype its first sample implies, an exception): the same here (rules 3, 4, 6)."""
    failure = parity.parity_failure(
        _SPECIAL_FIELDS[name], num_workers=num_workers, output="numpy", batch_size=2
    )
    assert failure is None, failure


_PROMOTED = {
    "0-d int8 array then Python int": [np.array(1, np.int8), 3] * 2,
    "0-d float16 array then Python float": [np.array(1.5, np.float16), 2.5] * 2,
    "int8 then int16 arrays": [np.array([1, 2], np.int8), np.array([3, 4], np.int16)] * 2,
    "int64 then int8 arrays": [np.array([1, 2]), np.array([3, 4], np.int8)] * 2,
    "int64 then float16 arrays (torch: float16)": [np.arange(2), np.ones(2, np.float16)] * 2,
    "0-d float32 array then numpy float64": [np.array(1.5, np.float32), np.float64(2.5)] * 2,
    "bool array then list of ints": [np.array([True, False]), [3, 4]] * 2,
    "(1, 0) bool array then [[]]": [np.zeros((1, 0), bool), [[]]] * 2,
    "list then array (zipped)": [[1, 2], np.array([3, 4])] * 2,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", list(_PROMOTED))
def test_mixed_dtypes_are_promoted_as_torch_does(name: str, num_workers: int) -> None:
    """A field whose first sample is an array and whose others are arrays of other dtypes,
    numbers or lists: torch makes each a tensor and stacks them, promoting the dtypes;
    the same batch here, never an error (checked without rule 8's exemption)."""
    samples = _PROMOTED[name]
    theirs = parity.run_torch(samples, batch_size=2)
    ours = parity.run_ours(samples, batch_size=2, num_workers=num_workers, output="torch")[0]
    assert theirs.error is None and ours.error is None, f"torch: {theirs.describe()}; ours: {ours.describe()}"
    assert len(ours.batches) == len(theirs.batches)
    try:
        for a, b in zip(ours.batches, theirs.batches, strict=True):
            parity.compare_batch(a, b, as_torch=True, tensors=set())
    except parity.Mismatch as exc:
        pytest.fail(str(exc))  # (the message only: a traceback would keep the batches)
    finally:
        ours.batches.clear()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_batches_that_differ_only_in_dtype_shape_kind_or_objects_stay_apart(output):
    """A worker places a batch structure once and reuses the placement (and its slot
    views) for every batch of that structure: batches that share a structure but not a
    leaf's dtype (of one itemsize), shape, kind (array or tensor) or object values, in
    turn through one worker's slots, each come out as torch makes them."""
    kinds = [
        lambda i: {"x": np.full(3, i, np.float32), "s": f"a{i}"},
        lambda i: {"x": np.full(3, i, np.int32), "s": f"b{i}"},
        lambda i: {"x": np.full(4, i, np.float32), "s": "c"},
        lambda i: {"x": np.full((3, 1), i, np.float32), "s": "d"},
        lambda i: {"x": torch.full((3,), float(i)), "s": "e"},
        lambda i: {"x": np.full(3, i % 2, np.bool_), "s": "f"},
        lambda i: {"x": np.full(3, i, np.uint8), "s": "g"},
    ]
    samples = [kinds[(i // 2) % len(kinds)](i) for i in range(4 * 2 * len(kinds))]
    failure = parity.parity_failure(samples, num_workers=1, output=output, batch_size=2)
    assert failure is None, failure
