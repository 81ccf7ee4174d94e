"""W9, the torchvision pipeline users already have: torch's DataLoader beside this loader's
``images="auto"`` and ``images="fast"`` over one torchvision ``ImageFolder``.

600 synthetic JPEGs of 500x375 (W6's images: :func:`shmloader.bench.jpeg.ensure_images`)
-> ``transforms.Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor()])``
-> batches of 64 float32 (3, 224, 224) images and int64 labels, shuffled. Peers, all
persistent loaders with ``--workers`` workers over the same dataset object:

- ``torch``: ``torch.utils.data.DataLoader``;
- ``shmloader auto``: this loader as a drop-in (``images="auto"``, the default: the
  pipeline runs fused, bit-identical to torch's batches);
- ``shmloader fast``: ``images="fast"`` (reduced-scale DCT decoding, torch's resampler).

Timed as W6 times its persistent peers (:class:`shmloader.bench.jpeg.EpochPeer`: whole
epochs, the consumer of W6, a warm-up epoch, then ``repeat`` epochs, the peers
alternating), so ratios pair epochs measured back to back. Run it as
``shmloader bench --workloads W9``; without torchvision the rows say so.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

from shmloader.bench.jpeg import W6_IMAGE_SIZE, EpochPeer, ensure_images, image_folder, skipped
from shmloader.bench.machine import load1
from shmloader.bench.peers import close_peers, summarize, time_peers
from shmloader.bench.progress import Progress
from shmloader.bench.results import ConfigResult
from shmloader.bench.workloads import WORKLOADS, Config

__all__ = ["PEERS", "W9_COUNT", "measure_w9", "w9_missing", "w9_steps"]

W9_COUNT = 600
W9_SIZE = 224
PEERS = ("torch", "shmloader auto", "shmloader fast")
_BASE = "torch"


def w9_missing(torch_dl: Any | None) -> str | None:
    """Why W9 cannot run here, or None."""
    for module, name in (("torch", "torch"), ("torchvision", "torchvision"), ("PIL", "Pillow")):
        try:
            __import__(module)
        except ImportError:
            return f"{name} not installed"
    return None if torch_dl is not None else "torch not installed"


def w9_steps(repeat: int) -> int:
    """Progress steps of :func:`measure_w9`: the dataset, then each peer's warm-up and runs."""
    return 1 + len(PEERS) * (1 + repeat)


def _peers(root: Any, batch_size: int, workers: int, torch_dl: Any) -> list[EpochPeer]:
    import torch
    from torchvision import datasets
    from torchvision import transforms as T

    from shmloader import DataLoader

    transform = T.Compose([T.RandomResizedCrop(W9_SIZE), T.RandomHorizontalFlip(), T.ToTensor()])
    dataset = datasets.ImageFolder(str(root), transform)
    common = {
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": workers,
        "persistent_workers": True,
        "multiprocessing_context": "fork",
    }
    torch.manual_seed(0)
    loaders = {
        "torch": torch_dl(dataset, **common),
        "shmloader auto": DataLoader(dataset, images="auto", **common),
        "shmloader fast": DataLoader(dataset, images="fast", **common),
    }
    return [EpochPeer(name, loaders[name], batch_size) for name in PEERS]


def measure_w9(cfg: Config, *, repeat: int, torch_dl: Any | None, progress: Progress) -> ConfigResult:
    """W9: the three peers side by side, ``repeat`` timed epochs each after a warm-up epoch;
    rows in batches of 64 with ratios to torch paired per repeat, images/s and the fused
    path's state in ``extra["w9"]`` and the notes."""
    wl = WORKLOADS["W9"]
    res = ConfigResult(cfg, wl.description, wl.batch_size, wl.batch_size * (3 * W9_SIZE * W9_SIZE * 4 + 8), 0)
    why = w9_missing(torch_dl)
    if why is not None:
        return skipped(res, why, PEERS, w9_steps(repeat), progress)
    folder = image_folder(W9_COUNT, W6_IMAGE_SIZE)
    if not (folder / ".complete").exists():
        progress.out(f"{cfg.label}: writing {W9_COUNT} synthetic JPEGs to {folder} (once)")
    ensure_images(folder, W9_COUNT, W6_IMAGE_SIZE)
    progress.step(f"{cfg.label} dataset ready: {folder}")
    load0 = load1()
    peers = _peers(folder, wl.batch_size, cfg.workers, torch_dl)
    try:
        rows = time_peers(cfg.label, peers, batches=0, max_s=math.inf, repeat=repeat, progress=progress)
        images = {p.name: p.loader.stats()["images"] for p in peers if p.name != _BASE}
    finally:
        close_peers(peers)
    summarize(rows, res.batch_bytes, base=_BASE)
    res.rows = list(rows.values())
    res.extra["w9"] = _summary(peers, images, cfg, [load0, load1()])
    for name, ratio in res.extra["w9"]["ratios"].items():
        lo, hi = res.extra["w9"]["ratio_ranges"][name]
        state = images[name.split(" / ")[0]]
        res.notes.append(
            f"{cfg.label} {name}: {ratio:.2f}x images/s (range {lo:.2f}-{hi:.2f} over {repeat} paired "
            f"epochs); fused path active={state['active']}, fell back {state['fell_back']} of "
            f"{state['fused'] + state['fell_back']} samples"
        )
    return res


def _summary(
    peers: list[EpochPeer], images: dict[str, Any], cfg: Config, load: list[float]
) -> dict[str, Any]:
    by = {p.name: p for p in peers}
    ratios = {
        f"{name} / {_BASE}": [
            a / b for a, b in zip(by[name].images_per_s, by[_BASE].images_per_s, strict=True)
        ]
        for name in PEERS
        if name != _BASE
    }
    return {
        "workload": f"W9: {W9_COUNT} JPEGs {W6_IMAGE_SIZE[0]}x{W6_IMAGE_SIZE[1]} -> torchvision "
        f"RandomResizedCrop {W9_SIZE} + flip + ToTensor -> batch 64 float32, {cfg.workers} workers",
        "load": load,
        "cores": os.cpu_count(),
        "results": [
            {
                "peer": p.name,
                "images_per_s": statistics.median(p.images_per_s),
                "total_cpu_ms_per_image": statistics.median(p.all_cpu_ms_per_image),
                "runs": p.images_per_s,
            }
            for p in peers
        ],
        "images": images,
        "ratios": {k: statistics.median(v) for k, v in ratios.items()},
        "ratio_ranges": {k: [min(v), max(v)] for k, v in ratios.items()},
    }
