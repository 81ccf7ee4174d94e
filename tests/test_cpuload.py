"""Whether other processes keep the CPUs busy (system/cpuload.py), and how the verdict
reaches the yielding of both sides (transport/yielding.py): /proc/stat read from files
written here, then real CPU-bound processes beside a real measure, then loaders."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from shmloader import DataLoader
from shmloader.epoch import collector as collector_module
from shmloader.system import cpuload
from shmloader.system.cpuload import PROC_STAT, OthersLoad, cpu_seconds, others_runnable, process_seconds
from shmloader.transport.channel import Channel
from shmloader.transport.yielding import YIELD_MAX_NS, YieldWindow

pytestmark = pytest.mark.timeout(120)

TICK = 1.0 / os.sysconf("SC_CLK_TCK")
CPUS = sorted(os.sched_getaffinity(0))


def _stat_file(path, busy: dict[int, int], idle: dict[int, int]) -> None:
    """A /proc/stat with the given busy (user) and idle ticks per CPU, the other columns
    spread so that each counts: nice 1, system 2, iowait 3, irq 4, softirq 5, steal 50."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for cpu in sorted(busy):
        lines.append(f"cpu{cpu} {busy[cpu]} 1 2 {idle[cpu]} 3 4 5 50 0 0")
    lines.append("intr 12 0 0")
    lines.append("ctxt 99")
    path.write_text("\n".join(lines) + "\n")


def test_cpu_seconds_sums_the_busy_and_idle_columns_of_the_cpus_asked(tmp_path):
    stat = tmp_path / "stat"
    _stat_file(stat, {0: 100, 1: 200, 5: 1000}, {0: 10, 1: 20, 5: 1000})
    busy, idle = cpu_seconds({0, 1}, str(stat))
    assert busy == pytest.approx((100 + 200 + 2 * (1 + 2 + 4 + 5)) * TICK)
    assert idle == pytest.approx((10 + 20 + 2 * 3) * TICK)
    every_busy, _ = cpu_seconds(set(), str(stat))  # no affinity mask: every CPU
    assert every_busy == pytest.approx((100 + 200 + 1000 + 3 * 12) * TICK)
    assert cpu_seconds({0}, str(tmp_path / "missing")) is None


def test_process_seconds_counts_a_process_cpu_and_nothing_for_one_gone():
    before = process_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert process_seconds(os.getpid()) - before >= 0.2
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_seconds(child.pid) == 0.0


def _verdict(tmp_path, busy_ticks: int, idle_ticks: int) -> bool:
    """OthersLoad's verdict over one simulated second in which every CPU of this process
    gained ``busy_ticks`` and ``idle_ticks`` (this process's own CPU is subtracted)."""
    stat = tmp_path / "stat"
    _stat_file(stat, dict.fromkeys(CPUS, 1000), dict.fromkeys(CPUS, 1000))
    load = OthersLoad(str(stat), str(tmp_path / "no-loadavg"))
    assert load.busy, "busy (nothing yields) until the first verdict, with no instant look"
    assert load.due(0)
    load.measure(0, [])
    assert not load.due(cpuload.FIRST_INTERVAL_NS - 1) and load.due(cpuload.FIRST_INTERVAL_NS)
    _stat_file(stat, dict.fromkeys(CPUS, 1000 + busy_ticks), dict.fromkeys(CPUS, 1000 + idle_ticks))
    verdict = load.measure(1_000_000_000, [])
    assert verdict == load.busy
    assert load.due(1_000_000_000 + cpuload.INTERVAL_NS) and not load.due(
        1_000_000_000 + cpuload.INTERVAL_NS - 1
    )
    return verdict


def test_the_verdict_is_busy_only_when_others_use_the_cpus_and_none_is_idle(tmp_path):
    second = round(1 / TICK)
    assert _verdict(tmp_path, second, 0), "every CPU busy, none of it ours"
    assert not _verdict(tmp_path, 1, second - 1), "every CPU idle"
    if len(CPUS) >= 2:
        # Others busy on the CPUs, but as much idle time as one CPU's: a yield finds an idle one.
        half = second // 2
        assert not _verdict(tmp_path, half, second - half)


def test_without_proc_stat_the_machine_counts_as_quiet(tmp_path):
    load = OthersLoad(str(tmp_path / "missing"), str(tmp_path / "missing-too"))
    assert not load.busy
    assert load.measure(0, []) is False


def test_before_the_first_verdict_one_look_at_the_runnable_tasks_decides(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.50 0.40 0.30 1/85 1234\n")  # only the reader runs
    assert others_runnable(2, str(loadavg)) is False
    assert not OthersLoad(PROC_STAT, str(loadavg)).busy
    loadavg.write_text("2.50 2.40 2.30 3/85 1234\n")  # the reader and two others
    assert others_runnable(2, str(loadavg)) is True
    assert others_runnable(8, str(loadavg)) is False, "idle CPUs left"
    assert OthersLoad(PROC_STAT, str(loadavg)).busy is (len(CPUS) <= 3)
    assert others_runnable(2, str(tmp_path / "missing")) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat (Linux)")
def test_cpu_bound_processes_beside_make_the_machine_busy():
    """One CPU-bound process per CPU of this process's mask (real processes, ended here):
    the next full measure says busy."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in CPUS[:8]]
    try:
        time.sleep(0.2)
        load = OthersLoad()
        load.measure(time.perf_counter_ns(), [])
        time.sleep(0.6)
        assert load.measure(time.perf_counter_ns(), []), f"{len(burners)} CPU-bound processes beside: busy"
    finally:
        for b in burners:
            b.kill()
        for b in burners:
            b.wait()


def test_the_loaders_own_processes_are_not_others(tmp_path):
    """A worker's CPU is the loader's own: given its pid, a CPU-bound process's time is
    taken off the machine's (a /proc/stat written here holds exactly that time), and the
    verdict stays quiet; not given it, the same time is others' and the verdict busy."""
    stat = tmp_path / "stat"
    _stat_file(stat, dict.fromkeys(CPUS, 1000), dict.fromkeys(CPUS, 1000))
    worker = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)
        ours, theirs = OthersLoad(str(stat)), OthersLoad(str(stat))  # (their first verdicts: not asked)
        began = time.perf_counter_ns()
        cpu = process_seconds(worker.pid)
        ours.measure(began, [worker.pid])
        theirs.measure(began, [])
        # Until it has had 0.2 s of CPU: half a second of wall time gives it less on a
        # loaded machine.
        deadline = time.monotonic() + 30
        while process_seconds(worker.pid) - cpu <= 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        spent = round((process_seconds(worker.pid) - cpu) / TICK)
        assert spent * TICK > 0.2, "the CPU-bound process ran"
        _stat_file(stat, {c: 1000 + (spent if c == CPUS[0] else 0) for c in CPUS}, dict.fromkeys(CPUS, 1000))
        # The verdicts' clock, as the stat file, is the test's: as much time passed as the
        # process had CPU (a whole core, however loaded the machine is).
        now = began + spent * round(TICK * 1e9)
        assert not ours.measure(now, [worker.pid])
        assert theirs.measure(now, [])
    finally:
        worker.kill()
        worker.wait()


class _Spin:
    """Sample i costs ~1 ms of CPU."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        end = time.process_time() + 0.001
        while time.process_time() < end:
            pass
        return i


def test_the_channel_carries_the_verdict_to_the_worker():
    consumer = Channel.create()
    worker = Channel.attach(os.dup(consumer.fd), consumer.offset, consumer.size)  # type: ignore[arg-type]
    consumer.close_fd()
    assert not worker.yielding_allowed(), "a new channel: no yielding until the consumer allows it"
    consumer.allow_yielding(True)
    assert worker.yielding_allowed()
    consumer.allow_yielding(False)
    assert not worker.yielding_allowed()


def test_a_yield_window_is_none_while_not_allowed_and_adapts_to_the_sleeps():
    window = YieldWindow()
    assert window.window() == 0
    window.allowed = True
    assert window.window() == YIELD_MAX_NS
    window.slept(10 * YIELD_MAX_NS)  # a long sleep: half
    assert window.window() == YIELD_MAX_NS // 2
    window.slept(YIELD_MAX_NS)  # yielding would have caught it: all again
    assert window.window() == YIELD_MAX_NS
    for _ in range(20):
        window.slept(10 * YIELD_MAX_NS)
    assert window.window() == 0


@pytest.mark.parametrize("busy", [True, False])
def test_the_consumer_tells_every_worker_the_verdict(request, monkeypatch, busy):
    """The consumer passes its verdict (conftest's stand-ins) to each worker's channel as
    it waits, and yields itself only on a quiet machine."""
    request.getfixturevalue("busy_machine" if busy else "quiet_machine")
    yields = []
    # A spy on the private yield: how long the consumer yields is seen nowhere else.
    original = collector_module.Collector._yield_for

    def counted(self, window_ns):
        yields.append(window_ns)
        return original(self, window_ns)

    monkeypatch.setattr(collector_module.Collector, "_yield_for", counted)
    dl = DataLoader(_Spin(64), batch_size=2, num_workers=2, persistent_workers=True, output="numpy")
    it = iter(dl)
    try:
        got = [int(v) for b in it for v in np.asarray(b)]
        assert got == list(range(64))
        flags = [w.channel.yielding_allowed() for w in it.workers]
        assert flags == [not busy] * 2
        assert bool(yields) == (not busy)
    finally:
        del it
        dl.shutdown()
