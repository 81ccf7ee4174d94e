"""shmloader.share: the cost of reading shared structures, per access.

Shares 200,000 items of each shape (paths, labels, annotation dicts as in
share_memory.py, the records of share_encode.py, a dict str -> int), then times each
access over 50,000 random indices, 5 repetitions, and prints the median and range per
access in ns. Compare two trees by alternating runs under the CPU lock:

    flock /tmp/cpu.lock env PYTHONPATH=src python benchmarks/share_read.py

``--epochs R`` measures a metadata-only epoch instead (issue 45's workload): a dataset
whose ``__getitem__`` reads a path from a list, a label from another and one field of an
annotation dict (``--n`` records, 600,000 by default), 2 forked workers, batch 512,
shuffled, plain and with ``share_dataset=True``. Per round and loader: one epoch (the
shared one shares there), then the next epoch timed. The two loaders alternate, their
order reversed every other round; printed: each round's two times, the ratio shared /
plain per round (median, range) and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import timeit

from shmloader import DataLoader, share

N = 200_000
CASES = {
    "paths[i]": "for i in idx: paths[i]",
    "labels[i]": "for i in idx: labels[i]",
    "anns[i]['cls']": "for i in idx: anns[i]['cls']",
    "anns[i]['box'][0]": "for i in idx: anns[i]['box'][0]",
    "recs[i]['path']": "for i in idx: recs[i]['path']",
    "recs[i]['ann']['bbox']": "for i in idx: recs[i]['ann']['bbox']",
    "dict(recs[i])": "for i in idx: dict(recs[i])",
    "recs[i].items() iter": "for i in idx:\n for kv in recs[i].items(): pass",
    "'cls' in anns[i]": "for i in idx: 'cls' in anns[i]",
    "index[path]": "for k in keys: index[k]",
    "iterate recs (per item)": "for r in recs: pass",
}


class Metadata:
    """Issue 45's dataset: sample i is (len(paths[i]), labels[i], anns[i]['cls'])."""

    def __init__(self, n: int) -> None:
        self.paths = [f"train/class_{i % 1000:04d}/image_{i:08d}.JPEG" for i in range(n)]
        self.labels = [i % 1000 for i in range(n)]
        self.anns = [
            {"box": [float(i % 97), 3.0, 50.0, 60.0], "cls": i % 1000, "crowd": i % 5 == 0} for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return len(self.paths[i]), self.labels[i], self.anns[i]["cls"]


def _epoch(loader: DataLoader) -> float:
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def epochs(n: int, rounds: int) -> None:
    """Issue 45's measurement (see the module's docstring)."""
    load0 = os.getloadavg()
    loaders = {
        shared: DataLoader(
            Metadata(n),
            batch_size=512,
            shuffle=True,
            num_workers=2,
            share_dataset=shared,
            multiprocessing_context="fork",
        )
        for shared in (False, True)
    }
    ratios = []
    for r in range(rounds):
        times = {}
        for shared in (False, True) if r % 2 == 0 else (True, False):
            _epoch(loaders[shared])  # the first (the shared loader shares here)
            times[shared] = _epoch(loaders[shared])
        ratios.append(times[True] / times[False])
        print(
            f"round {r}: plain {times[False]:.3f} s, shared {times[True]:.3f} s, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(
        f"shared / plain, second epoch: median {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f}) over {rounds} rounds; "
        f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--epochs", type=int, default=0, help="rounds of the epoch measurement (0: per access)"
    )
    parser.add_argument("--n", type=int, default=600_000, help="records of the epoch measurement")
    args = parser.parse_args()
    if args.epochs:
        epochs(args.n, args.epochs)
    else:
        accesses()


def accesses() -> None:
    paths = [f"train/class_{i % 1000:04d}/image_{i:08d}.JPEG" for i in range(N)]
    labels = [i % 1000 for i in range(N)]
    anns = [{"box": [float(i % 97), 3.0, 50.0, 60.0], "cls": i % 1000, "crowd": i % 5 == 0} for i in range(N)]
    recs = [
        {
            "path": f"/data/images/train/{i:08d}.jpg",
            "label": i % 1000,
            "ann": {"bbox": [1.0, 2.0, 3.0, 4.0], "area": 12.0, "iscrowd": 0},
        }
        for i in range(N)
    ]
    index = {p: i for i, p in enumerate(paths)}
    shared = {
        "paths": share(paths),
        "labels": share(labels),
        "anns": share(anns),
        "recs": share(recs),
        "index": share(index),
    }
    rng = random.Random(0)
    idx = [rng.randrange(N) for _ in range(50_000)]
    names = dict(shared, idx=idx, keys=[paths[i] for i in idx])
    for name, stmt in CASES.items():
        per = N if name.startswith("iterate") else len(idx)
        ts = [timeit.timeit(stmt, globals=names, number=1) / per * 1e9 for _ in range(5)]
        print(f"{name:26} {statistics.median(ts):8.0f} ns ({min(ts):.0f}-{max(ts):.0f})", flush=True)


if __name__ == "__main__":
    main()
