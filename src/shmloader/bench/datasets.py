"""The synthetic datasets of workloads W1-W5, W7 and W8, and W7's padding.

Module level, so they pickle under spawn and forkserver; every sample comes from a small
prebuilt cache, so fetching costs (almost) nothing and the loaders are what is measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

CACHE_ITEMS = 16  # samples come from a cache this big, so the dataset's cost is ~0


class ImageDataset:
    """3x224x224 images (uint8 or float32) and an int64 label: sample ``i`` is item
    ``i % 16`` of a prebuilt cache, so fetching costs one list lookup."""

    def __init__(self, length: int, dtype: str = "uint8", shape: tuple[int, ...] = (3, 224, 224)):
        rng = np.random.default_rng(0)
        images = rng.integers(0, 255, (CACHE_ITEMS, *shape)).astype(dtype)
        labels = np.arange(CACHE_ITEMS, dtype=np.int64)
        self.samples = [(images[k], labels[k]) for k in range(CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return self.samples[i % CACHE_ITEMS]


class RecordDataset:
    """Small records ``{"x": float32[16], "y": int64}``, from a prebuilt 16-item cache."""

    def __init__(self, length: int):
        rng = np.random.default_rng(0)
        x = rng.random((CACHE_ITEMS, 16), dtype=np.float32)
        y = np.arange(CACHE_ITEMS, dtype=np.int64)
        self.samples = [{"x": x[k], "y": y[k]} for k in range(CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i % CACHE_ITEMS]


class ScalarDataset:
    """One int64 scalar per sample, from a 16-item cache: measures per-batch overhead."""

    def __init__(self, length: int):
        values = np.arange(CACHE_ITEMS, dtype=np.int64)
        self.samples = [values[k] for k in range(CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.int64:
        return self.samples[i % CACHE_ITEMS]


class ComputeDataset:
    """Each sample costs ~``sample_s`` of CPU (sorting a cached random array), then a
    float32[64] vector and an int64 label: the loader should not matter at all here.

    The sort size is calibrated once, in the process that builds the dataset, so both
    loaders run exactly the same computation.
    """

    def __init__(self, length: int, sample_s: float = 1e-3):
        rng = np.random.default_rng(0)
        x = rng.random((CACHE_ITEMS, 64), dtype=np.float32)
        y = np.arange(CACHE_ITEMS, dtype=np.int64)
        self.samples = [(x[k], y[k]) for k in range(CACHE_ITEMS)]
        self.length = length
        self.work = rng.random(16384)
        for _ in range(3):  # scale the work to the target cost
            cost = self.cost_s()
            self.work = rng.random(max(1024, int(len(self.work) * sample_s / cost)))
        self.sample_s = self.cost_s()

    def cost_s(self) -> float:
        """The median CPU seconds one sample's computation takes here."""
        times = []
        for _ in range(7):
            c0 = time.thread_time()
            np.sort(self.work)
            times.append(time.thread_time() - c0)
        return max(statistics.median(times), 1e-6)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        np.sort(self.work)
        return self.samples[i % CACHE_ITEMS]


class TokenDataset:
    """Variable-length int32 token sequences (W7): sample ``i`` has ``lengths[i]`` tokens,
    drawn uniformly in ``[min_len, max_len]`` from a seeded RNG, and is a prefix of row
    ``i % 16`` of a cached pool (a view: fetching costs one slice)."""

    def __init__(self, length: int, min_len: int = 16, max_len: int = 2048, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(min_len, max_len + 1, length).tolist()
        self.pool = rng.integers(1, 32_000, (CACHE_ITEMS, max_len), dtype=np.int32)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:
        return self.pool[i % CACHE_ITEMS, : self.lengths[i]]


def pad_collate(samples: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """torch's side of W7: pad 1-d samples to the batch's longest with zeros (numpy);
    returns ``(padded, lengths)``, as shmloader's ``collate="pad"`` does."""
    lengths = np.fromiter((len(x) for x in samples), np.int64, len(samples))
    out = np.zeros((len(samples), int(lengths.max())), samples[0].dtype)
    for row, x in zip(out, samples, strict=True):
        row[: len(x)] = x
    return out, lengths


def bucket_sampler(dataset: TokenDataset, batch_size: int) -> Any:
    """W7's batch sampler: bucketed by length, 16 buckets, seeded (a fresh one per loader)."""
    from shmloader import BucketBatchSampler

    return BucketBatchSampler(dataset.lengths, batch_size, num_buckets=16, seed=0)


def padding_waste(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> dict[str, float]:
    """Padding of ``batches`` padded to each batch's longest sample: the share of padded
    elements in all elements, and the mean elements per batch."""
    lens = np.asarray(lengths, dtype=np.int64)
    total = real = 0
    for b in batches:
        bl = lens[np.asarray(b, dtype=np.int64)]
        total += len(bl) * int(bl.max())
        real += int(bl.sum())
    return {"waste": (total - real) / total, "elements_per_batch": total / max(len(batches), 1)}


def w7_padding(dataset: TokenDataset, batch_size: int) -> dict[str, dict[str, float]]:
    """One epoch's padding waste with the bucketed sampler and with plain batching over a
    shuffled order (what ``BatchSampler(RandomSampler(...))`` gives), from the lengths."""
    n = len(dataset)
    order = np.random.default_rng(0).permutation(n)
    plain = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return {
        "bucketed": padding_waste(dataset.lengths, list(bucket_sampler(dataset, batch_size))),
        "unbucketed": padding_waste(dataset.lengths, plain),
    }


def w8_record(i: int) -> dict[str, Any]:
    """Record ``i`` of W8's metadata, as a detection dataset holds one per image: its path,
    its label and an annotation dict (a box, its area, a crowd flag), every field varying
    with ``i``."""
    w = 16.0 + i % 200
    h = 16.0 + (i * 7) % 150
    return {
        "path": f"/data/images/train/{i:08d}.jpg",
        "label": i % 1000,
        "ann": {
            "bbox": [float(i % 640), float((i * 3) % 480), w, h],
            "area": w * h,
            "iscrowd": int(i % 10 == 0),
        },
    }


def w8_sample(record: Any) -> tuple[np.ndarray, np.int64, np.int64]:
    """What W8's ``__getitem__`` makes of a record: its box as float32[4], its label, and
    its path's length plus its crowd flag (every field read, little work)."""
    ann = record["ann"]
    box = np.array(ann["bbox"], dtype=np.float32)
    return box, np.int64(record["label"]), np.int64(len(record["path"]) + ann["iscrowd"])


class MetadataDataset:
    """W8: ``records`` holds one Python dict per sample (:func:`w8_record`), built in the
    process that makes the dataset; sample ``i`` reads record ``i``'s fields
    (:func:`w8_sample`). The list is what forked workers copy by reading it and what
    ``share_dataset=True`` replaces with a shared view."""

    def __init__(self, length: int):
        self.records = [w8_record(i) for i in range(length)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64, np.int64]:
        return w8_sample(self.records[i])


class EmptyMetadataDataset:
    """W8's baseline: the same samples as :class:`MetadataDataset`, each record built from
    its index when asked, so the dataset holds no container at all."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64, np.int64]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        return w8_sample(w8_record(i))
