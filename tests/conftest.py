"""Shared fixtures: every test that starts workers must leave nothing behind."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib.machinery
import os
import re
import sys
import tempfile
import time

import psutil
import pytest

START_METHODS = ["fork", "spawn", "forkserver"]

# A spawn worker runs its parent's main module again, as __mp_main__, unless that module
# was run by name as a package's __main__. Under the ``pytest`` command the main module is
# pytest's console script, whose re-run imports all of pytest in every spawned worker
# (0.35 s of CPU each on this 2-core machine, 1.1 s of wall time under load);
# under ``python -m pytest`` it is pytest/__main__.py, which is left alone. Give the
# script that module's name, as ``python -m pytest`` would: the workers still start from a
# fresh interpreter and unpickle everything they get; they skip re-running pytest's entry
# point, which no test is about.
_main = sys.modules["__main__"]
if getattr(_main, "__spec__", None) is None and os.path.basename(getattr(_main, "__file__", "")) in (
    "pytest",
    "py.test",
):
    _main.__spec__ = importlib.machinery.ModuleSpec("pytest.__main__", None)


MAX_TEST_PROCESSES = 4


def pytest_xdist_auto_num_workers(config):
    """How many pytest processes ``-n auto`` (pyproject.toml's addopts) starts: one per
    CPU this process may run on, at most MAX_TEST_PROCESSES. Most tests wait on the
    workers they start, so two files at once nearly halve the suite's time on two cores;
    each pytest process holds its own imports (torch's among them), so more than a few
    cost memory without saving time."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_TEST_PROCESSES))


# CI runs the suite twice, without torch and with it (.ci/run). A test whose workers start
# by spawn or forkserver spends most of its time starting fresh interpreters, and where it
# passed without torch, running it again with torch tests nothing new: its consumer's
# torch output is its fork case's, and what torch changes in a fresh worker is the
# torch-only tests' (they skip without torch, so they are never left out). The first run
# lists the tests that passed in PASSED_LOG_ENV's file; the second leaves out those of
# them whose id names spawn or forkserver, given that file in SKIP_SPAWNED_PASSED_ENV.
PASSED_LOG_ENV = "SHMLOADER_TESTS_PASSED_LOG"
SKIP_SPAWNED_PASSED_ENV = "SHMLOADER_TESTS_SKIP_SPAWNED_PASSED"
_FRESH_INTERPRETER = re.compile(r"\[(.*[^a-z])?(spawn|forkserver)([^a-z].*)?\]$")


def pytest_runtest_logreport(report):
    """Adds a passed test's id to PASSED_LOG_ENV's file (under pytest-xdist the process
    that ran it and the one it reports to may both write it: a set is read back)."""
    path = os.environ.get(PASSED_LOG_ENV)
    if path and report.when == "call" and report.passed:
        with open(path, "a") as log:
            log.write(report.nodeid + "\n")


# The test files that take longest (measured with --durations=0 in both of CI's runs),
# longest first. pytest-xdist hands a file to whichever pytest process is free, in the
# order of the collection (--no-loadscope-reorder: its own order is by the number of
# tests, and test_faults.py has few tests and a third of the time): a long file handed
# out last keeps one process busy while the other has nothing left to do.
LONGEST_FILES = [
    "test_faults.py",
    "test_core.py",
    "test_frameworks.py",
    "test_torch_compat.py",
    "test_collate_parity.py",
    "test_restart.py",
    "test_bench_w8.py",
    "test_rng_parity.py",
    "test_bench_cli.py",
    "test_variable.py",
    "test_where_it_runs.py",
    "test_share.py",
]


def _longest_first(items: list) -> None:
    """Puts the tests of LONGEST_FILES first, in its order; the rest keep theirs."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))


def pytest_collection_modifyitems(config, items):
    """Leaves out the spawn and forkserver tests that SKIP_SPAWNED_PASSED_ENV's file says
    passed in CI's run without torch (see above), and puts the longest files first."""
    _longest_first(items)
    path = os.environ.get(SKIP_SPAWNED_PASSED_ENV)
    if not path or not os.path.exists(path):
        return
    with open(path) as log:
        passed = set(log.read().split("\n"))
    kept, left = [], []
    for item in items:
        (left if item.nodeid in passed and _FRESH_INTERPRETER.search(item.nodeid) else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


@pytest.fixture(params=START_METHODS)
def method(request):
    """The start method of the test's workers: every such test runs under each of them."""
    return request.param


class _QuietMachine:
    """Stands in for :class:`shmloader.system.cpuload.OthersLoad`: no other process keeps
    the CPUs busy, from the first wait on. Tests of the yielding paths use it (the
    other pytest process running beside them would often close those paths);
    tests/test_cpuload.py measures the real thing."""

    busy = False

    def due(self, now_ns: int) -> bool:
        return True

    def measure(self, now_ns: int, worker_pids: object) -> bool:
        return self.busy


class _BusyMachine(_QuietMachine):
    """Other processes keep the CPUs busy, from the start."""

    busy = True


@pytest.fixture
def quiet_machine(monkeypatch):
    """The loaders made in the test find the machine quiet: their sides yield before they
    sleep (transport/yielding.py)."""
    from shmloader.epoch import collector

    monkeypatch.setattr(collector, "OthersLoad", _QuietMachine)


@pytest.fixture
def busy_machine(monkeypatch):
    """The loaders made in the test find the machine busy: neither side yields."""
    from shmloader.epoch import collector

    monkeypatch.setattr(collector, "OthersLoad", _BusyMachine)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


SHM_DIR = "/dev/shm"


def _shm_entries(where: str = SHM_DIR) -> set[str]:
    try:
        return set(os.listdir(where))
    except FileNotFoundError:
        return set()


# The names our code and torch give /dev/shm entries carry the creating process's pid:
# shmloader-PID-HEX (ring.py) and torch_PID_RAND_COUNTER (torch's shared storages).
_CREATOR = re.compile(r"^(?:shmloader-(\d+)-|torch_(\d+)_)")


def _creator(name: str) -> int | None:
    """The pid a /dev/shm entry's name says created it; our pid for any other name that
    carries it as ``_PID_``; None for a ``shmloader`` name without a pid; -1 otherwise
    (not a name we make: never ours)."""
    m = _CREATOR.match(name)
    if m:
        return int(m.group(1) or m.group(2))
    if name.startswith("shmloader"):
        return None
    return os.getpid() if f"_{os.getpid()}_" in name else -1


def _our_tree() -> set[int]:
    """This process and its running descendants."""
    return {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}


def _held_elsewhere(names: set[str], ours: set[int], where: str = SHM_DIR) -> set[str]:
    """The entries of ``names`` in ``where`` that a running process outside ``ours`` maps
    or holds open."""
    paths = {os.path.join(where, n): n for n in names}
    held = set()
    for pid in psutil.pids():
        if pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                held.update(paths[p] for line in f for p in paths if p in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in paths:
                    held.add(paths[target])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return held


def _blamed(new: set[str], grace: float = 1.0, where: str = SHM_DIR) -> set[str]:
    """The entries of ``new`` (made in ``where``, /dev/shm, during a test) that this test left: the
    machine is shared, and other processes' rings and torch storages come and go there.
    An entry is another process's when the pid in its name runs outside our process tree,
    or when such a process maps or holds it. One whose creator is ours (this process or a
    running descendant) is ours; one whose creator is gone, held by nobody else, is ours
    if it is still there after ``grace`` s (another process's ring between its creation
    and its unlinking goes away; a worker's leak stays)."""
    tree = _our_tree()
    ours, unsure = set(), set()
    for name in new:
        pid = _creator(name)
        if pid == -1:
            continue
        if pid in tree:
            ours.add(name)  # made by us: no benefit of the doubt
        elif pid is None or not psutil.pid_exists(pid):
            unsure.add(name)
        # else: a running process outside our tree made it
    unsure -= _held_elsewhere(unsure, tree, where) if unsure else set()
    deadline = time.monotonic() + grace
    while unsure and time.monotonic() < deadline:
        time.sleep(0.05)
        unsure &= _shm_entries(where)
    return (ours | unsure) & _shm_entries(where)


def _fds() -> set[str]:
    return set(os.listdir(f"/proc/{os.getpid()}/fd"))


@pytest.fixture(scope="module", autouse=True)
def _gc_unfreeze_after_module():
    """Ends the freeze of :func:`no_leaks` with each module: what outlived its tests
    (module-scoped fixtures torn down now) is collected at the next test's start."""
    yield
    gc.unfreeze()


# A test that leaves /dev/shm entries on purpose for a while (a create loop killed at random
# moments: tests/test_posix_segments.py) holds this lock exclusively (dev_shm_to_myself); the
# leak check of every test holds it shared, so no test of another pytest worker, running at
# the same time, takes those entries for its own leaks.
_SHM_LOCK_PATH = os.path.join(tempfile.gettempdir(), "shmloader-tests-dev-shm.lock")
_shm_lock_fd: list[int] = []


def _shm_lock() -> int:
    if not _shm_lock_fd:
        _shm_lock_fd.append(os.open(_SHM_LOCK_PATH, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o666))
    return _shm_lock_fd[0]


@contextlib.contextmanager
def dev_shm_to_myself():
    """Within the block no other test's leak check runs (see ``_SHM_LOCK_PATH``)."""
    fd = _shm_lock()
    fcntl.flock(fd, fcntl.LOCK_EX)  # (upgrades this test's shared hold)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_SH)


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves a worker process, a descriptor or a /dev/shm entry behind."""
    gc.collect()
    # Everything alive now predates the test: move it out of the collector's sight. A full
    # collection (this fixture's, the loader's own when every slot is held, a forked
    # worker's) then walks only what the test made, not pytest's, torch's and Lightning's
    # objects (400,000 after test_dropin: 0.3 s a collection here, twice a test). The
    # test's own garbage, reference cycles included, is collected as before; so is what
    # outlives a test, once its module is done (see _gc_unfreeze_after_module).
    gc.freeze()
    fcntl.flock(_shm_lock(), fcntl.LOCK_SH)
    try:
        yield from _checked_for_leaks()
    finally:
        fcntl.flock(_shm_lock(), fcntl.LOCK_UN)


def _checked_for_leaks():
    """:func:`no_leaks`'s body: the state before the test, the test, the checks after."""
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
    left_shm = _blamed(_shm_entries() - shm)
    assert not left_shm, f"/dev/shm entries left: {left_shm}"
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
