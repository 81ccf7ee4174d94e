"""Only the cffi extension lives here; all other metadata is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
