"""The cores this process may use: one answer (affinity, a cgroup's CPU quota, the CPU
count) shared by the tuner, the time report's verdict and the doctor."""

from __future__ import annotations

import os

import pytest

from shmloader import doctor
from shmloader.system import cores
from shmloader.tuning import autotune, timing


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_read(tmp_path):
    _write(tmp_path / "cpu.max", "250000 100000\n")
    assert cores.cpu_quota(str(tmp_path)) == 2.5


def test_cgroup_v2_without_quota(tmp_path):
    _write(tmp_path / "cpu.max", "max 100000\n")
    assert cores.cpu_quota(str(tmp_path)) is None


@pytest.mark.parametrize("name", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota_is_read(tmp_path, name):
    _write(tmp_path / name / "cpu.cfs_quota_us", "150000\n")
    _write(tmp_path / name / "cpu.cfs_period_us", "100000\n")
    assert cores.cpu_quota(str(tmp_path)) == 1.5


def test_cgroup_v1_without_quota(tmp_path):
    _write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cores.cpu_quota(str(tmp_path)) is None


def test_no_cgroup_files_and_garbage_mean_no_quota(tmp_path):
    assert cores.cpu_quota(str(tmp_path)) is None
    _write(tmp_path / "cpu.max", "lots 100000\n")
    assert cores.cpu_quota(str(tmp_path)) is None


def test_usable_cores_is_the_affinity_bounded_by_the_quota(monkeypatch):
    mine = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cores, "cpu_quota", lambda: None)
    assert cores.usable_cores() == mine
    monkeypatch.setattr(cores, "cpu_quota", lambda: 0.5)  # half a CPU: still one core
    assert cores.usable_cores() == 1
    monkeypatch.setattr(cores, "cpu_quota", lambda: mine + 8.0)  # a quota above the mask
    assert cores.usable_cores() == mine


def test_usable_cores_without_affinity_is_the_cpu_count(monkeypatch):
    monkeypatch.setattr(cores, "affinity_cpus", lambda: set())
    monkeypatch.setattr(cores, "cpu_quota", lambda: None)
    assert cores.usable_cores() == (os.cpu_count() or 1)


def test_tuner_verdict_and_doctor_agree_under_a_quota(monkeypatch):
    """A container limited to one CPU: every reader sees one core, whatever the mask."""
    monkeypatch.setattr(cores, "cpu_quota", lambda: 1.0)
    tuned = autotune.settings("auto", 2, iterable=False)
    assert tuned is not None and tuned.max_workers == 1
    assert "1 usable core(s)" in doctor.check_cores(1).detail
    figures = {"loop_s": 1.0, "wait_s": 1.0, "waited_share": 0.5, "workers_busy_share": 0.99}
    assert "1 workers already use the 1 CPUs" in timing.verdict(figures, 1)
