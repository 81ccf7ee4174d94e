"""The posix backend: a share() segment workers can only read, and no name left in /dev/shm
by a process killed while it made a segment."""

from __future__ import annotations

import errno
import fcntl
import mmap
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shmloader import share
from shmloader.system import segment

from .conftest import dev_shm_to_myself

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux"),
]


def _try_to_change(fd: int) -> list[str]:
    """Every way of changing the segment behind ``fd`` that worked (none should)."""
    worked = []
    try:
        os.pwrite(fd, b"x", 0)
        worked.append("pwrite")
    except OSError:
        pass
    try:
        os.ftruncate(fd, 0)
        worked.append("ftruncate")
    except OSError:
        pass
    try:
        mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
        worked.append("mmap writable")
    except OSError:
        pass
    if os.geteuid() != 0:  # root opens any file for writing, whatever its mode
        try:
            os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
            worked.append("open /proc/self/fd for writing")
        except OSError:
            pass
    return worked


def _worker(shared, out) -> None:
    out.put((_try_to_change(shared._store.fd), list(shared[:3]), int(shared[3].sum())))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_can_only_read_a_posix_share_segment(method):
    data = [1, 2, 3, np.arange(10)]
    shared = share(data, backend="posix")
    fd = shared._store.fd
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    assert os.fstat(fd).st_mode & 0o777 == 0o400
    assert _try_to_change(fd) == []  # the creator holds no writable descriptor either
    ctx = mp.get_context(method)
    out = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(shared, out))
    proc.start()
    try:
        tried, head, total = out.get(timeout=60)
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    assert tried == []
    assert head == [1, 2, 3] and total == 45
    assert list(shared[:3]) == [1, 2, 3] and int(shared[3].sum()) == 45  # readers unharmed


def _leftovers(pids) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"shmloader-{p}-") for p in pids)]


def _unnamed_segments_work() -> bool:
    fd = segment._unnamed_segment()
    if fd is None:
        return False
    os.close(fd)
    return True


def _start_create_loop(path: str) -> int:
    """Fork a child that makes posix segments in a loop (``path``: "named", as where the
    kernel refuses O_TMPFILE, or "unnamed") and return its pid once it runs. Forked, not
    a new interpreter: 25 of those (each importing shmloader) took minutes on a loaded
    machine, and the loop needs nothing a fork lacks."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: loop until killed, never back into pytest
        try:
            os.close(ready_r)
            segment._tmpfile_refused = path == "named"
            os.write(ready_w, b"r")
            while True:
                fd, _ = segment.create("posix", explicit=True)
                os.close(fd)
        finally:
            os._exit(1)
    os.close(ready_w)
    try:
        started = os.read(ready_r, 1) == b"r"
    finally:
        os.close(ready_r)
    if not started:
        os.waitpid(pid, 0)
        raise AssertionError("the create loop's child exited before it started")
    return pid


@pytest.mark.parametrize("path", ["named", "unnamed"])
def test_a_create_loop_killed_again_and_again_leaves_nothing_after_the_sweep(path):
    """A child making posix segments in a loop, SIGKILLed 25 times at random moments:
    named segments caught between create and unlink are removed by the sweep (their
    maker is dead); unnamed ones (O_TMPFILE) never exist."""
    pids = []
    with dev_shm_to_myself():  # (its names would look like leaks to a test running beside it)
        _kill_loop_then_sweep(path, pids)


def _kill_loop_then_sweep(path: str, pids: list[int]) -> None:
    try:
        for i in range(25):
            pid = _start_create_loop(path)
            pids.append(pid)
            time.sleep(0.005 + 0.002 * (i % 10))
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
        if path == "unnamed" and _unnamed_segments_work():
            assert _leftovers(pids) == []
        left = _leftovers(pids)
        removed = segment.sweep(min_age_s=0)
        assert set(left) <= set(removed)
        assert _leftovers(pids) == []
    finally:
        for name in _leftovers(pids):  # the test's own: never left in /dev/shm
            os.unlink(os.path.join("/dev/shm", name))


def test_the_sweep_leaves_live_processes_and_young_names_alone():
    mine = f"/dev/shm/shmloader-{os.getpid()}-{'ab' * 8}"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    young = f"/dev/shm/shmloader-{int(dead.stdout)}-{'cd' * 8}"
    try:
        for path in (mine, young):
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        assert segment.sweep() == []  # a live maker; a dead one's, but just made
        assert os.path.exists(mine) and os.path.exists(young)
        assert segment.sweep(min_age_s=0) == [os.path.basename(young)]
        assert os.path.exists(mine) and not os.path.exists(young)
    finally:
        for path in (mine, young):
            try:
                os.unlink(path)
            except OSError as exc:
                assert exc.errno == errno.ENOENT


def test_a_posix_segment_has_no_name_where_the_kernel_allows_it():
    fd, kind = segment.create("posix", explicit=True)
    try:
        assert kind == "posix"
        link = os.readlink(f"/proc/self/fd/{fd}")
        assert link.startswith("/dev/shm/") and link.endswith("(deleted)")
        if not segment._tmpfile_refused:
            assert "shmloader-" not in link  # made without a name: none to leave behind
    finally:
        os.close(fd)
