"""`shmloader bench`, `shmloader doctor` and `shmloader make-images`, run for real on
tiny settings.

Everything that starts worker processes runs the CLI in a subprocess with a deadline.
"""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shmloader import doctor
from shmloader.bench import ceiling, datasets, decodelimit, jpeg, progress, report, results, workloads
from shmloader.bench.cli import TORCH_HINT

_DEADLINE_S = 90
_TINY = ["--workloads", "W4", "--batches", "20", "--repeat", "1", "--seconds", "0.2", "--cold-batches", "4"]
_LOADERS = ["shmloader", "torch", "shmloader w0", "copy ceiling", "copy ceiling shm"]


def _cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """Run ``shmloader <args>`` in a fresh interpreter (after ``prelude``)."""
    code = f"{prelude}\nimport sys\nfrom shmloader.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=_DEADLINE_S)


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _targets():
    """benchmarks/targets.py (the project's targets are not in the library)."""
    spec = importlib.util.spec_from_file_location("bench_targets", BENCHMARKS / "targets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _judge(configs: list) -> dict:
    """The targets judged on ``configs`` (ConfigResults) through their JSON form."""
    data = json.loads(json.dumps(report.results_json(configs, {}, {}), default=str))
    return {t["target"]: t for t in _targets().evaluate(data["configs"])}


def test_bench_prints_table_and_writes_json(tmp_path):
    """With torch, its rows and ratios; without it (the README's test command on a fresh
    machine), everything else, and one line saying how to get them."""
    torch = _torch_installed()
    loaders = set(_LOADERS) if torch else set(_LOADERS) - {"torch"}
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
    for column in ["workload", "loader", "batches/s", "GB/s", "% ceiling", "CPU ms/batch"]:
        assert column in text
    assert ("vs torch" in text) == torch
    assert "[1/" in text  # plain progress lines when not on a terminal
    assert "Time to first batch" in text
    assert "Targets" not in text  # targets are benchmarks/run.py's
    assert report.CONSUMER_NOTE in text  # the figures are those of a consumer reading its batches
    assert (TORCH_HINT in text) == (not torch)
    cold_table = text.split("Cold vs steady")[1].split("\n\n")[0]
    (cold_line,) = [line for line in cold_table.splitlines() if line.startswith("W4 w2")]
    assert cold_line.split()[2] == "4" and " ms ±" in cold_line  # the cold epoch's batches, its time
    table = [line for line in text.splitlines() if line.startswith("W4 w2")]
    assert {name for name in _LOADERS if any(f"  {name}  " in line for line in table)} == loaders
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
    assert set(rows) == loaders
    shm = rows["shmloader"]
    assert shm["status"] == "ok" and shm["batches_per_s"] > 0 and len(shm["runs"]) == 1
    assert shm["consumer_cpu_ms"] > 0 and rows["copy ceiling"]["pct_of_ceiling"] == 100
    if torch:
        assert rows["torch"]["ratio_to_torch"] == pytest.approx(1.0)
        assert shm["ratio_to_torch"] > 0
        assert set(config["first_batch_s"]) == {"shmloader", "torch"}
        cold = config["cold"]
        assert cold["batches"] == 4 and data["settings"]["cold_batches"] == 4
        assert len(cold["shmloader"]["runs_s"]) == len(cold["torch"]["runs_s"]) == 1
        assert cold["ratio"] == pytest.approx(cold["torch"]["median_s"] / cold["shmloader"]["median_s"])
        # The cold epoch ends after the first batch: time to first batch comes from the same runs.
        assert cold["shmloader"]["median_s"] >= config["first_batch_s"]["shmloader"]["median_s"]
    else:
        assert machine["torch"] is None and shm["ratio_to_torch"] is None
        assert set(config["first_batch_s"]) == {"shmloader"}
        assert set(config["cold"]) == {"batches", "shmloader"} and config["cold"]["batches"] == 4
    assert "targets" not in data
    assert md.read_text().startswith("# shmloader vs torch DataLoader")
    assert "Reproduce with: `shmloader bench --workloads W4" in md.read_text()
    assert report.CONSUMER_NOTE in md.read_text()


def test_bench_without_torch_says_once_how_to_compare(tmp_path):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    # torch's import blocked: the run goes on, and says in one line how to get torch's columns.
    blocked = "import sys; sys.modules['torch'] = None"
    proc = _cli("bench", *_TINY, "--json", str(out), "--markdown", str(md), prelude=blocked)
    assert proc.returncode == 0, proc.stderr
    stdout = proc.stdout.replace(str(tmp_path), "TMP")  # the test's name is in its temporary folder
    assert [ln for ln in stdout.splitlines() if "torch" in ln] == [TORCH_HINT]
    assert "pip install torch" in TORCH_HINT and "not installed" not in stdout.replace(TORCH_HINT, "")
    main_table = next(b for b in proc.stdout.split("\n\n") if b.startswith("workload  loader"))
    header = " ".join(main_table.splitlines()[0].split())
    assert header == "workload loader batches/s spread GB/s % ceiling CPU ms/batch"
    cold_table = proc.stdout.split("Cold vs steady")[1].split("\n\n")[0].splitlines()
    assert cold_table[1].split() == ["workload", "batches", "shmloader"] and cold_table[3].startswith("W4 w2")
    data = json.loads(out.read_text())
    assert data["machine"]["torch"] is None
    (config,) = data["configs"]
    rows = {r["loader"]: r for r in config["rows"]}
    assert set(rows) == set(_LOADERS) - {"torch"}
    assert rows["shmloader"]["batches_per_s"] > 0 and rows["shmloader"]["ratio_to_torch"] is None
    assert set(config["first_batch_s"]) == {"shmloader"}
    assert set(config["cold"]) == {"batches", "shmloader"}  # no torch: no ratio
    # The memory probe ran for shmloader only, in its own process.
    assert set(config["memory"]) == {"shmloader"}
    mem = config["memory"]["shmloader"]
    assert "error" not in mem, mem
    assert mem["peak_rss_mb"] > 0 and mem["batches"] > 0
    assert (
        "| vs torch |" not in md.read_text() and "torch not installed" in md.read_text()
    )  # the machine line
    # No torch: nothing to judge but the one absolute figure, the consumer's CPU per batch.
    judged = {t["target"] for t in _targets().evaluate(data["configs"]) if t["met"] is not None}
    assert judged == {"W4 w2 consumer CPU/batch"}


def test_bench_rejects_unknown_workload():
    proc = _cli("bench", "--workloads", "W99")
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
        "region JPEG decoder",
    ]:
        assert f"] {name}:" in proc.stdout
    assert "ulimit -n" in proc.stdout


def test_doctor_names_the_headers_a_missing_region_decoder_needs():
    # As built where libjpeg-turbo's headers were absent: shmloader._jpeg does not import.
    proc = _cli(
        "doctor", "--workers", "1", "--json", prelude="import sys; sys.modules['shmloader._jpeg'] = None"
    )
    assert proc.returncode in (0, 1), proc.stderr
    check = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}["region JPEG decoder"]
    assert check["status"] == "WARN" and "jpeglib.h" in check["detail"], check
    assert "libjpeg62-turbo-dev (Debian)" in check["remedy"] and "libjpeg-turbo8-dev" in check["remedy"]
    # This process, as installed: OK naming the library bound, or WARN saying why not.
    from shmloader.vision import region

    bound, check = region.decoder(), doctor.check_region_decoder()
    if bound is not None:
        assert check.status == doctor.OK and bound.library in check.detail, check
    else:
        assert check.status == doctor.WARN and check.remedy, check


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
    configs = workloads.make_configs(["W1", "W1-unordered", "W1-fresh"], [2, 1])
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
    (w7,) = workloads.make_configs(["W7-unordered"], [2])
    assert (w7.workload, w7.in_order, w7.label) == ("W7", False, "W7-unordered w2")

    res = results.ConfigResult(configs[0], "d", 64, 1000, 8)
    res.rows = [
        results.Row(
            "shmloader", batches_per_s=900.0, ratio_to_torch=9.0, pct_of_ceiling=60.0, consumer_cpu_ms=0.1
        ),
        results.Row("torch", batches_per_s=100.0, ratio_to_torch=1.0, consumer_cpu_ms=2.0),
    ]
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
    (w4,) = workloads.make_configs(["W4"], [2])
    res4 = results.ConfigResult(w4, "d", 64, 8, 8)
    res4.rows = [results.Row("shmloader", batches_per_s=40e3, ratio_to_torch=35.0, consumer_cpu_ms=0.0162)]
    targets = _judge([res, res4])
    assert targets["W4 w2 vs torch"]["met"] is True
    assert targets["W4 w2 consumer CPU/batch"]["met"] is False
    assert targets["W4 w2 consumer CPU/batch"]["value"] == pytest.approx(16.2)
    assert "16.2 us" in _targets().text([targets["W4 w2 consumer CPU/batch"]])
    assert targets["W1 w2 vs torch"]["met"] is True
    assert targets["W1 w2 cold vs torch"]["met"] is False and targets["W1 w2 cold vs torch"]["value"] == 3.3
    assert targets["W1 w2 % of copy ceiling"]["met"] is True
    assert targets["W1 w2 consumer CPU/batch vs torch"]["value"] == pytest.approx(0.05)
    assert targets["W1 w2 time to first batch vs torch"]["met"] is False
    table = _targets().text(list(targets.values()))
    assert table.startswith("Targets (2 workers):") and "MISSED" in table and "9x" in table
    text = report.format_report([res])
    assert "9.00x" in text and "Targets" not in text
    cold_line = text.split("Cold vs steady")[1].splitlines()[3]
    assert " ".join(cold_line.split()) == "W1 w2 64 150 ms ±10% 500 ms ±20% 3.30x (3.00-3.60) 9.00x"


def test_datasets_pickle_and_match_workloads():
    import pickle

    for name, wl in workloads.WORKLOADS.items():
        if name == "W5" or wl.make is None:
            continue  # W5 calibrates ~1 ms of work (covered by the bench runs); W6 has no dataset here
        ds = wl.make(32)
        clone = pickle.loads(pickle.dumps(ds))
        assert type(clone) is type(ds) and len(clone) == 32
        assert type(ds).__module__ == "shmloader.bench.datasets"  # importable by name in spawned workers
    assert ceiling.batch_bytes_of(workloads.WORKLOADS["W1"].make(64), 64) == 64 * (3 * 224 * 224 + 8)
    assert ceiling.batch_bytes_of(workloads.WORKLOADS["W3"].make(256), 256) == 256 * (16 * 4 + 8)


def test_progress_plain_lines():
    lines: list[str] = []
    bar = progress.Progress(2, lines.append)
    bar.tty = False
    bar.step("one")
    bar.step("two")
    assert lines[0].startswith("[1/2 ") and lines[1].endswith("two")


def test_probe_is_module_level():
    # `python -m shmloader.bench` is `shmloader bench`; the memory probe runs
    # `python -m shmloader.bench.memory SPEC` (covered by the bench runs above).
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
    assert proc.returncode == 0 and "--workloads" in proc.stdout and "--probe" not in proc.stdout


def test_bench_package_is_small_modules():
    """The package's shape (issue 15): modules of one concept each, none large, W6 among
    them (no second harness in shmloader.vision), and importing the package itself is
    cheap (the CLI and its imports load when main runs)."""
    package = Path(jpeg.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in package.glob("*.py")}
    assert {"workloads.py", "peers.py", "measure.py", "jpeg.py", "memory.py", "report.py", "cli.py"} <= set(
        sizes
    )
    assert max(sizes.values()) < 400, sizes
    assert importlib.util.find_spec("shmloader.vision.benchmark") is None
    code = "import sys, shmloader.bench; print(sorted(m for m in sys.modules if 'shmloader.bench' in m))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "['shmloader.bench']", proc.stdout + proc.stderr


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
        "bench",
        "--workloads",
        "W7",
        "--batches",
        "20",
        "--repeat",
        "1",
        "--seconds",
        "0.2",
        "--no-memory",
        "--cold-batches",
        "4",
        "--json",
        str(out),
    )
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
    assert "targets" not in json.loads(out.read_text())
    (target,) = _targets().evaluate(json.loads(out.read_text())["configs"])
    assert target["target"] == "W7 w2 vs torch" and target["goal"] == ">= 5x"


def test_run_py_adds_the_targets(tmp_path):
    # benchmarks/run.py: `shmloader bench` with the full run's settings (later options win),
    # then the targets judged on its JSON: printed, and added to the JSON and the markdown.
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "run.py"),
            *_TINY,
            "--workers",
            "2",
            "--no-memory",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ],
        capture_output=True,
        text=True,
        timeout=_DEADLINE_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["settings"]["workloads"] == ["W4"] and data["settings"]["repeat"] == 1
    targets = {t["target"]: t for t in data["targets"]}
    assert targets["W4 w2 vs torch"]["goal"] == ">= 30x"
    assert proc.stdout.rstrip().endswith(_targets().text(data["targets"]))
    assert md.read_text().endswith(_targets().markdown(data["targets"]))
    if _torch_installed():
        assert targets["W4 w2 cold vs torch"]["goal"] == ">= 4x"
        assert targets["W4 w2 cold vs torch"]["value"] == pytest.approx(data["configs"][0]["cold"]["ratio"])


def test_w7_collate_and_waste_offline():
    import numpy as np

    padded, lengths = datasets.pad_collate([np.arange(1, 3, dtype=np.int32), np.arange(1, 5, dtype=np.int32)])
    assert padded.dtype == np.int32 and padded.tolist() == [[1, 2, 0, 0], [1, 2, 3, 4]]
    assert lengths.tolist() == [2, 4]
    waste = datasets.padding_waste([2, 4, 3, 3], [[0, 1], [2, 3]])
    assert waste["waste"] == pytest.approx(2 / 14) and waste["elements_per_batch"] == 7
    ds = datasets.TokenDataset(500)
    assert (
        all(16 <= n <= 2048 for n in ds.lengths) and ds[3].dtype == np.int32 and len(ds[3]) == ds.lengths[3]
    )
    assert ds.lengths == datasets.TokenDataset(500).lengths  # seeded


class _FakeEpochs(jpeg.EpochPeer):
    """A W6 peer whose epochs take no time: fixed images/s per repeat."""

    def __init__(self, name: str, rates: list[float]):
        super().__init__(name, SimpleNamespace(dataset=SimpleNamespace(backend="torch")), 64)
        self.rates = iter(rates)
        self.closed = False

    def warm_up(self) -> None:
        pass

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]:
        rate = next(self.rates)
        self.images_per_s.append(rate)
        self.all_cpu_ms_per_image.append(2000 / rate)
        return rate / 64, 0.002, 32

    def close(self) -> None:
        self.closed = True


def test_w6_runs_on_the_one_harness_offline(monkeypatch, tmp_path):
    rates = {
        "torch+conventional": [500.0, 600.0],
        "torch+ImageFolder": [900.0, 1000.0],
        "shmloader+ImageFolder": [1500.0, 1500.0],
    }
    peers = [_FakeEpochs(name, r) for name, r in rates.items()]
    fresh = [_FakeEpochs(name, [r / 2 for r in rs]) for name, rs in rates.items()]  # fresh passes
    fresh.append(_FakeEpochs(decodelimit.LIMIT, [1000.0, 1500.0]))  # their decode limit
    fresh.append(_FakeEpochs(decodelimit.PARALLEL, [800.0, 1000.0]))  # the decode on all cores
    monkeypatch.setattr(jpeg, "_peers", lambda *args: (peers, fresh))
    monkeypatch.setattr(jpeg, "ensure_images", lambda root, *args: root)
    monkeypatch.setattr(jpeg, "w6_missing", lambda torch_dl: None)
    (cfg,) = workloads.make_configs(["W6"], [2])
    lines: list[str] = []
    bar = progress.Progress(jpeg.w6_steps(2), lines.append)
    bar.tty = False
    res = jpeg.measure_w6(cfg, repeat=2, torch_dl=object(), progress=bar, root=tmp_path)
    assert bar.done == bar.total and all(p.closed for p in peers)
    # The harness alternates: repeat 1 in order, repeat 2 reversed.
    timed = [ln.split("] ")[1].split(":")[0] for ln in lines if "repeat" in ln]
    names = list(rates)
    order = [(r, n) for r, ns in ((1, names), (2, names[::-1])) for n in ns]
    fresh_names = [*names, decodelimit.LIMIT, decodelimit.PARALLEL]
    fresh_order = [(r, n) for r, ns in ((1, fresh_names), (2, fresh_names[::-1])) for n in ns]
    assert timed == [f"W6 w2 repeat {r}/2 {n}" for r, n in order] + [
        f"W6 w2 fresh repeat {r}/2 {n}" for r, n in fresh_order
    ]
    rows = {r.loader: r for r in res.rows}
    assert list(rows) == list(jpeg.PEERS)
    assert rows["shmloader+ImageFolder"].batches_per_s == pytest.approx(1500 / 64)
    assert rows["shmloader+ImageFolder"].ratio_to_torch == pytest.approx((3.0 + 2.5) / 2)
    assert rows["torch+conventional"].ratio_to_torch == pytest.approx(1.0)
    assert rows["shmloader+ImageFolder"].consumer_cpu_ms == pytest.approx(2.0)
    w6 = res.extra["w6"]
    assert w6["ratios"]["shmloader+ImageFolder / torch+ImageFolder"] == pytest.approx(
        (1500 / 900 + 1500 / 1000) / 2
    )
    assert {r["peer"]: r["images_per_s"] for r in w6["results"]}["torch+conventional"] == pytest.approx(550)
    assert w6["fresh"]["ratio_ranges"]["shmloader+ImageFolder / torch+conventional"] == pytest.approx(
        [2.5, 3.0]
    )
    # The fresh passes over their decode limit: 750/1000 and 750/1500, paired per repeat.
    assert w6["fresh"]["ratios"]["shmloader+ImageFolder / decode limit"] == pytest.approx((0.75 + 0.5) / 2)
    assert w6["fresh"]["ratios"]["shmloader+ImageFolder / decode, all cores"] == pytest.approx(
        (750 / 800 + 750 / 1000) / 2
    )
    assert w6["fresh"]["limit_cores"] == decodelimit.usable_cores()
    targets = _judge([res])
    assert targets["W6 w2 shmloader+ImageFolder vs torch+conventional"]["met"] is True
    assert targets["W6 w2 fresh pass vs decode limit"]["met"] is False  # 0.625x
    assert targets["W6 w2 fresh pass vs torch+ImageFolder"]["value"] == pytest.approx(
        (1500 / 900 + 1500 / 1000) / 2
    )
    assert targets["W6 w2 shmloader+ImageFolder vs torch+ImageFolder"]["value"] == pytest.approx(
        (1500 / 900 + 1500 / 1000) / 2
    )
    text = report.format_report([res])
    assert (
        "W6 w2 in detail:\n" + res.extra["w6_table"] in text
        and "Fresh loaders" in text
        and "decode limit: the dataset's own __getitem__" in text
        and "decode, all cores: the same __getitem__ in" in text
        and "MISSED" not in text
    )
    assert "W6 w2  " not in text.split("Time to first")[1]
    # CPU per image of all processes, torch+conventional's over ours: 2000/550 ms over 2000/1500 ms.
    assert (
        "torch+conventional / shmloader+ImageFolder" in res.extra["w6_table"]
        and "2.75x" in res.extra["w6_table"]
    )


def test_w6_decode_limit_is_the_datasets_getitem_on_one_thread_times_the_cores():
    """The decode limit reads every sample through the dataset's own __getitem__ in this
    process with torch on one thread (as in a worker), and restores torch's threads."""
    torch = pytest.importorskip("torch")
    seen: list[tuple[int, int]] = []

    class Samples:
        def __len__(self) -> int:
            return 70

        def __getitem__(self, i: int) -> int:
            seen.append((i, torch.get_num_threads()))
            time.sleep(0.001)
            return i

    before = torch.get_num_threads()
    peer = decodelimit.DecodeLimitPeer(Samples(), 64, cores=3)
    batches_per_s, _, batches = peer.run(0, math.inf)
    assert [i for i, _ in seen] == list(range(70)) and {t for _, t in seen} == {1}
    assert torch.get_num_threads() == before and batches == 2
    one_process = 70 / (70 * 0.001)  # images/s at most, sleeping 1 ms an image
    assert peer.images_per_s[0] < 3 * one_process and batches_per_s == pytest.approx(
        peer.images_per_s[0] / 64
    )


class _MarkedSamples:
    """70 samples whose __getitem__ marks, in memory shared with forked children, which
    process read each sample and with how many torch threads."""

    def __init__(self, fail: bool = False) -> None:
        self.marks = np.frombuffer(mmap.mmap(-1, 70 * 2 * 8), dtype=np.int64).reshape(70, 2)
        self.fail = fail

    def __len__(self) -> int:
        return 70

    def __getitem__(self, i: int) -> int:
        if self.fail and i == 40:
            raise ValueError("sample 40 cannot be read")
        import torch

        self.marks[i] = (os.getpid(), torch.get_num_threads())
        time.sleep(0.001)
        return i


def test_w6_parallel_decode_reads_every_sample_once_in_as_many_processes_as_cores():
    """The decode on all cores: ``cores`` forked processes, each over its contiguous share
    with torch on one thread, every sample read once, all of them reaped; images/s of all
    together and their CPU are kept; a process that fails makes the pass raise."""
    pytest.importorskip("torch")
    ds = _MarkedSamples()
    peer = decodelimit.ParallelDecodePeer(ds, 64, cores=3)
    batches_per_s, _, batches = peer.run(0, math.inf)
    pids = [int(p) for p in ds.marks[:, 0]]
    assert os.getpid() not in pids and set(ds.marks[:, 1].tolist()) == {1}
    shares = [pids[0:23], pids[23:46], pids[46:70]]  # 70 * k // 3: contiguous shares
    assert [len(set(s)) for s in shares] == [1, 1, 1] and len({s[0] for s in shares}) == 3
    assert not any(_alive(pid) for pid in set(pids))
    assert batches == 2 and batches_per_s == pytest.approx(peer.images_per_s[0] / 64)
    assert peer.images_per_s[0] > 0 and peer.all_cpu_ms_per_image[0] > 0
    failing = decodelimit.ParallelDecodePeer(_MarkedSamples(fail=True), 64, cores=2)
    with pytest.raises(RuntimeError, match="exit codes"):
        failing.run(0, math.inf)


def test_w6_skipped_without_pillow():
    proc = _cli(
        "bench", "--workloads", "W6", "--repeat", "1", prelude="import sys; sys.modules['PIL'] = None"
    )
    assert proc.returncode == 0, proc.stderr
    assert "needs Pillow and simplejpeg" in proc.stdout
    w6 = [ln for ln in proc.stdout.splitlines() if ln.startswith("W6 w2  ")]
    assert len(w6) == 3 and all("skipped" in ln for ln in w6)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process now (a zombie counts: not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_bench_busy_runs_burners_beside_the_loaders_and_ends_them(tmp_path):
    """``--busy 1``: one CPU-bound process runs through the measurement (its pid recorded
    by a prelude), the header and the JSON say so, and it is gone when the bench ends."""
    pids = tmp_path / "pids"
    prelude = textwrap.dedent(
        f"""
        from shmloader.bench import busy
        _start = busy.Burners.start
        def start(self):
            out = _start(self)
            with open({str(pids)!r}, "a") as f:
                f.write(" ".join(map(str, self.pids)) + "\\n")
            return out
        busy.Burners.start = start
        """
    )
    out = tmp_path / "r.json"
    proc = _cli("bench", *_TINY, "--no-memory", "--busy", "1", "--json", str(out), prelude=prelude)
    assert proc.returncode == 0, proc.stderr
    assert "busy: 1 CPU-bound process(es)" in proc.stdout
    assert json.loads(out.read_text())["settings"]["busy"] == 1
    (started,) = [int(p) for p in pids.read_text().split()]
    assert not _alive(started), f"burner {started} outlived the bench"


def test_burners_spin_and_are_reaped_however_the_block_ends():
    """Each burner uses a CPU while it runs; stop() (or leaving the block, by an exception
    too) ends and reaps every one of them."""
    from shmloader.bench.busy import Burners

    with pytest.raises(RuntimeError), Burners(2) as burners:
        pids = list(burners.pids)
        assert len(pids) == 2
        time.sleep(0.3)
        ticks = [int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11]) for pid in pids]
        assert all(t > 0 for t in ticks), f"burners used no CPU: {ticks} ticks"
        raise RuntimeError("the measurement failed")
    assert burners.pids == []
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(ValueError, match="--busy"):
        Burners(-1)


def test_bench_rejects_negative_busy():
    proc = _cli("bench", "--busy", "-1")
    assert proc.returncode != 0 and "--busy must be 0 or more" in proc.stderr


def test_doctor_warns_of_forks_that_get_stuck_on_cpython_3_11_before_3_11_8(monkeypatch):
    from shmloader import doctor

    assert doctor.fork_can_get_stuck((3, 11, 7), "cpython")
    assert doctor.fork_can_get_stuck((3, 11, 0), "cpython")
    assert not doctor.fork_can_get_stuck((3, 11, 8), "cpython")
    assert not doctor.fork_can_get_stuck((3, 12, 0), "cpython")
    assert not doctor.fork_can_get_stuck((3, 11, 7), "pypy")
    monkeypatch.setattr(doctor.multiprocessing, "get_start_method", lambda allow_none=False: "fork")
    stuck = doctor.check_start_method(stuck_forks=True)
    assert stuck.status == doctor.WARN and "gh-112275" in stuck.detail, stuck
    assert "3.11.8" in stuck.remedy and "multiprocessing_context='forkserver'" in stuck.remedy
    assert doctor.check_start_method(stuck_forks=False).status == doctor.OK
