"""W6, the JPEG training pipeline: this loader beside torch's over an image folder.

2,000 synthetic JPEGs (500x375 by default, ImageNet's median size; ``--image-size``;
written once under ``$SHMLOADER_CACHE`` or ``~/.cache/shmloader``) -> random resized crop
224 + horizontal flip -> batches of 64 uint8 HWC images and int64 labels, shuffled.
Peers:

- ``torch+conventional``: ``torch.utils.data.DataLoader`` over the dataset people write
  (Pillow open, ``convert("RGB")``, crop and resize as torchvision's
  ``RandomResizedCrop`` does, flip, ``np.array``), written in plain Pillow and numpy;
- ``torch+ImageFolder``: torch's DataLoader over :class:`~shmloader.vision.ImageFolder`
  (its ``__getitem__``);
- ``shmloader+ImageFolder``: this loader over the same ImageFolder (write-into path).

Two measurements, each by the one harness (:func:`shmloader.bench.peers.time_peers`:
a warm-up, then ``repeat`` timed runs, the peers alternating):

- long runs: persistent loaders over whole epochs of the 2,000 images;
- fresh passes: a new loader (workers not persistent) per run, over the first
  :data:`W6_FRESH_COUNT` images, timed from its construction to the end of its one
  epoch (worker start-up and pipeline fill included, as for a short epoch or a job
  that just started).

Every peer's consumer reads every page of every batch
(:func:`~shmloader.bench.consume.read_every_page`). Reported: median images/s with the
spread (min-max over median), batches/s = images/s / 64, median consumer CPU per batch
(``time.process_time`` of the consuming process), CPU per image of consumer and workers,
and ratios paired per repeat. Run it as ``shmloader bench --workloads W6``.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from shmloader.bench.consume import read_every_page
from shmloader.bench.decodelimit import LIMIT, PARALLEL, DecodeLimitPeer, ParallelDecodePeer, usable_cores
from shmloader.bench.jpegreport import OURS as _OURS
from shmloader.bench.jpegreport import w6_table
from shmloader.bench.machine import children_cpu_s, load1
from shmloader.bench.peers import close_loader, close_peers, summarize, time_peers
from shmloader.bench.progress import Progress
from shmloader.bench.results import ConfigResult, Row
from shmloader.bench.workloads import WORKLOADS, Config

W6_COUNT = 2000
W6_FRESH_COUNT = 600  # images of a fresh loader's pass
W6_IMAGE_SIZE = (500, 375)  # (width, height) of the synthetic JPEGs: ImageNet's median
W6_SIZE = 224
W6_BATCH = 64
PEERS = ("torch+conventional", "torch+ImageFolder", "shmloader+ImageFolder")
_BASE = "torch+conventional"  # what 'vs torch' is relative to


def default_cache_dir() -> Path:
    """Where W6's images are written once: ``$SHMLOADER_CACHE`` or ``~/.cache/shmloader``."""
    base = os.environ.get("SHMLOADER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "shmloader")
    return Path(base)


def image_folder(count: int = W6_COUNT, size: tuple[int, int] = W6_IMAGE_SIZE) -> Path:
    """The cache folder of ``count`` W6 JPEGs of ``size`` (width, height)."""
    return default_cache_dir() / f"w6-jpeg-{count}-{size[0]}x{size[1]}"


def ensure_images(
    root: str | os.PathLike | None = None, count: int = W6_COUNT, size: tuple[int, int] = W6_IMAGE_SIZE
) -> Path:
    """The W6 image folder (``count`` JPEGs of ``size``, 4 classes), made once and reused."""
    from shmloader.vision.synth import make_images

    root = Path(root) if root is not None else image_folder(count, size)
    marker = root / ".complete"
    if not (marker.exists() and marker.read_text().strip() == str(count)):
        make_images(root, count, seed=0, size=size)
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


def _epoch(loader: Iterable[Any]) -> tuple[int, int, float, float, float]:
    """Images, batches, wall seconds, consumer CPU seconds and all CPU seconds (consumer
    and workers) of one epoch, every batch read (as a training step reads it). The CPU
    figures depend far less than images/s on what else the machine runs."""
    images = batches = 0
    w0, c0, t0 = children_cpu_s(), time.process_time(), time.perf_counter()
    for batch in loader:
        read_every_page(batch)
        images += len(batch[1])
        batches += 1
    batch = None
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return images, batches, wall, cpu, cpu + children_cpu_s() - w0


def _reaped_cpu_s() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    t = os.times()
    return t.children_user + t.children_system


def _fresh_pass(make: Any) -> tuple[int, int, float, float, float]:
    """:func:`_epoch`'s figures for a new loader (``make()``) iterated once and shut down:
    the clocks start before it is made, and its workers' CPU is counted once they exit."""
    images = batches = 0
    w0, c0, t0 = _reaped_cpu_s(), time.process_time(), time.perf_counter()
    loader = make()
    for batch in loader:
        read_every_page(batch)
        images += len(batch[1])
        batches += 1
    batch = None
    close_loader(loader)  # not persistent: its workers are already stopping
    del loader
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return images, batches, wall, cpu, cpu + _reaped_cpu_s() - w0


class EpochPeer:
    """A persistent loader timed over whole epochs (W6): ``run`` ignores the batch and time
    bounds, and keeps each epoch's images/s and all-CPU per image for W6's own table."""

    def __init__(self, name: str, loader: Any, batch_size: int):
        self.name = name
        self.loader = loader
        self.batch_size = batch_size
        self.images_per_s: list[float] = []
        self.all_cpu_ms_per_image: list[float] = []

    def _once(self) -> tuple[int, int, float, float, float]:
        return _epoch(self.loader)

    def warm_up(self) -> None:
        """One untimed epoch: starts the workers, fills the page cache."""
        self._once()

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]:
        """One timed epoch: images/s / batch size (the last batch may be short), consumer
        CPU seconds per batch, batches."""
        images, n, wall, cpu, total = self._once()
        self.images_per_s.append(images / wall)
        self.all_cpu_ms_per_image.append(total / images * 1e3)
        return images / wall / self.batch_size, cpu / n, n

    def close(self) -> None:
        """Stop the loader's workers."""
        close_loader(self.loader)


class FreshPeer(EpochPeer):
    """A fresh loader per run (W6 fresh passes): ``make()`` builds a loader whose workers
    are not persistent; each run makes one, iterates its epoch and shuts it down, timed
    from before it is made (worker start-up and pipeline fill included)."""

    def __init__(self, name: str, make: Any, batch_size: int, dataset: Any):
        super().__init__(name, None, batch_size)
        self.make = make
        self.dataset = dataset

    def _once(self) -> tuple[int, int, float, float, float]:
        return _fresh_pass(self.make)

    def close(self) -> None:
        """Nothing runs between passes."""


def _peers(
    root: Path, batch_size: int, workers: int, backend: str, torch_dl: Any, fresh_count: int
) -> tuple[list[EpochPeer], list[EpochPeer]]:
    """The persistent peers over the whole folder, and the fresh ones over its first
    ``fresh_count`` images, with their decode limit (:class:`DecodeLimitPeer`) and the same
    decode on all cores at once (:class:`ParallelDecodePeer`)."""
    import torch

    from shmloader import DataLoader
    from shmloader.vision import ImageFolder, RandomHorizontalFlip, RandomResizedCrop

    transform = [RandomResizedCrop(W6_SIZE), RandomHorizontalFlip()]
    folder = ImageFolder(root, transform, backend=backend)
    subset = ImageFolder.from_files(
        *zip(*folder.samples[:fresh_count], strict=True), transform, backend=backend
    )
    common = {
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": workers,
        "multiprocessing_context": "fork",
    }

    def torch_loader(dataset: Any, persistent: bool) -> Any:
        gen = torch.Generator().manual_seed(0)
        return torch_dl(dataset, generator=gen, persistent_workers=persistent, **common)

    def makers(ds: Any, persistent: bool) -> dict[str, Any]:
        return {
            "torch+conventional": lambda: torch_loader(ConventionalFolder(ds.samples), persistent),
            "torch+ImageFolder": lambda: torch_loader(ds, persistent),
            "shmloader+ImageFolder": lambda: DataLoader(ds, seed=0, persistent_workers=persistent, **common),
        }

    steady, fresh = makers(folder, True), makers(subset, False)
    return (
        [EpochPeer(name, steady[name](), batch_size) for name in PEERS],
        [FreshPeer(name, fresh[name], batch_size, subset) for name in PEERS]
        + [
            DecodeLimitPeer(subset, batch_size, usable_cores()),
            ParallelDecodePeer(subset, batch_size, usable_cores()),
        ],
    )


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def w6_missing(torch_dl: Any | None) -> str | None:
    """Why W6 cannot run here, or None."""
    import importlib.util

    missing = [
        name for mod, name in (("PIL", "Pillow"), ("simplejpeg", "simplejpeg")) if not _importable(mod)
    ]
    if missing:
        return f'needs Pillow and simplejpeg ({", ".join(missing)} missing: pip install "shmloader[vision]")'
    if torch_dl is None or importlib.util.find_spec("torch") is None:
        return "needs torch (its peers are torch DataLoaders)"
    return None


def skipped(
    res: ConfigResult, why: str, peers: tuple[str, ...], steps: int, progress: Progress
) -> ConfigResult:
    """``res`` for a workload that cannot run here (``why``): a skipped row per peer, a
    note, and the progress steps it would have taken."""
    label = res.config.label
    res.rows = [Row(name, status=f"skipped: {why}") for name in peers]
    res.notes.append(f"{label} skipped: {why}")
    for _ in range(steps):
        progress.step(f"{label} skipped")
    return res


def w6_steps(repeat: int) -> int:
    """Progress steps of :func:`measure_w6`: the dataset, then warm-up and timed runs of
    the long runs and of the fresh passes (and their decode limit, one thread and all cores)."""
    return 1 + (2 * len(PEERS) + 2) * (1 + repeat)


def _summary(peers: list[EpochPeer], rows: dict[str, Row]) -> dict[str, Any]:
    """Per peer: median images/s, spread, CPU figures, runs; paired ratios (median and
    min-max over the repeats)."""
    by = {p.name: p for p in peers}
    pairs = ((_OURS, _BASE), (_OURS, "torch+ImageFolder"), ("torch+ImageFolder", _BASE))
    if LIMIT in by:
        pairs += ((_OURS, LIMIT), ("torch+ImageFolder", LIMIT))
    if PARALLEL in by:
        pairs += ((_OURS, PARALLEL), ("torch+ImageFolder", PARALLEL))
    ratios = {
        f"{a} / {b}": [x / y for x, y in zip(by[a].images_per_s, by[b].images_per_s, strict=True)]
        for a, b in pairs
    }
    return {
        "results": [
            {
                "peer": p.name,
                "images_per_s": statistics.median(p.images_per_s),
                "consumer_cpu_ms_per_batch": rows[p.name].consumer_cpu_ms,
                "total_cpu_ms_per_image": statistics.median(p.all_cpu_ms_per_image),
                "spread": rows[p.name].spread,
                "runs": p.images_per_s,
                "total_cpu_ms_per_image_runs": p.all_cpu_ms_per_image,
            }
            for p in peers
        ],
        "ratios": {k: statistics.median(v) for k, v in ratios.items()},
        "ratio_ranges": {k: [min(v), max(v)] for k, v in ratios.items()},
    }


def measure_w6(
    cfg: Config,
    *,
    repeat: int,
    torch_dl: Any | None,
    progress: Progress,
    root: str | os.PathLike | None = None,
    count: int = W6_COUNT,
    backend: str = "auto",
    image_size: tuple[int, int] = W6_IMAGE_SIZE,
    fresh_count: int = W6_FRESH_COUNT,
) -> ConfigResult:
    """W6: the three peers side by side, ``repeat`` timed epochs each after a warm-up
    epoch (persistent loaders: the rows, in batches of 64, ratios to torch+conventional),
    then ``repeat`` fresh loaders' passes over ``fresh_count`` images each after a
    warm-up pass; W6's own report (images/s, CPU per image, both measurements) in
    ``extra["w6"]`` (the fresh passes under ``"fresh"``) and as text in
    ``extra["w6_table"]``."""
    wl = WORKLOADS["W6"]
    res = ConfigResult(cfg, wl.description, wl.batch_size, wl.batch_size * (W6_SIZE * W6_SIZE * 3 + 8), 0)
    why = w6_missing(torch_dl)
    if why is not None:
        return skipped(res, why, PEERS, w6_steps(repeat), progress)
    folder = Path(root) if root is not None else image_folder(count, image_size)
    if not (folder / ".complete").exists():
        progress.out(f"{cfg.label}: writing {count} synthetic JPEGs to {folder} (once, a few minutes)")
    ensure_images(folder, count, image_size)
    progress.step(f"{cfg.label} dataset ready: {folder}")
    load0 = load1()
    fresh_count = min(fresh_count, count)
    peers, fresh = _peers(folder, wl.batch_size, cfg.workers, backend, torch_dl, fresh_count)
    resample = peers[-1].loader.dataset.backend
    try:
        rows = time_peers(cfg.label, peers, batches=0, max_s=math.inf, repeat=repeat, progress=progress)
    finally:
        close_peers(peers)
    fresh_rows = time_peers(
        f"{cfg.label} fresh", fresh, batches=0, max_s=math.inf, repeat=repeat, progress=progress
    )
    summarize(rows, res.batch_bytes, base=_BASE)
    summarize(fresh_rows, res.batch_bytes, base=_BASE)
    res.rows = list(rows.values())
    size = f"{image_size[0]}x{image_size[1]}"
    res.extra["w6"] = {
        "workload": f"W6: {count} JPEGs {size} -> RandomResizedCrop {W6_SIZE} + flip -> "
        f"batch {wl.batch_size} uint8, {cfg.workers} workers",
        "folder": str(folder),
        "image_size": list(image_size),
        "load": [load0, load1()],
        "cores": os.cpu_count(),
        "backend": resample,
        **_summary(peers, rows),
        "fresh": {"images": fresh_count, "limit_cores": usable_cores(), **_summary(fresh, fresh_rows)},
    }
    res.extra["w6_table"] = w6_table(res.extra["w6"])
    res.notes.append(
        f"{cfg.label}: batches/s = images/s / 64 over whole epochs of {count} images (the last "
        f"batch short); 'vs torch' = vs torch+conventional; resample backend {resample}; fresh "
        f"loaders' passes over {fresh_count} images in the detail table"
    )
    if load0 is not None:
        res.load_average = [load0, load1() or 0.0]
    return res
