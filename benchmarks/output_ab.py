"""Tensors vs numpy batches, side by side: the cost of ``output="torch"`` (the default
where torch is imported) against ``output="numpy"`` on a W4-like load (one int64 per
batch) and a W1-like load (64 uint8 3x224x224 images per batch), 2 persistent workers,
4 alternating rounds. Prints each round's batches/s and the median.

    python benchmarks/output_ab.py
"""

from __future__ import annotations

import time

import numpy as np
import torch  # noqa: F401  (torch imported: the default output is tensors)

from shmloader import DataLoader


class OneInt:
    def __len__(self) -> int:
        return 10**7

    def __getitem__(self, i: int) -> np.int64:
        return np.int64(i)


class Images:
    def __init__(self) -> None:
        self.img = np.zeros((3, 224, 224), np.uint8)

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.img, i


def rate(loader: DataLoader, n: int) -> float:
    it = iter(loader)
    for _ in range(50):  # warm up: workers started, ring sized
        next(it)
    t = time.perf_counter()
    for _ in range(n):
        next(it)
    return n / (time.perf_counter() - t)


def main() -> None:
    cases = {"W4-like": (OneInt(), 1, 20000), "W1-like": (Images(), 64, 300)}
    for name, (ds, batch_size, n) in cases.items():
        loaders = {
            out: DataLoader(ds, batch_size=batch_size, num_workers=2, persistent_workers=True, output=out)
            for out in ("numpy", "torch")
        }
        rates: dict[str, list[float]] = {out: [] for out in loaders}
        for _ in range(4):
            for out, loader in loaders.items():
                rates[out].append(rate(loader, n))
        for out, r in rates.items():
            median = round(float(np.median(r)))
            print(f"{name} output={out}: rounds {[round(x) for x in r]} median {median} batches/s")
        for loader in loaders.values():
            loader.shutdown()


if __name__ == "__main__":
    main()
