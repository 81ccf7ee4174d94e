"""The decode limit of an image pipeline: what loader workers could reach if decoding
were all they did. The dataset's own ``__getitem__`` over its samples in this process, on
one thread (torch's resampler single-threaded, as in a worker), its images/s times the
usable cores. W6 times it beside its fresh passes (:mod:`shmloader.bench.jpeg`).

Beside it, the same decode run by as many processes as there are cores at once
(:class:`ParallelDecodePeer`, forked, each over its contiguous share): what processes
forked for one pass reach with nothing but the decode to do, their forks, cold caches,
exits and the split of the samples included. On a quiet machine it stays below the limit
(the forks and exits of a process with torch imported take milliseconds each, a share of
a short pass: benchmarks/HISTORY.md has the figures); on a busy one far below, because the
scheduler shares the CPU between sessions (Linux's autogroups: every process of one
session shares one session's weight), not between processes, so a session's several
processes get about what its one thread got, and no loader's workers reach the
one-thread figure times the cores there.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

LIMIT = "decode limit"  # the peer's name in W6's tables and ratios
PARALLEL = "decode, all cores"  # the parallel peer's name


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _torch_or_none() -> Any:
    """torch, or None where it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


class _DecodePeer:
    """What both decode peers share: a peer of the one harness
    (:func:`shmloader.bench.peers.time_peers`) that reads every sample of ``dataset``
    through its ``__getitem__`` in each pass (:meth:`_pass`, the peer's own), and keeps
    images/s and the CPU per image for W6's table, as W6's epoch peers do."""

    name = ""

    def __init__(self, dataset: Any, batch_size: int, cores: int):
        self.dataset = dataset
        self.batch_size = batch_size
        self.cores = cores
        self.images_per_s: list[float] = []
        self.all_cpu_ms_per_image: list[float] = []

    def _pass(self) -> tuple[int, float, float]:
        """Images, wall seconds and CPU seconds of one pass over the dataset."""
        raise NotImplementedError

    def _rate(self, images: int, wall: float) -> float:
        """The images/s this peer reports for a pass of ``images`` in ``wall`` seconds."""
        return images / wall

    def warm_up(self) -> None:
        """One untimed pass (page cache, imports, scratch buffers)."""
        self._pass()

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]:
        """One timed pass (the bounds are ignored, as for W6's epochs): batches/s (the
        peer's images/s over the batch size), CPU seconds per batch, batches."""
        n, wall, cpu = self._pass()
        rate = self._rate(n, wall)
        self.images_per_s.append(rate)
        self.all_cpu_ms_per_image.append(cpu / n * 1e3)
        batches_done = -(-n // self.batch_size)
        return rate / self.batch_size, cpu / batches_done, batches_done

    def close(self) -> None:
        """Nothing runs between passes."""


class DecodeLimitPeer(_DecodePeer):
    """The decode limit: every sample through ``__getitem__`` in this process, one
    thread; ``run`` gives the rate times ``cores``, and the CPU per image is the
    decode's own."""

    name = LIMIT

    def _pass(self) -> tuple[int, float, float]:
        torch = _torch_or_none()
        threads = torch.get_num_threads() if torch is not None else 0
        if torch is not None:
            torch.set_num_threads(1)  # as in a worker: the cores are the workers' parallelism
        try:
            n = len(self.dataset)
            c0, t0 = time.process_time(), time.perf_counter()
            for i in range(n):
                self.dataset[i]
            return n, time.perf_counter() - t0, time.process_time() - c0
        finally:
            if torch is not None:
                torch.set_num_threads(threads)

    def _rate(self, images: int, wall: float) -> float:
        return images / wall * self.cores


class ParallelDecodePeer(_DecodePeer):
    """The decode on all cores: each pass runs ``cores`` processes at once, forked from
    this one, each reading its contiguous share of the samples through the dataset's own
    ``__getitem__`` with torch on one thread: images/s of all of them together, and their
    CPU per image (the decode's own in new processes: their copy-on-write pages and
    exits included). A process that fails makes the pass raise."""

    name = PARALLEL

    def _read_share(self, start: int, stop: int) -> None:
        torch = _torch_or_none()
        if torch is not None:
            torch.set_num_threads(1)
        for i in range(start, stop):
            self.dataset[i]

    def _pass(self) -> tuple[int, float, float]:
        """Images, wall seconds and CPU seconds (of the processes, reaped) of one pass."""
        n = len(self.dataset)
        bounds = [n * k // self.cores for k in range(self.cores + 1)]
        cpu0, t0 = _reaped_cpu_s(), time.perf_counter()
        codes = run_forked([partial(self._read_share, bounds[k], bounds[k + 1]) for k in range(self.cores)])
        wall = time.perf_counter() - t0
        if any(codes):
            raise RuntimeError(
                f"a decoding process of the parallel decode limit failed (exit codes {codes}): "
                "run the dataset's __getitem__ in this process to see its error."
            )
        return n, wall, _reaped_cpu_s() - cpu0


def run_forked(jobs: list[Callable[[], object]]) -> list[int]:
    """Run each of ``jobs`` in its own process forked from this one, all at once, and
    wait for them all: their exit codes, in order (0: the job returned; 1: it raised, its
    traceback printed there). A child exits without running this process's cleanup."""
    pids = []
    try:
        for job in jobs:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    job()
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            pids.append(pid)
    finally:
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return codes


def _reaped_cpu_s() -> float:
    """CPU seconds of this process's children that exited and were waited for."""
    t = os.times()
    return t.children_user + t.children_system
