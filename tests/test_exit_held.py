"""Interpreter exit with batches still referenced (issue 27, item 14).

A training script that keeps a batch in a module global (the loop's variable at module
level, a list of samples to log) exits with the batch alive: the modules are torn down
before the last view of the ring dies. Before, that printed two "Exception ignored"
tracebacks (``Ring.__del__`` and the mapping's ``ffi.gc`` callback found their modules'
names gone). The child interpreter runs loaders of each kind (torch or numpy output,
persistent workers or not, a finished epoch and one left mid-way, a first batch in its
own segment, a batch in a ring that grew since, the posix backend) under one start
method, keeps batches in globals, and exits: its exit code is 0, its stderr empty, and
nothing is left (no worker, no /dev/shm entry).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .faultcases import alive

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json
import sys

import psutil

from shmloader import DataLoader
from tests import datasets as D

HELD = []  # batches referenced by the module until the interpreter exits


def sizes(seq):
    out, start = [], 0
    for n in seq:
        out.append(list(range(start, start + n)))
        start += n
    return out


if __name__ == "__main__":  # (not in spawned workers, which run this file again)
    try:
        import torch  # noqa: F401  (torch output; with torch the tracebacks showed)

        OUTPUTS = ["torch", "numpy"]
    except ImportError:
        OUTPUTS = ["numpy"]
    method = sys.argv[1]
    LOADERS = []
    for output in OUTPUTS:
        for persistent in (False, True):
            dl = DataLoader(
                D.Squares(48, side=32),
                batch_sampler=sizes([2, 2, 2, 2, 8, 8, 8, 8, 8]),  # the ring grows
                num_workers=2,
                multiprocessing_context=method,
                persistent_workers=persistent,
                output=output,
                shm_backend="posix" if persistent else "auto",
            )
            LOADERS.append(dl)
            for batch in dl:
                HELD.append(batch)  # the first (its own segment), the old ring's, the last
            LAST = batch
            IT = iter(dl)  # an epoch left mid-way, its workers running
            MID = next(IT)
            LIVE = IT
    pids = [p.pid for p in psutil.Process().children(recursive=True)]
    print("PIDS " + json.dumps({"pid": __import__("os").getpid(), "children": pids}), flush=True)
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_exit_with_batches_in_globals_is_silent(method, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CHILD)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(script), method], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PIDS "))
    data = json.loads(line[len("PIDS ") :])
    assert data["children"], "the child had workers running when it exited"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in data["children"]):
        time.sleep(0.05)
    assert not [p for p in data["children"] if alive(p)], "workers outlived the interpreter"
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmloader-{data['pid']}-")]
    assert not left, f"/dev/shm entries left: {left}"
