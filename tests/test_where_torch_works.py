"""Where torch's DataLoader works, the loader works (issue 14): torch is the oracle.

A memory cgroup whose limit lets torch's DataLoader finish its epoch must let shmloader's
default settings finish it too. The cases run tests/environments.py's child script, as
tests/test_where_it_runs.py's do (those never import torch, and run in CI's half without
torch only); this one needs torch, so it lives apart from them.
"""

from __future__ import annotations

import signal

import pytest

from .environments import MemoryCgroup, run_child

TORCH_FITS_LIMIT = 512 * 2**20  # torch 2.13's DataLoader (fork) completes here: measured, and rechecked below


@pytest.mark.timeout(90)
def test_cgroup_where_torch_works():
    """Where torch's DataLoader completes the epoch (38 MB batches, 2 fork workers) inside
    a memory cgroup, shmloader's default settings complete it too (a smaller ring, one
    warning), never OOM-killed. torch runs first in the same cgroup limit; where it fails
    too, there is nothing to compare and the test skips."""
    why = MemoryCgroup.refused()
    if why:
        pytest.skip(why)
    pytest.importorskip("torch")
    with MemoryCgroup(TORCH_FITS_LIMIT) as cg:
        torch_run = run_child({"loader": "torch", "dtype": "float32"}, cgroup=cg, timeout=40)
        torch_kills = cg.oom_kills()
    if torch_kills or not torch_run.data or torch_run.data["error"] is not None:
        pytest.skip(f"torch's DataLoader itself fails under a {TORCH_FITS_LIMIT >> 20} MiB limit here")
    with MemoryCgroup(TORCH_FITS_LIMIT) as cg:
        child = run_child({"dtype": "float32", "backend": "auto"}, cgroup=cg, timeout=40)
        kills = cg.oom_kills()
        child.assert_inside(cg)
    assert child.rc != -signal.SIGKILL and kills == 0, child.why()
    assert child.worked(), (
        f"torch completes the epoch under this limit, shmloader refuses: {child.data['error']}"
    )
    assert len(child.data["warnings"]) <= 1, child.data["warnings"]
