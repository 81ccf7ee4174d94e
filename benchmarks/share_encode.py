"""shmloader.share: time to share() four shapes of dataset metadata.

Shapes (N items each): ``records``, a list of dicts
``{"path": str, "label": int, "ann": {"bbox": [4 floats], "area": float, "iscrowd": int}}``;
``paths``, a list of str; ``index``, a dict str -> int; ``pairs``, a list of (path, label)
tuples. Prints one line per shape: the median and range of ``--rounds`` timings of
share() (build of the Python objects excluded) and the segment's size. Compare two
trees by alternating runs under the CPU lock:

    flock /tmp/cpu.lock env PYTHONPATH=src python benchmarks/share_encode.py --n 1000000
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from shmloader import share


def build(shape: str, n: int):
    if shape == "records":
        return [
            {
                "path": f"/data/images/train/{i:08d}.jpg",
                "label": i % 1000,
                "ann": {"bbox": [1.0, 2.0, 3.0, 4.0], "area": 12.0, "iscrowd": 0},
            }
            for i in range(n)
        ]
    if shape == "paths":
        return [f"/data/images/train/{i:08d}.jpg" for i in range(n)]
    if shape == "index":
        return {f"/data/images/train/{i:08d}.jpg": i for i in range(n)}
    if shape == "pairs":
        return [(f"/data/images/train/{i:08d}.jpg", i % 1000) for i in range(n)]
    raise ValueError(shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shapes", default="records,paths,index,pairs")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        obj = build(shape, args.n)
        times = []
        for _ in range(args.rounds):
            gc.collect()
            t0 = time.perf_counter()
            shared = share(obj)
            times.append(time.perf_counter() - t0)
            size = shared._store.size
            del shared
        print(
            f"{shape:8} n={args.n}: share() {statistics.median(times):.3f} s "
            f"({min(times):.3f}-{max(times):.3f}), segment {size / 2**20:.1f} MiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
