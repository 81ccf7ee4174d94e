"""The default collate's per-batch cost, without processes: ``gather`` (samples -> leaves)
and ``gather`` plus copying the leaves into preallocated views, for four batches (256
small dict samples, 64 uint8 3x224x224 arrays, 256 (float32[16], int) tuples, one int).
With ``--against FILE``, a second copy of ``batch/collate.py`` (e.g. an older commit's:
``git show REV:src/shmloader/batch/collate.py > /tmp/old.py``) is timed in alternation
with the current one, and the ratio printed. Run it alone on the machine.

    PYTHONPATH=src python benchmarks/collate_micro.py [--against /tmp/old.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import timeit
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

import shmloader.batch.collate as current


def batches() -> dict[str, list[Any]]:
    rng = np.random.default_rng(0)
    return {
        "dict256": [{"x": rng.random(16, dtype=np.float32), "y": i, "name": f"s{i}"} for i in range(256)],
        "img64": [rng.integers(0, 255, (3, 224, 224), dtype=np.uint8) for _ in range(64)],
        "tuple256": [(rng.random(16, dtype=np.float32), i) for i in range(256)],
        "scalar1": [7],
    }


def step(module: ModuleType, samples: list[Any], fill: bool) -> Callable[[], None]:
    """One batch's collate by ``module``: gather, and with ``fill`` the copy into views."""
    indices = list(range(len(samples)))
    if not fill:
        return lambda: module.gather(samples, indices, 0)
    treedef, leaves = module.gather(samples, indices, 0)
    layout, data_bytes, _ = module.plan(treedef, leaves)
    views = module.array_views(layout, np.empty(max(data_bytes, 1), np.uint8))

    def run() -> None:
        module.copy_leaves(module.gather(samples, indices, 0)[1])(views)

    return run


def microseconds(fn: Callable[[], None], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="another copy of batch/collate.py to time in alternation")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    other = None
    if args.against:
        spec = importlib.util.spec_from_file_location("collate_against", args.against)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
    for name, samples in batches().items():
        for fill in (False, True):
            number = 20 if name == "img64" and fill else 2000
            ours = step(current, samples, fill)
            theirs = step(other, samples, fill) if other is not None else None
            mine, against = [], []
            for _ in range(args.rounds):  # alternating, so a busy moment hits both
                if theirs is not None:
                    against.append(microseconds(theirs, number))
                mine.append(microseconds(ours, number))
            label = f"{name:9s} {'gather+fill' if fill else 'gather':12s}"
            now = statistics.median(mine)
            if not against:
                print(f"{label} {now:9.2f} us")
            else:
                then = statistics.median(against)
                print(f"{label} against {then:9.2f} us  now {now:9.2f} us  ratio {now / then:5.3f}")


if __name__ == "__main__":
    main()
