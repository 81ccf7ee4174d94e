"""cffi builder for the region JPEG decoder (API mode): ``shmloader._jpeg``.

Compiles ``jpeg_region.c`` against the libjpeg-turbo headers of the build environment
(``jpeglib.h``, ``jconfig.h``, ``jmorecfg.h``) and links no libjpeg: the library is bound
at run time (``shmloader.vision.region``), one of the ABI the headers declare
(``JPEG_LIB_VERSION``). The extension is optional: ``setup.py`` builds it only where
:func:`find_headers` finds the headers, so an install without them still succeeds;
ImageFolder then decodes whole images and ``shmloader doctor`` says which package to
install. A compiler failure also leaves it out (setuptools warns).

``SHMLOADER_JPEG_INCLUDE``: the directories (``os.pathsep``-separated) to look in
instead of the usual ones, for headers in a non-standard place; a directory without
``jpeglib.h`` builds without the decoder.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

from cffi import FFI

_HERE = Path(__file__).resolve().parent
ENV_INCLUDE = "SHMLOADER_JPEG_INCLUDE"
PACKAGES = (
    "libjpeg62-turbo-dev (Debian), libjpeg-turbo8-dev (Ubuntu), libjpeg-turbo-devel "
    "(Fedora, RHEL), libjpeg-turbo-dev (Alpine), jpeg-turbo (Homebrew, conda-forge)"
)


class Headers(NamedTuple):
    """Where libjpeg-turbo's headers are, and the ABI they declare."""

    include_dirs: tuple[str, ...]  # jpeglib.h's directory, then jconfig.h's when elsewhere
    lib_version: int  # JPEG_LIB_VERSION: 62 (the libjpeg 6b ABI), 70 or 80


def _search_dirs() -> list[Path]:
    """The directories to look in for ``jpeglib.h``, in order."""
    if ENV_INCLUDE in os.environ:
        return [Path(p) for p in os.environ[ENV_INCLUDE].split(os.pathsep) if p]
    dirs = [p for var in ("CPATH", "C_INCLUDE_PATH") for p in os.environ.get(var, "").split(os.pathsep) if p]
    prefixes = [os.environ.get("CONDA_PREFIX", ""), sys.prefix, "/usr/local", "/usr"]
    if sys.platform == "darwin":  # Homebrew's keg-only jpeg-turbo, then its prefix
        prefixes = ["/opt/homebrew/opt/jpeg-turbo", "/usr/local/opt/jpeg-turbo", "/opt/homebrew", *prefixes]
    dirs += [os.path.join(p, "include") for p in prefixes if p]
    return [Path(d) for d in dict.fromkeys(dirs)]


def _define(text: str, name: str) -> int | None:
    m = re.search(rf"^\s*#\s*define\s+{name}\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else None


def find_headers() -> Headers | str:
    """libjpeg-turbo's headers here, or a sentence saying why there are none.

    ``jconfig.h`` may sit in the multiarch directory next to ``jpeglib.h``'s (Debian,
    Ubuntu). The headers must be libjpeg-turbo's: IJG libjpeg lacks the
    ``jpeg_skip_scanlines`` and ``jpeg_crop_scanline`` the decoder needs."""
    dirs = _search_dirs()
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for d in dirs:
        jpeglib = d / "jpeglib.h"
        if not jpeglib.is_file():
            continue
        text = jpeglib.read_text(errors="replace")
        if "jpeg_crop_scanline" not in text:
            return f"{jpeglib} is not libjpeg-turbo's (no jpeg_crop_scanline)"
        for conf_dir in (d, d / multiarch) if multiarch else (d,):
            jconfig = conf_dir / "jconfig.h"
            if jconfig.is_file():
                version = _define(jconfig.read_text(errors="replace"), "JPEG_LIB_VERSION")
                version = version or _define(text, "JPEG_LIB_VERSION") or 62
                return Headers(tuple(dict.fromkeys((str(d), str(conf_dir)))), version)
        return f"{jpeglib} has no jconfig.h next to it"
    where = ", ".join(str(d) for d in dirs) or f"nowhere (${ENV_INCLUDE} is empty)"
    return f"libjpeg-turbo's headers (jpeglib.h) are not in {where}"


def ffibuilder() -> FFI:
    """The cffi builder of ``shmloader._jpeg`` (``setup.py``'s ``cffi_modules`` calls it
    only when :func:`find_headers` found them)."""
    headers = find_headers()
    if isinstance(headers, str):
        raise RuntimeError(f"cannot build shmloader._jpeg: {headers}; install {PACKAGES}")
    ffi = FFI()
    ffi.cdef((_HERE / "jpeg_region.h").read_text())
    ffi.cdef((_HERE / "pil_bilinear.h").read_text())
    ffi.set_source(
        "shmloader._jpeg",
        (_HERE / "jpeg_region.c").read_text() + (_HERE / "pil_bilinear.h").read_text(),
        # (Pillow's bilinear resize, reproduced: torchvision_fused's resampler.)
        # setuptools takes only paths relative to setup.py's folder (the build's cwd).
        sources=[os.path.relpath(_HERE / "pil_bilinear.c")],
        include_dirs=list(headers.include_dirs),
        extra_compile_args=["-O2", "-std=gnu11"],
        py_limited_api=True,
        optional=True,  # never break the install: without it, full decodes
    )
    return ffi


if __name__ == "__main__":
    ffibuilder().compile(verbose=True)
