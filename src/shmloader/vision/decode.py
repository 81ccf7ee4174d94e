"""Decoding: libjpeg-turbo through simplejpeg for JPEG, Pillow for everything else.

:meth:`Decoder.decode_region` decodes only the part of a JPEG that a crop needs
(:mod:`shmloader.vision.region`).

A :class:`Decoder` is reused for every image a process decodes: JPEG is decoded into
one scratch buffer it keeps (no allocation per image), optionally downscaled by 2, 4 or
8 in the DCT domain (libjpeg-turbo's fast reduced IDCTs: several times less work when
the target is much smaller than the image). Grayscale, CMYK, palette, alpha and 16-bit
images come out as 3-channel uint8. A file that cannot be decoded raises
:class:`ImageDecodeError` naming it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmloader.errors import ShmLoaderError
from shmloader.vision.region import decoder as region_decoder

try:
    import simplejpeg
except ImportError:  # Pillow decodes JPEG too, slower
    simplejpeg = None

_JPEG_MAGIC = b"\xff\xd8"
_JPEG_END = b"\xff\xd9"
_SIMPLEJPEG_SPACES = ("YCbCr", "Gray", "RGB")  # what libjpeg-turbo converts to RGB itself
_FAST_FACTORS = (8, 4, 2)  # DCT scalings with fast reduced IDCTs; others are slower than 1


class ImageDecodeError(ShmLoaderError, ValueError):
    """A file could not be read or decoded as an image (corrupt, truncated, not an image).

    ``path`` is the file; the message says what failed and what to do."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.path))


@dataclass
class Probe:
    """What the header says: size, and how to decode it."""

    width: int
    height: int
    jpeg: bool  # decodable by simplejpeg
    data: bytes
    pil: Any = None  # the opened (not yet decoded) Pillow image otherwise


def dct_factor(width: int, height: int, box_w: float, box_h: float, out_w: int, out_h: int) -> int:
    """The largest fast DCT downscale (1, 2, 4 or 8) after which the box still has at
    least the output's pixels in both directions (so the resample never upsamples more
    than the full-size decode would)."""
    limit = min(box_w / max(out_w, 1), box_h / max(out_h, 1))
    for f in _FAST_FACTORS:
        if f <= limit and width >= f and height >= f:
            return f
    return 1


class Decoder:
    """Decodes image bytes to HxWx3 uint8, reusing one scratch buffer for JPEG.

    ``fast_dct``: libjpeg-turbo's fast integer IDCT instead of the accurate one (about 4%
    faster JPEG decoding here; pixels differ from the accurate decode by about one level
    on average, a few at most at usual qualities, more above quality 95).
    ``fast_upsample``: replicate subsampled chroma instead of interpolating it (about 7%
    faster on 4:2:0 JPEGs; differs by about two levels on average, up to tens at sharp
    colour edges). Both only apply to JPEGs decoded by libjpeg-turbo through simplejpeg."""

    def __init__(self, fast_dct: bool = False, fast_upsample: bool = False) -> None:
        self.fast_dct = bool(fast_dct)
        self.fast_upsample = bool(fast_upsample)
        self._scratch = np.empty(0, np.uint8)
        self._region_scratch = np.empty(0, np.uint8)

    def __reduce__(self) -> Any:
        return (type(self), (self.fast_dct, self.fast_upsample))  # the scratch buffer stays behind

    def probe(self, data: bytes) -> Probe:
        """Read the header (no pixel decoding)."""
        if simplejpeg is not None and data[:2] == _JPEG_MAGIC:
            try:
                h, w, space, _ = simplejpeg.decode_jpeg_header(data)
            except ValueError:
                pass  # let Pillow try (and name the failure)
            else:
                if space in _SIMPLEJPEG_SPACES:
                    return Probe(int(w), int(h), True, data)
        from PIL import Image

        img = Image.open(io.BytesIO(data))
        return Probe(img.width, img.height, False, data, img)

    def decode(self, probe: Probe, factor: int = 1, buffer: np.ndarray | None = None) -> np.ndarray:
        """HxWx3 uint8 of the image downscaled by ``factor`` (about: the size is rounded
        up). JPEG lands in ``buffer`` when given (it must be exactly the right size), else
        in the scratch buffer: the result is valid until the next decode."""
        if probe.jpeg:
            return self._decode_jpeg(probe, factor, buffer)
        img = probe.pil
        if factor > 1 and img.format == "JPEG":
            img.draft("RGB", (math.ceil(probe.width / factor), math.ceil(probe.height / factor)))
        img.load()
        return to_rgb(img)

    def decode_region(
        self,
        probe: Probe,
        factor: int,
        bounds: tuple[int, int, int, int],
        keep: tuple[int, int] | None = None,
    ) -> tuple[np.ndarray, int, int, int, int] | None:
        """Decode only rows ``y0:y1`` and (at least) columns ``x0:x1`` (``bounds``, in
        pixels of the image downscaled by ``factor``) of a JPEG, keeping only the columns
        ``keep`` when given: see
        :meth:`shmloader.vision.region.RegionDecoder.decode` for the result (less the
        scratch buffer, which this decoder keeps: valid until its next decode). None when
        the region decode does not apply (not a libjpeg-turbo JPEG, the region helper
        unavailable, an unsupported colour space, corrupt data, no end-of-image marker at
        the end of the file): decode it whole."""
        if not probe.jpeg or not probe.data.endswith(_JPEG_END):
            # No end-of-image marker: most likely truncated. A region that stops above
            # the cut would decode fine, so the same file would fail or not depending on
            # the crop: decode it whole, which names the damage every time.
            return None
        region = region_decoder()
        if region is None:
            return None
        got = region.decode(
            probe.data, factor, bounds, self.fast_dct, self.fast_upsample, self._region_scratch, keep
        )
        if got is None:
            return None
        self._region_scratch = got[5]
        return got[:5]

    def _decode_jpeg(self, probe: Probe, factor: int, buffer: np.ndarray | None) -> np.ndarray:
        kw = {}
        if factor > 1:
            kw = {
                "min_height": math.ceil(probe.height / factor),
                "min_width": math.ceil(probe.width / factor),
            }
        if buffer is None:
            h, w = (
                (probe.height, probe.width)
                if factor == 1
                else simplejpeg.decode_jpeg_header(probe.data, **kw)[:2]
            )
            need = h * w * 3
            if self._scratch.size < need:
                self._scratch = np.empty(int(need * 1.25), np.uint8)  # room for a few larger images
            buffer = self._scratch
        return simplejpeg.decode_jpeg(
            probe.data, "RGB", self.fast_dct, self.fast_upsample, buffer=buffer, **kw
        )


def to_rgb(img: Any) -> np.ndarray:
    """A decoded Pillow image as a writable HxWx3 uint8 array, whatever its mode.

    Alpha is dropped (as ``convert("RGB")`` does), palettes and CMYK are converted,
    16- and 32-bit integer images are scaled from 0..65535 to 0..255 (Pillow's own
    conversion would clip them), float images are clipped to 0..255."""
    mode = img.mode
    if mode == "RGB":
        return np.array(img)
    if mode.startswith("I") or mode == "F":
        a = np.asarray(img)
        if mode == "F":
            gray = np.clip(a, 0, 255).astype(np.uint8)
        else:
            gray = (np.clip(a.astype(np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=2)
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return np.array(img.convert("RGB"))
