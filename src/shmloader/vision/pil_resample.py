"""Pillow's antialiased bilinear resize of RGB images, reproduced in C and checked.

``native/pil_bilinear.c`` (built into ``shmloader._jpeg`` with the region decoder)
computes what ``PIL.Image.resize(size, Image.BILINEAR)`` computes for an 8-bit RGB image,
bit for bit: the same weights, fixed-point arithmetic and pass order, without Pillow's
4-byte pixels, image objects and copies. It also writes the per-level table of
torchvision's tensor ops (``ToTensor``, ``Normalize``...) channels-first into a batch row.

:func:`resampler` checks it against the installed Pillow once per process, on sizes
that exercise both pass orders (Pillow 13 runs the vertical pass first where the height
shrinks much more than the width; earlier versions never do), and returns None when no
variant matches: callers then use Pillow itself, so a Pillow that changes its resampler
costs speed, never exactness.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PilBilinear", "resampler"]

_CHECK_SEED = 20261206
_CHECK_CASES = 48
_state: dict[str, Any] = {"checked": False, "resampler": None}


class PilBilinear:
    """The C resize and table writer of this process (see the module docstring)."""

    def __init__(self, native: Any, vertical_first_rule: bool) -> None:
        self._ffi = native.ffi
        self._lib = native.lib
        self.vertical_first_rule = vertical_first_rule

    def resize(self, src: np.ndarray, dst: np.ndarray) -> None:
        """``Image.fromarray(src).resize(dst's size, BILINEAR)`` into ``dst`` (both
        C-contiguous (h, w, 3) uint8)."""
        h_in, w_in = src.shape[:2]
        oh, ow = dst.shape[:2]
        ffi = self._ffi
        status = self._lib.shmpil_bilinear_rgb(
            ffi.from_buffer(src), w_in, h_in, ffi.from_buffer(dst), ow, oh, int(self.vertical_first_rule)
        )
        if status != 0:
            raise MemoryError(f"cannot allocate the buffers to resize a {w_in}x{h_in} image to {ow}x{oh}")

    def resize_box(self, src: np.ndarray, box: tuple[float, float, float, float], dst: np.ndarray) -> None:
        """``Image.fromarray(src).resize(dst's size, BILINEAR, box=box)`` into ``dst`` (both
        C-contiguous (h, w, 3) uint8; ``box`` (x0, y0, x1, y1) in ``src``'s pixels, fractional
        edges allowed): the filter stops at ``src``'s edges, not the box's. Pillow's weights
        and arithmetic (bit-exact against Pillow 13 in the tests); unlike :meth:`resize`,
        not checked at run time: ``images="fast"`` uses it, whose pixels are within a
        tolerance of torchvision's, not exact."""
        h_in, w_in = src.shape[:2]
        oh, ow = dst.shape[:2]
        ffi = self._ffi
        x0, y0, x1, y1 = (float(v) for v in box)
        status = self._lib.shmpil_bilinear_rgb_box(
            ffi.from_buffer(src),
            w_in,
            h_in,
            x0,
            y0,
            x1,
            y1,
            ffi.from_buffer(dst),
            ow,
            oh,
            int(self.vertical_first_rule),
        )
        if status != 0:
            raise MemoryError(f"cannot allocate the buffers to resize a {w_in}x{h_in} image to {ow}x{oh}")

    def levels(self, src: np.ndarray, table: np.ndarray, row: np.ndarray, flip: bool) -> None:
        """``row[c, y, x] = table[c, src[y, x, c]]`` (mirrored left-right when ``flip``):
        ``src`` C-contiguous (h, w, 3) uint8, ``table`` (3, 256) float32, ``row``
        C-contiguous (3, h, w) float32."""
        h, w = src.shape[:2]
        ffi = self._ffi
        self._lib.shmpil_levels_chw_f32(
            ffi.from_buffer(src),
            w,
            h,
            ffi.from_buffer("float[]", table),
            ffi.from_buffer("float[]", row),
            int(flip),
        )


def resampler() -> PilBilinear | None:
    """This process's checked resampler, or None: the helper is not built (no
    libjpeg-turbo headers at install), Pillow is missing, or no variant reproduces the
    installed Pillow's resize."""
    if not _state["checked"]:
        _state["checked"] = True
        _state["resampler"] = _checked()
    return _state["resampler"]


def _checked() -> PilBilinear | None:
    try:
        from PIL import Image

        from shmloader import _jpeg
    except ImportError:
        return None
    if not hasattr(_jpeg.lib, "shmpil_bilinear_rgb"):
        return None
    rng = np.random.default_rng(_CHECK_SEED)
    cases = []
    for i in range(_CHECK_CASES):
        w, h = (int(v) for v in rng.integers(1, 400, 2))
        if i % 3 == 0:  # the height shrinks much more than the width: Pillow 13's vertical-first pass
            ow, oh = max(w - int(rng.integers(0, 20)), 1), max(h // 3, 1)
        else:
            ow, oh = (int(v) for v in rng.integers(1, 300, 2))
        src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        cases.append((src, np.asarray(Image.fromarray(src).resize((ow, oh), Image.BILINEAR))))
    for rule in (True, False):
        candidate = PilBilinear(_jpeg, rule)
        if all(_same(candidate, src, want) for src, want in cases):
            return candidate
    return None


def _same(candidate: PilBilinear, src: np.ndarray, want: np.ndarray) -> bool:
    got = np.empty_like(want)
    candidate.resize(src, got)
    return bool(np.array_equal(got, want))
