"""What the figures depend on: the machine, the versions, the commit, the load."""

from __future__ import annotations

import math
import multiprocessing
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import numpy as np


def proc_kb(path: str, keys: Sequence[str]) -> dict[str, int]:
    """The ``key: N kB`` lines of a /proc file (``status``, ``meminfo``) named in ``keys``."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def load1() -> float | None:
    """The 1-minute load average (other work on the machine skews every figure)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def children_cpu_s() -> float:
    """CPU seconds used so far by this process's live children (the loaders' workers;
    idle ones add nothing); nan without psutil."""
    try:
        import psutil
    except ImportError:
        return math.nan
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _git_commit() -> str | None:
    """The checkout's commit (with "+dirty" for local changes), when run from one; the
    SHMLOADER_COMMIT environment variable names it for a tree exported without .git."""
    if os.environ.get("SHMLOADER_COMMIT"):
        return os.environ["SHMLOADER_COMMIT"]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine_info() -> dict[str, Any]:
    """What the figures depend on: CPU, cores, memory, versions, start method, load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    import shmloader

    mem = proc_kb("/proc/meminfo", ("MemTotal",)).get("MemTotal")
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "shmloader_commit": _git_commit(),
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gb": mem / 2**20 if mem else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch_version,
        "shmloader": shmloader.__version__,
        "start_method": multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_context().get_start_method(),
        "load_average": load,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
