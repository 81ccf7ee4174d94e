"""The copy ceiling: as many processes as workers doing nothing but ``np.copyto`` of a
batch's bytes into a ring's worth of batch-sized buffers (the most a process can move),
each batch then read as the loaders' consumers read theirs (:mod:`shmloader.bench.consume`)."""

from __future__ import annotations

import math
import mmap
import multiprocessing
import time
from typing import Any

import numpy as np

from shmloader.batch.tree import leaves as tree_leaves
from shmloader.bench.consume import read_every_page
from shmloader.bench.datasets import CACHE_ITEMS


def _sources(dataset: Any, batch_size: int) -> list[np.ndarray]:
    """Per leaf, the first ``k`` samples stacked, ``k`` dividing the batch size: copying
    them ``batch_size / k`` times moves exactly a batch's bytes from the same cached
    source the datasets read."""
    k = math.gcd(batch_size, CACHE_ITEMS)
    samples = [dataset[i] for i in range(k)]

    cols = list(zip(*([np.asarray(v) for v in tree_leaves(s)] for s in samples), strict=True))
    return [np.stack(col) for col in cols]


def _copy_child(
    sources: list[np.ndarray],
    batch_size: int,
    num_slots: int,
    batches: int,
    max_s: float,
    shared: bool,
    barrier: Any,
    conn: Any,
) -> None:
    """One copying process: rotate over ``num_slots`` batch-sized buffers (private
    memory, or ``shared`` memory: a shmem-backed mapping like the ring's), reading every
    page of each batch once it is written, as a loader's consumer does."""
    try:
        k = sources[0].shape[0]
        slots = []
        for _ in range(num_slots):
            bufs = [_buffer((batch_size, *s.shape[1:]), s.dtype, shared) for s in sources]
            slots.append([b.reshape(batch_size // k, *s.shape) for b, s in zip(bufs, sources, strict=True)])
        copyto = np.copyto
        for views in slots:  # warm-up: one pass over every buffer
            for v, s in zip(views, sources, strict=True):
                copyto(v, s)
        barrier.wait(30)
        perf = time.perf_counter
        t0 = perf()
        deadline = t0 + max_s
        n = 0
        while n < batches:
            views = slots[n % num_slots]
            for v, s in zip(views, sources, strict=True):
                copyto(v, s)
            read_every_page(views)
            n += 1
            if perf() >= deadline:
                break
        conn.send((n, perf() - t0))
    except BaseException as exc:
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


def _buffer(shape: tuple[int, ...], dtype: np.dtype, shared: bool) -> np.ndarray:
    """A touched buffer: private (numpy's allocator; huge pages where the kernel gives
    them) or a MAP_SHARED anonymous mapping (shmem, like the ring's tmpfs pages)."""
    if not shared:
        return np.ones(shape, dtype)
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    buf = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    buf[:] = 1
    return buf[:nbytes].view(dtype).reshape(shape)


class CeilingPeer:
    """``procs`` processes copying batch bytes into a ring-sized rotation of buffers.

    The copy is one ``np.copyto`` per leaf per batch (from a cached block of samples, the
    same bytes the datasets return): the most a process can move. ``shared`` puts the
    buffers in shared memory, so the figure shows what the ring's pages themselves allow.
    """

    def __init__(self, dataset: Any, batch_size: int, num_slots: int, procs: int, shared: bool = False):
        self.name = "copy ceiling shm" if shared else "copy ceiling"
        self.shared = shared
        self.sources = _sources(dataset, batch_size)
        self.batch_size = batch_size
        self.num_slots = num_slots
        self.procs = procs
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        self.ctx = multiprocessing.get_context(method)

    def warm_up(self) -> None:
        """A few batches per process (pages touched, code paths warm)."""
        self.run(4 * self.procs, 0.2)

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]:
        """``batches`` batches in all or ``max_s`` seconds: the processes' summed batches/s,
        no consumer CPU (nan), and the batches copied."""
        ctx = self.ctx
        barrier = ctx.Barrier(self.procs)
        per_proc = max(1, -(-batches // self.procs))
        children = []
        for _ in range(self.procs):
            ours, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_copy_child,
                args=(
                    self.sources,
                    self.batch_size,
                    self.num_slots,
                    per_proc,
                    max_s,
                    self.shared,
                    barrier,
                    theirs,
                ),
                daemon=True,
            )
            p.start()
            theirs.close()
            children.append((p, ours))
        rate, total = 0.0, 0
        try:
            for _p, conn in children:
                if not conn.poll(max_s + 60):
                    raise RuntimeError("a copy-ceiling process did not report in time")
                msg = conn.recv()
                if msg[0] == "error":
                    raise RuntimeError(f"a copy-ceiling process failed: {msg[1]}")
                n, wall = msg
                rate += n / wall
                total += n
        finally:
            for p, conn in children:
                conn.close()
                p.join(5)
                if p.exitcode is None:
                    p.kill()
                    p.join()
        return rate, float("nan"), total

    def close(self) -> None:
        """Nothing to stop: each repeat's processes end with it."""


def batch_bytes_of(dataset: Any, batch_size: int) -> int:
    """Bytes of array data in one batch."""
    return sum(int(s.nbytes) for s in _sources(dataset, batch_size)) * (
        batch_size // math.gcd(batch_size, CACHE_ITEMS)
    )
