"""The workloads (W1-W9), their variants, and the configurations a run measures.

A workload is a dataset and how both loaders batch it; a configuration is a workload
with a worker count and the loader options of its variant (``W1-unordered``: in_order
False; ``W1-fresh``: persistent_workers False).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shmloader.bench.datasets import (
    ComputeDataset,
    ImageDataset,
    RecordDataset,
    ScalarDataset,
    TokenDataset,
    bucket_sampler,
    pad_collate,
)


@dataclass(frozen=True)
class Workload:
    """One workload: its dataset (``make(length)``) and batching."""

    name: str
    description: str
    batch_size: int
    default_batches: int  # per timed repeat (the time box usually ends it first for slow peers)
    make: Callable[[int], Any] | None  # length -> dataset (None: W6 and W8 measure themselves)
    time_scale: float = 1.0  # this workload's repeats run this many times --seconds
    ragged: bool = False  # W7: bucketed batches padded per batch; no copy ceiling


def _make_w1(n: int) -> ImageDataset:
    return ImageDataset(n, "uint8")


def _make_w2(n: int) -> ImageDataset:
    return ImageDataset(n, "float32")


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "images uint8 3x224x224 + int64 label, batch 64", 64, 1000, _make_w1),
    "W2": Workload("W2", "images float32 3x224x224 + int64 label, batch 64", 64, 200, _make_w2),
    "W3": Workload("W3", 'records {"x": float32[16], "y": int64}, batch 256', 256, 5000, RecordDataset),
    "W4": Workload("W4", "one int64 scalar, batch 1 (per-batch overhead)", 1, 40000, ScalarDataset),
    "W5": Workload(
        "W5",
        "~1 ms of numpy CPU per sample, float32[64] + int64, batch 16",
        16,
        400,
        ComputeDataset,
        time_scale=2.0,  # slow batches: longer repeats, so +-5% is measurable
    ),
    "W6": Workload(
        "W6",
        "2,000 synthetic JPEGs 500x375 (--image-size) -> RandomResizedCrop 224 + flip -> batch 64 "
        "uint8 HWC (shmloader.bench.jpeg; whole epochs of persistent loaders, and fresh loaders' "
        "passes over 600 images)",
        64,
        0,
        None,
    ),
    "W7": Workload(
        "W7",
        "int32 token sequences of 16..2048, BucketBatchSampler(64, 16 buckets), padded per batch",
        64,
        4000,
        TokenDataset,
        ragged=True,
    ),
    "W8": Workload(
        "W8",
        "1,000,000 metadata records (--w8-records) of path, label and annotation dict held in "
        "a Python list, batch 512, shuffled: workers' USS and total PSS over one fork epoch, "
        "and time to first batch under spawn, for torch, shmloader and shmloader with "
        "share_dataset=True (shmloader.bench.metadata; a fresh process per measurement; "
        "minutes at full size)",
        512,
        0,
        None,
    ),
    "W9": Workload(
        "W9",
        "600 synthetic JPEGs 500x375 in a torchvision ImageFolder -> transforms.Compose("
        "RandomResizedCrop 224, flip, ToTensor) -> batch 64 float32: torch's DataLoader vs "
        'images="auto" and images="fast" (shmloader.bench.torchvision_pipeline; whole epochs '
        "of persistent loaders; needs torchvision)",
        64,
        0,
        None,
    ),
}

# Variants: (workload, in_order, persistent_workers)
VARIANTS: dict[str, tuple[str, bool, bool]] = {
    "W1-unordered": ("W1", False, True),
    "W1-fresh": ("W1", True, False),  # persistent_workers=False: each epoch starts workers
    "W7-unordered": ("W7", False, True),  # both loaders balance tasks over their workers
}
OPT_IN_NAMES = ["W8"]  # run only when named: minutes of fresh processes at full size
ALL_NAMES = [n for n in [*WORKLOADS, *VARIANTS] if n not in OPT_IN_NAMES]  # what 'all' runs
DEFAULT_NAMES = ["W1", "W4"]


@dataclass(frozen=True)
class Config:
    """One measured setting: a workload, a worker count, and the loader options."""

    name: str  # "W1", "W1-unordered", ...
    workload: str  # "W1"
    workers: int
    in_order: bool = True
    persistent_workers: bool = True

    @property
    def label(self) -> str:
        return f"{self.name} w{self.workers}"


def make_configs(names: Sequence[str], workers: Sequence[int]) -> list[Config]:
    """The configurations for ``names`` x ``workers``, in that order."""
    configs = []
    for w in workers:
        for name in names:
            base, in_order, persistent = VARIANTS.get(name, (name, True, True))
            configs.append(Config(name, base, w, in_order, persistent))
    return configs


def loader_options(wl: Workload, dataset: Any, peer: str) -> dict[str, Any]:
    """How ``peer`` ("shmloader" or "torch") batches ``wl``: its batch size, or for W7 a
    bucketed batch sampler (a fresh one per loader, same seed) and padding (shmloader's
    ``collate="pad"``, torch's :func:`~shmloader.bench.datasets.pad_collate`)."""
    if not wl.ragged:
        return {"batch_size": wl.batch_size}
    opts: dict[str, Any] = {"batch_sampler": bucket_sampler(dataset, wl.batch_size)}
    if peer == "torch":
        opts["collate_fn"] = pad_collate
    else:
        opts["collate"] = "pad"
    return opts
