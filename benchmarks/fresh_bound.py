"""What a fresh pass over W6's images can reach, with and without a loader.

W6's fresh pass (:mod:`shmloader.bench.jpeg`: a new loader per pass over 600 JPEGs of
500x375, ``shmloader.vision.ImageFolder`` with RandomResizedCrop 224 + flip, batch 64,
2 forked workers, every page of every batch read) against its decode limit (the
dataset's own ``__getitem__`` in this process, one thread, times 2) and against two
bounds that no loader of this design can pass:

- ``bare forks``: 2 processes forked for the pass, each reading its contiguous half
  through ``__getitem__`` and exiting; nothing is sent anywhere;
- ``forks + fresh slots``: the same, each process also copying its images into 3 slots
  of batch size (9.6 MB) of a fresh memfd, cycling, each slot's pages reserved and
  mapped on first use (``MADV_POPULATE_WRITE``), as a worker writes its first ring slots.

and, beside them, ``threads``: 2 threads of this process, each over its half (no fork,
no exit, no fresh pages; as fast as the decode releases the GIL).

The five alternate in one process, ``--rounds`` times after one untimed round; printed:
each one's median time and its share of the limit, per round (median, min-max), and the
load average. Linux only (memfd, madvise).

    python benchmarks/fresh_bound.py --rounds 10
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from shmloader import DataLoader
from shmloader.bench.consume import read_every_page
from shmloader.bench.decodelimit import run_forked
from shmloader.bench.jpeg import W6_BATCH, W6_FRESH_COUNT, W6_SIZE, ensure_images
from shmloader.bench.peers import close_loader
from shmloader.vision import ImageFolder, RandomHorizontalFlip, RandomResizedCrop

WORKERS = 2
SLOTS_PER_WORKER = 3  # what each worker writes in a fresh pass: one held, two in flight
MADV_POPULATE_WRITE = 23


def _torch_threads(n: int) -> None:
    """torch's intra-op threads, where torch is imported (as in a worker: one)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)


class Passes:
    """The four passes over ``dataset``, each returning its wall seconds."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.n = len(dataset)
        self.slot_bytes = -(-W6_BATCH * W6_SIZE * W6_SIZE * 3 // 4096) * 4096
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self.madvise = libc.madvise

    def limit(self) -> float:
        """The decode limit's time for the pass: one thread's, over the workers."""
        _torch_threads(1)
        t0 = time.perf_counter()
        for i in range(self.n):
            self.dataset[i]
        return (time.perf_counter() - t0) / WORKERS

    def forks(self, write: bool) -> float:
        """Bare forked processes over their halves; ``write``: into fresh shared slots."""
        fd = os.memfd_create("fresh-bound") if write else -1
        size = WORKERS * SLOTS_PER_WORKER * self.slot_bytes
        if write:
            os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size) if write else None
        t0 = time.perf_counter()
        codes = run_forked([partial(self._half, k, mapping) for k in range(WORKERS)])
        wall = time.perf_counter() - t0
        if mapping is not None:
            mapping.close()
            os.close(fd)
        if any(codes):
            raise RuntimeError(f"a forked decoding process failed (exit codes {codes})")
        return wall

    def threads(self) -> float:
        """Threads of this process over their halves, nothing sent."""
        _torch_threads(1)
        halves = [
            threading.Thread(target=self._half, args=(k, None), name=f"fresh-bound-{k}")
            for k in range(WORKERS)
        ]
        t0 = time.perf_counter()
        for thread in halves:
            thread.start()
        for thread in halves:
            thread.join()
        return time.perf_counter() - t0

    def _half(self, k: int, mapping: mmap.mmap | None) -> None:
        _torch_threads(1)
        start, stop = self.n * k // WORKERS, self.n * (k + 1) // WORKERS
        if mapping is None:
            for i in range(start, stop):
                self.dataset[i]
            return
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        memory = np.frombuffer(mapping, np.uint8)
        mapped: set[int] = set()
        for j, i in enumerate(range(start, stop)):
            image = self.dataset[i][0].reshape(-1)
            slot = SLOTS_PER_WORKER * k + (j // W6_BATCH) % SLOTS_PER_WORKER
            if slot not in mapped:
                if self.madvise(base + slot * self.slot_bytes, self.slot_bytes, MADV_POPULATE_WRITE):
                    raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")
                mapped.add(slot)
            offset = slot * self.slot_bytes + (j % W6_BATCH) * image.nbytes
            memory[offset : offset + image.nbytes] = image

    def loader(self) -> float:
        """W6's fresh pass: made, iterated with every page read, shut down."""
        t0 = time.perf_counter()
        loader = DataLoader(
            self.dataset,
            batch_size=W6_BATCH,
            shuffle=True,
            num_workers=WORKERS,
            multiprocessing_context="fork",
            seed=0,
        )
        for batch in loader:
            read_every_page(batch)
        batch = None
        close_loader(loader)
        del loader
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (default 8)")
    args = parser.parse_args()
    folder = ImageFolder(ensure_images(), [RandomResizedCrop(W6_SIZE), RandomHorizontalFlip()])
    samples = folder.samples[:W6_FRESH_COUNT]
    dataset = ImageFolder.from_files(
        *zip(*samples, strict=True), [RandomResizedCrop(W6_SIZE), RandomHorizontalFlip()]
    )
    passes = Passes(dataset)
    kinds: dict[str, Callable[[], float]] = {
        "decode limit": passes.limit,
        "bare forks": lambda: passes.forks(False),
        "forks + fresh slots": lambda: passes.forks(True),
        "loader, fresh pass": passes.loader,
        "threads": passes.threads,
    }
    load0 = os.getloadavg()[0]
    for run in kinds.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.rounds):
        for name, run in kinds.items():
            times[name].append(run())
    for name in kinds:
        shares = [lim / t for lim, t in zip(times["decode limit"], times[name], strict=True)]
        print(
            f"{name:20s} {statistics.median(times[name]) * 1e3:7.1f} ms   of the limit "
            f"{statistics.median(shares):.3f} ({min(shares):.3f}-{max(shares):.3f})"
        )
    print(f"{args.rounds} rounds, load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
