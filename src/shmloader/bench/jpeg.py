"""W6: the JPEG training pipeline, this loader beside torch's, in one run.

2,000 synthetic JPEGs (~400 px) -> random resized crop 224 + horizontal flip -> batches
of 64 uint8 HWC images and int64 labels, 2 workers, shuffled. Peers:

- ``torch+conventional``: ``torch.utils.data.DataLoader`` over the dataset people write
  (Pillow open, ``convert("RGB")``, crop and resize as torchvision's
  ``RandomResizedCrop`` does, flip, ``np.array``), written in plain Pillow and numpy;
- ``torch+ImageFolder``: torch's DataLoader over :class:`~shmloader.vision.ImageFolder`
  (its ``__getitem__``);
- ``shmloader+ImageFolder``: this loader over the same ImageFolder (write-into path).

Workers are persistent; one warm-up epoch each, then ``repeat`` timed epochs, the peers
alternating inside each repeat. Reported: median images/s, median consumer CPU per
batch (``time.process_time`` of the consuming process) and ratios paired per repeat.

Run ``python -m shmloader.vision.benchmark`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

W6_COUNT = 2000
W6_SIZE = 224
W6_BATCH = 64
W6_WORKERS = 2
PEERS = ("torch+conventional", "torch+ImageFolder", "shmloader+ImageFolder")


def default_cache_dir() -> Path:
    base = os.environ.get("SHMLOADER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "shmloader")
    return Path(base)


def ensure_images(root: str | os.PathLike | None = None, count: int = W6_COUNT) -> Path:
    """The W6 image folder (``count`` JPEGs, 300-500 px, 4 classes), made once and reused."""
    from shmloader.vision.synth import make_images

    root = Path(root) if root is not None else default_cache_dir() / f"w6-jpeg-{count}"
    marker = root / ".complete"
    if not (marker.exists() and marker.read_text().strip() == str(count)):
        make_images(root, count, seed=0)
        marker.write_text(str(count))
    return root


class ConventionalFolder:
    """What a torchvision user writes, without torchvision: Pillow open, convert RGB,
    RandomResizedCrop (torchvision's parameters and algorithm, Python's ``random``,
    which torch's workers seed), random horizontal flip, uint8 HWC numpy array out."""

    def __init__(self, samples: list[tuple[str, int]], size: int = W6_SIZE) -> None:
        self.samples = samples
        self.size = size
        self.scale = (0.08, 1.0)
        self.ratio = (3.0 / 4.0, 4.0 / 3.0)

    def __len__(self) -> int:
        return len(self.samples)

    def _params(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target_area = area * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(*log_ratio))
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                return random.randint(0, height - h), random.randint(0, width - w), h, w
        w, h = min(width, height), min(width, height)
        return (height - h) // 2, (width - w) // 2, h, w

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        from PIL import Image

        path, label = self.samples[index]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        i, j, h, w = self._params(*img.size)
        img = img.crop((j, i, j + w, i + h)).resize((self.size, self.size), Image.BILINEAR)
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return np.array(img), label


@dataclass
class PeerResult:
    peer: str
    images_per_s: float  # median over repeats
    consumer_cpu_ms_per_batch: float  # median
    total_cpu_ms_per_image: float  # median; consumer and workers (nan without psutil)
    spread: float  # (max - min) / median of images/s
    runs: list[float]


def _children_cpu_s() -> float:
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


def _epoch(loader: Iterable[Any]) -> tuple[int, int, float, float, float]:
    """Images, batches, wall seconds, consumer CPU seconds and all CPU seconds (consumer
    and workers) of one epoch. The CPU figures depend far less than images/s on what
    else the machine runs."""
    images = batches = 0
    w0, c0, t0 = _children_cpu_s(), time.process_time(), time.perf_counter()
    for _, labels in loader:
        images += len(labels)
        batches += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return images, batches, wall, cpu, cpu + _children_cpu_s() - w0


def _loaders(root: Path, batch_size: int, workers: int, backend: str) -> dict[str, Any]:
    import torch

    from shmloader import DataLoader
    from shmloader.vision import ImageFolder, RandomHorizontalFlip, RandomResizedCrop

    transform = [RandomResizedCrop(W6_SIZE), RandomHorizontalFlip()]
    folder = ImageFolder(root, transform, backend=backend)
    common = {
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": workers,
        "persistent_workers": True,
        "multiprocessing_context": "fork",
    }

    def torch_loader(dataset: Any) -> Any:
        return torch.utils.data.DataLoader(dataset, generator=torch.Generator().manual_seed(0), **common)

    return {
        "torch+conventional": torch_loader(ConventionalFolder(folder.samples)),
        "torch+ImageFolder": torch_loader(folder),
        "shmloader+ImageFolder": DataLoader(folder, seed=0, **common),
    }


def run(
    root: str | os.PathLike | None = None,
    *,
    count: int = W6_COUNT,
    batch_size: int = W6_BATCH,
    workers: int = W6_WORKERS,
    repeat: int = 3,
    backend: str = "auto",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run W6 and return ``{"results": [PeerResult...], "ratios": {...}, ...}``."""
    log = log or (lambda s: None)
    folder = ensure_images(root, count)
    load_before = os.getloadavg()[0]
    loaders = _loaders(folder, batch_size, workers, backend)
    per: dict[str, list[tuple[float, float, float]]] = {p: [] for p in PEERS}
    try:
        for name in PEERS:
            _epoch(loaders[name])  # warm-up: starts the workers, fills the page cache
            log(f"warmed up {name}")
        for r in range(repeat):
            for name in PEERS if r % 2 == 0 else reversed(PEERS):
                images, batches, wall, cpu, total = _epoch(loaders[name])
                per[name].append((images / wall, cpu / batches * 1e3, total / images * 1e3))
                log(f"repeat {r + 1}: {name:<22} {images / wall:8.0f} images/s")
    finally:
        for name, loader in loaders.items():
            if name.startswith("shmloader"):
                loader.shutdown()
            else:
                it = getattr(loader, "_iterator", None)
                if it is not None:
                    it._shutdown_workers()
    results = []
    for name in PEERS:
        rates = [r[0] for r in per[name]]
        med = statistics.median(rates)
        results.append(
            PeerResult(
                name,
                med,
                statistics.median(r[1] for r in per[name]),
                statistics.median(r[2] for r in per[name]),
                (max(rates) - min(rates)) / med,
                rates,
            )
        )

    def paired(a: str, b: str) -> float:
        return statistics.median(x[0] / y[0] for x, y in zip(per[a], per[b], strict=False))

    ratios = {
        "shmloader+ImageFolder / torch+conventional": paired("shmloader+ImageFolder", "torch+conventional"),
        "shmloader+ImageFolder / torch+ImageFolder": paired("shmloader+ImageFolder", "torch+ImageFolder"),
        "torch+ImageFolder / torch+conventional": paired("torch+ImageFolder", "torch+conventional"),
    }
    return {
        "workload": f"W6: {count} JPEGs ~400px -> RandomResizedCrop {W6_SIZE} + flip -> "
        f"batch {batch_size} "
        f"uint8, {workers} workers",
        "folder": str(folder),
        "load": (load_before, os.getloadavg()[0]),
        "cores": os.cpu_count(),
        "backend": loaders["shmloader+ImageFolder"].dataset.backend,
        "results": results,
        "ratios": ratios,
        "targets": {
            "shmloader+ImageFolder / torch+conventional": 2.0,
            "shmloader+ImageFolder / torch+ImageFolder": 1.15,
        },
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [report["workload"], f"(resample backend: {report['backend']}; median of repeats)", ""]
    lines.append(f"{'peer':<24}{'images/s':>10}{'spread':>9}{'consumer CPU/batch':>21}{'all CPU/image':>16}")
    for r in report["results"]:
        lines.append(
            f"{r.peer:<24}{r.images_per_s:>10.0f}{r.spread:>8.0%} "
            f"{r.consumer_cpu_ms_per_batch:>16.2f} ms{r.total_cpu_ms_per_image:>13.2f} ms"
        )
    lines.append("")
    for name, value in report["ratios"].items():
        target = report["targets"].get(name)
        verdict = (
            "" if target is None else f"  (target >= {target:.2f}x: {'met' if value >= target else 'MISSED'})"
        )
        lines.append(f"{name:<46} {value:5.2f}x{verdict}")
    cpu = {r.peer: r.total_cpu_ms_per_image for r in report["results"]}
    ours = cpu["shmloader+ImageFolder"]
    lines.append("")
    lines.append("CPU per image, consumer + workers (far less sensitive to other load than images/s):")
    for peer in ("torch+conventional", "torch+ImageFolder"):
        lines.append(f"  {peer} / shmloader+ImageFolder {'':<18} {cpu[peer] / ours:5.2f}x")
    lo, hi = report["load"]
    if max(lo, hi) > report["cores"]:
        lines.append(
            f"note: load average {lo:.1f} -> {hi:.1f} on {report['cores']} cores: other processes "
            "competed for the CPU, so images/s and its ratios are noisy; trust the CPU ratios more."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shmloader.vision.benchmark", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dir", help="image folder to use or create (default: a cache folder)")
    parser.add_argument("--count", type=int, default=W6_COUNT, help="images (default 2000)")
    parser.add_argument("--batch-size", type=int, default=W6_BATCH)
    parser.add_argument("--workers", type=int, default=W6_WORKERS)
    parser.add_argument("--repeat", type=int, default=3, help="timed epochs per peer (default 3)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "pillow"))
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    report = run(
        args.dir,
        count=args.count,
        batch_size=args.batch_size,
        workers=args.workers,
        repeat=args.repeat,
        backend=args.backend,
        log=None if args.quiet or args.json else print,
    )
    if args.json:
        report = {**report, "results": [asdict(r) for r in report["results"]]}
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
