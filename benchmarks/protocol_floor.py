"""The floor under W4's per-batch cost: the loader's own exchange (the task and result
queues of shmloader.transport.channel in shared memory, a wake-up written only to a side that
sleeps, a numpy view of a slot per batch) driven by the least Python that can drive it,
without anything else the loader does per batch (sampler, scheduler, leases, timing,
layouts, collate). W4's shape: one int64 a batch, 2 forked workers, round robin, in order.

    python benchmarks/protocol_floor.py            # 5 rounds of 20,000 batches each
    python benchmarks/protocol_floor.py --rounds 3

Prints, per variant (tasks in flight per worker; workers at SCHED_BATCH or not): batches/s,
the consumer's CPU per batch, the workers' CPU per batch and the wake-ups the consumer
wrote per batch, medians over the rounds with their range. What the loader spends above
these figures is its own bookkeeping (compare ``benchmarks/consumer_profile.py``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import time

import numpy as np

from shmloader.transport.channel import Channel

_STOP = 99  # a task kind no loader uses: the worker exits


def _worker(channel: Channel, sock: socket.socket, ring: mmap.mmap, batch_policy: bool) -> None:
    if batch_policy:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    slots = np.frombuffer(ring, np.int64)
    while True:
        tasks = channel.take_tasks()
        if not tasks:
            if channel.arm_tasks() and not os.read(sock.fileno(), 64):
                os._exit(0)
            channel.disarm_tasks()
            continue
        for kind, slot, seq, _stamp, payload in tasks:
            if kind == _STOP:
                os._exit(0)
            slots[slot] = int.from_bytes(payload[:8], "little") * 2  # the "batch"
            if channel.push_result(1, slot, seq, 0, 0, 0, 0) == 2:
                sock.send(b"w")


def one_round(batches: int, per_worker: int, batch_policy: bool, workers: int = 2) -> dict[str, float]:
    """One run: fork the workers, hand out ``batches`` batches, stop them."""
    ring = mmap.mmap(-1, 4096)
    channels, socks, pids = [], [], []
    for _ in range(workers):
        channel = Channel.create()
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _worker(channel, theirs, ring, batch_policy)
        theirs.close()
        channels.append(channel)
        socks.append(ours)
        pids.append(pid)
    free = list(range(per_worker * workers))
    asleep: set[int] = set()
    wakes = 0

    def dispatch(seq: int) -> None:
        w = seq % workers
        if channels[w].push_task(0, free.pop(), seq, seq.to_bytes(8, "little")) == 2:
            asleep.add(w)

    def wake() -> int:
        woken = 0
        for w in asleep:
            if channels[w].take_sleeper():
                socks[w].send(b"t")
                woken += 1
        asleep.clear()
        return woken

    sent = per_worker * workers
    for seq in range(sent):
        dispatch(seq)
    wake()
    arrived: list[dict[int, int]] = [{} for _ in range(workers)]
    children0 = os.times()
    t0, c0 = time.perf_counter(), time.process_time()
    for seq in range(batches):
        w = seq % workers
        got = arrived[w]
        while seq not in got:
            for _kind, slot, rseq, *_ in channels[w].take_results():
                got[rseq] = slot
            if seq in got:
                break
            if channels[w].arm_results():
                socks[w].recv(64)
            channels[w].disarm_results()
        slot = got.pop(seq)
        view = np.frombuffer(ring, np.int64, 1, slot * 8)
        if view[0] != seq * 2:
            raise AssertionError(f"slot {slot} holds {view[0]}, expected {seq * 2}")
        del view
        free.append(slot)
        if sent < batches:
            dispatch(sent)
            sent += 1
            if asleep:
                wakes += wake()
    t1, c1 = time.perf_counter(), time.process_time()
    for w in range(workers):
        channels[w].push_task(_STOP, 0, 0, bytes(8))
        socks[w].send(b"x")
    for pid in pids:
        os.waitpid(pid, 0)
    children1 = os.times()  # (the workers were reaped: their CPU is counted now)
    workers_cpu = (children1.children_user + children1.children_system) - (
        children0.children_user + children0.children_system
    )
    for sock in socks:
        sock.close()
    return {
        "batches_s": batches / (t1 - t0),
        "consumer_us": (c1 - c0) / batches * 1e6,
        "workers_us": workers_cpu / batches * 1e6,  # (includes their start: a few ms)
        "wakes": wakes / batches,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    variants = [(2, False), (2, True), (16, False), (16, True)]
    runs: dict[tuple[int, bool], list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:  # (alternating: the machine's drift spreads over all)
            runs[v].append(one_round(args.batches, *v))
    heads = ("in flight/worker", "SCHED_BATCH", "batches/s", "consumer us", "workers us", "wakes")
    widths = (16, 11, 22, 18, 18, 6)
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, widths)))
    for (per_worker, batch_policy), rs in runs.items():
        cells = []
        for key, fmt in (("batches_s", "{:.0f}"), ("consumer_us", "{:.1f}"), ("workers_us", "{:.1f}")):
            values = [r[key] for r in rs]
            median, low, high = (fmt.format(x) for x in (statistics.median(values), min(values), max(values)))
            cells.append(f"{median} ({low}-{high})")
        wakes = statistics.median(r["wakes"] for r in rs)
        row = (per_worker, "yes" if batch_policy else "no", *cells, f"{wakes:.2f}")
        print(" ".join(f"{c:>{w}}" for c, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
