"""shmloader.share: workers' private memory and per-item access cost, plain vs shared.

Builds N records (paths, labels, small annotation dicts), then per round and per start
method runs a 2-worker DataLoader whose two samples each read every entry once in their
worker, reporting the worker's USS after the reads and its growth during them; plain
and shared alternate within each round. Then times item access (random indices) on the
plain and the shared structures. Run it under the CPU lock:

    flock /tmp/cpu.lock env PYTHONPATH=src python benchmarks/share_memory.py --n 1000000
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import timeit

import psutil

from shmloader import DataLoader, share


def records(n: int):
    paths = [f"train/class_{i % 1000:04d}/image_{i:08d}.JPEG" for i in range(n)]
    labels = [i % 1000 for i in range(n)]
    anns = [{"box": [float(i % 97), 3.0, 50.0, 60.0], "cls": i % 1000, "crowd": i % 5 == 0} for i in range(n)]
    return paths, labels, anns


class Reader:
    """Sample k: (USS after, USS growth) of the worker while it reads every entry once."""

    def __init__(self, paths, labels, anns):
        self.paths, self.labels, self.anns = paths, labels, anns

    def __len__(self):
        return 2

    def __getitem__(self, k):
        me = psutil.Process()
        before = me.memory_full_info().uss
        total = 0
        for p in self.paths:
            total += len(p)
        for label in self.labels:
            total += label
        for ann in self.anns:
            total += ann["cls"] + len(ann["box"])
        after = me.memory_full_info().uss
        return after, after - before


def run(dataset, method: str) -> list[tuple[int, int]]:
    loader = DataLoader(dataset, batch_size=1, num_workers=2, multiprocessing_context=method, output="numpy")
    return [(int(b[0][0]), int(b[1][0])) for b in loader]


def spread(values: list[float], scale: float, unit: str) -> str:
    v = [x / scale for x in values]
    return f"{statistics.median(v):.1f} {unit} ({min(v):.1f}-{max(v):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default="fork,spawn")
    args = ap.parse_args()

    me = psutil.Process()
    base = me.memory_full_info().uss
    plain = records(args.n)
    built = me.memory_full_info().uss
    t0 = time.perf_counter()
    shared = tuple(share(x) for x in plain)
    share_s = time.perf_counter() - t0
    seg = sum(s._store.size for s in shared)
    print(
        f"N={args.n}: plain objects {(built - base) / 2**20:.0f} MiB in the parent; "
        f"shared segments {seg / 2**20:.0f} MiB, share() took {share_s:.1f} s"
    )

    for method in args.methods.split(","):
        got: dict[str, list] = {"plain": [], "shared": []}
        for r in range(args.rounds):
            order = ["plain", "shared"] if r % 2 == 0 else ["shared", "plain"]
            for kind in order:
                got[kind] += run(Reader(*(plain if kind == "plain" else shared)), method)
        for kind in ("plain", "shared"):
            uss = [a for a, _ in got[kind]]
            growth = [g for _, g in got[kind]]
            print(
                f"{method:6} {kind:6}: worker USS {spread(uss, 2**20, 'MiB')}, "
                f"growth while reading {spread(growth, 2**20, 'MiB')} ({len(uss)} workers)"
            )

    rng = random.Random(0)
    idx = [rng.randrange(args.n) for _ in range(100_000)]
    cases = {
        "path (str)": "paths[i]",
        "label (int)": "labels[i]",
        "ann['cls'] (dict)": "anns[i]['cls']",
        "ann['box'][0]": "anns[i]['box'][0]",
    }
    for name, expr in cases.items():
        res = {"plain": [], "shared": []}
        for _ in range(5):
            for kind, (paths, labels, anns) in (("plain", plain), ("shared", shared)):
                names = {"idx": idx, "paths": paths, "labels": labels, "anns": anns}
                t = timeit.timeit(f"for i in idx: {expr}", globals=names, number=1)
                res[kind].append(t / len(idx) * 1e9)
        p, s = spread(res["plain"], 1, "ns"), spread(res["shared"], 1, "ns")
        print(f"access {name:18}: plain {p}, shared {s}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
