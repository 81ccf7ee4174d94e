"""Region JPEG decoding: only the rows and MCU columns a crop needs.

libjpeg-turbo decodes a JPEG in 8x8 blocks (MCUs of up to 16x16 pixels with chroma
subsampling). ``jpeg_skip_scanlines`` skips rows above the crop (entropy decoding only:
no IDCT, no upsampling, no colour conversion) and ``jpeg_crop_scanline`` restricts each
row to the MCU columns the crop covers; with ``scale_denom`` 2, 4 or 8 both combine
with DCT-domain downscaling. A random-resized crop keeps on average about half of an
image, so about half of the IDCT, upsampling and colour-conversion work goes away.

The binding: the C helper ``shmloader._jpeg`` (``native/jpeg_region.c``, built by
``native/build_jpeg.py`` against the libjpeg-turbo headers of the build environment, and
left out where there are none) links no libjpeg; :func:`decoder` binds it at run time to
the functions of a libjpeg-turbo of the ABI those headers declared (``JPEG_LIB_VERSION``).
For the libjpeg 6b ABI (62: what libjpeg-turbo builds by default, Debian's
``libjpeg62-turbo-dev``), that is the library Pillow's wheel ships
(``pillow.libs/libjpeg-*.so.62*``, ``PIL/.dylibs/libjpeg.62.dylib``) or, failing that, a
system ``libjpeg.so.62``; for ABI 80 (Ubuntu's ``libjpeg-turbo8-dev``), the system's
``libjpeg.so.8``. ``jpeg_CreateDecompress`` checks the version and the struct size, so
another ABI is refused cleanly. Whenever the helper is not built, no library is found or
it is refused, :func:`decoder` returns None with :func:`unavailable_reason` saying why,
and images are decoded whole, as before (simplejpeg).

Equality: the rows and columns decoded are identical to the same rows and columns of a
full decode, except the outermost pixel column on each side of a cropped region (fancy
chroma upsampling treats the region's edge as the image's edge): callers ask for a
margin around what they read (:func:`region_bounds`), or one column each side of exactly
the columns they keep (``keep``: the torch resampler's whole-pixel box, handed over
contiguous).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import math
import os
import sys
from typing import Any

import numpy as np

__all__ = ["HEADERS_PACKAGES", "RegionDecoder", "decoder", "native", "region_bounds", "unavailable_reason"]

# The order shmjpeg_bind expects (native/jpeg_region.c).
_FUNCTIONS = (
    "jpeg_std_error",
    "jpeg_CreateDecompress",
    "jpeg_destroy_decompress",
    "jpeg_mem_src",
    "jpeg_read_header",
    "jpeg_start_decompress",
    "jpeg_crop_scanline",
    "jpeg_skip_scanlines",
    "jpeg_read_scanlines",
    "jpeg_abort_decompress",
)
_OK, _UNSUPPORTED, _ERROR, _SMALL = 0, 1, 2, 3
_MSG_LEN = 200
ENV_OFF = "SHMLOADER_REGION_DECODE"  # "0": never decode regions (e.g. to measure the difference)

# Where the helper's build finds libjpeg-turbo's headers (native/build_jpeg.py names the same).
HEADERS_PACKAGES = (
    "libjpeg62-turbo-dev (Debian), libjpeg-turbo8-dev (Ubuntu), libjpeg-turbo-devel "
    "(Fedora, RHEL), libjpeg-turbo-dev (Alpine), jpeg-turbo (Homebrew, conda-forge)"
)

_state: dict[str, Any] = {"pid": None, "decoder": None, "reason": "not tried yet"}


def native() -> tuple[Any, str]:
    """The C helper ``shmloader._jpeg`` and ``""``, or None and a sentence saying why it
    is missing and how to get it."""
    try:
        from shmloader import _jpeg
    except ImportError as exc:
        return None, (
            f"the C helper shmloader._jpeg is not built ({exc}): it is compiled at install where "
            f"libjpeg-turbo's headers (jpeglib.h) are found; install {HEADERS_PACKAGES}, then "
            "reinstall shmloader from source (pip install -e . in a checkout) to get region decoding"
        )
    return _jpeg, ""


def library_candidates(abi: int = 62) -> list[str]:
    """Paths of libjpeg-turbo libraries of the libjpeg ABI ``abi`` (``JPEG_LIB_VERSION``)
    to try, best first: Pillow's bundled copy (ABI 62 only), then the system's."""
    found: list[str] = []
    if abi != 62:
        if sys.platform.startswith("linux"):
            found.append(f"libjpeg.so.{abi // 10}")  # 80: libjpeg.so.8, 70: libjpeg.so.7
        elif sys.platform == "darwin":
            name = ctypes.util.find_library("jpeg")
            if name:
                found.append(name)
        return found
    try:
        import PIL

        pil_dir = os.path.dirname(PIL.__file__)
        site = os.path.dirname(pil_dir)
        for pattern in (
            os.path.join(site, "pillow.libs", "libjpeg-*.so.62*"),  # Linux wheels (auditwheel)
            os.path.join(pil_dir, ".dylibs", "libjpeg.62*.dylib"),  # macOS wheels (delocate)
            os.path.join(site, "Pillow.libs", "libjpeg-*.so.62*"),
        ):
            found.extend(sorted(glob.glob(pattern)))
    except ImportError:
        pass
    if sys.platform.startswith("linux"):
        found.append("libjpeg.so.62")  # the system's libjpeg-turbo (6b ABI), when installed
    elif sys.platform == "darwin":
        name = ctypes.util.find_library("jpeg")
        if name:
            found.append(name)
    return found


class RegionDecoder:
    """The bound region decoder of this process (see :func:`decoder`)."""

    def __init__(self, native: Any, library: str, handle: Any) -> None:
        self._ffi = native.ffi
        self._lib = native.lib
        self.library = library
        self._handle = handle  # keeps the library loaded

    def decode(
        self,
        data: bytes,
        factor: int,
        bounds: tuple[int, int, int, int],
        fast_dct: bool,
        fast_upsample: bool,
        scratch: np.ndarray,
        keep: tuple[int, int] | None = None,
    ) -> tuple[np.ndarray, int, int, int, int, np.ndarray] | None:
        """Decode rows ``y0:y1`` and at least columns ``x0:x1`` (``bounds``, in pixels of
        the image scaled by 1/``factor``) as RGB into ``scratch`` (flat uint8; replaced
        by a larger one when too small). ``keep`` (``(k0, k1)`` within ``x0:x1``): keep
        only those columns, so that ``pixels`` is exactly them, C-contiguous.

        Returns ``(pixels, left, top, width, height, scratch)``: ``pixels`` the decoded
        region (HxWx3 uint8, a view of the returned ``scratch``: keep that for the next
        call), ``left``/``top`` where it starts in the scaled image (``left`` moved left
        to an MCU boundary), and the scaled image's ``width`` and ``height``. None when
        the region decode does not apply to this file (a colour space other than YCbCr,
        grayscale or RGB; data libjpeg calls corrupt): decode it whole instead (which
        names any error). Thread-safe (no state but the binding; the GIL is released
        while decoding)."""
        x0, y0, x1, y1 = bounds
        ffi = self._ffi
        geom = ffi.new("int[6]")
        src = ffi.from_buffer(data)
        k0, k1 = keep if keep is not None else (0, 0)
        status = _SMALL
        for _ in range(2):
            status = self._lib.shmjpeg_region(
                src,
                len(data),
                factor,
                int(fast_dct),
                int(fast_upsample),
                x0,
                y0,
                x1,
                y1,
                k0,
                k1,
                ffi.from_buffer(scratch),
                scratch.size,
                geom,
                ffi.NULL,
                0,
            )
            if status != _SMALL:
                break
            need = geom[2] * geom[3] * 3
            scratch = np.empty(int(need * 1.25) + 4096, np.uint8)  # room for a few larger ones
        if status == _OK:
            left, top, w, h = geom[0], geom[1], geom[2], geom[3]
            pixels = scratch[: w * h * 3].reshape(h, w, 3)
            return pixels, left, top, geom[4], geom[5], scratch
        return None  # _UNSUPPORTED, or an error: the full decode names it

    def why_not(self, data: bytes, factor: int = 1) -> str | None:
        """libjpeg's reason why ``data`` cannot be region-decoded (None when it can)."""
        msg = self._ffi.new(f"char[{_MSG_LEN}]")
        geom = self._ffi.new("int[6]")
        out = np.empty(3 * 64, np.uint8)
        # A one-pixel region: libjpeg reads the header and decodes the first rows only.
        status = self._lib.shmjpeg_region(
            self._ffi.from_buffer(data),
            len(data),
            factor,
            0,
            0,
            0,
            0,
            1,
            1,
            0,
            0,
            self._ffi.from_buffer(out),
            out.size,
            geom,
            msg,
            _MSG_LEN,
        )
        return None if status in (_OK, _SMALL) else self._ffi.string(msg).decode("utf-8", "replace")


def decoder() -> RegionDecoder | None:
    """This process's region decoder, bound on first use; None when unavailable
    (:func:`unavailable_reason` says why) or switched off with
    ``SHMLOADER_REGION_DECODE=0``."""
    if os.environ.get(ENV_OFF, "1").strip().lower() in ("0", "false", "no", "off"):
        _state["reason"] = f"switched off by {ENV_OFF}=0"
        return None
    if _state["pid"] == os.getpid() or (_state["pid"] is not None and _state["decoder"] is not None):
        return _state["decoder"]  # a forked child inherits the parent's binding
    _state["pid"] = os.getpid()
    _state["decoder"], _state["reason"] = _bind()
    return _state["decoder"]


def unavailable_reason() -> str | None:
    """Why :func:`decoder` returns None (None when it does not)."""
    return None if decoder() is not None else _state["reason"]


def _bind() -> tuple[RegionDecoder | None, str]:
    helper, why = native()
    if helper is None:
        return None, why
    abi = helper.lib.shmjpeg_abi()
    reasons = []
    for path in library_candidates(abi):
        try:
            handle = ctypes.CDLL(path)
            addrs = [ctypes.cast(getattr(handle, name), ctypes.c_void_p).value or 0 for name in _FUNCTIONS]
        except (OSError, AttributeError) as exc:
            reasons.append(f"{path}: {exc}")
            continue
        msg = helper.ffi.new(f"char[{_MSG_LEN}]")
        status = helper.lib.shmjpeg_bind(helper.ffi.new("uintptr_t[]", addrs), len(addrs), msg, _MSG_LEN)
        if status == _OK:
            return RegionDecoder(helper, path, handle), ""
        reasons.append(f"{path}: {helper.ffi.string(msg).decode('utf-8', 'replace')}")
    if not reasons and abi == 62:
        return None, "no libjpeg-turbo library found (Pillow's wheel ships one: pip install Pillow)"
    if not reasons:
        return None, (
            f"no libjpeg-turbo library of ABI {abi} found (shmloader._jpeg was built against "
            f"headers of JPEG_LIB_VERSION {abi}: install their runtime library, or rebuild "
            "against libjpeg62-turbo-dev's headers to use Pillow's)"
        )
    return None, "no usable libjpeg-turbo library: " + "; ".join(reasons)


def region_bounds(
    box: tuple[float, float, float, float], out_w: int, out_h: int, width: int, height: int
) -> tuple[int, int, int, int]:
    """The rows and columns (x0, y0, x1, y1) to decode so that resampling ``box`` (in
    pixels of a ``width`` x ``height`` image) to ``out_w`` x ``out_h`` reads only decoded
    pixels, identical to a full decode's: the antialiasing filter's reach (the
    downscale ratio, plus two pixels), one more for the chroma upsampling at the
    region's edges, and even offsets (so that rounding the shifted box, half to even,
    rounds as it did on the full image)."""
    bx0, by0, bx1, by1 = box
    mx = math.ceil(max((bx1 - bx0) / max(out_w, 1), 1.0)) + 4
    my = math.ceil(max((by1 - by0) / max(out_h, 1), 1.0)) + 4
    x0 = max(math.floor(bx0) - mx, 0) & ~1
    y0 = max(math.floor(by0) - my, 0) & ~1
    x1 = min(math.ceil(bx1) + mx, width)
    y1 = min(math.ceil(by1) + my, height)
    return x0, y0, x1, y1
