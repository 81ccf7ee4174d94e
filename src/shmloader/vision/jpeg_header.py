"""A plain JPEG's size and mode as Pillow opens it, read from its markers without Pillow.

The fused torchvision path needs, per sample and before any random draw, whether a file is
a JPEG that Pillow opens as RGB or grayscale, and its size (``RandomResizedCrop`` draws its
box from it). ``PIL.Image.open`` answers that and decodes nothing, but costs tens of
microseconds per file in Python; :func:`parse` answers it for the common well-formed
layout in a few: one marker segment after another from the start-of-image marker to the
start of scan, only the segments Pillow reads without judging them (``APPn``, ``DQT``,
``DHT``, ``DRI``, ``COM``) and one ``SOF0``/``SOF1``/``SOF2`` frame of 8-bit samples with
1 or 3 components (Pillow's mode ``"L"`` or ``"RGB"``). Anything else (fill bytes between
markers, another frame type, an MPO's ``MPF`` segment, 4 components, a size Pillow would
warn about) gives None: the caller asks Pillow itself, so an unusual file costs time,
never a different decision.

:func:`header_image` makes that size and mode as a ``PIL.Image.Image`` with no pixels,
which is what torchvision's ``RandomResizedCrop`` reads to draw its box (``size``; the
number of bands for ``get_dimensions``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["header_image", "is_header_image", "parse"]

_SOI = b"\xff\xd8\xff"
_FRAMES = frozenset((0xC0, 0xC1, 0xC2))  # baseline, extended sequential, progressive
_SOS = 0xDA
_APP2 = 0xE2
# Segments Pillow's JPEG plugin reads at open and stores or skips without raising on
# well-formed content: DHT, DQT, DRI, APP0-APP15, COM.
_PASSED = frozenset((0xC4, 0xDB, 0xDD, *range(0xE0, 0xF0), 0xFE))


def parse(data: bytes, max_pixels: int | None) -> tuple[int, int, str] | None:
    """``(width, height, mode)`` of ``data`` when it is a JPEG of the plain layout above
    that Pillow opens as ``mode`` ``"RGB"`` or ``"L"``, else None (not such a file, or a
    layout this parser leaves to Pillow). ``max_pixels``: Pillow's decompression-bomb
    limit (``Image.MAX_IMAGE_PIXELS``); larger images give None, so Pillow warns or raises."""
    if not data.startswith(_SOI):
        return None
    end = len(data)
    pos = 2
    frame: tuple[int, int, str] | None = None
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        length = (data[pos + 2] << 8) | data[pos + 3]
        body = pos + 4
        pos += 2 + length
        if length < 2 or pos > end:
            return None
        if marker == _SOS:
            return frame
        if marker in _FRAMES:
            if frame is not None or length < 8:
                return None
            frame = _frame(data, body, max_pixels)
            if frame is None:
                return None
        elif marker == _APP2 and data[body : body + 4] == b"MPF\x00":
            return None  # a possible MPO: Pillow's factory decides
        elif marker not in _PASSED:
            return None
    return None


def _frame(data: bytes, body: int, max_pixels: int | None) -> tuple[int, int, str] | None:
    bits = data[body]
    height = (data[body + 1] << 8) | data[body + 2]
    width = (data[body + 3] << 8) | data[body + 4]
    components = data[body + 5]
    if bits != 8 or components not in (1, 3) or width == 0 or height == 0:
        return None
    if max_pixels is not None and width * height > max_pixels:
        return None
    return width, height, "L" if components == 1 else "RGB"


def _pil_image_class() -> Any:
    from PIL import Image

    class _HeaderImage(Image.Image):
        """A PIL image of a given size and mode that holds no pixels."""

        def __init__(self, size: tuple[int, int], mode: str) -> None:
            super().__init__()
            self._header = (size, mode)

        @property
        def size(self) -> tuple[int, int]:
            return self._header[0]

        @property
        def mode(self) -> str:
            return self._header[1]

    return _HeaderImage


_classes: dict[str, Any] = {}


def header_image(size: tuple[int, int], mode: str) -> Any:
    """A ``PIL.Image.Image`` of ``size`` and ``mode`` without pixels (Pillow imported on
    first use, so that this module imports without it)."""
    cls = _classes.get("header")
    if cls is None:
        cls = _classes["header"] = _pil_image_class()
    return cls(size, mode)


def is_header_image(img: Any) -> bool:
    """Whether ``img`` is a :func:`header_image` (no pixels: open the file to decode it)."""
    cls = _classes.get("header")
    return cls is not None and isinstance(img, cls)
