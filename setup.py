"""Only the cffi extensions live here; all other metadata is in pyproject.toml."""

from setuptools import setup

# build_jpeg: the optional region JPEG decoder (a compile failure leaves it out; see
# native/build_jpeg.py).
setup(cffi_modules=["native/build_ffi.py:ffibuilder", "native/build_jpeg.py:ffibuilder"])
