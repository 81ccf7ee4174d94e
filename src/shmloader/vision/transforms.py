"""Image transforms that write into the slot: geometry first, pixels once.

Each geometric transform (:class:`Resize`, :class:`CenterCrop`,
:class:`RandomResizedCrop`, :class:`RandomHorizontalFlip`) only moves a *region*: which
box of the source image ends up where in the output, and whether it is mirrored. A
:class:`Compose` folds them into one plan per sample, so the pixels are touched once:
the decoder produces the (possibly DCT-downscaled) image, and one antialiased bilinear
resample of the box writes the output straight into its row of the slot. Resize then
crop therefore costs one resample, not two, and the result equals torchvision's up to
sub-pixel rounding of the box.

The parameters mean what they mean in torchvision (``Resize(256)`` resizes the shorter
side to 256, ``RandomResizedCrop(224, scale=(0.08, 1.0), ratio=(3/4, 4/3))`` draws the
crop with torchvision's algorithm, ten tries then a central fallback). Randomness comes
from the generator the dataset passes, one per sample (see
:class:`~shmloader.vision.ImageFolder`).

Output transforms: :class:`ToCHW` (uint8 channels-first) and :class:`Normalize`
(float32, ``(x / 255 - mean) / std``, for CPU consumers; on an accelerator, ship uint8
and normalize there: 4x fewer bytes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Region:
    """Where a box of the source image lands in the current (virtual) image.

    ``size`` is the current image's (width, height); ``content`` the rectangle of it
    (x0, y0, x1, y1) that shows the source ``box`` (x0, y0, x1, y1, source pixels), the
    rest being zero padding (only a crop larger than the image pads); ``flip``: the box
    is shown mirrored left-right.
    """

    size: tuple[int, int]
    content: tuple[float, float, float, float]
    box: tuple[float, float, float, float]
    flip: bool = False

    @classmethod
    def whole(cls, width: int, height: int) -> Region:
        r = (0.0, 0.0, float(width), float(height))
        return cls((int(width), int(height)), r, r)

    def _to_source_x(self, x: float) -> float:
        cx0, _, cx1, _ = self.content
        bx0, _, bx1, _ = self.box
        t = (x - cx0) / (cx1 - cx0) if cx1 > cx0 else 0.0
        return bx1 - t * (bx1 - bx0) if self.flip else bx0 + t * (bx1 - bx0)

    def _to_source_y(self, y: float) -> float:
        _, cy0, _, cy1 = self.content
        _, by0, _, by1 = self.box
        t = (y - cy0) / (cy1 - cy0) if cy1 > cy0 else 0.0
        return by0 + t * (by1 - by0)

    def resized(self, width: int, height: int) -> Region:
        w, h = self.size
        sx, sy = width / w, height / h
        x0, y0, x1, y1 = self.content
        return Region((int(width), int(height)), (x0 * sx, y0 * sy, x1 * sx, y1 * sy), self.box, self.flip)

    def cropped(self, top: int, left: int, height: int, width: int) -> Region:
        cx0, cy0, cx1, cy1 = self.content
        nx0, ny0 = max(cx0, left), max(cy0, top)
        nx1, ny1 = min(cx1, left + width), min(cy1, top + height)
        if nx1 <= nx0 or ny1 <= ny0:  # the crop shows padding only
            return Region((int(width), int(height)), (0.0, 0.0, 0.0, 0.0), self.box, self.flip)
        sx0, sx1 = sorted((self._to_source_x(nx0), self._to_source_x(nx1)))
        box = (sx0, self._to_source_y(ny0), sx1, self._to_source_y(ny1))
        content = (nx0 - left, ny0 - top, nx1 - left, ny1 - top)
        return Region((int(width), int(height)), content, box, self.flip)

    def flipped(self) -> Region:
        w = self.size[0]
        x0, y0, x1, y1 = self.content
        return Region(self.size, (w - x1, y0, w - x0, y1), self.box, not self.flip)


class Transform:
    """Base of the transforms: ``apply(region, rng) -> region``; ``fixed_size`` is the
    (height, width) every output has after it, or None when it depends on the image."""

    random = False

    def apply(self, region: Region, rng: np.random.Generator | None) -> Region:
        raise NotImplementedError

    def fixed_size(self, before: tuple[int, int] | None) -> tuple[int, int] | None:
        return before


def _pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)):
        pair = (int(size), int(size))
    else:
        if len(size) != 2:
            raise ValueError(f"{name} size must be an int or (height, width), got {size!r}.")
        pair = (int(size[0]), int(size[1]))
    if min(pair) < 1:
        raise ValueError(f"{name} size must be positive, got {size!r}.")
    return pair


class Resize(Transform):
    """Resize: an int resizes the shorter side to it (keeping the aspect ratio, as
    torchvision does); (height, width) resizes to exactly that."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.short = int(size) if isinstance(size, (int, np.integer)) else None
        self.size = None if self.short is not None else _pair(size, "Resize")
        if self.short is not None and self.short < 1:
            raise ValueError(f"Resize size must be positive, got {size!r}.")

    def apply(self, region: Region, rng: np.random.Generator | None) -> Region:
        w, h = region.size
        if self.size is not None:
            return region.resized(self.size[1], self.size[0])
        if w <= h:
            return region.resized(self.short, int(self.short * h / w))
        return region.resized(int(self.short * w / h), self.short)

    def fixed_size(self, before: tuple[int, int] | None) -> tuple[int, int] | None:
        return self.size

    def __repr__(self) -> str:
        return f"Resize({self.short if self.size is None else self.size})"


class CenterCrop(Transform):
    """Crop the centre (height, width) (an int: a square); an image smaller than the crop
    is padded with zeros, as torchvision does."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _pair(size, "CenterCrop")

    def apply(self, region: Region, rng: np.random.Generator | None) -> Region:
        w, h = region.size
        ch, cw = self.size
        top = round((h - ch) / 2.0)
        left = round((w - cw) / 2.0)
        return region.cropped(top, left, ch, cw)

    def fixed_size(self, before: tuple[int, int] | None) -> tuple[int, int] | None:
        return self.size

    def __repr__(self) -> str:
        return f"CenterCrop({self.size})"


class RandomResizedCrop(Transform):
    """Crop a random area and aspect ratio, then resize it to ``size``: torchvision's
    ``RandomResizedCrop`` (area fraction drawn in ``scale``, log-uniform aspect ratio in
    ``ratio``, ten tries, then a central crop clamped to ``ratio``)."""

    random = True

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    ) -> None:
        self.size = _pair(size, "RandomResizedCrop")
        if scale[0] > scale[1] or ratio[0] > ratio[1]:
            raise ValueError(f"scale and ratio must be (min, max) ranges, got scale={scale}, ratio={ratio}.")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))

    def params(self, width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """(top, left, height, width) of the crop, torchvision's ``get_params``."""
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target_area = area * rng.uniform(self.scale[0], self.scale[1])
            aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                i = int(rng.integers(0, height - h + 1))
                j = int(rng.integers(0, width - w + 1))
                return i, j, h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def apply(self, region: Region, rng: np.random.Generator | None) -> Region:
        if rng is None:
            raise ValueError("RandomResizedCrop needs a random generator; ImageFolder passes one per sample.")
        top, left, h, w = self.params(*region.size, rng)
        return region.cropped(top, left, h, w).resized(self.size[1], self.size[0])

    def fixed_size(self, before: tuple[int, int] | None) -> tuple[int, int] | None:
        return self.size

    def __repr__(self) -> str:
        return f"RandomResizedCrop({self.size}, scale={self.scale}, ratio={self.ratio})"


class RandomHorizontalFlip(Transform):
    """Mirror left-right with probability ``p``."""

    random = True

    def __init__(self, p: float = 0.5) -> None:
        self.p = float(p)

    def apply(self, region: Region, rng: np.random.Generator | None) -> Region:
        if rng is None:
            raise ValueError(
                "RandomHorizontalFlip needs a random generator; ImageFolder passes one per sample."
            )
        return region.flipped() if rng.random() < self.p else region

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class ToCHW:
    """Output channels-first (3, H, W) instead of the default (H, W, 3)."""

    def __repr__(self) -> str:
        return "ToCHW()"


class Normalize:
    """Output float32 ``(x / 255 - mean) / std`` per channel instead of uint8.

    For CPU consumers: with an accelerator, ship uint8 (4x fewer bytes through the ring
    and over the bus) and normalize there."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        self.mean = np.asarray(mean, np.float32).reshape(3)
        self.std = np.asarray(std, np.float32).reshape(3)
        if (self.std <= 0).any():
            raise ValueError(f"Normalize std must be positive, got {std!r}.")

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.tolist()}, std={self.std.tolist()})"


@dataclass(frozen=True)
class Plan:
    """One sample's plan: output (height, width), the integer rectangle of it that shows
    the source box (x0, y0, x1, y1), that box in source pixels, and the mirror flag."""

    out_size: tuple[int, int]
    content: tuple[int, int, int, int]
    box: tuple[float, float, float, float]
    flip: bool


class Compose:
    """A pipeline of the transforms above, applied in order, folded into one resample.

    ``Compose([RandomResizedCrop(224), RandomHorizontalFlip()])`` gives (224, 224, 3)
    uint8; append :class:`ToCHW` for (3, 224, 224) and :class:`Normalize` for float32.
    """

    def __init__(self, transforms: Sequence[Transform | ToCHW | Normalize]) -> None:
        self.transforms = list(transforms)
        self.geometry: list[Transform] = []
        self.chw = False
        self.normalize: Normalize | None = None
        for t in self.transforms:
            if isinstance(t, ToCHW):
                self.chw = True
            elif isinstance(t, Normalize):
                self.normalize = t
            elif isinstance(t, Transform):
                if self.chw or self.normalize is not None:
                    raise ValueError(f"{t!r} comes after ToCHW/Normalize; put the output transforms last.")
                self.geometry.append(t)
            else:
                raise TypeError(
                    f"{t!r} is not a shmloader.vision transform (Resize, CenterCrop, "
                    "RandomResizedCrop, RandomHorizontalFlip, ToCHW, Normalize); arbitrary "
                    "callables cannot write into the slot."
                )
        self.random = any(t.random for t in self.geometry)
        size = None
        for t in self.geometry:
            size = t.fixed_size(size)
        self.fixed_size: tuple[int, int] | None = size

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32 if self.normalize is not None else np.uint8)

    def output_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """The array shape for an output of this height and width."""
        return (3, height, width) if self.chw else (height, width, 3)

    def plan(self, width: int, height: int, rng: np.random.Generator | None) -> Plan:
        """Fold the geometry over a ``width`` x ``height`` source image."""
        region = Region.whole(width, height)
        for t in self.geometry:
            region = t.apply(region, rng)
        ow, oh = region.size
        x0, y0, x1, y1 = (round(v) for v in region.content)
        x0, y0 = min(max(x0, 0), ow), min(max(y0, 0), oh)
        x1, y1 = min(max(x1, x0), ow), min(max(y1, y0), oh)
        return Plan((oh, ow), (x0, y0, x1, y1), region.box, region.flip)

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"
