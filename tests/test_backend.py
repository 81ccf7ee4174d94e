"""Issue 14, part 1: memfd rings and memory-aware sizing.

memfd is the default backend on Linux (no /dev/shm entry, one descriptor per ring,
sealed against shrinking); ``shm_backend="posix"`` still works; a refused memfd falls
back to posix once. The first ring's slot count adapts to the memory the backend can
give (one RingSizeWarning), and when even the minimum does not fit, the error's first
words name the limit that binds. cgroup limits are read for v2 (a fake tree) and v1 (a
real child cgroup on this machine), and a loader inside a cgroup smaller than its
default ring gets a smaller ring or a clear error, never the OOM killer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from shmloader import doctor
from shmloader.errors import RingLimitError, RingSizeWarning, ShmSpaceError
from shmloader.memory import leases, sizing
from shmloader.memory import ring as ring_mod
from shmloader.memory.ring import Ring, ring_bytes
from shmloader.system import limits as memory
from shmloader.system import segment

from . import datasets as D
from .datasets import NumpyLoader as DataLoader

FORK = {"multiprocessing_context": "fork"}
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
LINUX_MEMFD = sys.platform.startswith("linux") and hasattr(os, "memfd_create")
needs_memfd = pytest.mark.skipif(not LINUX_MEMFD, reason="memfd_create is Linux-only")


def memfd_fds() -> list[int]:
    """This process's descriptors of shmloader memfds."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:shmloader"):
                out.append(int(name))
    return out


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmloader")}


def run_python(code: str, *, env: dict | None = None, preexec=None, timeout: float = 90):
    """Run ``code`` in a fresh interpreter with this checkout's sources first."""
    full_env = {**os.environ, "PYTHONPATH": SRC}
    full_env.pop(segment.BACKEND_ENV, None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        preexec_fn=preexec,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- A. the memfd backend ----------------------------------------------------------------------


@needs_memfd
def test_memfd_is_the_default_and_leaves_no_dev_shm_entry_and_one_descriptor(monkeypatch):
    monkeypatch.delenv(segment.BACKEND_ENV, raising=False)
    before_names, before_fds = shm_names(), memfd_fds()
    # 256 KiB batches: past worker.PICKLED_MAX_BYTES, the first ones come in one-off segments.
    dl = DataLoader(D.Squares(64, side=128), batch_size=4, num_workers=2, **FORK)
    it = iter(dl)
    held = [next(it) for _ in range(3)]  # batches from one-off segments and from the ring
    assert dl.ring.backend == "memfd"
    assert shm_names() == before_names, "a memfd ring must leave nothing in /dev/shm"
    assert len(memfd_fds()) - len(before_fds) == 1, "one descriptor per ring, whatever is held"
    rest = list(it)
    assert len(held) + len(rest) == 16
    del it, held, rest
    dl.ring.close_fd()
    assert memfd_fds() == before_fds


@needs_memfd
def test_the_seals_refuse_shrinking_and_growing():
    ring = Ring.create(2, 4096, backend="memfd")
    try:
        seals = fcntl.fcntl(ring.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        for size in (4096, ring.total_bytes * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(ring.fd, size)
        assert os.fstat(ring.fd).st_size == ring.total_bytes
        ring.slot_array(1)[:] = 7  # the mapping is whole
        assert int(ring.slot_array(1).sum()) == 7 * ring.slot_bytes
    finally:
        ring.close_fd()


def _reserved(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


@pytest.mark.skipif(not ring_mod.populate_supported(), reason="needs MADV_POPULATE_WRITE (Linux 5.14+)")
@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_a_ring_is_made_sparse_and_each_slot_is_reserved_by_its_first_writer(backend):
    slot = 2**20
    ring = Ring.create(4, slot, backend=backend)
    try:
        assert not ring.reserved_whole and os.fstat(ring.fd).st_size == ring.total_bytes
        assert _reserved(ring.fd) == ring.slot_offset(0), "only the control area when made"
        ring.slot_array(2)  # a writer's first use reserves (and maps) the slot, before any write
        got = _reserved(ring.fd) - ring.slot_offset(0)
        # Unsaid, the batch the slot was sized for in a memfd (a write past it cannot
        # SIGBUS there), the whole slot in /dev/shm; only that slot (and pages at its ends).
        want = ring_mod.expected_fill(slot) if backend == "memfd" else slot
        assert want <= got <= want + 2 * 4096, (got, want)
        ring.slot_array(2)[:] = 5  # past what was reserved: memfd pages come with the write
        assert got <= _reserved(ring.fd) - ring.slot_offset(0) <= slot + 2 * 4096
    finally:
        ring.close_fd()
    whole = Ring.create(4, slot, backend=backend, whole=True)  # e.g. page-locked for a GPU
    try:
        assert whole.reserved_whole and _reserved(whole.fd) == whole.total_bytes
    finally:
        whole.close_fd()


@pytest.mark.skipif(not ring_mod.populate_supported(), reason="needs MADV_POPULATE_WRITE (Linux 5.14+)")
def test_a_writer_that_says_what_it_writes_reserves_that_much_of_its_slot():
    slot = 2**20
    ring = Ring.create(2, slot)
    try:
        base = _reserved(ring.fd)
        ring.slot_array(1, 300_000)[:300_000] = 1  # a batch smaller than its slot
        first = _reserved(ring.fd) - base
        assert 300_000 <= first <= 300_000 + 2 * 4096
        ring.slot_array(1)[:10] = 2  # no size: what is reserved already (the header's write)
        assert _reserved(ring.fd) - base == first
        ring.slot_array(1, slot)[:] = 3  # a bigger batch: the rest, before it is written
        assert slot <= _reserved(ring.fd) - base <= slot + 2 * 4096
        assert int(ring.slot_array(1).sum()) == 3 * slot
    finally:
        ring.close_fd()


@pytest.mark.skipif(not ring_mod.populate_supported(), reason="needs MADV_POPULATE_WRITE (Linux 5.14+)")
def test_a_slot_whose_memory_is_gone_is_an_error_not_a_sigbus():
    # A segment cut under the mapping stands for memory that ran out after the ring was
    # sized: the first writer's reservation fails with an error, before anything writes.
    fd = os.memfd_create("shmloader-test", os.MFD_CLOEXEC)
    ring = Ring(fd, 2, 8192, populate=False)
    try:
        os.ftruncate(fd, ring.slot_offset(0))
        gone = r"^could not reserve \d+ bytes of the loader's shared-memory ring \(madvise [A-Z_]+: EFAULT"
        with pytest.raises(ShmSpaceError, match=gone):
            ring.slot_array(1)
    finally:
        ring.close_fd()


def test_rings_are_reserved_whole_where_the_kernel_cannot_populate(monkeypatch):
    monkeypatch.setattr(ring_mod, "_populate_works", False)
    ring = Ring.create(4, 2**20)
    try:
        assert ring.reserved_whole and _reserved(ring.fd) == ring.total_bytes
    finally:
        ring.close_fd()


def test_the_posix_backend_still_works_end_to_end():
    before = shm_names()
    expect = [[a.tolist() for a in b] for b in DataLoader(D.Squares(40), batch_size=4, num_workers=0)]
    dl = DataLoader(D.Squares(40), batch_size=4, num_workers=2, shm_backend="posix", **FORK)
    got = [[a.tolist() for a in b] for b in dl]
    assert got == expect
    assert dl.ring.backend == "posix"
    assert os.readlink(f"/proc/self/fd/{dl.ring.fd}").startswith("/dev/shm/")
    assert shm_names() == before, "posix segments are unlinked at creation"
    dl.ring.close_fd()


def test_a_bad_backend_is_a_clear_value_error(monkeypatch):
    with pytest.raises(
        ValueError, match=r"shm_backend should be one of 'auto', 'memfd', 'posix' \(got 'tmpfs'\)"
    ):
        DataLoader(D.Squares(8), batch_size=4, num_workers=2, shm_backend="tmpfs")
    monkeypatch.setenv(segment.BACKEND_ENV, "shm")
    with pytest.raises(ValueError, match=r"\$SHMLOADER_SHM_BACKEND should be one of .* \(got 'shm'\)"):
        DataLoader(D.Squares(8), batch_size=4, num_workers=2)
    monkeypatch.setenv(segment.BACKEND_ENV, "posix")
    assert segment.resolve_backend("auto") == "posix"
    assert segment.resolve_backend("memfd") == "memfd"  # a named backend beats the variable


@needs_memfd
def test_a_refused_memfd_falls_back_to_posix_once():
    """memfd_create refused (EPERM, as a seccomp profile does): 'auto' uses posix, asks
    only once per process, and the workers' one-off segments follow; 'memfd' by name
    is an error naming the remedy."""
    proc = run_python(
        """
        import errno, os
        calls = []
        def refused(*args):
            calls.append(args)
            raise OSError(errno.EPERM, "Operation not permitted")
        os.memfd_create = refused
        from shmloader import DataLoader
        from shmloader.memory import ring
        from shmloader.system import segment
        from shmloader.errors import ShmBackendError
        import numpy as np
        class Data:  # 128 KiB batches: the first ones come in one-off segments
            def __len__(self): return 40
            def __getitem__(self, i): return np.full(4096, i, np.int64)
        dl = DataLoader(Data(), batch_size=4, num_workers=2, multiprocessing_context="fork")
        sums = [int(b.sum()) for b in dl]
        assert sums == [4096 * (16 * k + 6) for k in range(10)], sums
        print("backend", dl.ring.backend, "calls", len(calls), "refusal", segment.memfd_refusal().errno)
        try:
            ring.Ring.create(1, 4096, backend="memfd")
        except ShmBackendError as exc:
            print("named:", exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert f"backend posix calls 1 refusal {errno.EPERM}" in proc.stdout, proc.stdout
    assert "named: memfd_create was refused (EPERM" in proc.stdout and "shm_backend='auto'" in proc.stdout


def test_no_writable_dev_shm_is_named_for_posix(monkeypatch, tmp_path):
    """posix without a usable /dev/shm: the error names why (places' tests mount the real
    cases); memfd does not care."""
    from shmloader.errors import ShmBackendError

    assert (
        memory.shm_problem(str(tmp_path / "absent"))
        == f"there is no {tmp_path / 'absent'} here (nothing is mounted there)"
    )
    assert memory.shm_problem(str(tmp_path)) is None
    monkeypatch.setattr(memory, "shm_problem", lambda *a: "/dev/shm is mounted read-only")
    with pytest.raises(
        ShmBackendError, match=r"^/dev/shm is mounted read-only, so the 'posix'.*shm_backend='memfd'"
    ):
        Ring.create(1, 4096, backend="posix")
    with pytest.raises(ShmBackendError, match=r"^/dev/shm is mounted read-only"):  # said at construction
        DataLoader(D.Squares(8), batch_size=4, num_workers=2, shm_backend="posix")
    if LINUX_MEMFD:
        ring = Ring.create(1, 4096, backend="memfd")
        ring.close_fd()


# --- B. memory-aware sizing --------------------------------------------------------------------


@pytest.mark.parametrize("side", [32, 256], ids=["ring-made-in-line", "ring-made-on-a-thread"])
def test_a_small_budget_gives_fewer_slots_one_warning_and_the_same_batches(side):
    """16 KB batches get their ring made in line, 1 MiB ones on a ring maker's thread
    (ringmaker.BACKGROUND_MIN_BATCH_BYTES): either way one warning, at the user's line."""
    dataset = D.Squares(96 if side == 32 else 24, side=side)
    expect = [[a.tolist() for a in b] for b in DataLoader(dataset, batch_size=4, num_workers=0)]
    batch_bytes = 4 * side * side * 4 + 4 * 8
    slot = sizing.slot_bytes_for(batch_bytes)
    wanted = sizing.default_num_slots(2)
    limit = ring_bytes(sizing.min_num_slots(2) + 1, slot + 256)  # room for 5 of the 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dl = DataLoader(dataset, batch_size=4, num_workers=2, max_shm_bytes=limit, **FORK)
        got = [[a.tolist() for a in b] for b in dl]
        got2 = [[a.tolist() for a in b] for b in dl]  # a second epoch: no second warning
    assert got == expect and got2 == expect
    ring = dl.ring
    assert sizing.min_num_slots(2) <= ring.num_slots < wanted
    mine = [w for w in caught if issubclass(w.category, RingSizeWarning)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert mine[0].filename == __file__, mine[0].filename  # the user's line, not a thread's
    text = str(mine[0].message)
    assert f"{ring.num_slots} slots instead of {wanted}" in text
    assert f"max_shm_bytes={limit}" in text and "pass a larger max_shm_bytes" in text
    ring.close_fd()


def _fake_budget(monkeypatch, cause: str) -> None:
    """Make ``cause`` the binding limit, at a figure no ring fits."""
    small = 3 * 2**20
    monkeypatch.setattr(memory, "mem_available", lambda *a: small if cause == "machine" else 2**40)
    cg = memory.CgroupLimit(2, "/kubepods/pod1", 64 * 2**20, 61 * 2**20, 0)
    monkeypatch.setattr(memory, "cgroup_limit", lambda *a: cg if cause == "cgroup" else None)
    monkeypatch.setattr(memory, "shm_free_bytes", lambda *a: small if cause == "shm" else 2**40)
    monkeypatch.setattr(memory, "shm_size_bytes", lambda *a: 64 * 2**20 if cause == "shm" else 2**40)


@pytest.mark.parametrize(
    ("cause", "backend", "first_words", "remedy"),
    [
        ("machine", "memfd", "The machine's available memory (MemAvailable 3.0 MiB)", "free memory"),
        (
            "cgroup",
            "memfd",
            "The memory limit of this process's cgroup "
            "(cgroup v2 /kubepods/pod1: memory.max 64.0 MiB, 61.0 MiB in use)",
            "raise the container's memory limit",
        ),
        ("shm", "posix", "/dev/shm (64.0 MiB, 3.0 MiB free", "--shm-size"),
    ],
)
def test_nothing_fits_the_error_leads_with_the_binding_limit(
    monkeypatch, cause, backend, first_words, remedy
):
    _fake_budget(monkeypatch, cause)
    dl = DataLoader(D.Squares(40, side=64), batch_size=64, num_workers=2, shm_backend=backend, **FORK)
    with pytest.raises(ShmSpaceError) as info:
        list(dl)
    text = str(info.value)
    assert text.startswith(first_words), text
    assert remedy in text and "holds" not in text and "batches still referenced" not in text
    assert ("--shm-size" in text) == (cause == "shm"), "the /dev/shm remedy only where /dev/shm binds"


def test_an_explicit_max_shm_bytes_too_small_is_named_first():
    dl = DataLoader(D.Squares(40), batch_size=4, num_workers=2, max_shm_bytes=10_000, **FORK)
    with pytest.raises(RingLimitError, match=r"^max_shm_bytes=10000 \(passed to the loader\) leaves") as info:
        list(dl)
    assert "holds" not in str(info.value)


def test_the_growth_error_names_held_batches_only_when_some_are_held():
    free_text = str(leases.limit_error(1000, 800, 0, 0))
    assert (
        free_text.startswith("max_shm_bytes=1000 bytes (passed to the loader)") and "holds" not in free_text
    )
    held_text = str(leases.limit_error(1000, 800, 600, 3))
    assert held_text.startswith("The consumer holds 3 batches, which pin 600 bytes")


def test_the_room_is_checked_before_reserving(monkeypatch):
    """A ring past the budget is refused before posix_fallocate runs (past a cgroup's
    limit, fallocate wakes the OOM killer instead of failing)."""
    _fake_budget(monkeypatch, "cgroup")
    called = []
    monkeypatch.setattr(ring_mod.os, "posix_fallocate", lambda *a: called.append(a))
    with pytest.raises(ShmSpaceError, match=r"^The memory limit of this process's cgroup"):
        Ring.create(2, 8 * 2**20)
    assert not called


# --- cgroups ---------------------------------------------------------------------------------


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limits_are_read_up_the_hierarchy(tmp_path):
    root = tmp_path / "cgroup"
    # kubepods: 1 GiB, 612 MiB charged of which 100 MiB reclaimable cache; the pod: no limit.
    _write(root / "kubepods" / "memory.max", f"{2**30}\n")
    _write(root / "kubepods" / "memory.current", f"{612 * 2**20}\n")
    _write(root / "kubepods" / "memory.stat", f"anon 1\ninactive_file {100 * 2**20}\nshmem 3\n")
    _write(root / "kubepods" / "pod1" / "memory.max", "max\n")
    _write(root / "kubepods" / "pod1" / "memory.current", f"{300 * 2**20}\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("0::/kubepods/pod1\n")
    cg = memory.cgroup_limit(str(root), str(proc))
    assert (cg.version, cg.path, cg.limit) == (2, "/kubepods", 2**30)
    assert cg.headroom == 2**30 - (612 - 100) * 2**20
    assert "memory.max 1024.0 MiB, 512.0 MiB in use" in cg.describe()
    # A tighter child: the least headroom binds.
    _write(root / "kubepods" / "pod1" / "memory.max", f"{400 * 2**20}\n")
    cg = memory.cgroup_limit(str(root), str(proc))
    assert (cg.path, cg.headroom) == ("/kubepods/pod1", 100 * 2**20)
    # No limit anywhere.
    for d in ("kubepods", "kubepods/pod1"):
        (root / d / "memory.max").write_text("max\n")
    assert memory.cgroup_limit(str(root), str(proc)) is None
    # A hybrid system whose memory controller is not on v1: the unified line is read.
    proc.write_text("4:memory:/kubepods\n0::/kubepods/pod1\n")
    (root / "kubepods" / "memory.max").write_text(f"{2**30}\n")
    assert memory.cgroup_limit(str(root), str(proc)).version == 2


def test_a_container_sees_its_own_cgroup_at_the_mount_root(tmp_path):
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names
    /docker/ID, and that cgroup is bind-mounted on /sys/fs/cgroup/memory (mountinfo's
    root field): its files are read at the mount, not at mount + /docker/ID."""
    mnt = tmp_path / "memory"
    _write(mnt / "memory.limit_in_bytes", f"{512 * 2**20}\n")
    _write(mnt / "memory.usage_in_bytes", f"{100 * 2**20}\n")
    _write(mnt / "memory.stat", "cache 0\ntotal_inactive_file 0\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("9:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    info = tmp_path / "mountinfo"
    info.write_text(
        f"31 23 0:28 / {tmp_path} rw - tmpfs tmpfs rw\n"
        f"35 31 0:32 /docker/abc {mnt} rw,relatime - cgroup cgroup rw,memory\n"
    )
    cg = memory.cgroup_limit(proc_cgroup=str(proc), mountinfo=str(info))
    assert (cg.version, cg.path, cg.limit, cg.headroom) == (1, "/docker/abc", 512 * 2**20, 412 * 2**20)
    # cgroup v2 with a cgroup namespace: "0::/" and the container's cgroup is the mount.
    _write(tmp_path / "unified" / "memory.max", f"{2**30}\n")
    _write(tmp_path / "unified" / "memory.current", "0\n")
    proc.write_text("0::/\n")
    info.write_text(f"40 31 0:40 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n")
    cg = memory.cgroup_limit(proc_cgroup=str(proc), mountinfo=str(info))
    assert (cg.version, cg.path, cg.limit) == (2, "/", 2**30)


def _own_v1_memory_cgroup() -> str:
    v1, _ = memory.own_cgroups("/proc/self/cgroup")
    base = os.path.join(memory.CGROUP_ROOT, "memory")
    if v1 is None or not os.path.isfile(os.path.join(base, "cgroup.procs")):
        pytest.skip(
            "no cgroup v1 memory controller here (under cgroup v2 a limited child cgroup needs "
            "a delegated subtree with the memory controller enabled: not attempted)"
        )
    return os.path.join(base, v1.lstrip("/")), v1


@contextlib.contextmanager
def child_cgroup(limit: int):
    """A v1 memory cgroup under this process's own, limited to ``limit`` bytes: (its
    directory, its path as /proc/self/cgroup names it). Removed afterwards."""
    base, path = _own_v1_memory_cgroup()
    name = f"shmloader-test-{os.getpid()}-{time.monotonic_ns()}"
    d = os.path.join(base, name)
    try:
        os.mkdir(d)
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        try:
            with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit))
        except OSError as exc:
            pytest.skip(f"cannot set a memory cgroup's limit here: {exc}")
        yield d, os.path.join(path, name)
    finally:
        for _ in range(100):  # its processes are gone; the kernel may take a moment
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.05)


def _join(d: str):
    def preexec() -> None:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    return preexec


def _oom_kills(d: str) -> int:
    with open(os.path.join(d, "memory.oom_control")) as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def test_cgroup_v1_limit_is_read_for_real():
    with child_cgroup(256 * 2**20) as (d, path):
        proc = run_python(
            """
            import json
            from shmloader import doctor
            from shmloader.system import limits as memory
            cg = memory.cgroup_limit()
            b = memory.budget("memfd")
            print(json.dumps([cg.version, cg.path, cg.limit, cg.headroom, b.limit, b.bytes,
                              doctor.check_memory(2, 2**20).detail]))
            """,
            preexec=_join(d),
        )
    assert proc.returncode == 0, proc.stderr
    version, got_path, limit, headroom, binding, size, detail = json.loads(proc.stdout)
    assert (version, got_path, limit) == (1, path, 256 * 2**20)
    assert 0 < headroom < limit and binding == "cgroup"
    # the budget reads the cgroup's usage again: the child's own pages may move it a little between
    assert abs(size - headroom) < 4 * 2**20, (size, headroom)
    assert f"cgroup limit: cgroup v1 {path}: memory.limit_in_bytes 256.0 MiB" in detail


_CGROUP_LOADER = """
    import warnings, numpy as np
    from shmloader import DataLoader
    class Images:  # 64 x 3x224x224 float32: 38.5 MB batches
        def __len__(self): return 64 * 6
        def __getitem__(self, i): return np.full((3, 224, 224), i % 251, np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dl = DataLoader(Images(), batch_size=64, num_workers=2, multiprocessing_context="fork",
                            output="numpy")
            n = 0
            for k, b in enumerate(dl):
                assert b.shape == (64, 3, 224, 224) and b[0, 0, 0, 0] == (64 * k) % 251
                n += 1
            print("done", n, dl.ring.num_slots, sum(w.category.__name__ == "RingSizeWarning" for w in caught))
        except MemoryError as exc:
            print("error", type(exc).__name__, exc)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("limit_mib", [700, 300])
def test_a_cgroup_smaller_than_the_default_ring_never_wakes_the_oom_killer(limit_mib):
    """The default ring for 2 workers and 38.5 MB batches is 8 x 48 MiB = 385 MiB: a
    700 MiB cgroup gets a smaller ring (and one warning), a 300 MiB one a clear error
    naming the cgroup's limit; neither is SIGKILLed."""
    with child_cgroup(limit_mib * 2**20) as (d, path):
        proc = run_python(_CGROUP_LOADER, preexec=_join(d))
        kills = _oom_kills(d)
    assert proc.returncode == 0, f"rc {proc.returncode} (-9: the OOM killer): {proc.stderr[-2000:]}"
    assert kills == 0, "the cgroup's OOM killer ran"
    words = proc.stdout.split()
    if words[0] == "done":
        n, slots, warned = map(int, words[1:4])
        assert n == 6 and sizing.min_num_slots(2) <= slots < sizing.default_num_slots(2) and warned == 1, (
            proc.stdout
        )
    else:
        assert words[:2] == ["error", "ShmSpaceError"], proc.stdout + proc.stderr
        text = proc.stdout.split("ShmSpaceError ", 1)[1]
        assert text.startswith(f"The memory limit of this process's cgroup (cgroup v1 {path}"), text
        assert "raise the container's memory limit" in text
    if limit_mib == 700:
        assert words[0] == "done", "700 MiB holds a smaller ring: " + proc.stdout
    else:
        assert words[0] == "error", "300 MiB cannot hold 4 slots at half the headroom: " + proc.stdout


# --- C. doctor ---------------------------------------------------------------------------------


def test_doctor_reports_the_backend_the_memory_and_the_cgroup(monkeypatch):
    monkeypatch.delenv(segment.BACKEND_ENV, raising=False)
    names = [c.name for c in doctor.run_checks(2, 2**20)]
    assert names[1:5] == ["shm backend", "memory", "/dev/shm", "ring creation"]
    backend = doctor.check_backend()
    if LINUX_MEMFD:
        assert backend.status == doctor.OK and backend.detail.startswith("memfd")
    assert doctor.check_backend("posix").detail.startswith("posix (asked for)")
    _fake_budget(monkeypatch, "cgroup")
    check = doctor.check_memory(2, 2**20, "memfd")
    assert "cgroup limit: cgroup v2 /kubepods/pod1: memory.max 64.0 MiB, 61.0 MiB in use" in check.detail
    assert "bound by the cgroup's limit" in check.detail
    assert check.status == doctor.FAIL and "raise the container's memory limit" in check.remedy
    monkeypatch.setattr(memory, "cgroup_limit", lambda *a: None)
    check = doctor.check_memory(2, 2**20, "memfd")
    assert "cgroup limit: no limit" in check.detail and check.status == doctor.OK
