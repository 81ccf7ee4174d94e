"""W6, the JPEG training pipeline: this loader beside torch's over an image folder.

2,000 synthetic JPEGs (~400 px, written once under ``$SHMLOADER_CACHE`` or
``~/.cache/shmloader``) -> random resized crop 224 + horizontal flip -> batches of 64
uint8 HWC images and int64 labels, shuffled, persistent workers. Peers:

- ``torch+conventional``: ``torch.utils.data.DataLoader`` over the dataset people write
  (Pillow open, ``convert("RGB")``, crop and resize as torchvision's
  ``RandomResizedCrop`` does, flip, ``np.array``), written in plain Pillow and numpy;
- ``torch+ImageFolder``: torch's DataLoader over :class:`~shmloader.vision.ImageFolder`
  (its ``__getitem__``);
- ``shmloader+ImageFolder``: this loader over the same ImageFolder (write-into path).

Timed by the one harness (:func:`shmloader.bench.peers.time_peers`) over whole epochs: one
warm-up epoch each, then ``repeat`` timed epochs, the peers alternating. Reported: median
images/s (and batches/s = images/s / 64), median consumer CPU per batch
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

from shmloader.bench.machine import load1
from shmloader.bench.peers import close_loader, close_peers, summarize, time_peers
from shmloader.bench.progress import Progress
from shmloader.bench.results import ConfigResult, Row
from shmloader.bench.workloads import WORKLOADS, Config

W6_COUNT = 2000
W6_SIZE = 224
W6_BATCH = 64
PEERS = ("torch+conventional", "torch+ImageFolder", "shmloader+ImageFolder")
_BASE = "torch+conventional"  # what 'vs torch' is relative to
_OURS = "shmloader+ImageFolder"


def default_cache_dir() -> Path:
    """Where W6's images are written once: ``$SHMLOADER_CACHE`` or ``~/.cache/shmloader``."""
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


class EpochPeer:
    """A persistent loader timed over whole epochs (W6): ``run`` ignores the batch and time
    bounds, and keeps each epoch's images/s and all-CPU per image for W6's own table."""

    def __init__(self, name: str, loader: Any, batch_size: int):
        self.name = name
        self.loader = loader
        self.batch_size = batch_size
        self.images_per_s: list[float] = []
        self.all_cpu_ms_per_image: list[float] = []

    def warm_up(self) -> None:
        """One untimed epoch: starts the workers, fills the page cache."""
        _epoch(self.loader)

    def run(self, batches: int, max_s: float) -> tuple[float, float, int]:
        """One timed epoch: images/s / batch size (the last batch may be short), consumer
        CPU seconds per batch, batches."""
        images, n, wall, cpu, total = _epoch(self.loader)
        self.images_per_s.append(images / wall)
        self.all_cpu_ms_per_image.append(total / images * 1e3)
        return images / wall / self.batch_size, cpu / n, n

    def close(self) -> None:
        """Stop the loader's workers."""
        close_loader(self.loader)


def _peers(root: Path, batch_size: int, workers: int, backend: str, torch_dl: Any) -> list[EpochPeer]:
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
        return torch_dl(dataset, generator=torch.Generator().manual_seed(0), **common)

    loaders = {
        "torch+conventional": torch_loader(ConventionalFolder(folder.samples)),
        "torch+ImageFolder": torch_loader(folder),
        "shmloader+ImageFolder": DataLoader(folder, seed=0, **common),
    }
    return [EpochPeer(name, loaders[name], batch_size) for name in PEERS]


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


def w6_steps(repeat: int) -> int:
    """Progress steps of :func:`measure_w6`: the dataset, warm-up epochs, timed epochs."""
    return 1 + len(PEERS) * (1 + repeat)


def measure_w6(
    cfg: Config,
    *,
    repeat: int,
    torch_dl: Any | None,
    progress: Progress,
    root: str | os.PathLike | None = None,
    count: int = W6_COUNT,
    backend: str = "auto",
) -> ConfigResult:
    """W6: the three peers side by side, ``repeat`` timed epochs each after a warm-up
    epoch; rows in batches of 64 and ratios to torch+conventional, W6's own report (images/s,
    CPU per image) in ``extra["w6"]`` and as text in ``extra["w6_table"]``."""
    wl = WORKLOADS["W6"]
    res = ConfigResult(cfg, wl.description, wl.batch_size, wl.batch_size * (W6_SIZE * W6_SIZE * 3 + 8), 0)
    why = w6_missing(torch_dl)
    if why is not None:
        res.rows = [Row(name, status=f"skipped: {why}") for name in PEERS]
        res.notes.append(f"{cfg.label} skipped: {why}")
        for _ in range(w6_steps(repeat)):
            progress.step(f"{cfg.label} skipped")
        return res
    folder = Path(root) if root is not None else default_cache_dir() / f"w6-jpeg-{count}"
    if not (folder / ".complete").exists():
        progress.out(f"{cfg.label}: writing {count} synthetic JPEGs to {folder} (once, about a minute)")
    ensure_images(folder, count)
    progress.step(f"{cfg.label} dataset ready: {folder}")
    load0 = load1()
    peers = _peers(folder, wl.batch_size, cfg.workers, backend, torch_dl)
    resample = peers[-1].loader.dataset.backend
    try:
        rows = time_peers(cfg.label, peers, batches=0, max_s=math.inf, repeat=repeat, progress=progress)
    finally:
        close_peers(peers)
    summarize(rows, res.batch_bytes, base=_BASE)
    res.rows = list(rows.values())
    by = {p.name: p for p in peers}

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(by[a].images_per_s, by[b].images_per_s, strict=True))

    res.extra["w6"] = {
        "workload": f"W6: {count} JPEGs ~400px -> RandomResizedCrop {W6_SIZE} + flip -> "
        f"batch {wl.batch_size} uint8, {cfg.workers} workers",
        "folder": str(folder),
        "load": [load0, load1()],
        "cores": os.cpu_count(),
        "backend": resample,
        "results": [
            {
                "peer": p.name,
                "images_per_s": statistics.median(p.images_per_s),
                "consumer_cpu_ms_per_batch": rows[p.name].consumer_cpu_ms,
                "total_cpu_ms_per_image": statistics.median(p.all_cpu_ms_per_image),
                "spread": rows[p.name].spread,
                "runs": p.images_per_s,
            }
            for p in peers
        ],
        "ratios": {
            f"{a} / {b}": paired(a, b)
            for a, b in ((_OURS, _BASE), (_OURS, "torch+ImageFolder"), ("torch+ImageFolder", _BASE))
        },
    }
    res.extra["w6_table"] = w6_table(res.extra["w6"])
    res.notes.append(
        f"{cfg.label}: batches/s = images/s / 64 over whole epochs of {count} images (the last "
        f"batch short); 'vs torch' = vs torch+conventional; resample backend {resample}"
    )
    if load0 is not None:
        res.load_average = [load0, load1() or 0.0]
    return res


def w6_table(report: dict[str, Any]) -> str:
    """W6's own table: images/s, consumer CPU per batch, CPU per image of all processes,
    the paired ratios, and a warning when other processes competed for the CPU."""
    lines = [report["workload"], f"(resample backend: {report['backend']}; median of repeats)", ""]
    lines.append(f"{'peer':<24}{'images/s':>10}{'spread':>9}{'consumer CPU/batch':>21}{'all CPU/image':>16}")
    for r in report["results"]:
        lines.append(
            f"{r['peer']:<24}{r['images_per_s']:>10.0f}{r['spread']:>8.0%} "
            f"{r['consumer_cpu_ms_per_batch']:>16.2f} ms{r['total_cpu_ms_per_image']:>13.2f} ms"
        )
    lines.append("")
    for name, value in report["ratios"].items():
        lines.append(f"{name:<46} {value:5.2f}x")
    cpu = {r["peer"]: r["total_cpu_ms_per_image"] for r in report["results"]}
    lines.append("")
    lines.append("CPU per image, consumer + workers (far less sensitive to other load than images/s):")
    for peer in ("torch+conventional", "torch+ImageFolder"):
        lines.append(f"  {peer} / shmloader+ImageFolder {'':<18} {cpu[peer] / cpu[_OURS]:5.2f}x")
    lo, hi = report["load"]
    if lo is not None and hi is not None and max(lo, hi) > report["cores"]:
        lines.append(
            f"note: load average {lo:.1f} -> {hi:.1f} on {report['cores']} cores: other processes "
            "competed for the CPU, so images/s and its ratios are noisy; trust the CPU ratios more."
        )
    return "\n".join(lines)
