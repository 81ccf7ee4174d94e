"""Differential tests: the keys a sampler or batch sampler yields reach the dataset with
their type, as in torch's DataLoader (issue 27, item 5).

torch hands each batch of keys to ``__getitem__`` (or ``__getitems__``) as the sampler
gave them: in the main process as they are, in a worker as pickled and unpickled (its
index queue), so ``np.int16``, ``np.int32``, ``np.int64``, ``bool`` and ``np.bool_``
stay themselves, and a batch sampler's tuple or array stays a tuple or an array. The
oracle is torch's loader with the same ``num_workers`` on the same dataset; the datasets
record, per sample, the type of the key it was given (and of the batch, for
``__getitems__``), and a user collate_fn hands those records out as they are.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import shmloader  # noqa: E402

N = 16  # samples: every key below (bools index 0 and 1) is in range


def _name(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


class KeyTypes:
    """Map-style: sample ``key`` is (the type of ``key``, ``int(key)``)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, key: object) -> tuple[str, int]:
        return _name(key), int(key)  # type: ignore[call-overload]


class BatchKeyTypes(KeyTypes):
    """With ``__getitems__``: each sample also records the type of the batch of keys."""

    def __getitems__(self, keys: object) -> list[tuple[str, str, int]]:
        return [(_name(keys), *self[k]) for k in keys]  # type: ignore[attr-defined]


def as_is(samples: object) -> object:
    """collate_fn: the samples as they are (module level: picklable)."""
    return samples


class Keys:
    """Sampler yielding ``keys`` (settable between epochs)."""

    def __init__(self, keys: list) -> None:
        self.keys = keys

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


# One of each type of the issue, a plain int among them, and the same value in several.
MIXED = [
    3,
    np.int16(1),
    np.int32(2),
    np.int64(3),
    True,
    np.bool_(False),
    np.int16(7),
    5,
    np.int64(9),
    False,
    np.int32(11),
    np.bool_(True),
    np.uint8(12),
]
TYPES = {
    "int": int,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "bool": lambda i: bool(i % 2),
    "np.bool_": lambda i: np.bool_(i % 2),
}


def _epoch(loader_cls: type, dataset: object, num_workers: int, **kw: object) -> list:
    loader = loader_cls(dataset, num_workers=num_workers, collate_fn=as_is, **kw)
    return list(loader)


def _both(dataset: object, num_workers: int, **kw: object) -> tuple[list, list]:
    theirs = _epoch(torch.utils.data.DataLoader, dataset, num_workers, **kw)
    ours = _epoch(shmloader.DataLoader, dataset, num_workers, **kw)
    return theirs, ours


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [1, 3, None])
@pytest.mark.parametrize("kind", [*TYPES, "mixed"])
def test_sampler_keys_keep_their_type(kind: str, batch_size: int | None, num_workers: int) -> None:
    """A sampler's keys of each type (and mixed) reach ``__getitem__`` as torch hands
    them over, batched by the loader (1, 3) or not (None)."""
    keys = MIXED if kind == "mixed" else [TYPES[kind](i) for i in range(7)]
    theirs, ours = _both(KeyTypes(), num_workers, sampler=Keys(keys), batch_size=batch_size)
    assert ours == theirs
    # The oracle is what the issue says: the types as the sampler yielded them.
    flat = [s for batch in theirs for s in (batch if batch_size is not None else [batch])]
    assert [t for t, _ in flat] == [_name(k) for k in keys]


# A batch sampler's batches: one type each, a mixed list, containers other than a list,
# batches of one key (the loader's path for a single plain int), an empty tuple aside.
BATCHES = [
    [np.int16(0), np.int16(1)],
    [np.int32(2), np.int32(3), np.int32(4)],
    [np.int64(5)],
    [True, False, True],
    [np.bool_(False), np.bool_(True)],
    [6],
    [7, 8, 9],
    MIXED[:5],
    (10, np.int64(11)),
    np.array([12, 13], dtype=np.int16),
    np.array([14], dtype=np.int64),
    [0, np.uint8(15)],
    [np.longlong(1), np.longlong(2)],  # (a type of its own beside np.int64: pickled, it becomes np.int64)
    [np.uint64(3), np.int8(4)],
    [np.uint16(5), np.uint16(6), np.uint16(7)],
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset", [KeyTypes, BatchKeyTypes])
def test_batch_sampler_keys_keep_their_type(dataset: type, num_workers: int) -> None:
    """A batch sampler's batches (lists of each type, mixed, a tuple, numpy arrays)
    reach ``__getitem__`` / ``__getitems__`` as torch hands them over: the batch's
    container and every key's type."""
    theirs, ours = _both(dataset(), num_workers, batch_sampler=Keys(BATCHES))
    assert ours == theirs
    given = [[_name(k) for k in b] for b in BATCHES]
    if num_workers:  # (what pickling makes of them: np.longlong's dtype is int64's)
        given = [[t.replace("numpy.longlong", "numpy.int64") for t in b] for b in given]
    assert [[s[-2] for s in batch] for batch in theirs] == given


_key = st.one_of(
    st.integers(0, N - 1),
    st.integers(0, N - 1).map(np.int16),
    st.integers(0, N - 1).map(np.int32),
    st.integers(0, N - 1).map(np.int64),
    st.integers(0, N - 1).map(np.uint8),
    st.integers(0, N - 1).map(np.longlong),
    st.booleans(),
    st.booleans().map(np.bool_),
)
_batch = st.one_of(
    st.lists(_key, min_size=1, max_size=5),
    st.sampled_from([np.int16, np.int64, np.uint32, np.bool_]).flatmap(
        lambda t: st.lists(st.integers(0, 1 if t is np.bool_ else N - 1).map(t), min_size=1, max_size=5)
    ),
    st.lists(st.integers(0, N - 1), min_size=1, max_size=5),
    st.lists(_key, min_size=1, max_size=5).map(tuple),
    st.lists(st.integers(0, N - 1), min_size=1, max_size=5).map(lambda b: np.array(b, dtype=np.int32)),
)


@pytest.mark.timeout(120)
def test_drawn_batches_keep_their_types_in_workers() -> None:
    """Drawn batch samplers (keys of every type, mixed, lists, tuples, arrays), through 2
    persistent workers of each loader (started once: the batch sampler runs in the main
    process, so each example sets its batches and iterates an epoch)."""
    sampler = Keys([[0]])
    kw = dict(batch_sampler=sampler, num_workers=2, persistent_workers=True, collate_fn=as_is)
    # In a dict emptied at the end: a failure's traceback keeps the frames, not the loaders
    # (nor does pytest's rewritten assert below: it names only the batches).
    loaders = {
        "theirs": torch.utils.data.DataLoader(BatchKeyTypes(), **kw),
        "ours": shmloader.DataLoader(BatchKeyTypes(), **kw),
    }

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(batches=st.lists(_batch, min_size=1, max_size=6))
    def check(batches: list) -> None:
        sampler.keys = batches
        ours, theirs = list(loaders["ours"]), list(loaders["theirs"])
        assert ours == theirs

    try:
        check()
    finally:
        loaders["ours"].shutdown()
        if loaders["theirs"]._iterator is not None:
            loaders["theirs"]._iterator._shutdown_workers()
        loaders.clear()
