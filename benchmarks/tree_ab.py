"""Two source trees of shmloader, one harness: an alternating A/B of the loader itself.

``shmloader bench`` lives in the package, so running each tree's bench compares harnesses
as well as loaders. This script defines its own datasets and touches only the public
``shmloader.DataLoader``, so any tree that has it can be measured the same way:

    git worktree add /tmp/wt_old <commit>
    (cd /tmp/wt_old && python setup.py -q build_ext --inplace)
    python benchmarks/tree_ab.py --tree old=/tmp/wt_old/src --tree new=src --rounds 4

Each measurement is a fresh interpreter with ``PYTHONPATH`` set to one tree's ``src``;
rounds alternate the trees' order (ABBA...) and run every workload. One measurement of a
workload gives:

- steady: batches/s of a persistent loader (``--workers``, 2 by default), its warm-up
  batches excluded, counted for ``--seconds``; and the CPU a batch over that time of the
  consumer (the process's CPU time) and of its workers (its children's, psutil);
- cold: a fresh loader (not persistent) over a short dataset (the workload's cold batches
  in WORKLOADS), from its construction to its last batch (worker start-up counted,
  shutdown not), as batches/s.

W7 here is int32 token sequences of 16..2048 tokens, bucketed by length
(``BucketBatchSampler``, 16 buckets, batch 64) and padded per batch (``collate="pad"``).
W6 here is a JPEG folder (simplejpeg decode, a random 224x224 crop, a random flip, batch
64) read in whole epochs; steady is a persistent loader's epoch, cold a fresh one's.
The report gives each tree's median per figure and the per-round ratio B/A (median and
range). Hold the CPU lock while measuring (``flock /tmp/cpu.lock ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CACHE_ITEMS = 16
JPEG_COUNT = 640
JPEG_SIZE = (375, 500)  # height, width
CROP = 224


class Images:
    """3x224x224 images of ``dtype`` and an int64 label, from a 16-item cache."""

    def __init__(self, length: int, dtype: str):
        rng = np.random.default_rng(0)
        images = rng.integers(0, 255, (CACHE_ITEMS, 3, 224, 224)).astype(dtype)
        self.samples = [(images[k], np.int64(k)) for k in range(CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.samples[i % CACHE_ITEMS]


class Records:
    """``{"x": float32[16], "y": int64}`` records from a 16-item cache."""

    def __init__(self, length: int):
        rng = np.random.default_rng(0)
        x = rng.random((CACHE_ITEMS, 16), dtype=np.float32)
        self.samples = [{"x": x[k], "y": np.int64(k)} for k in range(CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.samples[i % CACHE_ITEMS]


class Scalars:
    """One int64 scalar a sample: the per-batch overhead alone."""

    def __init__(self, length: int):
        self.samples = [np.int64(k) for k in range(CACHE_ITEMS)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.samples[i % CACHE_ITEMS]


class Tokens:
    """Int32 token sequences of 16..2048 tokens (seeded lengths), prefixes of a cached pool."""

    def __init__(self, length: int):
        rng = np.random.default_rng(0)
        self.lengths = rng.integers(16, 2049, length).tolist()
        self.pool = rng.integers(1, 32_000, (CACHE_ITEMS, 2048), dtype=np.int32)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Any:
        return self.pool[i % CACHE_ITEMS, : self.lengths[i]]


class Jpegs:
    """A folder of JPEGs: decode, a random 224x224 crop, a random horizontal flip."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        import simplejpeg

        with open(self.paths[i], "rb") as f:
            image = simplejpeg.decode_jpeg(f.read(), colorspace="RGB")
        rng = np.random.default_rng()
        top = int(rng.integers(0, image.shape[0] - CROP + 1))
        left = int(rng.integers(0, image.shape[1] - CROP + 1))
        crop = image[top : top + CROP, left : left + CROP]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        return np.ascontiguousarray(crop), i % 10


# workload -> (dataset maker(length), batch size, warm-up batches, cold batches)
WORKLOADS: dict[str, tuple[Any, int, int, int]] = {
    "W1": (lambda n: Images(n, "uint8"), 64, 20, 40),
    "W2": (lambda n: Images(n, "float32"), 64, 10, 20),
    "W3": (Records, 256, 200, 400),
    "W4": (Scalars, 1, 2000, 2000),
    "W7": (Tokens, 64, 200, 200),  # bucketed by length (16 buckets), padded per batch
}
STEADY_LENGTH = {"W7": 4000 * 64}  # samples of the steady loader (others: 10**7, never ending)


def loader_options(workload: str, dataset: Any, batch_size: int) -> dict[str, Any]:
    """How ``workload`` is batched: a batch size, or W7's bucketed batch sampler and padding."""
    if workload != "W7":
        return {"batch_size": batch_size}
    from shmloader import BucketBatchSampler

    sampler = BucketBatchSampler(dataset.lengths, batch_size, num_buckets=16, seed=0)
    return {"batch_sampler": sampler, "collate": "pad"}


def endless(loader: Any) -> Any:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def jpeg_folder() -> list[str]:
    """The W6 images, written once to a cache folder (seeded noise, smoothed)."""
    import simplejpeg

    folder = Path(tempfile.gettempdir()) / "shmloader-tree-ab-jpegs"
    paths = [str(folder / f"{k:04d}.jpg") for k in range(JPEG_COUNT)]
    if all(os.path.exists(p) for p in paths):
        return paths
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for p in paths:
        small = rng.integers(0, 255, (JPEG_SIZE[0] // 25, JPEG_SIZE[1] // 25, 3), dtype=np.uint8)
        image = np.ascontiguousarray(small.repeat(25, 0).repeat(25, 1))
        Path(p).write_bytes(simplejpeg.encode_jpeg(image, quality=90))
    return paths


def measure(workload: str, seconds: float, workers: int) -> dict[str, float]:
    """One tree's figures for ``workload`` (runs in the tree's interpreter)."""
    from shmloader import DataLoader

    if workload == "W6":
        return measure_w6(DataLoader, workers)
    make, batch_size, warmup, cold_batches = WORKLOADS[workload]
    dataset = make(STEADY_LENGTH.get(workload, 10**7))
    options = loader_options(workload, dataset, batch_size)
    loader = DataLoader(dataset, num_workers=workers, persistent_workers=True, **options)
    it = endless(loader)
    try:
        for _ in range(warmup):
            next(it)
        n = 0
        w0 = _children_cpu_s()
        t0, c0 = time.perf_counter(), time.process_time()
        end = t0 + seconds
        while True:
            next(it)
            n += 1
            if n % 16 == 0 and time.perf_counter() >= end:
                break
        t1, c1 = time.perf_counter(), time.process_time()
        w1 = _children_cpu_s()
    finally:
        del it
        loader.shutdown()
    small = make(cold_batches * batch_size)
    options = loader_options(workload, small, batch_size)
    t2 = time.perf_counter()
    fresh = DataLoader(small, num_workers=workers, **options)
    cold = sum(1 for _ in fresh)
    t3 = time.perf_counter()
    del fresh
    return {
        "steady": n / (t1 - t0),
        "cold": cold / (t3 - t2),
        "consumer_us": (c1 - c0) / n * 1e6,
        "workers_us": (w1 - w0) / n * 1e6,
    }


def _children_cpu_s() -> float:
    """The CPU seconds (user and system) of this process's live children: its workers."""
    import psutil

    total = 0.0
    for child in psutil.Process().children():
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def measure_w6(DataLoader: Any, workers: int) -> dict[str, float]:
    """W6: a persistent loader's third epoch, and a fresh loader's whole epoch."""
    dataset = Jpegs(jpeg_folder())
    batches = (len(dataset) + 63) // 64
    loader = DataLoader(dataset, batch_size=64, num_workers=workers, persistent_workers=True)
    try:
        for _ in range(2):
            for _ in loader:
                pass
        t0 = time.perf_counter()
        for _ in loader:
            pass
        t1 = time.perf_counter()
    finally:
        loader.shutdown()
    t2 = time.perf_counter()
    fresh = DataLoader(dataset, batch_size=64, num_workers=workers)
    for _ in fresh:
        pass
    t3 = time.perf_counter()
    del fresh
    return {"steady": batches / (t1 - t0), "cold": batches / (t3 - t2)}


def run_tree(src: str, workload: str, seconds: float, workers: int) -> dict[str, float]:
    """``measure`` in a fresh interpreter that imports shmloader from ``src``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import tree_ab; "
        "print(json.dumps(tree_ab.measure(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))))"
    )
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, workload, str(seconds), str(workers)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"measuring {workload} under {src} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", required=True, help="NAME=SRC_DIR (twice: A then B)")
    parser.add_argument("--workloads", default="W1,W2,W3,W4,W6,W7")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="also write every measurement here")
    args = parser.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    if len(trees) != 2:
        parser.error("give exactly two --tree NAME=SRC_DIR")
    names = args.workloads.split(",")
    if "W6" in names:
        jpeg_folder()
    results: dict[str, dict[str, list[dict[str, float]]]] = {n: {t[0]: [] for t in trees} for n in names}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for name in names:
            for tree, src in order:
                res = run_tree(src, name, args.seconds, args.workers)
                results[name][tree].append(res)
                print(
                    f"round {r + 1} {name} {tree}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()),
                    flush=True,
                )
    (a, _), (b, _) = trees
    print(f"\nmedian of {args.rounds} rounds; ratio {b}/{a}: per-round median (range)")
    for name in names:
        for key in results[name][a][0]:
            va = [x[key] for x in results[name][a]]
            vb = [x[key] for x in results[name][b]]
            ratios = [y / x for x, y in zip(va, vb)]
            print(
                f"{name} {key:12s} {a} {statistics.median(va):10.1f}  {b} {statistics.median(vb):10.1f}  "
                f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
