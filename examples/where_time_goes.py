"""Is my training loop waiting for data? Two loops, and what ``loader.stats()["time"]`` says.

    python examples/where_time_goes.py               # W1 with a 20 ms step, then W5 with none
    python examples/where_time_goes.py --step-ms 0   # W1 with no step: the loader is the limit

W1: 64 images of 3x224x224 uint8 per batch (cheap samples) and a training step of
``--step-ms`` (a stand-in for the forward and backward pass). W5: samples that cost ~1 ms
of CPU each, batch 16, and a loop that does nothing with them. A progress line shows the
verdict as it stands every ``--every`` batches.
"""

from __future__ import annotations

import argparse
import time

from shmloader import DataLoader
from shmloader.bench.datasets import ComputeDataset, ImageDataset


def run(name: str, loader: DataLoader, step_s: float, every: int) -> dict:
    """Iterate one epoch with a ``step_s`` training step, printing the verdict as it goes."""
    for n, _batch in enumerate(loader, 1):
        if step_s:
            time.sleep(step_s)
        if n % every == 0 or n == len(loader):
            t = loader.stats()["time"]
            waited, busy = t["waited_share"], t["workers_busy_share"]
            print(f"\r  {name} {n}/{len(loader)}: waited {waited:.0%}, workers busy {busy:.0%}", end="")
    print()
    return loader.stats()["time"]


def show(t: dict) -> None:
    workers = t["workers"]
    fetch = sum(w["fetch_s"] for w in workers)
    collate = sum(w["collate_s"] for w in workers)
    idle = sum(w["idle_s"] for w in workers)
    print(
        f"  loop: start {t['start_s'] * 1e3:.0f} ms, waited {t['wait_s']:.2f} s, stepped {t['loop_s']:.2f} s "
        f"({t['waited_share']:.0%} waiting); batches ready at next(): {t['ready_batches_mean']:.1f}"
    )
    print(
        f"  workers: fetch {fetch:.2f} s, collate+write {collate:.2f} s, idle {idle:.2f} s "
        f"(busy {t['workers_busy_share']:.0%})"
    )
    print(f"  verdict: {t['verdict']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0, help="W1's training step (default 20)")
    parser.add_argument("--every", type=int, default=10, help="batches between progress lines")
    args = parser.parse_args()
    w1 = DataLoader(ImageDataset(64 * args.batches), batch_size=64, num_workers=args.workers)
    print(f"W1, {args.step_ms:g} ms step:")
    show(run("W1", w1, args.step_ms / 1e3, args.every))
    w5 = DataLoader(ComputeDataset(16 * args.batches), batch_size=16, num_workers=args.workers)
    print("W5, no step:")
    show(run("W5", w5, 0.0, args.every))


if __name__ == "__main__":
    main()
