"""A torchvision ImageFolder's samples written straight into the batch, as torchvision makes them.

:class:`FusedFolder` implements the write-into protocol (``sample_spec`` /
``write_sample``, :mod:`shmloader.batch.writeinto`) for a torchvision ``ImageFolder`` or
``DatasetFolder`` whose pipeline :func:`~shmloader.vision.torchvision_plan.recognize`
accepted. Per sample, for a JPEG that Pillow opens as RGB or grayscale:

1. the file is read and its header parsed (:mod:`shmloader.vision.jpeg_header`, or
   Pillow's ``Image.open`` where its layout is not the plain one; nothing is decoded);
2. when the first op is ``RandomResizedCrop``, its box is drawn on that header-only image
   with the same torch RNG calls, in the same order, as in ``dataset[index]`` (by
   :mod:`shmloader.vision.crop_draw` where it is checked equal to the op's own code,
   else by that code), only that box is decoded (libjpeg-turbo, Pillow's own library
   and settings: :mod:`shmloader.vision.region`), and the op's own ``resized_crop``
   runs on it; otherwise Pillow decodes the image whole, as ``pil_loader`` does;
3. the other geometric ops run as they are (torchvision's code on the PIL image);
4. the tensor ops (``ToTensor``, ``Normalize``...) are one table look-up per channel and
   level, written into the sample's row: the table is their own output on the 256 levels.

Every other file (PNG, GIF, CMYK JPEG, ...) is decided before any random draw and goes
through ``dataset[index]`` itself, its tensor copied into the row: the batch is exact
either way. ``fast`` (``images="fast"``), for the pipelines ``RandomResizedCrop``
(bilinear) then at most ``RandomHorizontalFlip``: the same crops and flips; a box at least
1.5 times the output on both sides is decoded at 1/2 scale (1/4 from 3 times, 1/8 from 6)
and resampled from its fractional edges there by Pillow's filter (``resize_box``); a
smaller one is decoded at full scale (Pillow's accurate IDCT, as ``auto``: on these
crops the fast one is no faster and less accurate) and resampled by torch's antialiased
bilinear kernel (:mod:`shmloader.vision.resample`). Pixels are within a small tolerance
of torchvision's (docs/vision.md).
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from shmloader.batch.writeinto import ArraySpec
from shmloader.vision import crop_draw, jpeg_header, pil_resample, region
from shmloader.vision.resample import resample_into
from shmloader.vision.torchvision_plan import FusedPlan

__all__ = ["FusedFolder", "fallback_count"]

_JPEG_END = b"\xff\xd9"
# fast: a box is decoded at 1/f scale where it is at least this many times f times the output
# on both sides, so that the decoded box is upsampled by at most 1/0.75 (its error per image
# against torchvision's, measured: benchmarks/HISTORY.md, docs/vision.md).
_REDUCED_SCALE_MARGIN = 0.75


class FusedFolder:
    """Writes sample ``index`` of a torchvision folder dataset into a batch row, equal to
    ``default_collate([dataset[index], ...])``'s row (see the module docstring).

    ``dataset``: the user's dataset (read at each sample: ``samples``, ``transform``);
    ``plan``: its :class:`~shmloader.vision.torchvision_plan.FusedPlan`; ``fast``: the
    ``images="fast"`` approximations. Counts ``fused`` and ``fell_back`` samples in this
    process (:meth:`shmloader_stats`)."""

    def __init__(self, dataset: Any, plan: FusedPlan, fast: bool = False) -> None:
        self.dataset = dataset
        self.plan = plan
        self.fast = fast
        self.fused = 0
        self.fell_back = 0
        self._prepare()

    def __getstate__(self) -> dict[str, Any]:
        # (spawned workers: the C helpers and buffers are made again there)
        return {k: getattr(self, k) for k in ("dataset", "plan", "fast", "fused", "fell_back")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._prepare()

    def _prepare(self) -> None:
        """Buffers, the API's functions and the C helpers of this process."""
        plan, fast = self.plan, self.fast
        self._scratch = np.empty(1 << 20, np.uint8)  # the region decoder's, reused
        self._resized = np.empty((plan.shape[1], plan.shape[2], 3), np.uint8)  # the fast path's
        self._ops = _Functions(plan.api)
        head = plan.head
        self._crop_first = bool(head) and type(head[0]).__name__ == "RandomResizedCrop"
        crop_then_flip = _crop_then_flip(plan, self._ops)
        self._fast = fast and crop_then_flip
        # Pillow's bilinear resize reproduced in C where it applies and matches the
        # installed Pillow (pil_resample.resampler); the tensor ops' table as float32 for it.
        checked = pil_resample.resampler()
        self._resampler = checked if crop_then_flip else None
        float32 = plan.table is not None and plan.table.dtype == np.float32
        self._levels = checked if float32 else None
        # The crop's box and the flip's coin drawn without torchvision's per-call overhead,
        # where that gives its draws exactly (checked here; else its own code draws them).
        self._draw = None
        if crop_then_flip:
            flip_op = head[1] if len(head) > 1 else None
            self._draw = crop_draw.checked_draw(head[0], flip_op, self._own_box, self._ops.flip_drawn)

    def sample_spec(self) -> tuple[ArraySpec, ArraySpec]:
        """The image (C, H, W) of the plan's dtype and the int64 target."""
        return ArraySpec(self.plan.shape, self.plan.dtype), ArraySpec((), np.int64)

    def write_sample(self, index: int, out: tuple[np.ndarray, np.ndarray]) -> None:
        """Write sample ``index`` (image and target) into ``out``, its row of the batch."""
        image_row, target_row = out
        path, target = self.dataset.samples[index]
        with open(path, "rb") as f:
            data = f.read()
        img = _jpeg_header(data)
        if img is None:  # decided before any random draw: torchvision's code, as written
            sample, target = self.dataset[index]
            np.copyto(image_row, sample.numpy(force=False))
            self.fell_back += 1
        else:
            pixels, flip = self._image(data, img)
            self._tensor_ops(pixels, image_row, flip)
            self.fused += 1
        target_row[...] = target

    def shmloader_stats(self) -> dict[str, int]:
        """This process's counts, under the names the loader sums over its workers."""
        return {"images_fused": self.fused, "images_fell_back": self.fell_back}

    # --- one image -------------------------------------------------------------------------

    def _image(self, data: bytes, img: Any) -> tuple[np.ndarray, bool]:
        """The (H, W, 3) uint8 levels after the geometric ops, and whether they still
        need mirroring (a flip drawn, not yet applied)."""
        head = self.plan.head
        if self._crop_first:
            op = head[0]
            if self._draw is not None:
                top, left, h, w = self._draw.box(*img.size)
            else:
                top, left, h, w = self._ops.crop_params(op, img)
            if self._fast:
                return self._fast_crop(data, img, op, (left, top, w, h))
            if self._resampler is not None:
                region = self._region(data, img, left, top, w, h)
                if region is not None:
                    self._resampler.resize(region, self._resized)
                    return self._resized, self._flip_drawn()
                whole = self._whole(data, img)
                pil = self._ops.resized_crop(whole.crop((left, top, left + w, top + h)), op, h, w)
            else:
                pil = self._ops.resized_crop(self._crop(data, img, left, top, w, h), op, h, w)
            rest = head[1:]
        else:
            pil = self._whole(data, img)
            rest = head
        for op in rest:
            pil = op(pil)
        return np.asarray(pil), False

    @staticmethod
    def _whole(data: bytes, img: Any) -> Any:
        """``pil_loader``'s image: decoded by Pillow, in RGB (the file opened by Pillow
        where ``img`` holds only its header)."""
        if jpeg_header.is_header_image(img):
            from PIL import Image

            img = Image.open(io.BytesIO(data))
        return img.convert("RGB") if img.mode != "RGB" else _loaded(img)

    def _region(self, data: bytes, img: Any, left: int, top: int, w: int, h: int) -> np.ndarray | None:
        """The box's pixels (h, w, 3), decoded by region (Pillow's library and settings:
        the same pixels as its decode); None where the region decoder does not apply."""
        decoder = region.decoder()
        if decoder is None or not data.endswith(_JPEG_END):
            return None
        width, height = img.size
        bounds = (max(left - 1, 0), top, min(left + w + 1, width), top + h)
        got = decoder.decode(data, 1, bounds, False, False, self._scratch, (left, left + w))
        if got is None:
            return None
        pixels, x0, _, full_w, full_h, self._scratch = got
        if (x0, pixels.shape[1], full_w, full_h) != (left, w, width, height):
            return None
        return pixels

    def _crop(self, data: bytes, img: Any, left: int, top: int, w: int, h: int) -> Any:
        """``pil_loader``'s image cropped to the box, decoding only the box where the
        region decoder applies."""
        from PIL import Image

        pixels = self._region(data, img, left, top, w, h)
        if pixels is not None:
            return Image.frombuffer("RGB", (w, h), pixels, "raw", "RGB", 0, 1)
        return self._whole(data, img).crop((left, top, left + w, top + h))

    def _fast_crop(
        self, data: bytes, img: Any, op: Any, box: tuple[int, int, int, int]
    ) -> tuple[np.ndarray, bool]:
        """``images="fast"``: the box decoded by region, at a reduced DCT scale where it is
        large enough (:meth:`_reduced_factor`), resampled into the plan's size; and the flip
        drawn after it."""
        left, top, w, h = box
        factor = self._reduced_factor(w, h)
        pixels = self._fast_region(data, img, factor, box) if factor > 1 else None
        if pixels is not None:  # the box's fractional edges at 1/factor, resampled from them
            box_at = (left / factor, top / factor, (left + w) / factor, (top + h) / factor)
            hull_x0, hull_y0 = math.floor(box_at[0]), math.floor(box_at[1])
            local = (box_at[0] - hull_x0, box_at[1] - hull_y0, box_at[2] - hull_x0, box_at[3] - hull_y0)
            flip = self._flip_drawn()
            self._resampler.resize_box(pixels, local, self._resized)
            return self._resized, flip
        pixels = self._fast_region(data, img, 1, box)
        if pixels is not None:
            local = (0.0, 0.0, float(pixels.shape[1]), float(pixels.shape[0]))
        else:  # not region-decodable: whole, at full scale
            pixels = np.asarray(self._whole(data, img))
            local = (float(left), float(top), float(left + w), float(top + h))
        flip = self._flip_drawn()
        resample_into(pixels, local, self._resized, False, False, "torch")
        return self._resized, flip  # (mirrored as the tensor ops' table is written)

    def _reduced_factor(self, w: int, h: int) -> int:
        """The DCT scale 1/f (f 1, 2, 4 or 8) ``fast`` decodes a w x h box at: the largest
        f for which the box is at least ``_REDUCED_SCALE_MARGIN`` times f times the output
        on both sides (f = 2 from 1.5 times); 1 without the C resampler (the fractional box
        needs it)."""
        if self._resampler is None:
            return 1
        oh, ow = self.plan.shape[1:]
        factor = 1
        while factor < 8 and min(w / ow, h / oh) >= _REDUCED_SCALE_MARGIN * factor * 2:
            factor *= 2
        return factor

    def _fast_region(
        self, data: bytes, img: Any, factor: int, box: tuple[int, int, int, int]
    ) -> np.ndarray | None:
        """The whole pixels covering ``box`` in the image decoded at 1/``factor``, C-contiguous,
        or None where the region decoder does not apply."""
        decoder = region.decoder()
        if decoder is None or not data.endswith(_JPEG_END):
            return None
        left, top, w, h = box
        width, height = img.size
        sw, sh = -(-width // factor), -(-height // factor)
        kx0, ky0 = left // factor, top // factor
        kx1, ky1 = min(-(-(left + w) // factor), sw), min(-(-(top + h) // factor), sh)
        bounds = (max(kx0 - 1, 0), ky0, min(kx1 + 1, sw), ky1)
        got = decoder.decode(data, factor, bounds, False, False, self._scratch, (kx0, kx1))
        if got is None or (got[1], got[0].shape[1]) != (kx0, kx1 - kx0):
            return None
        self._scratch = got[5]
        return got[0]

    def _flip_drawn(self) -> bool:
        """The flip's coin of a crop-then-flip pipeline (False without a flip: no draw)."""
        if self._draw is not None:
            return self._draw.flip()
        head = self.plan.head
        return self._ops.flip_drawn(head[1]) if len(head) > 1 else False

    def _own_box(self, op: Any, width: int, height: int) -> tuple[int, int, int, int]:
        """The op's own box for a ``width`` x ``height`` image (what ``_draw`` is checked against)."""
        return self._ops.crop_params(op, jpeg_header.header_image((width, height), "RGB"))

    def _tensor_ops(self, pixels: np.ndarray, row: np.ndarray, flip: bool) -> None:
        """The tensor ops' values of (H, W, 3) uint8 ``pixels`` (mirrored when ``flip``),
        written into the (3, H, W) row."""
        table = self.plan.table
        if (
            self._levels is not None
            and table is not None
            and pixels.flags.c_contiguous
            and row.flags.c_contiguous
        ):
            self._levels.levels(pixels, table, row, flip)
            return
        if flip:
            pixels = pixels[:, ::-1]
        if table is None:
            np.copyto(row, pixels.transpose(2, 0, 1))
        else:
            for c in range(3):
                np.take(table[c], pixels[:, :, c], out=row[c])


def fallback_count(dataset: Any, limit: int = 500) -> tuple[int, int]:
    """``(files read, files that would go through torchvision's code)`` over the first
    ``limit`` samples of a torchvision folder dataset: every file but a JPEG that Pillow
    opens as RGB or grayscale (read from disk: the headers only)."""
    samples = list(getattr(dataset, "samples", ()))[:limit]
    fell_back = 0
    for path, _ in samples:
        with open(path, "rb") as f:
            head = f.read(1 << 16)  # the markers before the image data, for Pillow's header parse
        fell_back += _jpeg_header(head) is None
    return len(samples), fell_back


def _jpeg_header(data: bytes) -> Any:
    """The header-only Pillow image of a JPEG that decodes exactly by region or whole
    (Pillow's JPEG, mode RGB or L), else None: read from its markers where their layout
    is plain (:mod:`shmloader.vision.jpeg_header`), else by ``Image.open``."""
    from PIL import Image, UnidentifiedImageError

    if not data.startswith(b"\xff\xd8"):
        return None
    parsed = jpeg_header.parse(data, Image.MAX_IMAGE_PIXELS)
    if parsed is not None:
        return jpeg_header.header_image(parsed[:2], parsed[2])
    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None  # torchvision's own code raises its error
    if img.format != "JPEG" or img.mode not in ("RGB", "L"):
        return None
    return img


def _loaded(img: Any) -> Any:
    img.load()
    return img


def _crop_then_flip(plan: FusedPlan, ops: Any) -> bool:
    """Whether the pipeline is RandomResizedCrop (bilinear) then at most a horizontal
    flip: what ``images="fast"`` and the C resize (the flip drawn as its own code draws
    it) apply to."""
    head = plan.head
    names = [type(op).__name__ for op in head]
    if names not in (["RandomResizedCrop"], ["RandomResizedCrop", "RandomHorizontalFlip"]):
        return False
    return ops.bilinear(head[0])


class _Functions:
    """The torchvision functions of one API (v1 or v2) the fused path calls."""

    def __init__(self, api: str) -> None:
        from torchvision.transforms import InterpolationMode

        self.api = api
        self._bilinear = InterpolationMode.BILINEAR
        if api == "v1":
            from torchvision.transforms import functional

            self._resized_crop = functional.resized_crop
        else:
            from torchvision.transforms.v2 import functional

            self._resized_crop = functional.resized_crop

    def crop_params(self, op: Any, img: Any) -> tuple[int, int, int, int]:
        """``RandomResizedCrop``'s (top, left, height, width), drawn by its own code."""
        if self.api == "v1":
            top, left, h, w = op.get_params(img, op.scale, op.ratio)
            return int(top), int(left), int(h), int(w)
        params = op.make_params([img])
        return int(params["top"]), int(params["left"]), int(params["height"]), int(params["width"])

    def resized_crop(self, cropped: Any, op: Any, h: int, w: int) -> Any:
        """The op's own ``resized_crop`` of the already-cropped image."""
        return self._resized_crop(cropped, 0, 0, h, w, op.size, op.interpolation, antialias=op.antialias)

    def flip_drawn(self, op: Any) -> bool:
        """``RandomHorizontalFlip``'s draw, as its own code draws it (flip when below p)."""
        import torch

        return bool(torch.rand(1) < op.p)

    def bilinear(self, op: Any) -> bool:
        return op.interpolation in (self._bilinear, self._bilinear.value, 2)
