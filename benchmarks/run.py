"""The full measured run behind benchmarks/results.json and benchmarks/RESULTS.md.

    python benchmarks/run.py            # W1-W7 and the W1, W7 variants, 2 workers then 1, 5 repeats of <= 1 s
                                        # (W6: 5 whole epochs per peer; its JPEGs are written once
                                        # under $SHMLOADER_CACHE or ~/.cache/shmloader)
    python benchmarks/run.py --seconds 2  # extra options go to `shmloader bench`

The harness itself lives in the package (``shmloader.bench``), so ``shmloader bench``
works right after ``pip install -e .``; this script only fixes the settings and paths.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from shmloader import bench

HERE = Path(__file__).resolve().parent

FULL_RUN = [
    "--workloads", "all",
    "--workers", "2,1",
    "--repeat", "5",
    "--seconds", "1.0",
    "--json", os.path.relpath(HERE / "results.json"),
    "--markdown", os.path.relpath(HERE / "RESULTS.md"),
]  # fmt: skip


if __name__ == "__main__":
    sys.exit(bench.main([*FULL_RUN, *sys.argv[1:]]))
