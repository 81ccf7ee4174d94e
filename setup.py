"""Only the C extensions live here; all other metadata is in pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup


def _jpeg_builder():
    """native/build_jpeg.py, loaded from its path (native/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "build_jpeg", Path(__file__).resolve().parent / "native" / "build_jpeg.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


modules = ["native/build_ffi.py:ffibuilder"]
# The region JPEG decoder is optional: built only where libjpeg-turbo's headers are.
jpeg = _jpeg_builder()
headers = jpeg.find_headers()
if isinstance(headers, str):
    print(
        f"shmloader: building without the region JPEG decoder (shmloader._jpeg): {headers}. "
        f"ImageFolder decodes whole images; to get it, install {jpeg.PACKAGES} and reinstall.",
        file=sys.stderr,
    )
else:
    modules.append("native/build_jpeg.py:ffibuilder")
# The shared-structure reader builds Python objects, so it uses Python's C API, not cffi.
shared_read = Extension(
    "shmloader._shared_read", ["native/shared_read.c"], extra_compile_args=["-O2", "-std=gnu11"]
)
setup(cffi_modules=modules, ext_modules=[shared_read])
