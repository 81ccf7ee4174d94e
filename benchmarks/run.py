"""The full measured run behind benchmarks/results.json and benchmarks/RESULTS.md, judged
against the project's targets (benchmarks/targets.py).

    python benchmarks/run.py            # W1-W7 and the W1, W7 variants, 2 workers then 1, 5 repeats of <= 1 s
                                        # (W6: 5 whole epochs per peer; its JPEGs are written once
                                        # under $SHMLOADER_CACHE or ~/.cache/shmloader)
    python benchmarks/run.py --seconds 2  # extra options go to `shmloader bench`

The harness itself lives in the package (``shmloader.bench``), so ``shmloader bench``
works right after ``pip install -e .``; this script fixes the settings and paths, then
adds the targets table to the output, the JSON (``"targets"``) and the markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import targets

from shmloader.bench import main as bench_main

HERE = Path(__file__).resolve().parent

FULL_RUN = [
    "--workloads",
    "all",
    "--workers",
    "2,1",
    "--repeat",
    "5",
    "--seconds",
    "1.0",
    "--json",
    os.path.relpath(HERE / "results.json"),
    "--markdown",
    os.path.relpath(HERE / "RESULTS.md"),
]


def main(argv: list[str]) -> int:
    """Run ``shmloader bench`` with :data:`FULL_RUN` and then ``argv`` (later options win),
    then judge the run's JSON against the targets."""
    args = [*FULL_RUN, *argv]
    rc = bench_main(args)
    if rc != 0:
        return rc
    paths = argparse.ArgumentParser(add_help=False)
    paths.add_argument("--json")
    paths.add_argument("--markdown")
    where, _ = paths.parse_known_args(args)
    with open(where.json) as f:
        data = json.load(f)
    judged = targets.evaluate(data["configs"])
    print("\n" + targets.text(judged))
    data["targets"] = judged
    with open(where.json, "w") as f:
        json.dump(data, f, indent=1, default=str)
    if where.markdown:
        with open(where.markdown, "a") as f:
            f.write("\n" + targets.markdown(judged))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
