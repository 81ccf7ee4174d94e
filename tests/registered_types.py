"""A user type with a collate function in shmloader's registry, registered when this
module is imported: workers started by spawn or forkserver import it when they unpickle
:class:`IntervalDataset`, so they register it too (what docs/collate.md tells users)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from shmloader import default_collate_fn_map, get_worker_info
from shmloader.dataset import Dataset


class Interval:
    """A value the default collate has no rule for (not a number, array or container)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo = lo
        self.hi = hi


class Intervals(NamedTuple):
    """A batch of intervals: their bounds as arrays, and the worker that collated them
    (-1: the main process)."""

    lo: np.ndarray
    hi: np.ndarray
    worker: int


def collate_intervals(batch, *, collate_fn_map):
    info = get_worker_info()
    return Intervals(
        np.array([v.lo for v in batch], np.int32),
        np.array([v.hi for v in batch], np.int32),
        -1 if info is None else info.id,
    )


default_collate_fn_map[Interval] = collate_intervals


class IntervalDataset(Dataset):
    """Sample i: ``{"span": Interval(i, 2 * i), "label": i}``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"span": Interval(i, 2 * i), "label": i}
