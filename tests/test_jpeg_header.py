"""jpeg_header.parse: the size and mode Pillow opens a plain JPEG with, or None (Pillow decides)."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("PIL")

from PIL import Image

from shmloader.vision import jpeg_header
from shmloader.vision.synth import synth_image


def encoded(im, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, **kw)
    return buf.getvalue()


def pillow_says(data: bytes):
    try:
        im = Image.open(io.BytesIO(data))
    except Exception:
        return None
    return im.format, im.size, im.mode


def exif_bytes() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # an orientation: pil_loader does not apply it, and neither does the fused path
    return exif.tobytes()


EXIF = exif_bytes()


@pytest.fixture(scope="module")
def photo():
    return Image.fromarray(synth_image(np.random.default_rng(2), 120, 180, 1))


@pytest.mark.parametrize(
    "kw",
    [
        {"format": "JPEG", "quality": 90},
        {"format": "JPEG", "quality": 85, "progressive": True},
        {"format": "JPEG", "quality": 95, "subsampling": 0},
        {"format": "JPEG", "quality": 80, "subsampling": 1, "restart_marker_blocks": 2},
        {"format": "JPEG", "quality": 90, "exif": EXIF},
        {"format": "JPEG", "quality": 90, "comment": b"a comment", "dpi": (300, 300)},
    ],
)
def test_plain_jpegs_read_as_pillow_opens_them(photo, kw):
    for mode in ("RGB", "L"):
        data = encoded(photo.convert(mode), **kw)
        width, height, got_mode = jpeg_header.parse(data, Image.MAX_IMAGE_PIXELS)
        assert ("JPEG", (width, height), got_mode) == pillow_says(data)


def test_other_files_are_left_to_pillow(photo):
    plain = encoded(photo, format="JPEG", quality=90)
    cmyk = encoded(photo.convert("CMYK"), format="JPEG")
    mpo = encoded(photo, format="MPO", save_all=True, append_images=[photo.rotate(90)])
    assert pillow_says(cmyk)[2] == "CMYK" and pillow_says(mpo)[0] == "MPO"
    sos = plain.index(b"\xff\xda")
    cases = {
        "png": encoded(photo, format="PNG"),
        "cmyk": cmyk,
        "mpo": mpo,
        "cut before the scan": plain[:sos],
        "fill bytes before a marker": plain[:2] + b"\xff\xff" + plain[2:],
        "not a JPEG": b"GIF89a" + plain[6:],
    }
    for name, data in cases.items():
        assert jpeg_header.parse(data, Image.MAX_IMAGE_PIXELS) is None, name
    # Pillow's decompression-bomb limit: larger images go through Pillow (which warns or raises)
    assert jpeg_header.parse(plain, 180 * 120 - 1) is None
    assert jpeg_header.parse(plain, 180 * 120) == (180, 120, "RGB")


def test_header_image_is_a_pil_image_without_pixels():
    img = jpeg_header.header_image((500, 375), "L")
    assert isinstance(img, Image.Image) and jpeg_header.is_header_image(img)
    assert (img.size, img.width, img.height, img.mode, img.getbands()) == ((500, 375), 500, 375, "L", ("L",))
    assert not jpeg_header.is_header_image(Image.new("RGB", (2, 2)))
