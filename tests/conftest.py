"""Shared fixtures: every test that starts workers must leave nothing behind."""

from __future__ import annotations

import gc
import os
import time

import psutil
import pytest

START_METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture(params=START_METHODS)
def method(request):
    """The start method of the test's workers: every such test runs under each of them."""
    return request.param


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def _shm_entries() -> set[str]:
    """/dev/shm entries this test process could be blamed for: ours (none should ever
    exist: the ring is unlinked at creation) and torch's, which carry the creator's pid.
    Entries of unrelated processes on a shared machine are not this test's."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    mine = f"_{os.getpid()}_"
    return {n for n in names if n.startswith("shmloader") or mine in n}


def _fds() -> set[str]:
    return set(os.listdir(f"/proc/{os.getpid()}/fd"))


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves a worker process, a descriptor or a /dev/shm entry behind."""
    gc.collect()
    children, shm, fds = _children(), _shm_entries(), _fds()
    yield
    gc.collect()

    def left_running() -> set[int]:
        # multiprocessing's own helpers (forkserver, resource tracker) live for the session.
        return {pid for pid in _children() - children if not _is_mp_helper(pid)}

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and left_running():
        time.sleep(0.05)
    left = left_running()
    assert not left, f"worker processes left running: {sorted(left)}"
    assert _shm_entries() - shm == set(), f"/dev/shm entries left: {_shm_entries() - shm}"
    extra = {fd for fd in _fds() - fds if not _is_session_fd(fd)}
    assert not extra, f"descriptors left open: {[_describe_fd(fd) for fd in sorted(extra)]}"


def _is_mp_helper(pid: int) -> bool:
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return True
    return "forkserver" in cmd or "resource_tracker" in cmd


def _describe_fd(fd: str) -> str:
    try:
        return f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"
    except OSError:
        return fd


def _is_session_fd(fd: str) -> bool:
    """Descriptors of multiprocessing's long-lived helpers (forkserver, resource tracker)."""
    from multiprocessing import forkserver, resource_tracker

    target = _describe_fd(fd)
    helper_fds = set()
    fs = forkserver._forkserver
    for attr in ("_forkserver_alive_fd", "_forkserver_address"):
        v = getattr(fs, attr, None)
        if isinstance(v, int):
            helper_fds.add(str(v))
    rt = resource_tracker._resource_tracker
    if getattr(rt, "_fd", None) is not None:
        helper_fds.add(str(rt._fd))
    return fd in helper_fds or "/dev/urandom" in target
