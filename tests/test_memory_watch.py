"""Workers' memory seen and shared: ``stats()["memory"]``, the CopyOnReadWarning on a
dataset of Python metadata (and not on a numpy-backed one of the same size), and
``share_dataset=True``, whose batches equal torch's loader's on the unshared dataset."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from shmloader import CopyOnReadWarning, DataLoader
from shmloader.memory import containers, watch
from shmloader.memory.shared import SharedDict, SharedList
from shmloader.memory.usage import memory_totals, process_memory
from shmloader.memory.watch import CHECK_WORKERS, WARN_MIN_GROWTH, MemoryWatch


def record(i: int) -> dict:
    return {
        "path": f"/data/images/train/{i:08d}.jpg",
        "label": i % 1000,
        "ann": {"bbox": [i * 0.5, 2.0, 3.0 + i % 7, 4.0], "area": float(i % 97), "iscrowd": i % 2},
    }


class Metadata:
    """A detection dataset's shape: one dict of Python objects per image."""

    def __init__(self, n: int) -> None:
        self.records = [record(i) for i in range(n)]
        self.name = "metadata"

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        r = self.records[i]
        return np.asarray(r["ann"]["bbox"], dtype=np.float32), np.int64(r["label"]), len(r["path"])


class NumpyBacked:
    """The same information held in numpy arrays: reading it writes no shared page."""

    def __init__(self, n: int) -> None:
        i = np.arange(n)
        self.bbox = np.stack([i * 0.5, np.full(n, 2.0), 3.0 + i % 7, np.full(n, 4.0)], 1).astype(np.float32)
        self.labels = (i % 1000).astype(np.int64)
        self.paths = np.array([f"/data/images/train/{k:08d}.jpg" for k in range(n)])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.bbox[i], self.labels[i], len(self.paths[i])


class Wrapper:
    """A dataset around another (as torch's Subset): its containers are found inside."""

    def __init__(self, base) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        return self.base[i]


# Large enough that forked workers reading it grow past the warning's 64 MiB floor.
BIG = 400_000


def one_epoch(dl) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [tuple(np.asarray(x).copy() for x in b) for b in dl]
    return batches, [w for w in caught if issubclass(w.category, CopyOnReadWarning)]


# --- reading memory ----------------------------------------------------------------------


def test_process_memory_reads_this_process_and_nothing_for_a_gone_one():
    me = process_memory(os.getpid())
    assert me is not None
    assert 0 < me.uss <= me.rss and 0 < me.pss <= me.rss and me.private <= me.uss
    # 64 MiB of new pages written: private to this process. (A fresh mapping: a heap
    # allocation could reuse pages that earlier tests in this process made resident.)
    fresh = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = np.frombuffer(fresh, dtype=np.uint8)
    pages[:] = 1
    grown = process_memory(os.getpid())
    assert grown.private - me.private > 48 << 20
    del pages
    fresh.close()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_memory(child.pid) is None


# --- finding and sharing large containers ------------------------------------------------------


def test_large_containers_names_python_containers_not_arrays():
    found = containers.large_containers(Metadata(40_000))
    assert [c.path for c in found] == ["records"]
    (records,) = found
    assert records.kind == "list" and records.length == 40_000
    # ~550 bytes of objects per record; the estimate need only be of the right size
    assert 10 << 20 < records.estimated_bytes < 60 << 20
    assert "records (list of 40,000" in records.describe()
    assert containers.large_containers(NumpyBacked(40_000)) == []
    assert containers.large_containers(Metadata(1_000)) == []  # small: costs little per worker


def test_large_containers_are_found_inside_a_wrapped_dataset():
    assert [c.path for c in containers.large_containers(Wrapper(Wrapper(Metadata(40_000))))] == [
        "base.base.records"
    ]


def test_share_containers_replaces_in_place_and_says_what_it_left():
    class Mixed:
        def __init__(self) -> None:
            self.records = [record(i) for i in range(40_000)]
            self.by_path = {r["path"]: i for i, r in enumerate(self.records)}
            self.objects = [object() for _ in range(200_000)]  # nothing share() can store
            self.subclassed = type("Paths", (list,), {})(f"p{i:020d}" for i in range(300_000))

    ds = Mixed()
    original = [record(i) for i in range(40_000)]
    report = containers.share_containers(ds, min_bytes=4 << 20)
    assert set(report.shared) == {"records", "by_path"}
    assert isinstance(ds.records, SharedList) and isinstance(ds.by_path, SharedDict)
    assert ds.records == original and ds.by_path["/data/images/train/00000007.jpg"] == 7
    assert set(report.skipped) == {"objects", "subclassed"}
    assert "cannot store" in report.skipped["objects"]
    assert "subclass" in report.skipped["subclassed"]
    with pytest.raises(TypeError):
        ds.records[0] = {}


def test_share_dataset_must_be_a_bool():
    with pytest.raises(ValueError, match="share_dataset should be True or False"):
        DataLoader(Metadata(10), share_dataset="yes")


# --- the warning ----------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_the_warning_fires_on_python_metadata_and_not_on_numpy_or_when_shared():
    ds = Metadata(BIG)
    dl = DataLoader(ds, batch_size=512, shuffle=True, num_workers=2, multiprocessing_context="fork")
    _, warned = one_epoch(dl)
    assert len(warned) == 1
    text = str(warned[0].message)
    assert "records (list of 400,000" in text and "share_dataset=True" in text
    assert warned[0].filename == __file__  # points at the user's loop
    memory = dl.stats()["memory"]
    assert memory["copy_on_read_warned"]
    assert memory["peak_worker_growth"] >= WARN_MIN_GROWTH

    arrays = NumpyBacked(BIG)
    _, warned = one_epoch(
        DataLoader(arrays, batch_size=512, shuffle=True, num_workers=2, multiprocessing_context="fork")
    )
    assert warned == []

    shared = DataLoader(ds, batch_size=512, shuffle=True, num_workers=2, share_dataset=True)
    _, warned = one_epoch(shared)
    assert warned == []
    memory = shared.stats()["memory"]
    assert set(memory["shared"]) == {"records"} and isinstance(ds.records, SharedList)
    # workers read the shared segment: what they made private is a small part of the copy
    assert memory["peak_worker_growth"] < dl.stats()["memory"]["peak_worker_growth"] / 4


class CachedBesideNames:
    """A dataset holding a large list that ``__getitem__`` never reads, whose memory grows
    in each worker from a cache it fills (64 KiB a sample)."""

    def __init__(self, n: int, names: int) -> None:
        self.names = [f"/data/images/train/sample-{i:09d}-with-a-long-name.jpg" for i in range(names)]
        self.n = n
        self.cache: dict = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(0.0005)  # (the workers run long enough for the scheduled readings)
        if i not in self.cache:
            self.cache[i] = np.full(8192, float(i))
        return self.cache[i][:4].copy()


@pytest.mark.timeout(240)
def test_the_warning_names_no_container_that_did_not_grow():
    """Growth from a per-worker cache beside a large list the workers never read: the
    warning says what grew and that its cause is unknown, and neither blames the list
    nor recommends share_dataset=True (which would not help); the list is named where
    the workers do read it (test above)."""
    ds = CachedBesideNames(4096, 1_000_000)
    # Persistent: their memory is read at each epoch's end (workers that stop with the
    # epoch are read only by the scheduled checks, which may come before the cache is full).
    dl = DataLoader(ds, batch_size=64, num_workers=2, multiprocessing_context="fork", persistent_workers=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for _batch in dl:
                pass
    growth = dl.stats()["memory"]["peak_worker_growth"]
    dl.shutdown()
    warned = [w for w in caught if issubclass(w.category, CopyOnReadWarning)]
    assert growth >= WARN_MIN_GROWTH
    assert len(warned) == 1
    text = str(warned[0].message)
    assert "grew by" in text and "unknown" in text
    assert "names (list of 1,000,000" in text and "would not help" in text
    assert "Pass share_dataset=True" not in text


def test_the_warning_is_shown_under_default_filters():
    code = "import warnings, shmloader; warnings.warn('grew', shmloader.CopyOnReadWarning)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "CopyOnReadWarning: grew" in done.stderr
    ignored = subprocess.run(
        [sys.executable, "-W", "ignore::ResourceWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "grew" not in ignored.stderr  # the user's -W is kept...
    code_after = code.replace(
        "; warnings.warn", "; warnings.simplefilter('ignore', ResourceWarning); warnings.warn"
    )
    silenced = subprocess.run([sys.executable, "-c", code_after], capture_output=True, text=True, timeout=60)
    assert "grew" not in silenced.stderr  # ...and so is a filter set after the import


# --- stats()["memory"] and share_dataset's batches --------------------------------------------


@pytest.mark.timeout(60)
def test_a_scheduled_check_reads_the_workers_read_longest_ago_and_stats_reads_the_stale(monkeypatch):
    """Five real processes as workers: each scheduled check looks at CHECK_WORKERS of them,
    those read longest ago (a read costs 10-20 ms a worker: all of them at once held the
    consumer), so every one is read in turn, by its totals only (small processes: their
    private memory cannot have reached the warning's floor); stats()' report reads in
    full those whose full reading is over a second old (none yet), and reports every
    worker."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(5)]
    try:
        pids = [p.pid for p in procs]
        looked: list[int] = []
        read: list[int] = []

        def totals(pid):
            looked.append(pid)
            return memory_totals(pid)

        def counted(pid):
            read.append(pid)
            return process_memory(pid)

        monkeypatch.setattr(watch, "memory_totals", totals)
        monkeypatch.setattr(watch, "process_memory", counted)
        now = [10.0]
        mw = MemoryWatch(dataset=lambda: None, clock=lambda: now[0])
        for wid, pid in enumerate(pids):
            mw.started(wid, pid)
        assert CHECK_WORKERS == 2
        for t in (10.0, 10.5, 11.0):
            mw.check(t)
        assert looked == [pids[0], pids[1], pids[2], pids[3], pids[4], pids[0]]
        assert read == []
        assert mw.peak_uss > 0  # from the totals
        now[0] = 11.5
        report = mw.report()
        assert [pid for pid in read if pid in pids] == pids  # (and this process's own)
        assert [w["pid"] for w in report["workers"]] == pids
        assert all(w["uss"] > 0 for w in report["workers"])
        read.clear()
        now[0] = 12.0  # every full reading is half a second old
        mw.report()
        assert [pid for pid in read if pid in pids] == []
        now[0] = 12.6  # every full reading is 1.1 s old
        mw.report()
        assert [pid for pid in read if pid in pids] == pids
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.timeout(60)
def test_a_scheduled_check_reads_in_full_a_worker_whose_unique_memory_reached_the_floor(monkeypatch):
    """A worker whose USS reached 64 MiB may have grown that much private memory (what the
    warning weighs): the check reads it in full and counts its growth; a small one is
    read by its totals only."""
    grown = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096]); "
            "print('ok', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    small = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert grown.stdout.readline().strip() == "ok"
        read: list[int] = []

        def counted(pid):
            read.append(pid)
            return process_memory(pid)

        totals: list[int] = []

        def totals_counted(pid):
            totals.append(pid)
            return memory_totals(pid)

        monkeypatch.setattr(watch, "process_memory", counted)
        monkeypatch.setattr(watch, "memory_totals", totals_counted)
        mw = MemoryWatch(dataset=lambda: None, clock=lambda: 10.0)
        mw.started(0, grown.pid)
        mw.started(1, small.pid)
        mw.check(10.0)
        assert read == [grown.pid] and sorted(totals) == sorted([grown.pid, small.pid])
        assert mw.peak_growth >= WARN_MIN_GROWTH and mw.peak_uss >= WARN_MIN_GROWTH
        # The next check reads the grown one in full at once: its totals would not spare it.
        read.clear()
        totals.clear()
        mw.check(20.0)
        assert read == [grown.pid] and totals == [small.pid]
    finally:
        for p in (grown, small):
            p.kill()
            p.wait()


def test_memory_totals_agree_with_the_full_reading():
    me, totals = process_memory(os.getpid()), memory_totals(os.getpid())
    assert totals is not None
    for name in ("uss", "pss", "rss"):
        assert abs(getattr(totals, name) - getattr(me, name)) < 8 << 20, name
    assert me.private <= totals.uss + (8 << 20)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert memory_totals(child.pid) is None


def test_an_epoch_end_reads_the_workers_once_they_ran_half_a_second(monkeypatch):
    """A short epoch of workers just started (a fresh loader's, a small validation pass)
    ends without reading /proc: a read costs milliseconds a worker, more than such an
    epoch; later ends read when half the interval passed since the last reading."""
    read: list[int] = []
    monkeypatch.setattr(watch, "memory_totals", lambda pid: read.append(pid))  # None: read in full
    monkeypatch.setattr(watch, "process_memory", lambda pid: None)
    now = [10.0]
    mw = MemoryWatch(dataset=lambda: None, clock=lambda: now[0])
    mw.started(0, os.getpid())
    mw.epoch_ended(10.3)
    assert read == []
    mw.epoch_ended(10.5)
    assert read == [os.getpid()]
    mw.epoch_ended(10.7)  # read 0.2 s ago
    assert read == [os.getpid()]
    mw.stopped(os.getpid())  # workers not persistent: the next epoch's start anew
    now[0] = 20.0
    mw.started(0, os.getpid())
    mw.epoch_ended(20.2)
    assert read == [os.getpid()]


@pytest.mark.timeout(120)
def test_stats_memory_reports_running_workers():
    dl = DataLoader(Metadata(20_000), batch_size=256, num_workers=2, persistent_workers=True)
    it = iter(dl)
    next(it)
    memory = dl.stats()["memory"]
    assert [w["id"] for w in memory["workers"]] == [0, 1]
    assert [w["pid"] for w in memory["workers"]] == it.worker_pids()
    for w in memory["workers"]:
        assert w["uss"] > 0 and w["pss"] > 0 and w["growth"] >= 0
    assert memory["workers_uss"] == sum(w["uss"] for w in memory["workers"])
    assert memory["parent"]["uss"] > 0
    assert memory["shared"] == {} and memory["not_shared"] == {}
    for _ in it:
        pass
    del it
    dl.shutdown()
    assert dl.stats()["memory"]["workers"] == []  # stopped workers are not reported
    assert dl.stats()["memory"]["peak_worker_uss"] > 0  # their peak is


@pytest.mark.timeout(240)
@pytest.mark.parametrize("start", ["fork", "spawn", "forkserver"])
def test_shared_dataset_batches_equal_torchs(start):
    torch = pytest.importorskip("torch")
    n = 40_000  # past share_dataset's 16 MiB: the records are shared
    expected = [
        tuple(x.numpy() for x in b)
        for b in torch.utils.data.DataLoader(
            Metadata(n), batch_size=500, shuffle=True, generator=torch.Generator().manual_seed(5)
        )
    ]
    ds = Metadata(n)
    dl = DataLoader(
        ds,
        batch_size=500,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(5),
        share_dataset=True,
        multiprocessing_context=start,
    )
    got, _ = one_epoch(dl)
    assert isinstance(ds.records, SharedList) and set(dl.stats()["memory"]["shared"]) == {"records"}
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
            assert x.dtype == y.dtype


# --- checking a dataset before training ---------------------------------------------------------


def _doctor_on(tmp_path, body: str, spec: str) -> subprocess.CompletedProcess:
    (tmp_path / "userdata.py").write_text(body)
    code = f"import sys\nfrom shmloader.cli import main\nsys.exit(main(['doctor', '--dataset', {spec!r}]))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=tmp_path
    )


def test_doctor_names_a_datasets_large_containers(tmp_path):
    body = (
        "import numpy as np\n"
        "class Meta:\n"
        "    def __init__(self):\n"
        "        self.records = [{'path': f'/x/{i:08d}.jpg', 'label': i} for i in range(200_000)]\n"
        "    def __len__(self):\n"
        "        return len(self.records)\n"
        "    def __getitem__(self, i):\n"
        "        return self.records[i]['label']\n"
        "def arrays():\n"
        "    m = Meta()\n"
        "    m.records = np.arange(2_000_000)\n"
        "    return m\n"
    )
    proc = _doctor_on(tmp_path, body, "userdata:Meta")
    assert "[WARN] dataset memory:" in proc.stdout and "records (list of 200,000" in proc.stdout
    assert "share_dataset=True" in proc.stdout
    proc = _doctor_on(tmp_path, body, "userdata:arrays")
    assert "[OK  ] dataset memory:" in proc.stdout
    proc = _doctor_on(tmp_path, body, "userdata")
    assert proc.returncode == 2 and "--dataset takes MODULE:NAME" in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [True, False])
def test_an_epoch_end_reads_the_workers_only_when_they_live_on(monkeypatch, persistent):
    """At an epoch's end persistent workers are read (they start the next epoch with
    that memory); workers that stop with the epoch are not (their memory goes with them,
    and the reads would hold the last next()). The watch's first check at once, so every
    end is due for a reading."""
    reads: list[int] = []
    monkeypatch.setattr(watch, "FIRST_CHECK_S", 0.0)
    monkeypatch.setattr(watch, "memory_totals", lambda pid: reads.append(pid))  # None: read in full
    monkeypatch.setattr(watch, "process_memory", lambda pid: None)
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=persistent)
    try:
        it = iter(loader)
        for _ in range(4):
            next(it)
        before = len(reads)
        with pytest.raises(StopIteration):
            next(it)
        at_end = len(reads) - before
        del it
    finally:
        loader.shutdown()
    assert before > 0  # the scheduled checks read the running workers
    assert at_end == (CHECK_WORKERS if persistent else 0)
