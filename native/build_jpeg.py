"""cffi builder for the region JPEG decoder (API mode): ``shmloader._jpeg``.

Compiles ``jpeg_region.c`` against the libjpeg headers vendored in ``native/jpeg/``
(no system libjpeg development package needed) and links no libjpeg: the library is
bound at run time (``shmloader.vision.region``). The extension is optional: a compiler
failure leaves it out (setuptools warns) and ImageFolder decodes whole images, as before.
"""

from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef((_HERE / "jpeg_region.h").read_text())
ffibuilder.set_source(
    "shmloader._jpeg",
    (_HERE / "jpeg_region.c").read_text(),
    include_dirs=[str(_HERE / "jpeg")],
    extra_compile_args=["-O2", "-std=gnu11"],
    py_limited_api=True,
    optional=True,  # never break the install: without it, full decodes
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
