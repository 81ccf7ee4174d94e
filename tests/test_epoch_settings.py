"""One frozen snapshot of a loader's settings per epoch (issue 43, part A), against torch.

torch lets a user assign most of its loader's attributes after construction
(``num_workers``, ``prefetch_factor``, ``collate_fn``, ...; only the ones its epoch plan
reads are fixed, tests/test_dropin.py checks those) and its iterator reads them once, when
``iter()`` makes it. The oracle is torch's loader on the same dataset and assignments:
what each epoch yields, and how many samples its workers load ahead.
"""

from __future__ import annotations

import dataclasses
import mmap
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils import data  # noqa: E402

import shmloader  # noqa: E402

DataLoader = shmloader.DataLoader


class Counted(data.Dataset):
    """Sample i: a small tensor filled with i; marks each sample loaded in an anonymous
    shared mapping, which forked workers share (and which holds no descriptor)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.marks = mmap.mmap(-1, n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.marks[i] = 1
        return torch.full((4,), i)

    def loaded(self) -> int:
        return sum(self.marks[:])


def loaded_ahead(cls: type, num_workers: int, prefetch_factor: int, raised: dict) -> tuple[int, int]:
    """Samples loaded once three batches were handed out and the workers settled, and
    batches in the epoch, for a loader made with ``num_workers`` and ``prefetch_factor``
    whose attributes ``raised`` were assigned before ``iter()``."""
    ds = Counted(64)
    loader = cls(ds, batch_size=1, num_workers=num_workers, prefetch_factor=prefetch_factor)
    for name, value in raised.items():
        setattr(loader, name, value)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    seen, still_since = -1, time.monotonic()
    while time.monotonic() - still_since < 0.75:  # (settled: nothing loaded for 0.75 s)
        if ds.loaded() != seen:
            seen, still_since = ds.loaded(), time.monotonic()
        time.sleep(0.05)
    got += list(it)
    ds.marks.close()
    return seen, len(got)


@pytest.mark.parametrize(
    "raised",
    [{"prefetch_factor": 6}, {"num_workers": 3}, {"num_workers": 2, "prefetch_factor": 5}],
    ids=["prefetch_factor", "num_workers", "both"],
)
def test_counts_raised_after_construction_are_kept_in_flight_like_torch(raised):
    # Before: the ring sized when the loader was made capped what was in flight below
    # torch's, and a raised num_workers failed (the clocks had a row per first worker).
    ours = loaded_ahead(DataLoader, 1, 2, raised)
    theirs = loaded_ahead(data.DataLoader, 1, 2, raised)
    assert ours == theirs


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_fn_assigned_after_iter_waits_for_the_next_epoch_like_torch(num_workers):
    # torch's iterator reads collate_fn at iter(); before, shmloader's workers read it at
    # the epoch's first next().
    ds = [np.full(2, i) for i in range(8)]
    seen = []
    for cls in (data.DataLoader, DataLoader):
        loader = cls(ds, batch_size=2, num_workers=num_workers)
        it = iter(loader)
        loader.collate_fn = len
        this_epoch = [b if isinstance(b, int) else b.tolist() for b in it]
        seen.append((this_epoch, list(loader)))
    assert seen[0] == seen[1]
    assert seen[1][1] == [2, 2, 2, 2]


def test_settings_assigned_between_epochs_are_read_by_the_next_like_torch():
    ds = [np.full(2, i) for i in range(6)]
    seen = []
    for cls in (data.DataLoader, DataLoader):
        loader = cls(ds, batch_size=3)
        epochs = [[b.tolist() for b in loader]]
        loader.num_workers = 2
        loader.prefetch_factor = 3
        loader.collate_fn = lambda b: [int(x[0]) for x in b]
        epochs.append(list(loader))
        loader.num_workers = 0
        loader.prefetch_factor = None
        epochs.append(list(loader))
        seen.append(epochs)
    assert seen[0] == seen[1]


def test_epoch_settings_are_frozen_and_read_from_the_attributes():
    loader = DataLoader(list(range(10)), batch_size=2, num_workers=1, output="numpy")
    loader.prefetch_factor = 7
    loader.timeout = 3.5
    loader.in_order = False
    settings = loader.epoch_settings()
    assert (settings.num_workers, settings.prefetch_factor, settings.timeout) == (1, 7, 3.5)
    assert not settings.in_order and settings.now.prefetch_factor == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.num_workers = 2  # type: ignore[misc]
    loader.num_workers = 3
    assert settings.num_workers == 1 and loader.epoch_settings().num_workers == 3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (torch's __del__)
def test_num_workers_assigned_without_a_prefetch_factor_is_a_type_error_at_iter_like_torch():
    # A loader made with num_workers=0 has prefetch_factor None; torch's iterator fails on
    # it at iter() with a TypeError. Ours says what to assign.
    for cls in (data.DataLoader, DataLoader):
        loader = cls([np.zeros(2)] * 4, batch_size=2)
        loader.num_workers = 2
        with pytest.raises(TypeError):
            iter(loader)
    with pytest.raises(TypeError, match=r"assign loader\.prefetch_factor"):
        iter(loader)
