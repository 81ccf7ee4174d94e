"""The conftest's /dev/shm leak check on a shared machine: it blames a test for the entries
its own processes left, never for another process's rings or torch storages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from . import conftest
from .conftest import _blamed


def _reaped() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def shm(tmp_path):
    """A stand-in for /dev/shm: these names in the real one could fail other test runs on
    this machine (those whose check still goes by the name alone)."""
    return str(tmp_path / "shm")


@pytest.fixture
def made(shm):
    """Makes an entry in ``shm`` (removed with tmp_path)."""
    os.mkdir(shm)

    def make(name: str) -> str:
        with open(os.path.join(shm, name), "wb") as f:
            f.write(b"x" * 4096)
        return name

    return make


@pytest.mark.timeout(30)
def test_entries_of_our_processes_are_blamed(made, shm):
    """Ours: named by this process (ring or torch storage), by a running child, or by a
    process that is gone (a worker that leaked and exited), or a shmloader name without a
    pid; held by no process outside our tree."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        names = {
            made(f"shmloader-{os.getpid()}-{'ab' * 8}"),
            made(f"torch_{os.getpid()}_123_0"),
            made(f"torch_{child.pid}_123_1"),
            made(f"torch_{_reaped()}_123_2"),
            made(f"shmloader-{_reaped()}-{'cd' * 8}"),
            made("shmloader-odd"),
        }
        assert _blamed(names, grace=0.1, where=shm) == names
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(30)
def test_entries_of_other_processes_are_not_blamed(made, shm, tmp_path):
    """Not ours: named by a running process outside our tree (another test run's ring or
    torch storage), or by a process that is gone but held by one outside our tree (torch's
    file_system storages outlive the worker that made them), names nobody of ours makes,
    and an entry that goes away within the grace period (another process's ring between
    its creation and its unlinking)."""
    foreign_pid = 1  # init: running, and not a descendant of this test
    held = made(f"torch_{_reaped()}_456_0")
    ready = tmp_path / "ready"
    # A process outside our tree (its parent exits at once and init adopts it) that holds
    # ``held`` open, as another session's training process holds its storages.
    hold = "import sys, time; f = open(sys.argv[1], 'rb'); print(1, flush=True); time.sleep(30)"
    launch = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]],"
        " stdout=open(sys.argv[3], 'w'), stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,"
        " start_new_session=True)\n"
        "print(p.pid)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", launch, hold, os.path.join(shm, held), str(ready)],
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    ).stdout
    holder_pid = int(out)
    try:
        deadline = time.monotonic() + 20
        while ready.read_text() == "":
            assert time.monotonic() < deadline, "the holder did not open the entry"
            time.sleep(0.02)
        names = {
            made(f"shmloader-{foreign_pid}-{'ab' * 8}"),
            made(f"torch_{foreign_pid}_789_0"),
            held,
            made("psm_0123abcd"),
            made("sem.mp-xyz"),
        }
        assert _blamed(names, grace=0.1, where=shm) == set()
    finally:
        os.kill(holder_pid, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_an_entry_that_goes_away_within_the_grace_is_not_blamed(made, shm, monkeypatch):
    """Another process's ring between its creation and its unlinking (its maker is gone
    by the time we look, say): not a leak once it goes away within the grace period."""
    transient = made(f"shmloader-{_reaped()}-{'ef' * 8}")
    real = conftest._held_elsewhere
    timers = []

    def held_then_unlinked(names, ours, where):
        held = real(names, ours, where)
        # Unlinked once the check has looked at every process: only waiting sees it go.
        timers.append(threading.Timer(0.5, os.unlink, [os.path.join(shm, transient)]))
        timers[-1].start()
        return held

    monkeypatch.setattr(conftest, "_held_elsewhere", held_then_unlinked)
    try:
        assert _blamed({transient}, grace=5.0, where=shm) == set()
    finally:
        for t in timers:
            t.join()
    assert timers, "the check did not look for holders"
