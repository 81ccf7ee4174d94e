"""Per-image CPU of the worker's decode + transform path, region decoding off vs on.

``python -m shmloader.vision.decodecost DIR [DIR ...]``: for each image folder, the CPU
time (``time.process_time``, one thread, as in a worker) of ``ImageFolder.write_sample``
(read, header, crop draw, decode, resample into a preallocated row) per image, with
``RandomResizedCrop(224) + RandomHorizontalFlip()``; the two settings alternate pass by
pass over the same images and crops, and the report gives the median and the spread
(min-max) over the passes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def measure(root: str, count: int = 200, repeat: int = 5, backend: str = "auto") -> dict[str, Any]:
    """``{"off": [ms per image, one per pass], "on": [...], "size": "WxH...", "stats": {...}}``."""
    import numpy as np

    from shmloader.vision import ImageFolder, RandomHorizontalFlip, RandomResizedCrop
    from shmloader.vision.resample import _get_torch

    transform = [RandomResizedCrop(224), RandomHorizontalFlip()]
    sets = {
        "off": ImageFolder(root, transform, backend=backend, region_decode=False),
        "on": ImageFolder(root, transform, backend=backend, region_decode=True),
    }
    if sets["on"].backend == "torch":
        _get_torch().set_num_threads(1)  # as in a worker
    n = min(count, len(sets["on"]))
    out = (np.empty((224, 224, 3), np.uint8), np.empty((), np.int64))
    per: dict[str, list[float]] = {"off": [], "on": []}
    for name in ("off", "on"):  # warm-up: page cache, imports, scratch buffers
        write = sets[name].write_sample
        np.random.seed(0)
        for i in range(n):
            write(i, out)
    for r in range(repeat):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            write = sets[name].write_sample
            np.random.seed(r)  # the same crops for both settings within a pass
            c0 = time.process_time()
            for i in range(n):
                write(i, out)
            per[name].append((time.process_time() - c0) / n * 1e3)
    from PIL import Image

    sizes = sorted({Image.open(p).size for p, _ in sets["on"].samples[:n]})
    size = f"{sizes[0][0]}x{sizes[0][1]}" if len(sizes) == 1 else f"{len(sizes)} sizes"
    return {**per, "images": n, "size": size, "stats": sets["on"].stats()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmloader.vision.decodecost", description=__doc__)
    parser.add_argument("dirs", nargs="+", help="image folders (e.g. from shmloader make-images --size)")
    parser.add_argument("--count", type=int, default=200, help="images per pass (default 200)")
    parser.add_argument("--repeat", type=int, default=5, help="passes per setting (default 5)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "pillow"))
    args = parser.parse_args(argv)
    for root in args.dirs:
        m = measure(root, args.count, args.repeat, args.backend)
        off, on = m["off"], m["on"]
        ratios = [a / b for a, b in zip(off, on)]
        print(
            f"{root} ({m['images']} images, {m['size']}): CPU per image "
            f"full decode {statistics.median(off):.2f} ms [{min(off):.2f}-{max(off):.2f}], "
            f"region decode {statistics.median(on):.2f} ms [{min(on):.2f}-{max(on):.2f}]; "
            f"{statistics.median(ratios):.2f}x less [{min(ratios):.2f}-{max(ratios):.2f}]; {m['stats']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
