"""Module-level datasets and helpers for the tests (module level so spawn can pickle them)."""

from __future__ import annotations

import os
import random
import time
from collections import namedtuple

import numpy as np

from shmloader import DataLoader, Dataset, IterableDataset, get_worker_info

Point = namedtuple("Point", ["x", "y"])


class NumpyLoader(DataLoader):
    """``shmloader.DataLoader`` with ``output="numpy"`` unless told otherwise. The suites
    that check numpy views of the ring use it: the default output follows whether torch is
    imported, and whether a test process has imported torch depends on which tests ran."""

    def __init__(self, *args, output: str = "numpy", **kwargs):
        super().__init__(*args, output=output, **kwargs)


class Squares(Dataset):
    """Sample i: a ``side`` x ``side`` (default 4x4) float32 array filled with i, and i."""

    def __init__(self, n: int = 100, side: int = 4):
        self.n = n
        self.side = side

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((self.side, self.side), i, np.float32), i


class Records(Dataset):
    """Every supported leaf type, nested (None is not one: torch's collate refuses it,
    see test_collate_parity)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {
            "array": np.arange(3, dtype=np.int16) + i,
            "scalar": np.float32(i) / 2,
            "flag": bool(i % 2),
            "int": i,
            "float": i * 1.5,
            "text": f"item-{i}",
            "raw": bytes([i]),
            "nested": (np.full(2, i, np.uint8), [i, Point(i, -i)]),
        }


class RandomDraws(Dataset):
    """Sample i: what the worker's seeded RNGs give, and the worker id."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        info = get_worker_info()
        return {
            "random": random.random(),
            "numpy": np.random.random(),
            "worker": -1 if info is None else info.id,
            "seed": -1 if info is None else info.seed,
        }


class Ragged(Dataset):
    """Sample 5 has a different shape from the others."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"image": np.zeros((3, 4 if i != 5 else 5), np.uint8), "label": i}


class Failing(Dataset):
    """Raises KeyError for the indices in ``bad``."""

    def __init__(self, bad, n=40):
        self.bad = set(bad)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise KeyError(f"sample {i} is broken")
        return np.full(2, i), i


class Counting(IterableDataset):
    """Yields 0..n-1, split between workers by worker id."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, self.n, nw):
            yield np.array([i, wid]), i


class Unsplit(IterableDataset):
    """Yields 0..n-1 in every worker (no sharding), with the worker id."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = get_worker_info()
        for i in range(self.n):
            yield i, -1 if info is None else info.id


class WhoLoads(Dataset):
    """Sample i is ``[i, id of the worker that loaded it]``; worker 0 takes 20 ms a sample,
    so results finish out of order."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        info = get_worker_info()
        time.sleep(0.02 if info is not None and info.id == 0 else 0.0)
        return np.array([i, -1 if info is None else info.id])


class Pid(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return os.getpid()


class Sleepy(Dataset):
    """Sample i: i, after ``delay`` seconds of sleep (a batch that takes a while)."""

    def __init__(self, n: int, delay: float):
        self.n = n
        self.delay = delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return i


class SchedPolicy(Dataset):
    """Sample i: the Linux scheduling policy of the process that loads it."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return os.sched_getscheduler(0)


def normal_policy(worker_id: int) -> None:
    """worker_init_fn: back to the default policy (SCHED_OTHER)."""
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def record_init(worker_id: int) -> None:
    """worker_init_fn: write the numpy draw it sees into the environment for the dataset."""
    os.environ["SHMLOADER_TEST_INIT"] = f"{worker_id}:{np.random.random()}"


class InitEcho(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return os.environ.get("SHMLOADER_TEST_INIT", "")


def stack_collate(samples):
    """A user collate_fn: sum of the arrays and the list of labels as an array."""
    return {"sum": np.stack([s[0] for s in samples]).sum(axis=0), "labels": np.array([s[1] for s in samples])}


class TorchSamples(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import torch

        return torch.full((2, 3), float(i)), i


class Killer(Dataset):
    """Sample 7 kills its worker with SIGKILL."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 7:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return i


class WriteInto(Dataset):
    """The write-into protocol: sample i is an HWC image filled with i and its label."""

    def __init__(self, n: int = 30):
        self.n = n
        self.calls = 0

    def __len__(self):
        return self.n

    def sample_spec(self):
        from shmloader import ArraySpec

        return {"image": ArraySpec((4, 5, 3), "uint8"), "label": ArraySpec((), "int64")}

    def write_sample(self, index, out):
        out["image"][...] = index
        out["label"][...] = index

    def __getitem__(self, i):  # what the protocol replaces: same values
        return {"image": np.full((4, 5, 3), i, np.uint8), "label": np.int64(i)}


def image_of(i: int) -> np.ndarray:
    """Sample i of RandomSizeImages: an HxWx3 uint8 image of a size drawn from i."""
    rng = np.random.default_rng(i)
    h, w = rng.integers(8, 40, 2)
    return rng.integers(0, 255, (h, w, 3), dtype=np.uint8)


class RandomSizeImages(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"image": image_of(i), "label": i}


def tokens_of(i: int) -> np.ndarray:
    """Sample i of Tokens: int32 tokens of a length in 1..4096 drawn from i."""
    rng = np.random.default_rng(1000 + i)
    return rng.integers(0, 50_000, rng.integers(1, 4097), dtype=np.int32)


class Tokens(Dataset):
    def __len__(self):
        return 200

    def __getitem__(self, i):
        return tokens_of(i)

    def lengths(self):
        return [len(tokens_of(i)) for i in range(len(self))]


class Wide(Dataset):
    """Sample i: 1,000 float64 values equal to i (8 kB)."""

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        return np.full(1000, i, np.float64)


class Counted(Dataset):
    """A dataset with counters for the loader (shmloader_stats()): multiples of 7 count as 'odd_ones'."""

    def __init__(self):
        self.odd_ones = 0

    def __len__(self):
        return 50

    def __getitem__(self, i):
        if i % 7 == 0:
            self.odd_ones += 1
        return i

    def shmloader_stats(self):
        return {"odd_ones": self.odd_ones}


class TorchThreads(Dataset):
    """Each sample: torch's intra-op thread count in the process that loaded it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        import torch

        return torch.get_num_threads()
