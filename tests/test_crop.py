"""Region JPEG decoding (issue 17): decode only the rows and MCU columns a crop needs.

Real files, real decoding: the region decoder (native/jpeg_region.c bound to the
libjpeg-turbo of Pillow's wheel) against simplejpeg's full decode and against
ImageFolder with region decoding off; its build (native/build_jpeg.py) with and without
libjpeg-turbo's headers."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from shmloader.vision import (
    CenterCrop,
    ImageDecodeError,
    ImageFolder,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    region,
    synth,
)
from shmloader.vision.synth import synth_image

from .datasets import NumpyLoader as DataLoader

HAS_TORCH = importlib.util.find_spec("torch") is not None
BACKENDS = ["pillow", "torch"] if HAS_TORCH else ["pillow"]
ROOT = Path(__file__).resolve().parent.parent
# Pillow's wheels ship libjpeg-turbo for these; elsewhere region decoding may be absent.
REGION_PLATFORM = sys.platform.startswith("linux") or sys.platform == "darwin"
# The helper is built only where libjpeg-turbo's headers were at install: without it,
# images decode whole (test_the_region_decoder_is_bound_to_a_libjpeg_turbo says why).
EXPECT_REGION = REGION_PLATFORM and region.native()[0] is not None


def _builder():
    """native/build_jpeg.py (native/ is no package)."""
    spec = importlib.util.spec_from_file_location("build_jpeg", ROOT / "native" / "build_jpeg.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _variants(img: np.ndarray) -> dict[str, bytes]:
    """One image as the JPEG flavours the region decode must handle."""
    out = {sub: simplejpeg.encode_jpeg(img, 90, colorsubsampling=sub) for sub in ("420", "422", "444")}
    gray = np.ascontiguousarray(img.mean(2, keepdims=True).astype(np.uint8))
    out["gray"] = simplejpeg.encode_jpeg(gray, 90, colorspace="GRAY")
    for name, kw in (("progressive", {"progressive": True}), ("restarts", {"restart_marker_rows": 1})):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=85, **kw)
        out[name] = buf.getvalue()
    return out


@pytest.fixture(scope="module")
def flavours() -> dict[str, bytes]:
    return _variants(synth_image(np.random.default_rng(5), 150, 203))  # odd sizes: partial MCUs


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """A folder of every flavour, a CMYK JPEG and a PNG, in two sizes."""
    root = tmp_path_factory.mktemp("mixed")
    (root / "a").mkdir()
    rng = np.random.default_rng(7)
    for h, w in ((150, 203), (300, 401)):
        img = synth_image(rng, h, w)
        for name, data in _variants(img).items():
            (root / "a" / f"{w}_{name}.jpg").write_bytes(data)
        Image.fromarray(img).convert("CMYK").save(root / "a" / f"{w}_cmyk.jpg", quality=90)
        Image.fromarray(img).save(root / "a" / f"{w}_png.png")
    return root


def test_the_region_decoder_is_bound_to_a_libjpeg_turbo():
    if not REGION_PLATFORM:
        pytest.skip("Pillow's wheel for this platform may ship no libjpeg.so.62")
    helper, why = region.native()
    if helper is None:
        headers = _builder().find_headers()
        # Headers here but no helper: the build broke (or ran before they were installed).
        assert isinstance(headers, str), f"libjpeg-turbo's headers are in {headers.include_dirs}, but {why}"
        pytest.skip(f"built without the region decoder: {headers}")
    dec = region.decoder()
    assert dec is not None, region.unavailable_reason()
    assert "jpeg" in dec.library and region.unavailable_reason() is None


@pytest.mark.parametrize("name", ["420", "422", "444", "gray", "progressive", "restarts"])
def test_a_region_has_the_full_decode_s_pixels(flavours, name):
    """Bit-exact except the outermost column of a cropped side (chroma upsampling)."""
    dec = region.decoder()
    if dec is None:
        pytest.skip(str(region.unavailable_reason()))
    data = flavours[name]
    rng = np.random.default_rng(0)
    for factor in (1, 2, 4, 8):
        for fast in (False, True):
            full = simplejpeg.decode_jpeg(
                data, "RGB", fast, False, min_height=-(-150 // factor), min_width=-(-203 // factor)
            )
            h, w = full.shape[:2]
            for _ in range(6):
                x0, y0 = int(rng.integers(0, w - 3)), int(rng.integers(0, h - 1))
                x1, y1 = int(rng.integers(x0 + 3, w + 1)), int(rng.integers(y0 + 1, h + 1))
                got = dec.decode(data, factor, (x0, y0, x1, y1), fast, False, np.empty(0, np.uint8))
                pixels, left, top, fw, fh, _ = got
                assert (fw, fh) == (w, h) and top == y0 and pixels.shape[0] == y1 - y0
                assert left <= x0 and left + pixels.shape[1] >= x1
                a = 1 if left > 0 else 0  # the edge columns of a cropped side may differ
                b = pixels.shape[1] - (1 if left + pixels.shape[1] < w else 0)
                assert np.array_equal(pixels[:, a:b], full[y0:y1, left + a : left + b]), (factor, fast)
                # keep: exactly the inner columns, contiguous (what the torch resampler reads)
                k0, k1 = x0 + (x0 > 0), x1 - (x1 < w)
                if k1 > k0:
                    kept = dec.decode(
                        data, factor, (x0, y0, x1, y1), fast, False, np.empty(0, np.uint8), (k0, k1)
                    )
                    assert kept[1] == k0 and kept[0].flags.c_contiguous
                    assert np.array_equal(kept[0], full[y0:y1, k0:k1]), (factor, fast)


def _render(root: Path, transform, **kw) -> tuple[list[np.ndarray], dict]:
    ds = ImageFolder(root, transform, **kw)
    np.random.seed(0)  # outside a loader, the crops follow numpy's global seed
    return [ds[i][0] for i in range(len(ds))], ds.stats()


TRANSFORMS = {
    "rrc": [RandomResizedCrop(48, scale=(0.08, 1.0)), RandomHorizontalFlip()],
    "resize+crop": [Resize(40), CenterCrop(32)],
    "pad": [CenterCrop((160, 64))],  # taller than the small images: padded
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_the_exact_path_is_unchanged(mixed, backend, transform):
    """fast_decode=False: the same pixels as a full accurate decode followed by the crop."""
    ref, ref_stats = _render(
        mixed, TRANSFORMS[transform], backend=backend, fast_decode=False, region_decode=False
    )
    got, stats = _render(mixed, TRANSFORMS[transform], backend=backend, fast_decode=False)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert ref_stats["region_decodes"] == 0
    if EXPECT_REGION:
        assert stats["region_decodes"] >= 6, stats  # the YCbCr and gray JPEGs (crops that need it)
        assert stats["region_fallbacks"] == 2, stats  # the two CMYK JPEGs


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fast_path_is_within_the_fast_idct_s_error(mixed, backend):
    """fast_decode=True with region decoding, against the accurate full decode + crop:
    the per-pixel mean absolute difference of the fast IDCT (about one level)."""
    tf = TRANSFORMS["rrc"]
    ref, _ = _render(mixed, tf, backend=backend, fast_decode=False, region_decode=False)
    got, _ = _render(mixed, tf, backend=backend, fast_decode=True)
    same, _ = _render(mixed, tf, backend=backend, fast_decode=True, region_decode=False)
    assert all(np.array_equal(a, b) for a, b in zip(got, same))  # region on or off: identical
    mad = [np.abs(a.astype(int) - b.astype(int)).mean() for a, b in zip(got, ref)]
    assert max(mad) < 1.5 and np.mean(mad) < 1.0, mad


def test_dct_scaling_combines_with_the_region(tmp_path):
    """A 1200x800 photo cropped to 56 px: decoded at 1/8 and only the crop's part of it."""
    root = tmp_path / "big"
    synth.make_images(root, 2, classes=1, size=(1200, 800))
    tf = [Resize(60), CenterCrop(56)]
    ds = ImageFolder(root, tf, backend="pillow")
    calls = []
    original = region.RegionDecoder.decode

    def spy(self, data, factor, bounds, *args):
        out = original(self, data, factor, bounds, *args)
        calls.append((factor, None if out is None else out[0].shape))
        return out

    region.RegionDecoder.decode = spy
    try:
        got = [ds[i][0] for i in range(2)]  # Resize + CenterCrop: no randomness
    finally:
        region.RegionDecoder.decode = original
    if not EXPECT_REGION:
        pytest.skip("no region decoder here")
    assert [f for f, _ in calls] == [8, 8]
    h, w = calls[0][1][:2]
    assert h == 100 and w < 120, calls  # of the 150x100 image at 1/8: the centre 93 columns + margin
    ref = [ImageFolder(root, tf, backend="pillow", region_decode=False)[i][0] for i in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))


def test_cmyk_is_refused_with_libjpeg_s_reason(mixed, flavours):
    dec = region.decoder()
    if dec is None:
        pytest.skip(str(region.unavailable_reason()))
    assert dec.why_not(flavours["420"]) is None
    assert dec.why_not((mixed / "a" / "203_cmyk.jpg").read_bytes()) == "colour space"
    assert dec.why_not(b"\xff\xd8 not a jpeg")  # libjpeg's message


@pytest.mark.parametrize("missing", ["library", "helper"])
def test_without_a_usable_library_images_decode_whole_and_count_it(mixed, monkeypatch, missing):
    """No library to bind, or no helper (built where libjpeg-turbo's headers were absent):
    the same pixels as with region decoding off, each JPEG counted as a fallback."""
    monkeypatch.setattr(region, "_state", {"pid": None, "decoder": None, "reason": ""})
    if missing == "library":
        if region.native()[0] is None:
            pytest.skip(region.native()[1])
        monkeypatch.setattr(region, "library_candidates", lambda abi: ["/nonexistent/libjpeg.so.62"])
        expected = "/nonexistent/libjpeg.so.62"
    else:
        import shmloader

        monkeypatch.setitem(sys.modules, "shmloader._jpeg", None)  # the import fails, as unbuilt
        monkeypatch.delattr(shmloader, "_jpeg", raising=False)
        expected = "libjpeg62-turbo-dev (Debian)"
    assert region.decoder() is None
    assert expected in str(region.unavailable_reason())
    got, stats = _render(mixed, TRANSFORMS["rrc"], backend="pillow")
    ref, _ = _render(mixed, TRANSFORMS["rrc"], backend="pillow", region_decode=False)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert stats["region_decodes"] == 0 and stats["region_fallbacks"] >= 12, stats


def test_library_candidates_follow_the_helper_s_abi():
    """Headers of the libjpeg 6b ABI (62) bind Pillow's libjpeg-turbo first; others (Ubuntu's
    libjpeg-turbo8-dev declares 80) only a system library of their ABI."""
    six_b = region.library_candidates(62)
    eight = region.library_candidates(80)
    assert not any("pillow" in path.lower() for path in eight)
    if sys.platform.startswith("linux"):
        assert six_b[-1] == "libjpeg.so.62" and eight == ["libjpeg.so.8"]
        if importlib.util.find_spec("PIL") is not None:
            assert "pillow.libs" in six_b[0].lower() or len(six_b) == 1


def test_the_builder_finds_the_headers_or_says_which_are_missing(tmp_path, monkeypatch):
    builder = _builder()
    monkeypatch.setenv(builder.ENV_INCLUDE, str(tmp_path))
    why = builder.find_headers()
    assert isinstance(why, str) and "jpeglib.h" in why and str(tmp_path) in why
    (tmp_path / "jpeglib.h").write_text("/* IJG libjpeg: no region API */\n")
    assert "not libjpeg-turbo's" in builder.find_headers()
    with pytest.raises(RuntimeError, match="libjpeg62-turbo-dev"):
        builder.ffibuilder()
    (tmp_path / "jpeglib.h").write_text("EXTERN(void) jpeg_crop_scanline(void);\n")
    (tmp_path / "jconfig.h").write_text("#define JPEG_LIB_VERSION  80\n")
    assert builder.find_headers() == builder.Headers((str(tmp_path),), 80)
    monkeypatch.delenv(builder.ENV_INCLUDE)
    found = builder.find_headers()
    if region.native()[0] is not None and isinstance(found, str):
        pytest.skip(f"the helper was built elsewhere: {found}")
    if not isinstance(found, str):  # this machine's headers: what the helper was built against
        assert found.lib_version in (62, 70, 80)
        if region.native()[0] is not None:
            assert region.native()[0].lib.shmjpeg_abi() == found.lib_version


def test_setup_leaves_the_decoder_out_without_headers(tmp_path):
    """setup.py lists the region decoder's builder only where the headers are, so an install
    without them succeeds (and says how to get the decoder)."""
    code = (
        "import runpy, setuptools\n"
        "seen = {}\n"
        "setuptools.setup = lambda **kw: seen.update(kw)\n"
        "runpy.run_path('setup.py', run_name='__main__')\n"
        "print(seen['cffi_modules'])\n"
    )
    env = {**os.environ, "SHMLOADER_JPEG_INCLUDE": str(tmp_path)}
    hidden = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert hidden.returncode == 0, hidden.stderr
    assert hidden.stdout.strip() == "['native/build_ffi.py:ffibuilder']"
    assert (
        "building without the region JPEG decoder" in hidden.stderr and "libjpeg-turbo8-dev" in hidden.stderr
    )
    if not isinstance(_builder().find_headers(), str):
        env.pop("SHMLOADER_JPEG_INCLUDE")
        found = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert found.returncode == 0, found.stderr
        assert found.stdout.strip().endswith("'native/build_jpeg.py:ffibuilder']") and not found.stderr


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SHMLOADER_REGION_DECODE", "0")
    assert region.decoder() is None and "SHMLOADER_REGION_DECODE" in str(region.unavailable_reason())


def test_the_counters_reach_the_loader_s_stats(mixed):
    """Workers' counters, summed in loader.stats(), equal the main process's own."""
    counted = []
    for workers in (0, 2):
        ds = ImageFolder(mixed, TRANSFORMS["rrc"], backend="pillow")
        kw = {"multiprocessing_context": "fork"} if workers else {}
        loader = DataLoader(ds, batch_size=4, num_workers=workers, seed=3, **kw)
        assert sum(len(y) for _, y in loader) == len(ds) == 16
        counted.append({k: v for k, v in loader.stats()["dataset"].items() if v})  # workers: sent when >0
    assert counted[0] == counted[1], counted
    stats = counted[1]
    assert "skipped" not in stats
    if EXPECT_REGION:
        assert stats["region_fallbacks"] == 2, stats  # the CMYK JPEGs
        assert 1 <= stats["region_decodes"] <= 12, stats  # the others whose crop needs part of them
    else:  # no decoder: every JPEG whose crop needs only part of it (14 JPEGs, 2 PNGs)
        assert "region_decodes" not in stats and 2 <= stats["region_fallbacks"] <= 14, stats


def test_a_truncated_jpeg_fails_whatever_the_crop(mixed, tmp_path):
    """Decoding only the top rows of a cut file would succeed for some crops: the region
    decode refuses files without an end marker, so the error does not depend on the crop."""
    (tmp_path / "a").mkdir()
    data = (mixed / "a" / "401_420.jpg").read_bytes()
    (tmp_path / "a" / "cut.jpg").write_bytes(data[: len(data) * 2 // 3])
    ds = ImageFolder(tmp_path, [RandomResizedCrop(24, scale=(0.01, 0.02))], backend="pillow")
    np.random.seed(0)
    for _ in range(8):
        with pytest.raises(ImageDecodeError, match=r"cut\.jpg"):
            ds[0]
    assert ds.stats()["region_decodes"] == 0 and ds.stats()["region_fallbacks"] == 8


def test_make_images_size_gives_every_image_that_size(tmp_path):
    assert synth.main([str(tmp_path / "d"), "--count", "3", "--classes", "1", "--size", "120x90"]) == 0
    sizes = {Image.open(p).size for p in (tmp_path / "d").rglob("*.jpg")}
    assert sizes == {(120, 90)}
    with pytest.raises(SystemExit):
        synth.main([str(tmp_path / "e"), "--size", "120by90"])
