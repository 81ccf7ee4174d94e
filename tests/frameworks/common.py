"""Datasets and helpers shared by the framework scripts (run as child processes by
tests/test_frameworks.py; importable from the test process too).

Every sample carries its id, so a script can record exactly which samples each rank
trained on. Datasets are pure Python / numpy (torchvision cannot import here: its CPU
wheel needs CUDA libraries); they return what torchvision's would (a float image, an int
label) or what a numpy pipeline would.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

N = 96  # samples: 12 batches of 8 on one rank, 6 per rank on two
BATCH = 8
FEATURES = 8
CLASSES = 4


class NumpySamples:
    """Sample i: ``(x, y, i)`` with x a float32 numpy vector, y a numpy int64 label."""

    def __init__(self, n: int = N):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64, int]:
        x = np.full(FEATURES, i / self.n, dtype=np.float32)
        return x, np.int64(i % CLASSES), i


class NumpyPairs(NumpySamples):
    """Sample i: ``(x, y)`` of :class:`NumpySamples` (the tutorial loop's shape)."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return super().__getitem__(i)[:2]


class IntLabelled:
    """torchvision-like: sample i is ``(image, label)``, a float32 CHW tensor and a Python
    int (as ``datasets.FakeData(transform=ToTensor())`` gives)."""

    def __init__(self, n: int = N):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        return torch.full((1, 2, FEATURES // 2), float(i) / self.n), i % CLASSES


def out_dir() -> str:
    """The folder a script writes its records to: its first argument."""
    path = sys.argv[1]
    os.makedirs(path, exist_ok=True)
    return path


def write(name: str, record: Any) -> None:
    """Write ``record`` as JSON to ``<out>/<name>.json`` (atomically: the test reads it
    only after the script exited, but a crash must not leave half a file)."""
    path = os.path.join(out_dir(), f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def ids(batch_ids: Any) -> list[int]:
    """A batch's sample ids as a list of ints (from a tensor or an array)."""
    return [int(v) for v in batch_ids.tolist()]
