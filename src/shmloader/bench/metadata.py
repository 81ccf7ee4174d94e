"""W8, a dataset whose metadata is a million Python dicts: the workers' memory and the
time to first batch, for torch's DataLoader, this loader, and this loader with
``share_dataset=True``.

Every measurement runs in a fresh process (``python -m shmloader.bench.metadata SPEC``,
in a session of its own), so no configuration inherits another's memory; the bench ends
and reaps it, and any process it left, also on errors and interrupts. Two kinds:

- ``fork``: one shuffled epoch, batch 512, workers started by fork (not persistent), then
  the same loader's next epoch, timed alone (share_dataset shares in the first only). A
  thread of the measuring process reads each worker's USS and PSS
  (:func:`~shmloader.memory.usage.process_memory`) every 0.25 s and once more when the
  last batch is in hand, before the workers stop. Reported: each worker's peak USS,
  their sum, the total PSS (the measuring process and its workers) at the end, time to
  the first batch and to the last (both from ``iter()``), batches/s after the first
  batch. Peers: torch, this loader, this loader after ``gc.freeze()`` (called before
  ``iter()``), this loader with ``share_dataset=True``, and torch and this loader over
  :class:`~shmloader.bench.datasets.EmptyMetadataDataset` (the same samples, no
  containers: the floor).
- ``spawn``: time from ``iter()`` to the first batch, workers started by spawn: torch,
  this loader, this loader with ``share_dataset=True`` (share() runs inside that first
  ``iter()``), and the same over a dataset already shared (share() timed apart, before).

Peers alternate, their order reversed every other round; every batch is read
(:func:`~shmloader.bench.consume.read_every_page`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from shmloader.bench.consume import read_every_page
from shmloader.bench.isolated import run_isolated
from shmloader.bench.peers import close_iter, summarize
from shmloader.bench.progress import Progress
from shmloader.bench.results import ConfigResult, Row, median_spread
from shmloader.bench.workloads import WORKLOADS, Config
from shmloader.memory.usage import process_memory

W8_RECORDS = 1_000_000
W8_BATCH = 512
SAMPLE_INTERVAL_S = 0.25
CHILD_TIMEOUT_S = 900.0

# name -> (loader, dataset, options): "records" is MetadataDataset, "empty" its twin.
FORK_PEERS: dict[str, tuple[str, str, dict[str, bool]]] = {
    "torch": ("torch", "records", {}),
    "shmloader": ("shmloader", "records", {}),
    "shmloader gc.freeze": ("shmloader", "records", {"gc_freeze": True}),
    "shmloader share_dataset": ("shmloader", "records", {"share_dataset": True}),
    "torch empty": ("torch", "empty", {}),
    "shmloader empty": ("shmloader", "empty", {}),
}
SPAWN_PEERS: dict[str, tuple[str, str, dict[str, bool]]] = {
    "torch": ("torch", "records", {}),
    "shmloader": ("shmloader", "records", {}),
    "shmloader share_dataset": ("shmloader", "records", {"share_dataset": True}),
    "shmloader pre-shared": ("shmloader", "records", {"share_dataset": True, "preshare": True}),
}


# --- in the measuring process ------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux: every thread's ``children`` list)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return kids


class _Sampler:
    """Reads this process's workers' memory (its children) every ``interval`` seconds
    from a thread: each worker's peak USS, and the last reading of each."""

    def __init__(self, interval: float = SAMPLE_INTERVAL_S):
        self.interval = interval
        self.peak_uss: dict[int, int] = {}
        self.last: dict[int, dict[str, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> dict[int, dict[str, int]]:
        """Read every worker now: ``{pid: {"uss", "pss", ...}}``."""
        now: dict[int, dict[str, int]] = {}
        for pid in _children(os.getpid()):
            mem = process_memory(pid)
            if mem is not None:
                now[pid] = mem.as_dict()
        with self._lock:
            for pid, mem in now.items():
                self.peak_uss[pid] = max(self.peak_uss.get(pid, 0), mem["uss"])
            self.last = now
        return now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _dataset(kind: str, records: int) -> Any:
    from shmloader.bench.datasets import EmptyMetadataDataset, MetadataDataset

    return MetadataDataset(records) if kind == "records" else EmptyMetadataDataset(records)


def _loader(spec: dict[str, Any], dataset: Any) -> Any:
    opts = dict(
        batch_size=W8_BATCH,
        shuffle=True,
        num_workers=spec["workers"],
        multiprocessing_context=spec["method"],
    )
    if spec["loader"] == "torch":
        from torch.utils.data import DataLoader as TorchDataLoader

        return TorchDataLoader(dataset, **opts)
    from shmloader import DataLoader

    return DataLoader(dataset, share_dataset=spec.get("share_dataset", False), **opts)


def _epoch(spec: dict[str, Any]) -> dict[str, Any]:
    """One fork epoch of ``spec``'s loader, its workers' memory read throughout."""
    dataset = _dataset(spec["dataset"], spec["records"])
    loader = _loader(spec, dataset)
    gc.collect()
    if spec.get("gc_freeze"):
        gc.freeze()  # the objects made so far leave the collector's lists: workers' GC passes skip them
    sampler = _Sampler()
    sampler.start()
    perf = time.perf_counter
    batches = len(loader)
    t0 = perf()
    c0 = time.process_time()
    it = iter(loader)
    t_first = t_last = 0.0
    end: dict[int, dict[str, int]] = {}
    for n, _batch in enumerate(it, 1):
        read_every_page(_batch)
        if n == 1:
            t_first = perf() - t0
            c0 = time.process_time()
        if n == batches:
            t_last = perf() - t0
            end = sampler.sample()  # the workers still run: the epoch's end, before they stop
            break
    cpu_s = time.process_time() - c0
    sampler.stop()
    _batch = None
    parent = process_memory(os.getpid())
    memory = loader.stats().get("memory", {}) if spec["loader"] == "shmloader" else {}
    closed = _closed(it)
    it = None
    # The same loader's next epoch: a shared dataset was shared by the first.
    t0 = perf()
    for _batch in loader:
        read_every_page(_batch)
    _batch = None
    next_epoch_s = perf() - t0
    peak = [sampler.peak_uss[pid] for pid in sorted(end)]
    return {
        "batches": batches,
        "first_batch_s": t_first,
        "epoch_s": t_last,
        "next_epoch_s": next_epoch_s,
        "batches_per_s": (batches - 1) / max(t_last - t_first, 1e-9),
        "consumer_cpu_ms": cpu_s / max(batches - 1, 1) * 1e3,
        "workers_peak_uss": peak,
        "workers_end_pss": [end[pid]["pss"] for pid in sorted(end)],
        "parent_pss": parent.pss if parent is not None else 0,
        "total_pss": (parent.pss if parent is not None else 0) + sum(m["pss"] for m in end.values()),
        "shared": memory.get("shared", {}),
        "copy_on_read_warned": memory.get("copy_on_read_warned"),
        **closed,
    }


def _closed(it: Any) -> dict[str, str]:
    """Stop ``it``'s workers. The figures are taken by then: a worker that dies while it
    stops (torch's spawn workers now and then abort at exit, "terminate called without an
    active exception") is reported as ``close_error``, not as a failed measurement."""
    try:
        close_iter(it)
    except Exception as exc:
        return {"close_error": f"{type(exc).__name__}: {exc}".strip()}
    return {}


def _first_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """Seconds from ``iter()`` to the first batch under ``spec``'s start method (and, for
    a pre-shared dataset, how long its share() took before)."""
    from shmloader.memory.containers import share_containers

    dataset = _dataset(spec["dataset"], spec["records"])
    share_s = None
    if spec.get("preshare"):
        t = time.perf_counter()
        share_containers(dataset)
        share_s = time.perf_counter() - t
    loader = _loader(spec, dataset)
    gc.collect()
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    return {"first_batch_s": first, "share_s": share_s, **_closed(it)}


def _child_main(spec: dict[str, Any]) -> dict[str, Any]:
    return _epoch(spec) if spec["kind"] == "fork" else _first_batch(spec)


# --- in the bench's process ------------------------------------------------------------


def run_child(spec: dict[str, Any], timeout: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """Run one W8 measurement in a fresh process of its own session (see
    :func:`~shmloader.bench.isolated.run_isolated`): its figures, or ``{"error": ...}``."""
    return run_isolated("shmloader.bench.metadata", spec, timeout)


def w8_steps(rounds: int, have_torch: bool) -> int:
    """Progress steps of :func:`measure_w8`."""
    peers = [FORK_PEERS, SPAWN_PEERS]
    return rounds * sum(sum(1 for v in p.values() if have_torch or v[0] != "torch") for p in peers)


def _rounds(
    label: str,
    kind: str,
    peers: dict[str, tuple[str, str, dict[str, bool]]],
    base: dict[str, Any],
    rounds: int,
    progress: Progress,
) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in peers}
    for r in range(rounds):
        for name in list(peers) if r % 2 == 0 else list(reversed(peers)):
            loader, dataset, opts = peers[name]
            spec = {**base, "kind": kind, "method": kind, "loader": loader, "dataset": dataset, **opts}
            got = run_child(spec)
            runs[name].append(got)
            what = got.get("error") or f"{got.get('epoch_s', got.get('first_batch_s')):.2f} s"
            progress.step(f"{label} {kind} {name}, round {r + 1}/{rounds}: {what}")
    return runs


def _summary(values: list[float]) -> dict[str, Any]:
    med, spread = median_spread(values)
    return {"median": med, "spread": spread, "runs": values}


def summarize_w8(runs: dict[str, list[dict[str, Any]]], fields: dict[str, Callable[[dict], float]]) -> dict:
    """Per peer, each of ``fields`` (name -> figure of one run) over the runs without
    errors: ``{"median", "spread", "runs"}``; a peer with no good run gets its error."""
    out: dict[str, Any] = {}
    for name, got in runs.items():
        good = [g for g in got if "error" not in g]
        if not good:
            out[name] = {"error": got[0]["error"] if got else "not run"}
            continue
        out[name] = {f: _summary([get(g) for g in good]) for f, get in fields.items()}
    return out


FORK_FIELDS: dict[str, Callable[[dict], float]] = {
    "worker_peak_uss": lambda g: max(g["workers_peak_uss"], default=0),
    "workers_peak_uss_sum": lambda g: sum(g["workers_peak_uss"]),
    "total_pss": lambda g: g["total_pss"],
    "epoch_s": lambda g: g["epoch_s"],
    "first_batch_s": lambda g: g["first_batch_s"],
    "next_epoch_s": lambda g: g["next_epoch_s"],
    "batches_per_s": lambda g: g["batches_per_s"],
}
SPAWN_FIELDS: dict[str, Callable[[dict], float]] = {"first_batch_s": lambda g: g["first_batch_s"]}


def measure_w8(
    cfg: Config, *, records: int, rounds: int, torch_dl: Any | None, progress: Progress
) -> ConfigResult:
    """W8 at ``cfg.workers`` workers over ``records`` records, ``rounds`` rounds of every
    peer (torch's left out without torch): the fork epochs and the spawn first batches,
    each in a fresh process. The figures go to ``extra["w8"]``; the main table's rows are
    the fork epochs' batches/s (after the first batch)."""
    wl = WORKLOADS["W8"]
    t0 = time.perf_counter()
    res = ConfigResult(cfg, wl.description, W8_BATCH, W8_BATCH * (16 + 8 + 8), 0)
    keep = (
        (lambda p: p) if torch_dl is not None else (lambda p: {k: v for k, v in p.items() if v[0] != "torch"})
    )
    base = {"records": records, "workers": cfg.workers}
    fork = _rounds(cfg.label, "fork", keep(FORK_PEERS), base, rounds, progress)
    spawn = _rounds(cfg.label, "spawn", keep(SPAWN_PEERS), base, rounds, progress)
    fork_sum = summarize_w8(fork, FORK_FIELDS)
    spawn_sum = summarize_w8(spawn, SPAWN_FIELDS)
    share_s = [g["share_s"] for g in spawn.get("shmloader pre-shared", []) if g.get("share_s") is not None]
    if share_s and "error" not in spawn_sum["shmloader pre-shared"]:
        spawn_sum["shmloader pre-shared"]["share_s"] = _summary(share_s)
    leaked = sorted({pid for got in [*fork.values(), *spawn.values()] for g in got for pid in g["leaked"]})
    shared = next((g["shared"] for g in fork.get("shmloader share_dataset", []) if g.get("shared")), {})
    res.extra["w8"] = {
        "records": records,
        "rounds": rounds,
        "fork": fork_sum,
        "spawn": spawn_sum,
        "fork_runs": fork,
        "spawn_runs": spawn,
        "shared": shared,
        "leaked": leaked,
        "seconds": time.perf_counter() - t0,
    }
    for name, got in fork.items():
        good = [g for g in got if "error" not in g]
        row = Row(name, status="ok" if good else f"failed: {got[0]['error']}")
        row.runs = [g["batches_per_s"] for g in good]
        row.cpu_ms_runs = [g["consumer_cpu_ms"] for g in good]
        row.batches_runs = [g["batches"] for g in good]
        res.rows.append(row)
    ok = {r.loader: r for r in res.rows if r.runs}
    paired = len({len(r.runs) for r in ok.values()}) == 1  # ratios pair rounds: only when all ran
    summarize(ok, res.batch_bytes, base="torch" if paired else "")
    for kind, peers in (("fork", fork), ("spawn", spawn)):
        for name, got in peers.items():
            for g in got:
                if "close_error" in g:
                    res.notes.append(
                        f"{cfg.label} {kind} {name}: a worker died while the workers stopped, after "
                        f"the figures were taken ({g['close_error']})"
                    )
    res.notes.append(
        f"{cfg.label}: {records:,} records, batch {W8_BATCH}, shuffled, one epoch per fresh process "
        f"(fork), batches/s after the first batch; W8 took {res.extra['w8']['seconds']:.0f} s"
    )
    return res


if __name__ == "__main__":
    print(json.dumps(_child_main(json.loads(sys.argv[1]))))
