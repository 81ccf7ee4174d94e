"""shmloader.share: the cost of reading shared structures, per access.

Shares 200,000 items of each shape (paths, labels, annotation dicts as in
share_memory.py, the records of share_encode.py, a dict str -> int), then times each
access over 50,000 random indices, 5 repetitions, and prints the median and range per
access in ns. Compare two trees by alternating runs under the CPU lock:

    flock /tmp/cpu.lock env PYTHONPATH=src python benchmarks/share_read.py
"""

from __future__ import annotations

import random
import statistics
import timeit

from shmloader import share

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


def main() -> None:
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
