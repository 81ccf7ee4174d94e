"""Fault tolerance (issue 3): every way a worker, the consumer or the input can fail.

Each case runs the loader in a child process (tests/faultcases.py) with a deadline; the
child checks itself that nothing is left once its loaders are gone (no live descendant,
no extra descriptor, no mapping of a ring) and reports its workers' pids, which the test
then checks from outside after the child exited. The conftest fixture checks this
process (children, descriptors, /dev/shm entries) around every test.

One child runs several sub-cases where that keeps them honest, to stay fast on 2 cores.
Start methods: fork, spawn and forkserver for worker death, early exit, Ctrl-C and the
consumer's death; fork and spawn for the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from shmloader.memory.ring import ring_bytes

from .faultcases import IDLE_POINTS, WIDE_BAD, alive, read_line, wait_gone

# Every case's loaders run in a fresh child interpreter that never imports torch (no torch
# output, pin_memory or generator here): the same with or without torch installed.
pytestmark = pytest.mark.torch_free

ROOT = Path(__file__).resolve().parents[1]
CHILD_CODE = "from tests.faultcases import main; main()"
ALL_METHODS = ["fork", "spawn", "forkserver"]
METHODS = ["fork", "spawn"]
CHILD_TIMEOUT_S = 90
# Runs a child in a private mount namespace whose /dev/shm is a 16 MiB tmpfs (needs root).
SMALL_SHM = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"', "sh"]


@dataclass
class Child:
    rc: int
    out: str
    err: str
    elapsed: float
    data: dict[str, Any] = field(default_factory=dict)
    exited_at: float = 0.0  # time.monotonic() when the child had exited
    t_end: float | None = None  # time.monotonic() at the end of the child's script


def _command(case: str, kwargs: dict[str, Any]) -> list[str]:
    return [sys.executable, "-c", CHILD_CODE, case, json.dumps(kwargs)]


def _env(backend: str | None = None) -> dict[str, str]:
    """The child's environment; ``backend`` pins its ring backend (SHMLOADER_SHM_BACKEND)
    for cases whose subject is the posix segment in /dev/shm."""
    env = dict(os.environ)
    if backend is not None:
        env["SHMLOADER_SHM_BACKEND"] = backend
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _parse(rc: int, out: str, err: str, elapsed: float, exited_at: float) -> Child:
    child = Child(rc, out, err, elapsed, exited_at=exited_at)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            child.data = json.loads(line[len("RESULT ") :])
        elif line.startswith("T_END "):
            child.t_end = float(line.split()[1])
    return child


def run_case(
    case: str,
    timeout: float = CHILD_TIMEOUT_S,
    prefix: list[str] | None = None,
    backend: str | None = None,
    **kwargs: Any,
) -> Child:
    """Run scenario ``case`` of tests/faultcases.py in a child (``backend``: its ring
    backend, default the loader's); its result and timings."""
    t0 = time.monotonic()
    proc = subprocess.run(
        (prefix or []) + _command(case, kwargs),
        cwd=ROOT,
        env=_env(backend),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    exited_at = time.monotonic()
    return _parse(proc.returncode, proc.stdout, proc.stderr, exited_at - t0, exited_at)


def assert_clean(child: Child, pids: list[int] = ()) -> dict[str, Any]:
    """The child ran its scenario without crashing and left nothing; returns its data."""
    data = child.data
    assert child.rc == 0, (
        f"child exited with {child.rc}\nstdout:\n{child.out[-3000:]}\nstderr:\n{child.err[-3000:]}"
    )
    assert data, f"no result from the child\nstderr:\n{child.err[-3000:]}"
    assert "crash" not in data, data["crash"]
    assert data.get("leftover_children", []) == [], data
    assert data.get("leftover_fds", []) == [], data
    assert data.get("leftover_mappings", []) == [], data
    assert wait_gone(list(pids), 2.0) == [], "workers outlived the consumer"
    return data


def shm_used_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


# --------------------------------------------------------------------------- 1. death


@pytest.mark.parametrize("method", ALL_METHODS)
def test_worker_death(method, tmp_path):
    """SIGKILL, segfault and os._exit(3) mid-epoch, map-style and iterable, persistent
    on and off (faultcases.case_death: which of them under which start method):
    WorkerDiedError within 1 s naming worker, pid and cause; the other workers are
    reaped before the error reaches the consumer."""
    child = run_case("death", method=method, tmp=str(tmp_path))
    data = assert_clean(child, [p for c in child.data.get("cases", []) for p in c["pids"]])
    assert len(data["cases"]) == (12 if method == "fork" else 6)
    for case in data["cases"]:
        label = f"{case['kind']} persistent={case['persistent']} {case['mode']}"
        err = case["error"]
        assert err is not None, f"{label}: no error, {case['batches']} batches"
        assert err["type"] == "WorkerDiedError" and "RuntimeError" in err["mro"], (label, err)
        assert case["latency_s"] < 1.0, (label, case["latency_s"])
        assert err["worker_id"] == case["crashed_worker"], (label, err)
        assert err["pid"] == case["crashed_pid"], (label, err)
        msg = err["msg"]
        assert f"worker {case['crashed_worker']} " in msg and f"pid {case['crashed_pid']}" in msg, msg
        expected = {
            "sigkill": ("SIGKILL", -9),
            "segv": ("SIGSEGV", -11),
            "exit3": ("exited unexpectedly with exit code 3", 3),
        }
        text, code = expected[case["mode"]]
        assert text in msg and err["exitcode"] == code, (label, msg)
        if case["mode"] == "sigkill":
            assert "out-of-memory" in msg, msg
        assert case["running_after_error"] == [], (label, "workers still running after the error")
        if case["persistent"]:
            assert case["full_epochs_before"] == 1


# The batches of the idle-death cases' epochs (8 samples in batches of 2, in order; the
# iterable dataset's 2 shards are 0, 2, 4, 6 and 1, 3, 5, 7, taken in turn).
IDLE_EPOCH = {"map": [[0, 1], [2, 3], [4, 5], [6, 7]], "iter": [[0, 2], [1, 3], [4, 6], [5, 7]]}


@pytest.mark.parametrize("point", IDLE_POINTS)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_idle_worker_death(method, point):
    """Deaths at every point of an epoch, idle included (issue 27): a worker SIGKILLed
    while it has no batch to load (persistent workers between epochs, map and iterable;
    mid-epoch with no batch left for it; after the epoch's last batch, before the next()
    that ends it). Without max_worker_restarts: a WorkerDiedError at the next next(),
    within 1 s, with timeout=0 as with a timeout, naming the worker, its pid, SIGKILL and
    that it was idle (never a wait for it, nor a timeout naming it busy). With one restart
    allowed: the worker is replaced (a WorkerRestartWarning naming it) and both epochs
    are exactly the undisturbed ones."""
    child = run_case("idle_death", method=method, point=point)
    data = assert_clean(child, [p for r in child.data.get("runs", []) for p in r["pids"]])
    expected = IDLE_EPOCH["iter" if point.endswith("_iter") else "map"]
    for run in data["runs"]:
        label = {k: run[k] for k in ("point", "persistent", "restarts", "timeout")}
        assert run["victim_gone"], (label, "the SIGKILLed worker still ran 5 s later")
        wid, pid = run["victim"], run["killed_pid"]
        if run["restarts"]:
            assert run["error"] is None, (label, run["error"])
            assert run["epochs"] == [expected, expected], label
            assert run["worker_restarts"] == 1, label
            [warning] = run["restart_warnings"]
            assert f"worker {wid} (pid {pid})" in warning and "SIGKILL" in warning, (label, warning)
            assert "while idle" in warning, (label, warning)
            continue
        err = run["error"]
        assert err is not None, (label, "no error", run["epochs"])
        assert err["type"] == "WorkerDiedError", (label, err)
        assert (err["worker_id"], err["pid"], err["exitcode"]) == (wid, pid, -9), (label, err)
        msg = err["msg"]
        assert f"pid {pid}" in msg and f"worker {wid} while idle" in msg and "SIGKILL" in msg, (label, msg)
        assert "busy" not in msg and "timed out" not in msg, (label, msg)
        assert run["latency_s"] < 1.0, (label, run["latency_s"])
        # Raised in the epoch where the worker died (before its end), or, between epochs,
        # at the next epoch's first next().
        if point.startswith("between_epochs"):
            assert run["epochs"] == [expected, []], (label, run["epochs"])
        else:
            assert len(run["epochs"]) == 1 and run["epochs"][0] == expected[: len(run["epochs"][0])], label


# --------------------------------------------------------------------------- 2. consumer dies


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["busy", "blocked"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_consumer_sigkilled(method, mode):
    """SIGKILL the consumer while workers sleep in __getitem__ over a 64 MiB ring
    ('busy'), or while they are blocked sending a 16 MiB result ('blocked'): every worker
    exits within 2 s and the ring's memory is freed: no process on the machine maps it
    or holds a descriptor of it any more (the kernel frees an unlinked segment or a memfd
    then), and no /dev/shm file ever existed. (Default backend: memfd on Linux.)"""
    shm_before = set(os.listdir("/dev/shm"))
    used_before = shm_used_bytes()
    proc = subprocess.Popen(
        _command("victim", {"method": method, "mode": mode}),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = read_line(proc, "READY", 30)
        pids = json.loads(line.split(" ", 1)[1])
        time.sleep(0.5)  # let the workers get busy / fill the socket
        assert all(alive(p) for p in pids)
        segment = f"shmloader-{proc.pid}-"  # /dev/shm/shmloader-... or /memfd:shmloader-...
        holders = _segment_holders(segment)
        if mode == "busy":  # the ring exists: the consumer and every worker map it
            assert set(holders) >= {proc.pid, *pids}, holders
            assert sum(holders.values()) >= 64 * 2**20
        helpers = [c.pid for c in psutil.Process(proc.pid).children() if c.pid not in pids]
        used_alive = shm_used_bytes()
        proc.kill()
        t_kill = time.monotonic()
        proc.wait(10)
        left = wait_gone(pids, 2.0)
        took = time.monotonic() - t_kill
        assert left == [], f"workers {left} still running 2 s after the consumer was killed"
        assert _segment_holders(segment) == {}, "a process still maps the dead consumer's ring"
        # (Entries of other processes on a shared machine, e.g. torch_PID_..., are not ours.)
        ours = (f"shmloader-{proc.pid}-", *(f"_{p}_" for p in [proc.pid, *pids]))
        assert {n for n in set(os.listdir("/dev/shm")) - shm_before if any(o in n for o in ours)} == set()
        # /dev/shm's use is machine-wide (other test runs may allocate meanwhile): reported,
        # not asserted; the holders check above is the proof.
        deadline = time.monotonic() + 2
        while shm_used_bytes() > used_before + 16 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.05)
        print(
            f"{method}/{mode}: workers gone {took:.2f} s after the consumer's SIGKILL; /dev/shm "
            f"used {used_before >> 20} MiB before, {used_alive >> 20} MiB with the ring, "
            f"{shm_used_bytes() >> 20} MiB after"
        )
        # The fork server (forkserver) and resource tracker exit with their client.
        assert wait_gone(helpers, 5.0) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


def _segment_holders(prefix: str) -> dict[int, int]:
    """Processes that map or hold a descriptor of a segment whose name contains ``prefix``
    (a posix name or a memfd label): pid -> bytes mapped."""
    holders: dict[int, int] = {}
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if prefix in line:
                        lo, hi = line.split()[0].split("-")
                        holders[pid] = holders.get(pid, 0) + int(hi, 16) - int(lo, 16)
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # the process is gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    holders.setdefault(pid, 0)
            except OSError:  # closed meanwhile: not held
                pass
    return holders


# --------------------------------------------------------------------------- 3. exceptions


@pytest.mark.parametrize("method", METHODS)
def test_exceptions_are_reraised(method):
    data = assert_clean(run_case("exceptions", method=method))
    # __getitem__: as torch, one error per bad batch, and iteration goes on after it.
    for key in ("getitem-p0-e0", "getitem-p1-e0", "getitem-p1-e1"):
        sub = data[key]
        assert [e["indices"] for e in sub["errors"]] == [[0, 1, 2, 3], [16, 17, 18, 19]], key
        for e in sub["errors"]:
            assert e["type"] == "ValueError" and e["worker_id"] in (0, 1)
            assert "__getitem__" in e["worker_traceback"] and "bad sample" in e["worker_traceback"]
            assert "bad sample" in e["msg"] and "sample indices" in e["msg"]
        good = [list(range(k, k + 4)) for k in range(0, 40, 4) if k not in (0, 16)]
        assert sub["got"] == good, key
    for key, type_name, text in (
        ("iter", "KeyError", "no such shard"),
        ("worker_init_fn", "ZeroDivisionError", "init of worker 1 failed"),
        ("collate_fn", "AttributeError", "collate cannot handle"),
        ("sampler", "LookupError", "sampler failed at position 9"),
        ("unrebuildable", "WorkerError", "checksum mismatch"),
    ):
        sub = data[key]
        err = sub["error"]
        assert err is not None and err["type"] == type_name, (key, err)
        assert text in err["msg"], (key, err["msg"])
        assert sub["left"] == [], (key, "workers outlived the iterator")
        if key != "sampler":  # the sampler runs in the consumer: its own traceback
            assert text in err["worker_traceback"], key
            assert err["worker_id"] == (1 if key == "worker_init_fn" else 0), (key, err)
    assert data["collate_fn"]["error"]["indices"] == [8, 9, 10, 11]
    assert data["unrebuildable"]["error"]["indices"] == [0, 1]
    assert "BadShard" in data["unrebuildable"]["error"]["msg"]
    assert "RuntimeError" in data["unrebuildable"]["error"]["mro"]


# --------------------------------------------------------------------------- 4. early exit


@pytest.mark.parametrize("kind", ["map", "iter"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_early_exit(method, kind):
    """break after 1 batch and after half an epoch: the workers stop at once (gone under
    3 s from the break, where a stop that waited for JOIN_TIMEOUT_S would take 5); then
    exit the interpreter with an iterator still referenced and a persistent loader's
    iterator alive: exit code 0, under 3 s, nothing left."""
    child = run_case("early_exit", method=method, kind=kind)
    data = assert_clean(child, child.data.get("exit_pids", []))
    assert child.err.strip() == "", child.err
    for key in ("break1", "half"):
        assert data[key]["left"] == [], key
        assert data[key]["close_s"] < 3.0, (key, data[key])
    exit_s = child.exited_at - child.t_end
    assert exit_s < 3.0, f"the interpreter took {exit_s:.2f} s to exit"


# --------------------------------------------------------------------------- 5. churn


CHURN_ITERATORS = 200


@pytest.mark.slow
def test_churn_stays_flat():
    """200 iterators read for 3 batches and dropped, on one loader then on fresh
    loaders: processes, descriptors, ring mappings and RSS stay flat. (A leaked process,
    descriptor or mapping shows after one iterator; RSS may grow by under 32 KiB an
    iterator, 6.4 MiB in all: what 16 MiB over 500 iterators allowed. Measured growth: 0
    to 4 KiB in all.)"""
    child = run_case("churn", timeout=150, method="fork", iterators=CHURN_ITERATORS)
    data = assert_clean(child)
    for phase in ("one_loader", "fresh_loaders"):
        before, after = data[phase]["before"], data[phase]["after"]
        print(f"churn {phase}: before {before} after {after}")
        assert after["processes"] == before["processes"] == 0, phase
        assert after["fds"] == before["fds"], phase
        assert after["ring_mapped_bytes"] == before["ring_mapped_bytes"], phase
        assert after["rss"] - before["rss"] < CHURN_ITERATORS * 32 * 2**10, phase
    print(f"churn: {data['elapsed_s']:.1f} s for 2 x {CHURN_ITERATORS + 20} iterators")


# --------------------------------------------------------------------------- 6. held batches


@pytest.mark.parametrize("method", METHODS)
def test_held_batches(method):
    """10,000 batches kept alive (ring of 16 slots): no hang, values correct, and one
    descriptor for the ring whatever happens once every slot is held (the core issue's
    rule: the ring grows, or batches come by copy with at most one RuntimeWarning)."""
    data = assert_clean(run_case("held", method=method, backend="posix"))
    print(
        f"held {method}: {data['iterate_s']:.2f} s, final ring {data['final_num_slots']} slots, "
        f"{data['views']} batches in it, pinned {data['pinned_shm_bytes']} bytes, "
        f"fds {data['fd_counts']}"
    )
    assert data["values_ok"]
    assert len(data["fd_counts"]) == 1, data["fd_counts"]  # no descriptor growth
    assert data["ring_fds"] == 1
    assert len(data["warnings"]) <= 1, data["warnings"]
    assert data["iterate_s"] < 20


# --------------------------------------------------------------------------- 7. timeout


@pytest.mark.parametrize("method", METHODS)
def test_timeout(method):
    child = run_case("timeout", method=method)
    data = assert_clean(child, child.data.get("pids", []))
    err = data["error"]
    assert "TimeoutError" in err["mro"], err
    assert 0.9 <= data["waited_s"] < 2.0, data["waited_s"]
    assert "batch 2" in err["msg"] and "sample indices [4, 5]" in err["msg"], err["msg"]
    busy = [p for p in data["pids"] if f"(pid {p})" in err["msg"]]
    assert len(busy) == 1, err["msg"]
    assert data["running_after"] == [] and sorted(data["reaped"]) == sorted(data["pids"])


@pytest.mark.timeout(120)
def test_worker_stuck_in_its_fork_is_replaced(tmp_path):
    """A forked worker stuck before running any of its code (a lock copied locked) is
    killed and replaced after the start deadline; the epoch yields every batch, in order,
    map-style and iterable (whose shard the new worker starts, as the stuck one would
    have)."""
    child = run_case("stuck_in_fork", method="fork", tmp=str(tmp_path), every=False, kinds=["map", "iter"])
    data = assert_clean(child, child.data.get("pids", []))
    expected = {
        "map": [[[i] * 4, [i + 1] * 4] for i in range(0, 20, 2)],
        # Stream: worker w yields w, w+2, ...; batches alternate between the workers.
        "iter": [[[b + 4 * (k // 2) + (k % 2)] * 4 for b in (0, 2)] for k in range(10)],
    }
    for kind, got in data["kinds"].items():
        assert got["error"] is None, (kind, got["error"])
        assert got["batches"] == expected[kind], kind
        assert not got["token_left"], kind  # (a child did take the lock)
        stuck = [w for w in got["warnings"] if "stuck in its fork" in w]
        assert len(stuck) == 1, (kind, got["warnings"])
        assert "none of its code ran within 1 s" in stuck[0] and "gh-112275" in stuck[0], stuck[0]
        assert "not counted in max_worker_restarts" in stuck[0], stuck[0]
        assert "WorkerRestartWarning" in got["categories"], kind
        assert 0.8 <= got["elapsed_s"] < 15, (kind, got["elapsed_s"])  # (the deadline runs from the fork)


@pytest.mark.timeout(120)
def test_workers_stuck_in_every_fork_raise(tmp_path):
    """Every fork stuck: after a few replacements the iterator stops and raises
    WorkerStartError (a WorkerDiedError) naming the remedy; nothing is left running."""
    child = run_case("stuck_in_fork", method="fork", tmp=str(tmp_path), every=True, kinds=["map"])
    data = assert_clean(child, child.data.get("pids", []))
    got = data["kinds"]["map"]
    err = got["error"]
    assert err is not None and "WorkerStartError" in err["mro"] and "WorkerDiedError" in err["mro"], err
    assert "multiprocessing_context='forkserver'" in err["msg"], err["msg"]
    assert got["batches"] == []
    assert len([w for w in got["warnings"] if "stuck in its fork" in w]) == 3, got["warnings"]
    assert got["elapsed_s"] < 20, got["elapsed_s"]


# --------------------------------------------------------------------------- 8. Ctrl-C


def _sigint_as_a_fresh_process() -> None:
    """In the child before exec: SIGINT default and unblocked, as in a user's shell, so
    the case tests the loader's Ctrl-C handling, not what the test process inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.parametrize("method", ALL_METHODS)
def test_ctrl_c(method):
    """SIGINT to the whole process group mid-epoch: one KeyboardInterrupt in the
    consumer, no traceback from any worker, nothing left."""
    # How this test process receives SIGINT, for the failure message: a child inherits an
    # ignored SIGINT and a blocked mask across exec, which a full run has been seen to
    # give it (the child then ran its whole epoch), though no subset reproduced it.
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    here = (str(signal.getsignal(signal.SIGINT)), blocked)
    proc = subprocess.Popen(
        _command("interrupted", {"method": method}),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_sigint_as_a_fresh_process,
    )
    try:
        line = read_line(proc, "READY", 30)
        pids = json.loads(line.split(" ", 1)[1])
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    child = _parse(proc.returncode, out, err, 0.0, time.monotonic())
    data = assert_clean(child, pids)
    assert data["interrupts"] == 1, (here, data.get("sigint"), data["batches"], err[-3000:])
    assert data["left"] == []
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


# --------------------------------------------------------------------------- 9. /dev/shm full


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.parametrize("method", METHODS)
def test_dev_shm_too_small(method):
    """A 64 MiB ring in a 16 MiB /dev/shm (private mount namespace): a clear
    ShmSpaceError (a MemoryError) naming the bytes and the remedies; no SIGBUS."""
    if not _can_mount_tmpfs():
        pytest.skip("cannot mount a private tmpfs on /dev/shm here (needs root and unshare)")
    data = assert_clean(run_case("shm_small", prefix=SMALL_SHM, method=method, backend="posix"))
    assert data["shm_size"] == 16 * 2**20
    for key in ("fixed", "sized"):
        sub = data[key]
        err = sub["error"]
        # ShmSpaceError (posix_fallocate: ENOSPC) or RingLimitError (the default
        # max_shm_bytes, half of /dev/shm's free space): both MemoryError.
        assert err is not None and "MemoryError" in err["mro"] and "ShmLoaderError" in err["mro"], (
            key,
            err,
        )
        msg = err["msg"]
        assert "needs" in msg and "bytes" in msg and "--shm-size" in msg and "--ipc=host" in msg, msg
        assert "num_slots" in msg, msg
        assert sub["shm_entries"] == [], (key, "a partial file was left")
        assert sub["left"] == [], key
        # Sized from the first batch: the workers' first batches (each in a segment of its
        # own) are handed out while the ring is made on a thread (ringmaker), and the error
        # comes when the consumer needs the ring.
        assert (sub["batches"] == 0) if key == "fixed" else (1 <= sub["batches"] <= 2), (key, sub)
    assert data["fixed"]["stage"] == "construction"  # slot_bytes given: the ring is made at once
    assert str(ring_bytes(8, 8 * 2**20)) in data["fixed"]["error"]["msg"]


# --------------------------------------------------------------------------- 10. bad input


@pytest.mark.parametrize("method", METHODS)
def test_bad_input(method):
    data = assert_clean(run_case("bad_input", method=method))
    expect = {
        "ragged": ("BatchLayoutError", ["(4, 2)", "(3, 2)", "sample index 5"]),
        "dtype": ("BatchLayoutError", ["<U1", "float32", "sample index 6"]),
        # BatchTypeError: a BatchLayoutError that is also a TypeError, as torch raises here
        "object": ("BatchTypeError", ["dtype object"]),
        "none": ("BatchLayoutError", ["None", "sample index 2"]),
        "too_big": ("BatchLayoutError", ["slot_bytes", "8192", "batch 3"]),
        "len_raises": ("TypeError", ["no length"]),
        "sampler_out_of_range": ("IndexError", ["99", "out of range"]),
    }
    if method != "fork":
        remedy = ["'spawn'", "module level", "multiprocessing_context='fork'"]
        expect["lambda_collate"] = ("TypeError", ["lambda", *remedy])
        expect["local_dataset"] = ("TypeError", ["Local", *remedy])
    for key, (type_name, texts) in expect.items():
        sub = data[key]
        err = sub["error"]
        assert err is not None and err["type"] == type_name, (key, err)
        for text in texts:
            assert text in err["msg"], (key, text, err["msg"])
        assert sub["elapsed_s"] < 10, key
        assert sub["left"] == [], key


@pytest.mark.parametrize(("method", "backend"), [("fork", None), ("spawn", None), ("fork", "posix")])
def test_stray_bytes_on_a_worker_socket_raise_a_protocol_error_naming_it(method, backend):
    """A real worker's socket gets bytes that are no frame (its dataset writes them to the
    descriptor, as a library writing to a number it no longer owns would): the consumer
    raises CorruptDataError naming the worker, at once (bytes sent with the epoch's last
    batch: when a wait reads that socket, else as the epoch ends), and leaves no process,
    descriptor, mapping or /dev/shm name behind (posix: the ring's names in /dev/shm)."""
    data = assert_clean(run_case("stray_bytes", method=method, backend=backend))
    # (Batch 4 of 2 workers in turn is worker 0's, the last one, batch 29, worker 1's.)
    for name, worker in (("minus_four", 0), ("huge", 0), ("at_the_end", 1)):
        sub = data[name]
        err = sub["error"]
        assert err is not None and err["type"] == "CorruptDataError", (name, err)
        assert "ValueError" in err["mro"] and "ShmLoaderError" in err["mro"]
        assert f"worker {worker} sent bytes that are not a frame" in err["msg"], (name, err["msg"])
        assert sub["elapsed_s"] < 10, (name, sub)
        assert sub["left"] == [], name


# --------------------------------------------------------------------------- 11. fork


@pytest.mark.parametrize("method", METHODS)
def test_consumer_forks(method):
    """os.fork() while an iterator is alive; the copy exits normally (running atexit):
    the original's epoch goes on undisturbed, no hang, no error at either exit."""
    child = run_case("fork_consumer", method=method)
    data = assert_clean(child, child.data.get("pids", []))
    assert data["copy_exit"] == 0
    assert data["values_ok"]
    assert "Traceback" not in child.err and "Exception ignored" not in child.err, child.err


# --------------------------------------------------------------------------- 12. two loaders


@pytest.mark.parametrize("method", METHODS)
def test_two_loaders_interleaved(method):
    data = assert_clean(run_case("two_loaders", method=method))
    assert data["a_ok"] and data["b_ok"]


@pytest.mark.parametrize("method", METHODS)
def test_two_processes(method):
    procs = [
        subprocess.Popen(
            _command("solo", {"method": method, "n": n}),
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (50, 70)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        data = assert_clean(_parse(proc.returncode, out, err, 0.0, 0.0))
        assert data["ok"]


# --------------------------------------------------------------------------- security


@pytest.mark.parametrize("method", METHODS)
def test_segment_is_private(method):
    """Mode 0600, O_EXCL: a name someone created beforehand is never used (a new random
    name is drawn), nobody can open the segment by name, and every name taken is a
    clear error."""
    data = assert_clean(run_case("security", method=method, backend="posix"))
    created = data["created"]
    assert len(created) == 1 and created[0]["mode"] == 0o600
    assert created[0]["name"].endswith("-" + "11" * 8), "the squatted name was not skipped"
    assert data["ring_ino"] == created[0]["ino"] != data["squat_ino"]
    assert data["ring_link"].endswith("(deleted)")
    assert data["squat_content"] == "attacker" and data["squat_still_there"]
    assert data["probe"] == [f"ABSENT {created[0]['name']}"]
    assert data["batches_ok"]
    err = data["all_taken_error"]
    assert err["type"] == "FileExistsError" and "taken" in err["msg"]


@pytest.mark.parametrize("method", METHODS)
def test_segment_unlinked_before_workers_start(method):
    data = assert_clean(run_case("unlinked_before_start", method=method))
    assert data["names_seen_by_workers"] == [""]


# --------------------------------------------------------------------------- leases (issue 12)


@pytest.mark.parametrize("method", METHODS)
def test_every_object_reachable_from_a_batch_keeps_its_memory_mapped(method):
    """batch.base.base, kept after the ring grew and retired: reading it was a SIGSEGV."""
    data = assert_clean(run_case("base_outlives_ring", method=method))
    assert data["first_ring"] and data["rings_created"] >= 2 and data["read"], data


@pytest.mark.parametrize("method", METHODS)
def test_dev_shm_full_while_the_ring_grows_closes_the_iterator(method):
    """ShmSpaceError from a growth mid-epoch leaves the iterator closed and its workers
    reaped, as RingLimitError does (it left them running)."""
    if not _can_mount_tmpfs():
        pytest.skip("cannot mount a private tmpfs on /dev/shm here (needs root and unshare)")
    data = assert_clean(run_case("shm_full_mid_epoch", prefix=SMALL_SHM, method=method, backend="posix"))
    err = data["error"]
    assert err is not None and err["type"] == "ShmSpaceError", data
    assert "--shm-size" in err["msg"] and "num_slots" in err["msg"], err
    assert data["batches"] >= 4, data
    assert data["closed"] and data["running"] == [] and data["after"] == "'end'", data


# --------------------------------------------------------------------------- frames over a socket buffer


def _wide_error(err, batch: int) -> None:
    assert err is not None and err["type"] == "ValueError", err
    assert f"sample {batch * 65_536 + 7} is bad" in err["msg"], err["msg"]
    assert f"batch {batch} " in err["msg"] and "(+65528 more)" in err["msg"], err["msg"]


@pytest.mark.parametrize("method", METHODS)
def test_big_task_and_big_error_do_not_deadlock(method):
    """batch_size=65536 and a sample that raises: the consumer used to block writing a
    512 KiB task to a worker blocked writing its error (65,536 indices) back. The
    error reaches the consumer."""
    child = run_case("big_frames", timeout=60, method=method, scenario="raises")
    data = assert_clean(child, child.data.get("pids", []))
    assert data["got"][:2] == [[0, 65_535, 65_536], [65_536, 131_071, 65_536]]
    _wide_error(data["error"], 2)


@pytest.mark.parametrize("method", METHODS)
def test_timeout_fires_while_a_big_task_waits_for_a_hung_worker(method):
    """Worker 0 hangs in batch 2 and does not read the 512 KiB task queued after it: the
    consumer's write used to block for ever; timeout=5 fires."""
    child = run_case("big_frames", timeout=60, method=method, scenario="hang")
    data = assert_clean(child, child.data.get("pids", []))
    err = data["error"]
    assert err is not None and "TimeoutError" in err["mro"], data
    assert "batch 2" in err["msg"], err["msg"]
    assert [g[0] for g in data["got"][:2]] == [0, 65_536]
    assert data["left"] == []


@pytest.mark.parametrize("method", METHODS)
def test_big_results_and_big_tasks_both_ways_keep_the_stream_whole(method):
    """Workers write big errors while the consumer has big tasks to send, batch after
    batch; the loop catches each error and goes on: every batch comes, in order, the
    bad ones as their own errors (no frame lost or cut)."""
    child = run_case("big_frames", timeout=60, method=method, scenario="continue")
    data = assert_clean(child, child.data.get("pids", []))
    got = data["got"]
    assert len(got) == 8, got
    for b, item in enumerate(got):
        if b in WIDE_BAD:
            _wide_error(item, b)
        else:
            assert item == [b * 65_536, b * 65_536 + 65_535, 65_536], (b, item)
