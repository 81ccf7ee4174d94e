"""Where the loader runs (issue 14): real environments, each made for one child process.

Each case runs tests/environments.py's child script (a 2-worker loader over an in-memory
numpy dataset, one full epoch, every batch checked against the dataset) in a child
placed in the environment, with its own deadline, and asserts the child's result and
returncode: it works, or it raises a clear error that names the cause and the remedy.
Mechanisms the machine refuses (mount namespaces, cgroups, seccomp) skip with the reason.

Where the loader offers ``shm_backend`` (the memfd backend), the default backend must
simply work in every environment here: a memfd ring does not live in /dev/shm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from typing import Any

import psutil
import pytest

from .environments import (
    BATCH,
    NO_SHM,
    READONLY_SHM,
    SMALL_SHM,
    Child,
    MemoryCgroup,
    child_env,
    command,
    refuses,
    run_child,
    seccomp_refused,
)
from .faultcases import alive, read_line, wait_gone

# The loaders run in child interpreters that never import torch (the one case that
# compares with torch's DataLoader is tests/test_where_torch_works.py).
pytestmark = pytest.mark.torch_free

ALL_METHODS = ["fork", "spawn", "forkserver"]
MiB = 2**20
SHM_SIZE = 64 * MiB


def _need(prefix: list[str]) -> None:
    why = refuses(prefix)
    if why:
        pytest.skip(why)


def _memfd_default(child: Child) -> bool:
    """Whether this loader has the memfd backend (the ``shm_backend`` argument)."""
    return bool(child.data.get("backend_arg"))


def _names_size(text: str, n: int) -> bool:
    """``text`` states the byte count ``n`` (in bytes, MiB or GiB)."""
    forms = {str(n), f"{n / 2**20:.1f} MiB", f"{n / 2**20:.0f} MiB", f"{n / 2**30:.1f} GiB"}
    return any(f in text for f in forms)


def _first_sentence(msg: str) -> str:
    return re.split(r"(?<=[.:])\s", msg, maxsplit=1)[0]


def _is_loader_memory_error(err: dict[str, Any]) -> None:
    assert "ShmLoaderError" in err["mro"] and "MemoryError" in err["mro"], err


def _ring_total(ring: dict[str, Any] | None) -> int | None:
    return None if not ring else ring["num_slots"] * ring["slot_bytes"]


# --------------------------------------------------------------------------- 1. Docker's 64 MiB


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_docker_default_shm(dtype):
    """A private 64 MiB tmpfs on /dev/shm (Docker's default), 9.6 MB (uint8) and 38 MB
    (float32) batches, 2 workers, default settings: the epoch completes."""
    _need(SMALL_SHM)
    child = run_child({"dtype": dtype, "backend": "auto"}, prefix=SMALL_SHM, timeout=30)
    assert child.data.get("shm", {}).get("size") == SHM_SIZE, child.why()
    assert child.worked(), f"the default settings fail where torch works: {child.data['error']}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_docker_default_shm_posix(dtype):
    """The same with the POSIX backend forced (the only one before memfd): a smaller ring
    that fits, with one warning; or an error whose first words name /dev/shm's size, and
    that names the remedy (docker --shm-size / --ipc=host)."""
    _need(SMALL_SHM)
    child = run_child({"dtype": dtype, "backend": "posix"}, prefix=SMALL_SHM, timeout=30)
    d = child.data
    if child.worked():
        total = _ring_total(d.get("ring_end"))
        if total is not None:
            assert total <= SHM_SIZE, d
        shm_warnings = [w for w in d["warnings"] if "/dev/shm" in w]
        assert len(shm_warnings) == 1, d["warnings"]
        return
    err = d["error"]
    _is_loader_memory_error(err)
    first = _first_sentence(err["msg"])
    assert "/dev/shm" in first and _names_size(first, SHM_SIZE), (
        f"the error's first words must name /dev/shm's size: {err['msg']!r}"
    )
    assert "--shm-size" in err["msg"] and "--ipc=host" in err["msg"], err["msg"]
    assert d["batches"] <= 1, d  # at construction, or with the first batch


# --------------------------------------------------------------------------- 2. no / read-only /dev/shm


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_no_dev_shm(method):
    """No /dev/shm at all (a fresh /dev without it): the memfd backend needs none, and
    neither do multiprocessing's start methods (no semaphore: sockets and pipes only)."""
    _need(NO_SHM)
    child = run_child({"method": method, "backend": "auto"}, prefix=NO_SHM, timeout=30)
    assert "FileNotFoundError" in child.data.get("shm", {}).get("error", ""), child.why()
    if child.worked():
        return
    err = child.data["error"]
    assert not _memfd_default(child), f"the memfd backend needs no /dev/shm: {err}"
    _assert_names_dev_shm_remedy(err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "where, prefix", [("none", NO_SHM), ("read-only", READONLY_SHM)], ids=["none", "read-only"]
)
def test_posix_without_a_writable_dev_shm(where, prefix):
    """The POSIX backend forced where /dev/shm is missing or read-only: an error at
    construction or with the first batch that names /dev/shm and what to do."""
    _need(prefix)
    child = run_child({"backend": "posix"}, prefix=prefix, timeout=30)
    assert not child.worked(), f"/dev/shm is {where}: how did a POSIX ring work? {child.data}"
    _assert_names_dev_shm_remedy(child.data["error"])
    if where == "read-only":  # the cause, not a size: 64 MiB free says nothing here
        assert "read-only" in child.data["error"]["msg"], child.data["error"]
    assert child.data["batches"] <= 1, child.data


@pytest.mark.timeout(60)
def test_readonly_dev_shm():
    """A read-only tmpfs on /dev/shm, default settings: works (memfd)."""
    _need(READONLY_SHM)
    child = run_child({"backend": "auto"}, prefix=READONLY_SHM, timeout=30)
    assert child.data.get("shm", {}).get("readonly") is True, child.why()
    if child.worked():
        return
    err = child.data["error"]
    assert not _memfd_default(child), f"the memfd backend needs no /dev/shm: {err}"
    _assert_names_dev_shm_remedy(err)
    assert "read-only" in err["msg"], f"the error must name the cause: {err['msg']}"


def _assert_names_dev_shm_remedy(err: dict[str, Any]) -> None:
    assert "ShmLoaderError" in err["mro"], err
    msg = err["msg"]
    assert "/dev/shm" in msg, msg
    assert "names were all taken" not in msg, f"the error blames the wrong cause: {msg}"
    assert any(r in msg for r in ("memfd", "--shm-size", "--ipc=host", "mount")), msg


# --------------------------------------------------------------------------- 3. ulimit -n 64


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_ulimit_n_64(method):
    """RLIMIT_NOFILE lowered to 64 before the loader: the epoch completes (the ring is
    one descriptor, however many batches), or the error names ulimit -n."""
    child = run_child({"method": method, "nofile": 64, "backend": "auto"}, timeout=30)
    assert child.data.get("nofile") == 64, child.why()
    if not child.worked():
        assert "ulimit -n" in child.data["error"]["msg"], child.data["error"]


# --------------------------------------------------------------------------- 4. prctl refused


def _need_seccomp() -> None:
    why = seccomp_refused()
    if why:
        pytest.skip(why)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pdeathsig_refused(method):
    """A seccomp filter (inherited by every worker) fails prctl(PR_SET_PDEATHSIG) with
    EPERM, as some container profiles do: the epoch completes, without a warning.
    (forkserver workers never arm the signal: their parent is the fork server.)"""
    _need_seccomp()
    child = run_child({"method": method, "seccomp": "pdeathsig"}, timeout=30)
    assert child.data.get("seccomp") == "pdeathsig", child.why()
    assert child.worked(), child.data["error"]
    assert child.data["warnings"] == [], child.data["warnings"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pdeathsig_refused_workers_die_with_the_consumer(method):
    """prctl refused, workers busy in a 20 s __getitem__: SIGKILL the consumer, and
    every worker exits within 3 s (its lifeline: EOF on its socket)."""
    _need_seccomp()
    args = {
        "method": method,
        "seccomp": "pdeathsig",
        "announce": True,
        "batch_size": 2,
        "samples": 40,
        "sleep_s": 20.0,
        "sleep_from": 4,  # the first batch of each worker is quick, then each sample sleeps
        "dtype": "uint8",
    }
    proc = subprocess.Popen(
        command(args),
        env=child_env(),
        cwd=os.getcwd(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        line = read_line(proc, "READY ", 30)
        reported = json.loads(line.split(" ", 1)[1])
        workers = [c.pid for c in psutil.Process(proc.pid).children() if c.pid in reported]
        assert sorted(workers) == sorted(reported) and len(workers) == 2, (reported, workers)
        for pid in workers:  # the filter reached them: their prctl was refused
            assert _seccomp_mode(pid) == 2, pid
        time.sleep(0.3)  # let them enter the long __getitem__
        assert all(alive(p) for p in workers)
        proc.kill()
        t_kill = time.monotonic()
        proc.wait(10)
        left = wait_gone(workers, 3.0)
        assert left == [], f"workers {left} outlived the SIGKILLed consumer by 3 s"
        print(f"{method}: workers gone {time.monotonic() - t_kill:.2f} s after the consumer's SIGKILL")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in workers:  # ours (started by our child): never leave them running
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()


def _seccomp_mode(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Seccomp:"):
                return int(line.split()[1])
    return -1


@pytest.mark.timeout(60)
def test_memfd_create_refused():
    """A seccomp filter fails memfd_create with EPERM (an old sandbox profile): the loader
    falls back to POSIX shared memory and the epoch completes. (Needs the backend's
    fallback; trivially true where memfd is never used.)"""
    _need_seccomp()
    child = run_child({"seccomp": "memfd", "backend": "auto"}, timeout=30)
    assert child.data.get("seccomp") == "memfd", child.why()
    assert child.worked(), child.data["error"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sched_setscheduler_refused(method):
    """A seccomp filter fails sched_setscheduler with EPERM (the workers cannot take the
    SCHED_BATCH policy): they run under their inherited policy, the epoch completes,
    without a warning."""
    _need_seccomp()
    child = run_child({"method": method, "seccomp": "sched"}, timeout=30)
    assert child.data.get("seccomp") == "sched", child.why()
    assert child.worked(), child.data["error"]
    assert child.data["warnings"] == [], child.data["warnings"]


# --------------------------------------------------------------------------- 5. cgroup memory limit


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "method, limit",
    [("fork", 320 * MiB), ("spawn", 320 * MiB), ("fork", 432 * MiB), ("fork", 480 * MiB)],
    ids=["fork-320MiB", "spawn-320MiB", "fork-432MiB", "fork-480MiB"],
)
def test_cgroup_memory_limit(method, limit):
    """The loader's process in a memory cgroup whose limit is below the default ring of 38
    MB batches (8 slots x 45.9 MiB = 368 MiB), 2 workers: a smaller ring (one warning) or a
    clear error naming the limit; never the OOM killer. 432 MiB is where a 4-slot ring
    would fit only by the margin (a working 4-slot epoch peaks at 437 MiB here): the
    limit at which a ring sized too early lets the OOM killer take a worker. From 480 MiB
    (torch works from 448 MiB here) the margin leaves room for 4 slots: it must work."""
    why = MemoryCgroup.refused()
    if why:
        pytest.skip(why)
    with MemoryCgroup(limit) as cg:
        child = run_child({"method": method, "dtype": "float32", "backend": "auto"}, cgroup=cg, timeout=40)
        kills = cg.oom_kills()
        child.assert_inside(cg)
    assert child.rc != -signal.SIGKILL and kills == 0, (
        f"the OOM killer struck ({kills} kills in the cgroup v{cg.version}): {child.why()}"
    )
    d = child.data
    if limit >= 480 * MiB:
        assert child.worked(), f"the margin leaves room for a 4-slot ring here: {d.get('error')}"
    if child.worked():
        total = _ring_total(d.get("ring_end"))
        if total is not None:
            assert total < limit, d
        assert len(d["warnings"]) <= 1, d["warnings"]
        return
    err = d["error"]
    _is_loader_memory_error(err)
    assert _names_size(err["msg"], limit), f"the error must name the limit: {err['msg']}"
    assert "cgroup" in err["msg"] or "memory.max" in err["msg"] or "limit_in_bytes" in err["msg"], err


@pytest.mark.timeout(60)
def test_worker_oom_killed_in_a_cgroup_names_the_limit():
    """A worker that outgrows the cgroup (it touches 400 MiB under a 320 MiB limit) is
    taken by the OOM killer: the consumer lives and its WorkerDiedError names the signal,
    the cgroup's limit and the kills the kernel counted there."""
    why = MemoryCgroup.refused()
    if why:
        pytest.skip(why)
    with MemoryCgroup(320 * MiB) as cg:
        child = run_child({"hog_at": 3 * BATCH, "hog_mb": 400}, cgroup=cg, timeout=40)
        kills = cg.oom_kills()
        child.assert_inside(cg)
    assert child.rc == 0 and kills >= 1, child.why()
    err = child.data["error"]
    assert err is not None and "WorkerDiedError" in err["mro"], child.why()
    msg = err["msg"]
    assert "SIGKILL" in msg and "memory limit" in msg and _names_size(msg, 320 * MiB), msg
    assert "OOM kill" in msg, msg
