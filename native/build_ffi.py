"""cffi builder for the shmloader C helper (API mode).

Reads the declarations and the source from the files beside it, so the C lives in real
files. ``setup.py`` names ``native/build_ffi.py:ffibuilder`` in ``cffi_modules``.
"""

from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef((_HERE / "slots.h").read_text())
ffibuilder.set_source(
    "shmloader._native",
    (_HERE / "slots.c").read_text(),
    extra_compile_args=["-O2", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
