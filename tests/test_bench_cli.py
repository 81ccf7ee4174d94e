"""`shmloader bench`, `shmloader doctor` and `shmloader make-images`, run for real on
tiny settings.

Everything that starts worker processes runs the CLI in a subprocess with a deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from shmloader import bench, doctor

_DEADLINE_S = 90
_TINY = ["--workloads", "W4", "--batches", "20", "--repeat", "1", "--seconds", "0.2", "--cold-batches", "4"]
_LOADERS = ["shmloader", "torch", "shmloader w0", "copy ceiling", "copy ceiling shm"]


def _cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """Run ``shmloader <args>`` in a fresh interpreter (after ``prelude``)."""
    code = f"{prelude}\nimport sys\nfrom shmloader.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=_DEADLINE_S)


def _torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def test_bench_prints_table_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    png = tmp_path / "r.png"
    proc = _cli(
        "bench",
        *_TINY,
        "--no-memory",
        "--json",
        str(out),
        "--markdown",
        str(md),
        "--plot",
        str(png),
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for column in [
        "workload",
        "loader",
        "batches/s",
        "GB/s",
        "vs torch",
        "% ceiling",
        "CPU ms/batch",
    ]:
        assert column in text
    assert "[1/" in text  # plain progress lines when not on a terminal
    assert "Time to first batch" in text and "Targets (2 workers)" in text
    cold_table = text.split("Cold vs steady")[1].split("\n\n")[0]
    (cold_line,) = [line for line in cold_table.splitlines() if line.startswith("W4 w2")]
    assert cold_line.split()[2] == "4" and " ms ±" in cold_line  # the cold epoch's batches, its time
    table = [line for line in text.splitlines() if line.startswith("W4 w2")]
    assert {name for name in _LOADERS if any(f"  {name}  " in line for line in table)} == set(_LOADERS)
    try:
        import matplotlib  # noqa: F401

        assert png.exists()
    except ImportError:
        assert "matplotlib is not installed" in text and not png.exists()

    data = json.loads(out.read_text())
    machine = data["machine"]
    for key in ["cpu_model", "cores", "python", "numpy", "torch", "start_method"]:
        assert key in machine
    assert data["settings"]["workloads"] == ["W4"] and data["settings"]["repeat"] == 1
    (config,) = data["configs"]
    assert config["label"] == "W4 w2" and config["batch_size"] == 1 and config["batch_bytes"] == 8
    rows = {r["loader"]: r for r in config["rows"]}
    assert set(rows) == set(_LOADERS)
    shm = rows["shmloader"]
    assert shm["status"] == "ok" and shm["batches_per_s"] > 0 and len(shm["runs"]) == 1
    assert shm["consumer_cpu_ms"] > 0 and rows["copy ceiling"]["pct_of_ceiling"] == 100
    if _torch_installed():
        assert rows["torch"]["ratio_to_torch"] == pytest.approx(1.0)
        assert shm["ratio_to_torch"] > 0
        assert set(config["first_batch_s"]) == {"shmloader", "torch"}
        cold = config["cold"]
        assert cold["batches"] == 4 and data["settings"]["cold_batches"] == 4
        assert len(cold["shmloader"]["runs_s"]) == len(cold["torch"]["runs_s"]) == 1
        assert cold["ratio"] == pytest.approx(cold["torch"]["median_s"] / cold["shmloader"]["median_s"])
        # The cold epoch ends after the first batch: time to first batch comes from the same runs.
        assert cold["shmloader"]["median_s"] >= config["first_batch_s"]["shmloader"]["median_s"]
    targets = {t["target"]: t for t in data["targets"]}
    assert targets["W4 w2 vs torch"]["goal"] == ">= 20x"
    if _torch_installed():
        assert targets["W4 w2 cold vs torch"]["goal"] == ">= 4x"
        assert targets["W4 w2 cold vs torch"]["value"] == pytest.approx(config["cold"]["ratio"])
    assert md.read_text().startswith("# shmloader vs torch DataLoader")
    assert "Reproduce with: `shmloader bench --workloads W4" in md.read_text()


def test_bench_without_torch_says_not_installed(tmp_path):
    out = tmp_path / "r.json"
    proc = _cli("bench", *_TINY, "--json", str(out), prelude="import sys; sys.modules['torch'] = None")
    assert proc.returncode == 0, proc.stderr
    torch_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("W4 w2  ") and "torch" in ln]
    assert torch_lines and all("not installed" in ln for ln in torch_lines)
    data = json.loads(out.read_text())
    assert data["machine"]["torch"] is None
    (config,) = data["configs"]
    rows = {r["loader"]: r for r in config["rows"]}
    assert rows["torch"]["status"] == "not installed" and rows["torch"]["batches_per_s"] is None
    assert rows["shmloader"]["batches_per_s"] > 0 and rows["shmloader"]["ratio_to_torch"] is None
    assert set(config["first_batch_s"]) == {"shmloader"}
    assert set(config["cold"]) == {"batches", "shmloader"}  # no torch: no ratio
    cold_line = proc.stdout.split("Cold vs steady")[1].splitlines()[3]
    assert cold_line.startswith("W4 w2") and "not installed" in cold_line
    # The memory probe ran for shmloader only, in its own process.
    assert set(config["memory"]) == {"shmloader"}
    mem = config["memory"]["shmloader"]
    assert "error" not in mem, mem
    assert mem["peak_rss_mb"] > 0 and mem["batches"] > 0
    assert data["targets"][0]["met"] is None  # no torch: nothing to judge


def test_bench_rejects_unknown_workload():
    proc = _cli("bench", "--workloads", "W9")
    assert proc.returncode == 2 and "unknown workload" in proc.stderr
    proc = _cli("bench", "--cold-batches", "0")
    assert proc.returncode == 2 and "--cold-batches must be positive" in proc.stderr


def test_doctor_reports_every_check():
    proc = _cli("doctor", "--workers", "2")
    assert proc.returncode in (0, 1), proc.stderr
    for name in [
        "native helper",
        "shm backend",
        "memory",
        "/dev/shm",
        "ring creation",
        "open files",
        "start method",
        "cores",
        "parent-death signal",
    ]:
        assert f"] {name}:" in proc.stdout
    assert "ulimit -n" in proc.stdout


def test_doctor_json_and_too_small_shm():
    proc = _cli("doctor", "--workers", "1", "--batch-mb", str(2**30), "--json", "--backend", "posix")
    data = json.loads(proc.stdout)
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["/dev/shm"]["status"] == "FAIL" and "--shm-size" in checks["/dev/shm"]["remedy"]
    assert checks["memory"]["status"] == "FAIL"
    assert proc.returncode == 1


def test_doctor_warns_when_workers_exceed_cores():
    check = doctor.check_cores(10_000)
    assert check.status == doctor.WARN and "num_workers <=" in check.remedy


def test_cli_usage():
    proc = _cli()
    assert proc.returncode == 0 and "bench" in proc.stdout and "doctor" in proc.stdout
    assert _cli("nonsense").returncode == 2


def test_configs_and_targets_offline():
    configs = bench.make_configs(["W1", "W1-unordered", "W1-fresh"], [2, 1])
    assert [c.label for c in configs] == [
        "W1 w2",
        "W1-unordered w2",
        "W1-fresh w2",
        "W1 w1",
        "W1-unordered w1",
        "W1-fresh w1",
    ]
    assert not configs[1].in_order and configs[1].persistent_workers
    assert configs[2].in_order and not configs[2].persistent_workers
    (w7,) = bench.make_configs(["W7-unordered"], [2])
    assert (w7.workload, w7.in_order, w7.label) == ("W7", False, "W7-unordered w2")

    res = bench.ConfigResult(configs[0], "d", 64, 1000, 8)
    res.rows = [
        bench.Row("shmloader", batches_per_s=900.0, ratio_to_torch=9.0, pct_of_ceiling=60.0,
                  consumer_cpu_ms=0.1),
        bench.Row("torch", batches_per_s=100.0, ratio_to_torch=1.0, consumer_cpu_ms=2.0),
    ]  # fmt: skip
    res.first_batch_s = {
        "shmloader": {"median_s": 0.2, "spread": 0.0},
        "torch": {"median_s": 0.1, "spread": 0.0},
    }
    res.cold = {
        "batches": 64,
        "shmloader": {"median_s": 0.15, "spread": 0.1},
        "torch": {"median_s": 0.5, "spread": 0.2},
        "ratio": 3.3,
        "ratio_range": [3.0, 3.6],
    }
    targets = {t["target"]: t for t in bench.evaluate_targets([res])}
    assert targets["W1 w2 vs torch"]["met"] is True
    assert targets["W1 w2 cold vs torch"]["met"] is False and targets["W1 w2 cold vs torch"]["value"] == 3.3
    assert targets["W1 w2 % of copy ceiling"]["met"] is True
    assert targets["W1 w2 consumer CPU/batch vs torch"]["value"] == pytest.approx(0.05)
    assert targets["W1 w2 time to first batch vs torch"]["met"] is False
    report = bench.format_report([res], list(targets.values()))
    assert "MISSED" in report and "9.00x" in report
    cold_line = report.split("Cold vs steady")[1].splitlines()[3]
    assert cold_line.split() == ["W1", "w2", "64", "150", "ms", "±10%", "500", "ms", "±20%", "3.30x",
                                 "(3.00-3.60)", "9.00x"]  # fmt: skip


def test_datasets_pickle_and_match_workloads():
    import pickle

    for name, wl in bench.WORKLOADS.items():
        if name == "W5" or wl.make is None:
            continue  # W5 calibrates ~1 ms of work (covered by the bench runs); W6 has no dataset here
        ds = wl.make(32)
        clone = pickle.loads(pickle.dumps(ds))
        assert type(clone) is type(ds) and len(clone) == 32
    assert bench.batch_bytes_of(bench.WORKLOADS["W1"].make(64), 64) == 64 * (3 * 224 * 224 + 8)
    assert bench.batch_bytes_of(bench.WORKLOADS["W3"].make(256), 256) == 256 * (16 * 4 + 8)


def test_progress_plain_lines():
    lines: list[str] = []
    progress = bench.Progress(2, lines.append)
    progress.tty = False
    progress.step("one")
    progress.step("two")
    assert lines[0].startswith("[1/2 ") and lines[1].endswith("two")


def test_probe_is_module_level():
    # The memory probe runs `python -m shmloader.bench --probe`: the module must stay runnable.
    src = textwrap.dedent(
        """
        import runpy, sys
        sys.argv = ["shmloader.bench", "--help"]
        try:
            runpy.run_module("shmloader.bench", run_name="__main__")
        except SystemExit as e:
            sys.exit(e.code)
        """
    )
    proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--workloads" in proc.stdout


def test_make_images_writes_a_folder(tmp_path):
    root = tmp_path / "imgs"
    proc = _cli(
        "make-images", str(root), "--count", "6", "--classes", "2", "--min-size", "24", "--max-size", "40"
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 6 JPEGs in 2 classes" in proc.stdout
    files = sorted(root.glob("class_*/*.jpg"))
    assert len(files) == 6 and {f.parent.name for f in files} == {"class_00", "class_01"}
    assert all(f.read_bytes()[:2] == b"\xff\xd8" for f in files)  # JPEG start-of-image
    assert "make-images" in _cli().stdout
    assert _cli("make-images", str(root), "--count", "0").returncode == 2


def test_make_images_without_pillow_says_so(tmp_path):
    proc = _cli(
        "make-images", str(tmp_path / "x"), "--count", "2", prelude="import sys; sys.modules['PIL'] = None"
    )
    assert proc.returncode == 2 and "needs Pillow" in proc.stderr and "pip install pillow" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_bench_w7_bucketed_padding(tmp_path):
    out = tmp_path / "r.json"
    proc = _cli(
        "bench", "--workloads", "W7", "--batches", "20", "--repeat", "1", "--seconds", "0.2", "--no-memory",
        "--cold-batches", "4",
        "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "W7 padding waste" in proc.stdout and "n/a (ragged batches)" in proc.stdout
    (config,) = json.loads(out.read_text())["configs"]
    rows = {r["loader"]: r for r in config["rows"]}
    assert rows["shmloader"]["batches_per_s"] > 0 and rows["shmloader w0"]["batches_per_s"] > 0
    assert rows["copy ceiling"]["status"].startswith("n/a") and rows["shmloader"]["pct_of_ceiling"] is None
    pad = config["extra"]["padding"]
    assert 0 < pad["bucketed"]["waste"] < 0.2 < pad["unbucketed"]["waste"] < 0.7
    if _torch_installed():
        assert rows["torch"]["batches_per_s"] > 0 and rows["shmloader"]["ratio_to_torch"] > 0
        assert set(config["first_batch_s"]) == {"shmloader", "torch"}
    (target,) = json.loads(out.read_text())["targets"]
    assert target["target"] == "W7 w2 vs torch" and target["goal"] == ">= 5x"


def test_w7_collate_and_waste_offline():
    import numpy as np

    padded, lengths = bench.pad_collate([np.arange(1, 3, dtype=np.int32), np.arange(1, 5, dtype=np.int32)])
    assert padded.dtype == np.int32 and padded.tolist() == [[1, 2, 0, 0], [1, 2, 3, 4]]
    assert lengths.tolist() == [2, 4]
    waste = bench.padding_waste([2, 4, 3, 3], [[0, 1], [2, 3]])
    assert waste["waste"] == pytest.approx(2 / 14) and waste["elements_per_batch"] == 7
    ds = bench.TokenDataset(500)
    assert (
        all(16 <= n <= 2048 for n in ds.lengths) and ds[3].dtype == np.int32 and len(ds[3]) == ds.lengths[3]
    )
    assert ds.lengths == bench.TokenDataset(500).lengths  # seeded


def test_w6_rows_and_targets_offline(monkeypatch):
    from shmloader.bench import jpeg as vb

    def fake_run(root, *, batch_size, workers, repeat, log):
        for _ in range(len(vb.PEERS) * (1 + repeat)):
            log("step")
        rates = {"torch+conventional": [500.0, 600.0], "torch+ImageFolder": [900.0, 1000.0],
                 "shmloader+ImageFolder": [1500.0, 1500.0]}  # fmt: skip
        results = [vb.PeerResult(p, sorted(r)[0], 2.0, 1.0, 0.1, r) for p, r in rates.items()]
        return {"workload": "W6", "folder": str(root), "load": (0.0, 0.0), "cores": 2, "backend": "torch",
                "results": results, "ratios": {}, "targets": {}}  # fmt: skip

    monkeypatch.setattr(vb, "run", fake_run)
    monkeypatch.setattr(vb, "ensure_images", lambda root, count=vb.W6_COUNT: root)
    monkeypatch.setattr(vb, "format_table", lambda report: "W6 table")
    monkeypatch.setattr(bench, "_w6_missing", lambda torch_dl: None)
    (cfg,) = bench.make_configs(["W6"], [2])
    lines: list[str] = []
    progress = bench.Progress(bench._config_steps(cfg, 2, True, True), lines.append)
    progress.tty = False
    res = bench.measure_config(
        cfg, batches=None, seconds=1.0, repeat=2, memory=True, torch_dl=object(), progress=progress
    )
    assert progress.done == progress.total
    rows = {r.loader: r for r in res.rows}
    assert set(rows) == set(vb.PEERS)
    assert rows["shmloader+ImageFolder"].batches_per_s == pytest.approx(1500 / 64)
    assert rows["shmloader+ImageFolder"].ratio_to_torch == pytest.approx((3.0 + 2.5) / 2)
    assert rows["torch+conventional"].ratio_to_torch == pytest.approx(1.0)
    targets = {t["target"]: t for t in bench.evaluate_targets([res])}
    assert targets["W6 w2 shmloader+ImageFolder vs torch+conventional"]["met"] is True
    assert targets["W6 w2 shmloader+ImageFolder vs torch+ImageFolder"]["value"] == pytest.approx(
        (1500 / 900 + 1500 / 1000) / 2
    )
    report = bench.format_report([res], list(targets.values()))
    assert "W6 w2 in detail:\nW6 table" in report and "W6 w2  " not in report.split("Time to first")[1]


def test_w6_skipped_without_pillow():
    proc = _cli(
        "bench", "--workloads", "W6", "--repeat", "1", prelude="import sys; sys.modules['PIL'] = None"
    )
    assert proc.returncode == 0, proc.stderr
    assert "needs Pillow and simplejpeg" in proc.stdout
    w6 = [ln for ln in proc.stdout.splitlines() if ln.startswith("W6 w2  ")]
    assert len(w6) == 3 and all("skipped" in ln for ln in w6)
