"""A fork while a batch is held, and rings that change while workers start (issue 27, item 9).

Training with this loader and validating with torch's (whose workers are forks of the
consumer) forks while the loop still holds the epoch's last batch. The rule: a held slot
is never rewritten, only the process that holds a slot releases it, and a forked child's
inherited finalizers do nothing; and the next epoch works. A fork that sees a held batch
retires the ring, so the next epoch's first task makes a new one while its workers are
still being started: every worker must get that ring, whether it was already running or
not started yet (before, the later ones wrote into the old ring: "slot N holds batch 0,
expected 1", an IndexError in the worker, or under spawn "this ring's descriptor is
closed"). A ring that grows as the epoch starts (the consumer keeps every batch) is the
same case.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest

from shmloader.system import slots as _slots

from . import datasets as D
from .datasets import NumpyLoader as DataLoader


def _slot_of(ring, array) -> int:
    offset = array.__array_interface__["data"][0] - ring.mapping.address - ring.control_bytes
    return offset // ring.slot_stride


def _drop_and_collect() -> int:
    """In a forked child: drop its copies of every batch (their inherited finalizers run)."""
    gc.collect()
    return 0


def _fork_os(held) -> None:
    """os.fork(): the child drops its copy of the held batch, checks it, and exits."""
    expect = held[0].copy()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            same = np.array_equal(held[0], expect)
            held.clear()
            _drop_and_collect()
            code = 0 if same else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _fork_torch(held) -> None:
    """A torch DataLoader with workers (forks of this process), as a validation loop."""
    torch = pytest.importorskip("torch")
    loader = torch.utils.data.DataLoader(
        list(range(8)), batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def _fork_mp(held) -> None:
    """A multiprocessing Process started by fork."""
    proc = multiprocessing.get_context("fork").Process(target=_drop_and_collect)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0


def _fork_subprocess(held) -> None:
    """A subprocess helper (fork and exec)."""
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)


FORKS = {
    "os.fork": _fork_os,
    "torch": _fork_torch,
    "multiprocessing": _fork_mp,
    "subprocess": _fork_subprocess,
}


# Every kind of fork beside the default loader (fork workers, not persistent); the other
# start methods and persistent workers with os.fork (a spawn epoch starts its workers in
# ~1 s here).
CASES = [("fork", how, False) for how in FORKS] + [
    ("spawn", "os.fork", False),
    ("forkserver", "os.fork", False),
    ("fork", "os.fork", True),
    ("fork", "torch", True),
]


@pytest.mark.parametrize(("method", "how", "persistent"), CASES)
def test_a_fork_while_the_last_batch_is_held_leaves_the_next_epochs_intact(method, how, persistent):
    dl = DataLoader(
        D.Squares(24),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=method,
        persistent_workers=persistent,
    )
    expected = [list(range(i, i + 4)) for i in range(0, 24, 4)]
    for _ in range(2):
        held = None
        got = []
        for batch in dl:
            held = batch  # the loop's variable: the epoch's last batch outlives the loop
            got.append(batch[1].tolist())
        assert got == expected
        ring = dl.ring
        x, y = held
        assert ring.contains(x)
        slot = _slot_of(ring, x)
        keep = (x.copy(), y.copy())
        FORKS[how]([x, y])
        assert ring.states.load(slot) == _slots.HELD, "a forked child freed the parent's slot"
        # The next epoch (new workers, perhaps a new ring) never rewrites the held batch.
        assert [b[1].tolist() for b in dl] == expected
        assert np.array_equal(x, keep[0]) and np.array_equal(y, keep[1]), "a held batch was rewritten"
        del x, y, held, batch, ring
    gc.collect()
    # Retired rings are freed once their batches die: only the current one stays mapped.
    assert dl.pinned_shm_bytes() == dl.ring.total_bytes


def test_a_ring_that_grows_as_an_epoch_starts_reaches_every_worker(method):
    """The consumer keeps every batch: a later epoch's first tasks find every slot of
    the ring held and grow it while the workers are still being started."""
    dl = DataLoader(D.Squares(20), batch_size=4, num_workers=2, multiprocessing_context=method)
    kept = []
    for _ in range(3):
        batches = list(dl)
        assert [b[1].tolist() for b in batches] == [list(range(i, i + 4)) for i in range(0, 20, 4)]
        kept.extend(batches)
    assert dl.stats()["rings_created"] >= 2, "the ring grew (the case this test is about)"
    for n, (x, y) in enumerate(kept):
        first = (n % 5) * 4
        assert y.tolist() == list(range(first, first + 4)), "a held batch was rewritten"
        assert (x[:, 0, 0] == y).all()
