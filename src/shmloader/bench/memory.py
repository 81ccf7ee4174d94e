"""Memory: peak consumer RSS and the system's shared memory while one loader runs, in a
fresh process per loader (``python -m shmloader.bench.memory SPEC``), so one loader's
allocations never count against another's."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from shmloader.bench.consume import read_every_page
from shmloader.bench.machine import proc_kb
from shmloader.bench.peers import close_loader
from shmloader.bench.workloads import WORKLOADS, Config, loader_options

_PROBE_TIMEOUT_S = 120.0
_MEM_SAMPLE_INTERVAL_S = 0.005


def _shm_used_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


_STATUS_KEYS = ("VmRSS", "RssAnon", "RssShmem", "VmHWM")


def _probe_main(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: run one loader over ``spec``'s workload, touching every page
    of every batch like a real consumer, and sample this process's RSS and the system's
    shared memory while it runs."""
    cfg = Config(**spec["config"])
    wl = WORKLOADS[cfg.workload]
    batches = spec["batches"]
    dataset = wl.make(wl.batch_size * (batches + 8))
    if spec["loader"] == "torch":
        from torch.utils.data import DataLoader as Loader
    else:
        from shmloader import DataLoader as Loader
    gc.collect()
    try:  # reset the kernel's peak-RSS mark (VmHWM) so it covers the loader only
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = proc_kb("/proc/self/status", _STATUS_KEYS)
    base_shmem = proc_kb("/proc/meminfo", ("Shmem",)).get("Shmem")
    base_devshm = _shm_used_bytes()
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0, "Shmem": 0, "devshm": 0}
    stop = threading.Event()

    def sample() -> None:
        while True:
            st = proc_kb("/proc/self/status", _STATUS_KEYS)
            mi = proc_kb("/proc/meminfo", ("Shmem",))
            for k in ("VmRSS", "RssAnon", "RssShmem"):
                peaks[k] = max(peaks[k], st.get(k, 0))
            peaks["Shmem"] = max(peaks["Shmem"], mi.get("Shmem", 0))
            peaks["devshm"] = max(peaks["devshm"], _shm_used_bytes() or 0)
            if stop.wait(_MEM_SAMPLE_INTERVAL_S):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    loader = Loader(
        dataset,
        num_workers=cfg.workers,
        persistent_workers=cfg.persistent_workers,
        in_order=cfg.in_order,
        **loader_options(wl, dataset, spec["loader"]),
    )
    n = 0
    t0 = time.perf_counter()
    for batch in loader:
        read_every_page(batch)
        n += 1
        if n >= batches or time.perf_counter() - t0 > spec["seconds"]:
            break
    del batch
    stop.set()
    thread.join()
    end = proc_kb("/proc/self/status", _STATUS_KEYS)
    close_loader(loader)
    kib = 1024
    return {
        "batches": n,
        "baseline_rss_mb": base.get("VmRSS", 0) * kib / 2**20,
        "peak_rss_mb": max(end.get("VmHWM", 0), peaks["VmRSS"]) * kib / 2**20,
        "peak_rss_anon_mb": peaks["RssAnon"] * kib / 2**20,
        "peak_rss_shmem_mb": peaks["RssShmem"] * kib / 2**20,
        "shmem_delta_mb": (peaks["Shmem"] - base_shmem) * kib / 2**20 if base_shmem is not None else None,
        "dev_shm_delta_mb": (peaks["devshm"] - base_devshm) / 2**20 if base_devshm is not None else None,
    }


def probe_memory(cfg: Config, loader: str, batches: int = 60, seconds: float = 3.0) -> dict[str, Any]:
    """Run ``loader`` ("shmloader" or "torch") over ``cfg`` in a fresh process: its peak
    memory figures, or ``{"error": ...}`` saying why there are none."""
    spec = {"config": asdict(cfg), "loader": loader, "batches": batches, "seconds": seconds}
    cmd = [sys.executable, "-m", "shmloader.bench.memory", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"the memory probe did not finish in {_PROBE_TIMEOUT_S:.0f} s"}
    if proc.returncode != 0:
        return {"error": f"the memory probe failed: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(_probe_main(json.loads(sys.argv[1]))))
