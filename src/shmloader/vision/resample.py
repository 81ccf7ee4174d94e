"""One antialiased bilinear resample of a source box, written straight into the output.

Two backends give the same geometry:

- ``"torch"``: ATen's uint8 antialiased bilinear kernel (vectorized; 3-5x faster than
  Pillow's here), called with ``out=`` on a tensor that *is* the slot's row, so the
  resampled pixels are written once, into the slot. The box is rounded to whole pixels.
- ``"pillow"``: ``Image.resize(box=...)`` (fractional box), then one copy into the row.

``"auto"`` picks torch when it is installed. Both match torchvision's antialiased
bilinear resize within a few levels of uint8.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

BACKENDS = ("auto", "torch", "pillow")

_torch: Any = None
_aa_out: Any = None  # torch.ops.aten._upsample_bilinear2d_aa.out, looked up once (None: absent)
_threads_set_in_pid = 0


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "auto":
        backend = "torch" if importlib.util.find_spec("torch") is not None else "pillow"
    if backend == "torch":
        # Import it here, once: workers forked later inherit it instead of each paying the
        # import (seconds) before their first image.
        _get_torch()
    return backend


def _get_torch() -> Any:
    """torch, imported once; single-threaded inside worker processes (they are the
    parallelism; torch's own threads would oversubscribe the cores)."""
    global _torch, _aa_out, _threads_set_in_pid
    if _torch is None:
        import torch

        try:
            _aa_out = torch.ops.aten._upsample_bilinear2d_aa.out
        except (AttributeError, RuntimeError):  # a torch without that overload
            _aa_out = None
        _torch = torch
    if _threads_set_in_pid != os.getpid():
        _threads_set_in_pid = os.getpid()
        from shmloader.context import get_worker_info

        if get_worker_info() is not None:
            _torch.set_num_threads(1)
    return _torch


def resample_into(
    src: np.ndarray,
    box: tuple[float, float, float, float],
    dst: np.ndarray,
    chw: bool,
    flip: bool,
    backend: str,
) -> None:
    """Resample ``src[box]`` (HxWx3 uint8, box in its pixels) into ``dst`` (uint8,
    (h, w, 3) or (3, h, w) when ``chw``), mirrored left-right when ``flip``."""
    oh, ow = dst.shape[1:] if chw else dst.shape[:2]
    if oh == 0 or ow == 0:
        return
    if backend == "torch":
        _resample_torch(src, box, dst, chw, flip, oh, ow)
    else:
        _resample_pillow(src, box, dst, chw, flip, oh, ow)


def int_box(box: tuple[float, float, float, float], w: int, h: int) -> tuple[int, int, int, int]:
    """The whole-pixel box (x0, y0, x1, y1) the torch backend resamples for ``box`` on a
    ``w`` x ``h`` image (rounded half to even, at least one pixel, inside the image)."""
    x0 = min(max(round(box[0]), 0), w - 1)
    y0 = min(max(round(box[1]), 0), h - 1)
    x1 = min(max(round(box[2]), x0 + 1), w)
    y1 = min(max(round(box[3]), y0 + 1), h)
    return x0, y0, x1, y1


def _resample_torch(
    src: np.ndarray,
    box: tuple[float, float, float, float],
    dst: np.ndarray,
    chw: bool,
    flip: bool,
    oh: int,
    ow: int,
) -> None:
    if not dst.flags.c_contiguous:  # a padded output's inner rectangle: via a whole array
        whole = np.empty(dst.shape, np.uint8)
        _resample_torch(src, box, whole, chw, flip, oh, ow)
        dst[...] = whole
        return
    torch = _get_torch()
    x0, y0, x1, y1 = int_box(box, src.shape[1], src.shape[0])
    # NCHW views of HWC memory (channels-last, what the uint8 kernel is vectorized for).
    source = torch.from_numpy(src[None, y0:y1, x0:x1]).permute(0, 3, 1, 2)
    out = torch.from_numpy(dst[None]) if chw else torch.from_numpy(dst[None]).permute(0, 3, 1, 2)
    if (y1 - y0, x1 - x0) == (oh, ow):
        out.copy_(source)
    elif not _resize_into(source, out, oh, ow):  # a torch without that overload: one more copy
        resized = torch.nn.functional.interpolate(
            source, size=(oh, ow), mode="bilinear", antialias=True, align_corners=False
        )
        out.copy_(resized)
    if flip:
        out.copy_(out.flip(-1))


def _resize_into(source: Any, out: Any, oh: int, ow: int) -> bool:
    """ATen's antialiased bilinear kernel writing into ``out`` (the slot's row) itself;
    False where this torch has no such overload."""
    if _aa_out is None:
        return False
    try:
        _aa_out(source, [oh, ow], False, None, None, out=out)
    except RuntimeError:
        return False
    return True


def _resample_pillow(
    src: np.ndarray,
    box: tuple[float, float, float, float],
    dst: np.ndarray,
    chw: bool,
    flip: bool,
    oh: int,
    ow: int,
) -> None:
    from PIL import Image

    h, w = src.shape[:2]
    # Hand Pillow only the rows and columns the box touches (plus the filter's reach).
    scale_x = max((box[2] - box[0]) / ow, 1.0)
    scale_y = max((box[3] - box[1]) / oh, 1.0)
    x0 = max(int(box[0] - scale_x - 1), 0)
    y0 = max(int(box[1] - scale_y - 1), 0)
    x1 = min(int(box[2] + scale_x + 2), w)
    y1 = min(int(box[3] + scale_y + 2), h)
    img = Image.fromarray(np.ascontiguousarray(src[y0:y1, x0:x1]))
    local = (
        min(max(box[0] - x0, 0.0), x1 - x0),
        min(max(box[1] - y0, 0.0), y1 - y0),
        min(max(box[2] - x0, 0.0), x1 - x0),
        min(max(box[3] - y0, 0.0), y1 - y0),
    )
    if local[2] <= local[0] or local[3] <= local[1]:
        local = (0.0, 0.0, float(x1 - x0), float(y1 - y0))
    out = img.resize((ow, oh), Image.BILINEAR, box=local)
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    a = np.asarray(out)
    dst[...] = a.transpose(2, 0, 1) if chw else a


def flip_inplace(dst: np.ndarray, chw: bool, backend: str) -> None:
    """Mirror ``dst`` (uint8 (h, w, 3) or (3, h, w)) left-right in place."""
    if backend == "torch":
        t = _get_torch().from_numpy(dst)
        t.copy_(t.flip(-1 if chw else 1))
    else:
        dst[...] = dst[..., ::-1].copy() if chw else dst[:, ::-1].copy()
