"""Fetch and collate protocols exactly as torch's DataLoader (issue 42, section 2), with torch's
loader as the oracle, 0 and 2 workers:

- ``__getitems__`` is called only when batching, and its return value reaches ``collate_fn``
  unchanged (a dict of columns, a tensor); with ``batch_size=None`` each index goes to
  ``__getitem__`` (``Subset`` + a ``BatchSampler`` as ``sampler``);
- types registered in torch's ``default_collate_fn_map`` (and overrides of built-in ones
  such as ``int``) are honoured by the default collate;
- ``collections.Counter`` samples collate as torch's (the update applied once);
- a float64 array and a float32 tensor in one field promote as torch's stack promotes;
- a ``torch.Tensor`` subclass keeps its class in the batch;
- a ``collate_fn``'s channels_last or transposed tensor keeps its strides through the ring;
- the dataset's ``__len__`` is called as often per epoch as torch calls it.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.data._utils import collate as torch_collate  # noqa: E402

import shmloader  # noqa: E402
from shmloader.errors import BatchLayoutError  # noqa: E402
from tests.parity import compare_exact  # noqa: E402

TorchLoader = torch.utils.data.DataLoader
WORKERS = pytest.mark.parametrize("nw", [0, 2])


def load(which: str, dataset: Any, nw: int, **kwargs: Any) -> list[Any]:
    """One epoch's batches of torch's loader or ours (fork workers for both)."""
    if nw:
        kwargs["multiprocessing_context"] = "fork"
    if which == "torch":
        return list(TorchLoader(dataset, num_workers=nw, **kwargs))
    return list(shmloader.DataLoader(dataset, num_workers=nw, **kwargs))


def outcome(which: str, dataset: Any, nw: int, **kwargs: Any) -> tuple[list[Any] | None, type | None]:
    try:
        return load(which, dataset, nw, **kwargs), None
    except Exception as exc:  # the kind of error, compared with torch's
        return None, type(exc)


def assert_same_batches(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        compare_exact(a, b)


# --- __getitems__ ------------------------------------------------------------------------------


class Columns(torch.utils.data.Dataset):
    """``__getitems__`` returns what ``kind`` says: a dict of columns, a tensor, a tuple or
    a list of samples."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.calls: list[Any] = []

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: Any) -> Any:
        return torch.tensor([float(i)])

    def __getitems__(self, indices: list[int]) -> Any:
        if self.kind == "dict":
            return {"x": torch.tensor(indices, dtype=torch.float32), "n": len(indices)}
        if self.kind == "tensor":
            return torch.tensor(indices, dtype=torch.float32) * 2
        if self.kind == "tuple":
            return tuple(self[i] for i in indices)
        return [self[i] * 3 for i in indices]


def as_given(batch: Any) -> Any:
    """A collate_fn that returns what it gets."""
    return batch


@WORKERS
@pytest.mark.parametrize("kind", ["dict", "tensor", "tuple", "list"])
def test_getitems_return_value_reaches_collate_fn_unchanged(nw, kind):
    theirs = load("torch", Columns(kind), 0, batch_size=3, collate_fn=as_given)
    ours = load("ours", Columns(kind), nw, batch_size=3, collate_fn=as_given)
    assert_same_batches(ours, theirs)


@WORKERS
@pytest.mark.parametrize("kind", ["dict", "tensor", "tuple", "list"])
def test_getitems_with_the_default_collate_as_torch(nw, kind):
    """torch's default_collate takes a list or tuple of samples; a dict of columns or a
    tensor is an error there (KeyError, TypeError), and a KeyError or TypeError here."""
    theirs, their_error = outcome("torch", Columns(kind), 0, batch_size=3)
    ours, our_error = outcome("ours", Columns(kind), nw, batch_size=3)
    if their_error is not None:
        assert our_error is not None and issubclass(our_error, their_error), (our_error, their_error)
    else:
        assert our_error is None, our_error
        assert_same_batches(ours, theirs)


class Calls(torch.utils.data.Dataset):
    """Records whether __getitems__ was called."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, indices: list[int]) -> list[int]:
        raise AssertionError("__getitems__ is called only when batching")


@WORKERS
def test_getitems_is_not_called_without_batching(nw):
    assert load("ours", Calls(), nw, batch_size=None) == load("torch", Calls(), 0, batch_size=None)


@WORKERS
def test_subset_with_a_batch_sampler_as_sampler_and_no_batch_size(nw):
    """random_split's Subset (which has __getitems__), a BatchSampler given as sampler and
    batch_size=None: each list of indices goes to __getitem__, as torch does."""
    base = torch.utils.data.TensorDataset(torch.arange(20.0), torch.arange(20))
    torch.manual_seed(0)
    part, _ = torch.utils.data.random_split(base, [12, 8])

    def kwargs() -> dict:
        sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(part), 5, False)
        return {"batch_size": None, "sampler": sampler}

    assert_same_batches(load("ours", part, nw, **kwargs()), load("torch", part, 0, **kwargs()))


# --- torch's default_collate_fn_map -------------------------------------------------------------


class Box:
    def __init__(self, v: int) -> None:
        self.v = v


def collate_boxes(batch: Any, *, collate_fn_map: Any = None) -> Any:
    return torch.tensor([b.v for b in batch]) * 10


def collate_ints_as_int32(batch: Any, *, collate_fn_map: Any = None) -> Any:
    return torch.tensor(batch, dtype=torch.int32)


class Boxes(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return {"box": Box(i), "label": i, "x": np.full(2, i, np.float32)}


@pytest.fixture
def torch_map():
    """torch's default_collate_fn_map, restored after the test."""
    saved = dict(torch_collate.default_collate_fn_map)
    yield torch_collate.default_collate_fn_map
    torch_collate.default_collate_fn_map.clear()
    torch_collate.default_collate_fn_map.update(saved)


@WORKERS
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("register", ["type", "int", "both"])
def test_torch_default_collate_fn_map_registrations_are_honoured(nw, explicit, register, torch_map):
    if register in ("type", "both"):
        torch_map[Box] = collate_boxes
    if register in ("int", "both"):
        torch_map[int] = collate_ints_as_int32
    kwargs: dict[str, Any] = {"batch_size": 4}
    if explicit:
        kwargs["collate_fn"] = torch_collate.default_collate
    dataset = Squares() if register == "int" else Boxes()
    ours = load("ours", dataset, nw, **kwargs)
    assert_same_batches(ours, load("torch", dataset, 0, **kwargs))
    if register != "type":
        assert all(b["label" if isinstance(b, dict) else 0].dtype == torch.int32 for b in ours)


@WORKERS
def test_an_unmodified_torch_map_leaves_the_default_collate_as_it_was(nw):
    """No registration: shmloader's own map is the one in use (its fast path)."""
    from shmloader.interop.torchcollate import honoured_map

    assert honoured_map(shmloader.default_collate_fn_map) is shmloader.default_collate_fn_map
    assert_same_batches(load("ours", Squares(), nw, batch_size=3), load("torch", Squares(), 0, batch_size=3))


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int) -> Any:
        return i * i, float(i)


# --- Counter, mixed array and tensor, Tensor subclasses ----------------------------------------


class Counts(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return collections.Counter({"a": i, "b": 1, "c": 2 * i})


@WORKERS
@pytest.mark.parametrize("batch_size", [2, None])
def test_counter_samples_collate_as_torchs(nw, batch_size):
    ours = load("ours", Counts(), nw, batch_size=batch_size)
    theirs = load("torch", Counts(), 0, batch_size=batch_size)
    assert [type(b) for b in ours] == [type(b) for b in theirs]
    assert [{k: np.asarray(v).tolist() for k, v in b.items()} for b in ours] == [
        {k: np.asarray(v).tolist() for k, v in b.items()} for b in theirs
    ]


class Mixed(torch.utils.data.Dataset):
    """An array first, then tensors (and arrays) of other dtypes in one field."""

    def __init__(self, dtypes: list[tuple[str, bool]], nested: bool = False) -> None:
        self.dtypes = dtypes
        self.nested = nested

    def __len__(self) -> int:
        return len(self.dtypes)

    def __getitem__(self, i: int) -> Any:
        name, tensor = self.dtypes[i]
        value = (np.arange(3) % 2 + i).astype(name)
        value = torch.from_numpy(value) if tensor else value
        return {"v": value, "i": i} if self.nested else value


NUMERIC = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]


@WORKERS
@pytest.mark.parametrize("nested", [False, True])
def test_float64_array_with_float32_tensor_promotes_as_torch(nw, nested):
    dataset = Mixed([("float64", False), ("float32", True), ("float32", False)], nested)
    ours = load("ours", dataset, nw, batch_size=3)
    assert_same_batches(ours, load("torch", dataset, 0, batch_size=3))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    first=st.sampled_from(NUMERIC),
    rest=st.lists(st.tuples(st.sampled_from(NUMERIC), st.booleans()), min_size=1, max_size=3),
)
def test_an_array_first_then_tensors_promotes_as_torch(first, rest):
    dataset = Mixed([(first, False), *rest])
    theirs, their_error = outcome("torch", dataset, 0, batch_size=len(dataset))
    ours, our_error = outcome("ours", dataset, 0, batch_size=len(dataset))
    if their_error is not None:
        assert our_error is not None, theirs
        return
    assert our_error is None, our_error
    assert_same_batches(ours, theirs)


class Marked(torch.Tensor):
    """A plain subclass of torch.Tensor (keeps its class through torch ops)."""


class MarkedSamples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> Any:
        return {"m": torch.full((2,), float(i)).as_subclass(Marked), "p": torch.nn.Parameter(torch.ones(1))}


@WORKERS
def test_tensor_subclass_keeps_its_class_as_in_torch(nw):
    with torch.no_grad():
        theirs = load("torch", MarkedSamples(), nw, batch_size=2)
        ours = load("ours", MarkedSamples(), nw, batch_size=2)
    assert [type(b["m"]) for b in ours] == [type(b["m"]) for b in theirs] == [Marked] * 3
    assert [type(b["p"]) for b in ours] == [type(b["p"]) for b in theirs]
    for a, b in zip(ours, theirs):
        assert torch.equal(a["m"].as_subclass(torch.Tensor), b["m"].as_subclass(torch.Tensor))


# --- strides of a collate_fn's tensors ---------------------------------------------------------


def channels_last(batch: list[int]) -> Any:
    x = torch.arange(len(batch) * 3 * 4 * 5, dtype=torch.float32).reshape(len(batch), 3, 4, 5)
    return {"img": x.contiguous(memory_format=torch.channels_last), "i": torch.tensor(batch)}


def transposed(batch: list[int]) -> Any:
    return torch.arange(len(batch) * 6.0).reshape(len(batch), 6).t(), np.ones((len(batch), 3)).T


def expanded(batch: list[int]) -> Any:
    return torch.tensor(batch).unsqueeze(1).expand(len(batch), 4)


@WORKERS
@pytest.mark.parametrize("collate_fn", [channels_last, transposed, expanded])
def test_collate_fn_strides_survive_the_ring_as_torchs(nw, collate_fn):
    theirs = load("torch", list(range(6)), nw, batch_size=3, collate_fn=collate_fn)
    ours = load("ours", list(range(6)), nw, batch_size=3, collate_fn=collate_fn)
    assert_same_batches(ours, theirs)

    def strides(tree: Any) -> list:
        leaves = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, tuple) else [tree]
        return [(type(v).__name__, v.stride() if isinstance(v, torch.Tensor) else v.strides) for v in leaves]

    assert [strides(b) for b in ours] == [strides(b) for b in theirs]


# --- __len__ calls -----------------------------------------------------------------------------


class Measured(torch.utils.data.Dataset):
    """Counts the calls of ``__len__`` (in this process: the loaders read it here)."""

    def __init__(self) -> None:
        self.len_calls = 0

    def __len__(self) -> int:
        self.len_calls += 1
        return 9

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 2},
        {"batch_size": None},
        {"batch_size": 2, "shuffle": True},
        {"batch_size": 2, "drop_last": True},
        {"batch_size": 2, "num_workers": 2},
        {"batch_size": 2, "num_workers": 2, "persistent_workers": True},
    ],
)
def test_len_is_called_per_epoch_as_torch_calls_it(kwargs):
    """(Not compared: batch_size=None with workers, where torch's iterator calls
    ``iter(sampler)`` twice, and a SequentialSampler's eager ``__iter__`` reads the length
    each time: twice per epoch there, once here.)"""
    counts = {}
    for which, make in (("torch", TorchLoader), ("ours", shmloader.DataLoader)):
        dataset = Measured()
        loader = make(dataset, **kwargs)
        per_epoch = []
        for _ in range(2):
            before = dataset.len_calls
            for _batch in loader:  # (no len() of the loader: only the epoch's own calls)
                pass
            per_epoch.append(dataset.len_calls - before)
        counts[which] = per_epoch
        loader._iterator = None
    assert counts["ours"] == counts["torch"]


def test_an_error_while_writing_names_the_batch_once():
    """A worker's error while writing a batch into its slot reads "while writing batch N"."""
    with pytest.raises(BatchLayoutError) as info:
        load("ours", OtherWidths(), 2, batch_size=2)
    text = str(info.value)
    assert "while writing batch 0" in text and "batch batch" not in text, text


class OtherWidths(torch.utils.data.Dataset):
    """Samples of 2 rows of 3, then 2 rows of 4: only the slot's copy finds them unequal."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        return np.zeros((2, 3 + i), np.float32)


class Float8AfterInt(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> Any:
        return (
            torch.tensor(-6, dtype=torch.int32) if i == 0 else torch.tensor(32.0, dtype=torch.float8_e4m3fn)
        )


@WORKERS
def test_a_float8_tensor_among_int_tensors_is_refused_as_torch_refuses_it(nw):
    """torch cannot promote float8 with another dtype (RuntimeError); the float8 tensor's
    raw bytes are never read as the other dtype's numbers."""
    _, their_error = outcome("torch", Float8AfterInt(), 0, batch_size=3)
    ours, our_error = outcome("ours", Float8AfterInt(), nw, batch_size=3)
    assert their_error is not None and issubclass(their_error, RuntimeError)
    assert our_error is not None and issubclass(our_error, RuntimeError), ours


class ShortSequential(torch.utils.data.SequentialSampler):
    """Says it is shorter than the order it yields."""

    def __len__(self) -> int:
        return 3


@WORKERS
def test_a_sequential_sampler_overriding_len_is_iterated_as_it_says(nw):
    def kwargs() -> dict:
        return {"batch_size": 2, "sampler": ShortSequential(range(7))}

    assert_same_batches(
        load("ours", list(range(7)), nw, **kwargs()), load("torch", list(range(7)), 0, **kwargs())
    )
