"""`shmloader bench --workloads W9` where it cannot run: its rows say why, the run succeeds."""

from __future__ import annotations

import subprocess
import sys

from shmloader.bench import torchvision_pipeline, workloads


def test_w9_registered():
    assert "W9" in workloads.ALL_NAMES and workloads.WORKLOADS["W9"].batch_size == 64
    assert torchvision_pipeline.w9_steps(3) == 1 + 3 * 4


def test_w9_skipped_without_torchvision():
    code = (
        "import sys; sys.modules['torchvision'] = None\n"
        "from shmloader.cli import main\n"
        "sys.exit(main(['bench', '--workloads', 'W9', '--repeat', '1']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("W9 w2  ")]
    assert len(rows) == 3, proc.stdout
    assert all("skipped: torchvision not installed" in ln or "torch not installed" in ln for ln in rows)
