"""Worker restarts (issue 16 part 1): ``max_worker_restarts=N`` replaces a worker that dies
or hangs, and the epoch still yields exactly the batches of an undisturbed run.

Each case runs the loader in a child process (tests/faultcases.py, as test_faults does)
with a deadline; the child checks that nothing is left behind (no live descendant, no
extra descriptor, no mapping of a ring) and reports every worker pid it saw, which the
test checks from outside once the child has exited. Workers are SIGKILLed from the
consumer at batches drawn from fixed seeds (at whatever they are doing: between tasks,
fetching, or halfway through writing a slot), and die inside the dataset or
worker_init_fn; the batches are compared one by one with an undisturbed run's.
"""

from __future__ import annotations

import pytest

from shmloader import DataLoader, WorkerRestartWarning

from .test_faults import assert_clean, run_case

pytestmark = pytest.mark.timeout(150)


def _check_same(data: dict, in_order: bool = True) -> None:
    """The disturbed run yielded the undisturbed run's batches (in order, or as a
    multiset with in_order=False), restarted a worker at least once, and warned once
    per restart, naming the signal."""
    ref, got = data["ref"], data["got"]
    assert [len(e) for e in ref] == [20] * len(ref)
    if in_order:
        assert got == ref, (data["plan"], data["warnings"])
    else:
        assert [sorted(e) for e in got] == [sorted(e) for e in ref], (data["plan"], data["warnings"])
    assert data["restarts"] >= 1, data
    assert data["slot_states"] and set(data["slot_states"]) == {0}, data["slot_states"]  # all FREE
    restarts = [w for w in data["warnings"] if w.startswith("WorkerRestartWarning")]
    assert len(restarts) == data["restarts"], data["warnings"]
    assert all("SIGKILL" in w and "pid " in w and "max_worker_restarts=" in w for w in restarts), restarts


@pytest.mark.parametrize(
    "method,seed", [("fork", 1), ("fork", 2), ("fork", 3), ("spawn", 1), ("forkserver", 1)]
)
def test_sigkill_map_style(method, seed):
    """Map-style, in order: SIGKILL a random worker after three random batches; the
    epoch equals the undisturbed one batch by batch."""
    child = run_case("restart_kill", method=method, kind="map", seed=seed, kills=3)
    data = assert_clean(child, child.data.get("pids", []))
    _check_same(data)


def test_sigkill_big_batches():
    """6 MB batches (a worker spends milliseconds writing a slot, so kills land mid-write
    too): every batch's digest equals the undisturbed run's, never a half-written slot."""
    child = run_case("restart_kill", method="fork", kind="map", seed=8, kills=3, width=250_000)
    data = assert_clean(child, child.data.get("pids", []))
    _check_same(data)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sigkill_unordered(method):
    """in_order=False: the same batches (as a multiset), with a worker killed thrice."""
    child = run_case("restart_kill", method=method, kind="map", in_order=False, seed=4, kills=3)
    data = assert_clean(child, child.data.get("pids", []))
    _check_same(data, in_order=False)


@pytest.mark.parametrize("method,seed", [("fork", 1), ("fork", 5), ("spawn", 1)])
def test_sigkill_iterable_with_state(method, seed):
    """An iterable dataset with state_dict/load_state_dict: the new worker's shard
    resumes from the state reported after its last batch received; nothing repeated or
    skipped, batch by batch."""
    child = run_case("restart_kill", method=method, kind="iter", seed=seed, kills=3)
    data = assert_clean(child, child.data.get("pids", []))
    _check_same(data)


@pytest.mark.parametrize("generator", [False, True], ids=["seed", "torch-generator"])
@pytest.mark.parametrize("between", [False, True])
@pytest.mark.parametrize("kind", ["map", "iter"])
def test_persistent_two_epochs(kind, between, generator):
    """persistent_workers: two kills in each of two epochs (and, ``between``, one of an
    idle worker between them); each epoch equals the undisturbed one (a new worker takes
    the current epoch's seed), with seed= and under torch's RNG (a torch generator, the
    map-style dataset shuffled)."""
    if generator:
        pytest.importorskip("torch")
    child = run_case(
        "restart_kill",
        method="fork",
        kind=kind,
        seed=6,
        kills=4,
        epochs=2,
        between=between,
        generator=generator,
    )
    data = assert_clean(child, child.data.get("pids", []))
    assert len(data["got"]) == 2
    _check_same(data)


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """One child runs every fault scenario under fork (see faultcases.case_restart_faults)."""
    tmp = tmp_path_factory.mktemp("restart")
    child = run_case("restart_faults", method="fork", tmp=str(tmp))
    return assert_clean(child)


def test_death_in_dataset_once(faults):
    """A segfault in __getitem__ once: replaced, the epoch equals the undisturbed one."""
    case = faults["segv_once"]
    assert case["error"] is None, case
    assert case["got"] == faults["ref"]["got"]
    assert case["restarts"] == 1
    (warning,) = case["warnings"]
    assert "SIGSEGV" in warning and "batch 4" in warning and "[12, 13, 14]" in warning, warning


def test_restarts_used_up(faults):
    """A worker that dies at the same sample every time: two restarts, then today's
    WorkerDiedError, which says the limit was reached."""
    case = faults["exit_always"]
    assert case["error"]["type"] == "WorkerDiedError", case
    assert "exit code 3" in case["error"]["msg"] and "max_worker_restarts=2" in case["error"]["msg"]
    assert case["restarts"] == 2 and len(case["warnings"]) == 2, case["warnings"]
    assert case["got"] == faults["ref"]["got"][:4]  # the batches before the bad one


def test_death_in_worker_init_fn(faults):
    """A worker that dies in worker_init_fn (before its first batch) counts like any
    other death: once, replaced and the epoch exact; every time, the limit ends it."""
    once = faults["init_once"]
    assert once["error"] is None and once["got"] == faults["ref"]["got"], once
    assert once["restarts"] == 1 and "exit code 5" in once["warnings"][0]
    always = faults["init_always"]
    assert always["error"]["type"] == "WorkerDiedError", always
    assert always["restarts"] == 3 and always["got"] == []


def test_hung_worker_replaced(faults):
    """A worker hung past timeout= is killed and replaced; the epoch is exact. Hung
    again after the last restart: today's LoaderTimeoutError."""
    once = faults["hung_once"]
    assert once["error"] is None and once["got"] == faults["ref"]["got"], once
    assert once["restarts"] == 1
    assert "did not deliver within timeout=2.0 s" in once["warnings"][0], once["warnings"]
    assert once["elapsed_s"] < 20, once
    always = faults["hung_always"]
    assert always["error"]["type"] == "LoaderTimeoutError", always
    assert always["restarts"] == 1


def test_iterable_without_state_is_not_restarted(faults):
    """An iterable dataset without shmloader_state_dict/shmloader_load_state_dict cannot resume its shard
    exactly: today's WorkerDiedError, with a sentence saying what restarts need."""
    case = faults["iter_stateless"]
    assert case["error"]["type"] == "WorkerDiedError", case
    assert "shmloader_state_dict() and shmloader_load_state_dict()" in case["error"]["msg"], case["error"][
        "msg"
    ]
    assert case["restarts"] == 0 and case["warnings"] == []


def test_default_no_restart(faults):
    """max_worker_restarts=0 (the default): a dead worker ends the epoch as before."""
    case = faults["default"]
    assert case["error"]["type"] == "WorkerDiedError" and "SIGKILL" in case["error"]["msg"], case
    assert "max_worker_restarts" not in case["error"]["msg"]
    assert case["restarts"] == 0 and case["warnings"] == []


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_argument_checked(bad):
    with pytest.raises(ValueError, match="max_worker_restarts should be a non-negative integer"):
        DataLoader(list(range(4)), max_worker_restarts=bad)


def test_public_names():
    dl = DataLoader(list(range(4)), num_workers=1, max_worker_restarts=2)
    assert dl.max_worker_restarts == 2 and dl.stats()["worker_restarts"] == 0
    assert issubclass(WorkerRestartWarning, UserWarning)


SCRIPT = """
import os, signal, sys
from shmloader import DataLoader

class KillOnce:
    def __init__(self, marker):
        self.marker = marker
    def __len__(self):
        return 16
    def __getitem__(self, i):
        if i == 5 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return i

loader = DataLoader(KillOnce(sys.argv[1]), batch_size=2, num_workers=2, max_worker_restarts=1)
batches = [b.tolist() for b in loader]  # THE LOOP
assert batches == [[2 * k, 2 * k + 1] for k in range(8)], batches
"""


@pytest.mark.timeout(60)
def test_the_restart_warning_points_at_the_loop_calling_next(tmp_path):
    """The warning names the line of the training loop, however deep in the loader the
    death was seen (a child process: a SIGKILL is involved)."""
    import subprocess
    import sys

    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-W", "always", str(script), str(tmp_path / "marker")],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    line = SCRIPT.splitlines().index("batches = [b.tolist() for b in loader]  # THE LOOP") + 1
    assert f"{script}:{line}: WorkerRestartWarning" in proc.stderr, proc.stderr
