"""`shmloader bench --workloads W8` run for real, small: 30,000 records (above the 16 MiB
from which share_dataset=True shares a container), 2 workers.

The checks are on sizes and structure, never on timings: shared workers' peak USS below
plain ones', the dataset's list replaced, every measuring process reaped.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shmloader.bench import metadata, report
from shmloader.bench.datasets import EmptyMetadataDataset, MetadataDataset

_RECORDS = 30_000
_DEADLINE_S = 400


@pytest.fixture(scope="module")
def w8_run(tmp_path_factory):
    """One W8 run through the CLI: its JSON and its printed report."""
    out = tmp_path_factory.mktemp("w8") / "w8.json"
    args = ["bench", "--workloads", "W8", "--workers", "2", "--w8-records", str(_RECORDS), "--json", str(out)]
    code = f"import sys\nfrom shmloader.cli import main\nsys.exit(main({args!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=_DEADLINE_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(_DEADLINE_S + 30)
def test_w8_shared_workers_hold_less_and_nothing_leaks(w8_run):
    data, text = w8_run
    (cfg,) = data["configs"]
    w8 = cfg["extra"]["w8"]
    assert cfg["label"] == "W8 w2" and w8["records"] == _RECORDS and w8["rounds"] == 1
    assert w8["leaked"] == []
    fork, spawn = w8["fork"], w8["spawn"]
    for name in ("shmloader", "shmloader gc.freeze", "shmloader share_dataset", "shmloader empty"):
        assert "error" not in fork[name], fork[name]
        run = w8["fork_runs"][name][0]
        assert len(run["workers_peak_uss"]) == 2 and run["batches"] == -(-_RECORDS // metadata.W8_BATCH)
        assert run["total_pss"] > sum(run["workers_end_pss"]) > 0
        assert run["next_epoch_s"] > 0
    for name in ("shmloader", "shmloader share_dataset", "shmloader pre-shared"):
        assert spawn[name]["first_batch_s"]["median"] > 0
    assert spawn["shmloader pre-shared"]["share_s"]["median"] > 0
    # The list was replaced by a shared view before the workers started, so they read it
    # without copying its pages: their peak USS is below the plain loader's.
    assert list(w8["shared"]) == ["records"]
    shared = fork["shmloader share_dataset"]["worker_peak_uss"]["median"]
    assert shared < fork["shmloader"]["worker_peak_uss"]["median"]
    assert (
        fork["shmloader empty"]["worker_peak_uss"]["median"] < fork["shmloader"]["worker_peak_uss"]["median"]
    )
    assert "next epoch s" in text and "W8 workers' memory" in text and "W8 time to first batch (spawn" in text


@pytest.mark.timeout(_DEADLINE_S + 30)
def test_w8_torch_column(w8_run):
    pytest.importorskip("torch")
    data, text = w8_run
    w8 = data["configs"][0]["extra"]["w8"]
    fork, spawn = w8["fork"], w8["spawn"]
    assert "error" not in fork["torch"] and "error" not in spawn["torch"]
    assert len(w8["fork_runs"]["torch"][0]["workers_peak_uss"]) == 2
    # torch's workers copy the pages of the records they read; shared ones do not.
    assert (
        fork["shmloader share_dataset"]["worker_peak_uss"]["median"]
        < fork["torch"]["worker_peak_uss"]["median"]
    )
    assert "vs torch" in text


def test_w8_datasets_agree_and_pickle():
    import pickle

    full, empty = MetadataDataset(50), EmptyMetadataDataset(50)
    for i in (0, 7, 49):
        a, b = full[i], empty[i]
        assert a[0].dtype.name == "float32" and a[0].shape == (4,)
        assert (a[0] == b[0]).all() and a[1:] == b[1:]
    assert len(pickle.loads(pickle.dumps(full)).records) == 50
    with pytest.raises(IndexError):
        empty[50]


def test_w8_tables_show_errors_and_spread():
    from shmloader.bench.results import ConfigResult
    from shmloader.bench.workloads import Config

    res = ConfigResult(Config("W8", "W8", 2), "W8", 512, 0, 0)
    fig = {"median": 2.0 * 2**20, "spread": 0.1, "runs": [1, 2]}
    times = {"median": 1.5, "spread": 0.0, "runs": [1.5]}
    res.extra["w8"] = {
        "fork": {
            "shmloader": {
                "worker_peak_uss": fig,
                "workers_peak_uss_sum": fig,
                "total_pss": fig,
                "epoch_s": times,
                "first_batch_s": times,
            },
            "torch": {"error": "the measurement failed: boom"},
        },
        "spawn": {"shmloader": {"first_batch_s": times}},
    }
    text = report.format_report([res])
    assert "2 ±10%" in text and "1.50" in text and "the measurement failed: boom" in text


def test_w8_only_when_named():
    from shmloader.bench.cli import build_parser

    parser = build_parser()
    assert "W8" not in parser.parse_args(["--workloads", "all"]).workloads
    assert parser.parse_args(["--workloads", "w8"]).workloads == ["W8"]
    assert parser.parse_args([]).w8_records == metadata.W8_RECORDS
    with pytest.raises(SystemExit):
        parser.parse_args(["--workloads", "W99"])
