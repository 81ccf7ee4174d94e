"""shmloader.vision: ImageFolder, transforms into the slot, decoding, errors, determinism."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("simplejpeg")

from PIL import Image

from shmloader.batch.writeinto import supports
from shmloader.vision import (
    CenterCrop,
    ImageDecodeError,
    ImageFolder,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToCHW,
    make_images,
)
from shmloader.vision import decode as vdecode
from shmloader.vision.synth import encode_jpeg, synth_image

from .conftest import START_METHODS
from .datasets import NumpyLoader as DataLoader  # numpy output: these tests check numpy views

HAS_TORCH = __import__("importlib").util.find_spec("torch") is not None
BACKENDS = ["pillow", "torch"] if HAS_TORCH else ["pillow"]
RRC = [RandomResizedCrop(32, scale=(0.2, 1.0)), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """24 JPEGs of 64-96 px in 3 classes."""
    return make_images(tmp_path_factory.mktemp("images"), 24, classes=3, min_size=64, max_size=96)


class GetItemOnly:
    """Hides the write-into protocol: the loader calls __getitem__ and collates."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def _batches(loader):
    return [(np.array(x), np.array(y)) for x, y in loader]


def _save(path: Path, img: Image.Image, fmt: str) -> Path:
    img.save(path, format=fmt)
    return path


# --- the folder ------------------------------------------------------------------------


def test_class_per_subfolder_layout_and_flat_lists(folder):
    ds = ImageFolder(folder)
    assert ds.classes == ["class_00", "class_01", "class_02"] and len(ds) == 24
    assert ds.targets.dtype == np.int64 and sorted(set(ds.targets.tolist())) == [0, 1, 2]
    image, label = ds[5]
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and isinstance(label, np.int64)
    assert label == int(Path(ds.samples[5][0]).parent.name[-2:])
    flat = ImageFolder.from_files([p for p, _ in ds.samples[:4]], [7, 8, 9, 7], [CenterCrop(16)])
    assert [int(flat[i][1]) for i in range(4)] == [7, 8, 9, 7] and flat[0][0].shape == (16, 16, 3)
    with pytest.raises(FileNotFoundError, match="no class folder"):
        ImageFolder(folder / "class_00")
    with pytest.raises(ValueError, match="one label per file"):
        ImageFolder.from_files(["a.jpg"], [])


@pytest.mark.parametrize("fast", [True, False])
def test_whole_image_decodes_straight_into_the_output_like_libjpeg(folder, fast):
    import simplejpeg

    ds = ImageFolder(folder, fast_decode=fast)  # no transform: the whole image
    path = ds.samples[3][0]
    assert not supports(ds)  # no fixed size: torch-style __getitem__ only
    ref = simplejpeg.decode_jpeg(Path(path).read_bytes(), "RGB", fastdct=fast)
    assert np.array_equal(ds[3][0], ref)


def _jpeg_errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """Mean absolute difference and the share of values more than 8 levels off."""
    err = np.abs(got.astype(int) - ref.astype(int))
    return float(err.mean()), float((err > 8).mean())


@pytest.mark.parametrize("quality", [75, 90])
def test_fast_decode_equals_pillow_s_reference_decode_within_jpeg_tolerance(tmp_path, quality):
    rng = np.random.default_rng(quality)
    root = tmp_path / "q"
    (root / "c").mkdir(parents=True)
    for k in range(4):
        (root / "c" / f"{k}.jpg").write_bytes(encode_jpeg(synth_image(rng, 120 + 16 * k, 160), quality))
    accurate = ImageFolder(root, fast_decode=False)
    fast = ImageFolder(root)  # the default: libjpeg-turbo's fast integer IDCT
    assert fast.fast_decode and not fast.fast_upsample
    for i, (path, _) in enumerate(fast.samples):
        ref = np.asarray(Image.open(path).convert("RGB"))
        assert np.array_equal(accurate[i][0], ref)  # the accurate decode is Pillow's, exactly
        mean, outliers = _jpeg_errors(fast[i][0], ref)
        assert mean <= 1.5 and outliers <= 0.001, (path, mean, outliers)


def test_fast_upsample_is_an_opt_in_beyond_jpeg_tolerance_at_colour_edges(tmp_path):
    import pickle

    rng = np.random.default_rng(3)
    path = tmp_path / "c" / "edges.jpg"
    path.parent.mkdir()
    path.write_bytes(encode_jpeg(synth_image(rng, 160, 160), 90))
    ref = np.asarray(Image.open(path).convert("RGB"))
    ds = ImageFolder(tmp_path, fast_upsample=True)
    # The decoder itself (not the setting) must cross the pickle: the workers decode with it.
    assert pickle.loads(pickle.dumps(ds))._decoder.fast_upsample
    mean, outliers = _jpeg_errors(ds[0][0], ref)
    assert mean < 4.0 and outliers > 0.001  # close on average, far off at sharp chroma edges


# --- transforms --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_layouts_and_normalization(folder, backend):
    hwc = ImageFolder(folder, [Resize(40), CenterCrop(32)], backend=backend)
    chw = ImageFolder(folder, [Resize(40), CenterCrop(32), ToCHW()], backend=backend)
    norm = ImageFolder(folder, [Resize(40), CenterCrop(32), ToCHW(), Normalize()], backend=backend)
    a, b, c = hwc[2][0], chw[2][0], norm[2][0]
    assert a.shape == (32, 32, 3) and b.shape == (3, 32, 32) and c.shape == (3, 32, 32)
    assert c.dtype == np.float32 and b.dtype == np.uint8
    assert np.array_equal(a.transpose(2, 0, 1), b)
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    np.testing.assert_allclose(c, (b / 255.0 - mean) / std, rtol=1e-5, atol=1e-5)
    assert norm.sample_spec()[0].dtype == np.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_resize_and_center_crop_match_a_two_step_pillow_reference(folder, backend):
    ds = ImageFolder(folder, [Resize(48), CenterCrop(40)], backend=backend)
    for i in (0, 7):
        img = Image.open(ds.samples[i][0]).convert("RGB")
        w, h = img.size
        size = (48, int(48 * h / w)) if w <= h else (int(48 * w / h), 48)
        ref = img.resize(size, Image.BILINEAR)
        left, top = round((size[0] - 40) / 2), round((size[1] - 40) / 2)
        ref = np.asarray(ref.crop((left, top, left + 40, top + 40))).astype(int)
        got = ds[i][0].astype(int)
        assert np.abs(got - ref).mean() < 3.0, np.abs(got - ref).mean()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_crop_larger_than_the_image_pads_with_zeros(folder, backend):
    ds = ImageFolder(folder, [Resize(20), CenterCrop(30)], backend=backend)
    image = ds[0][0]
    assert image.shape == (30, 30, 3)
    assert (image[:, :5] == 0).all() or (image[:5] == 0).all()
    assert image[10:20, 10:20].mean() > 5


def test_random_resized_crop_draws_in_torchvision_ranges():
    t = RandomResizedCrop(8, scale=(0.1, 0.5), ratio=(0.5, 2.0))
    rng = np.random.default_rng(0)
    for _ in range(300):
        i, j, h, w = t.params(300, 200, rng)
        assert 0 <= i <= 200 - h and 0 <= j <= 300 - w
        assert 0.09 <= h * w / 60000 <= 0.51 and 0.45 <= w / h <= 2.2


def test_flip_mirrors_the_same_crop(folder):
    plain = ImageFolder(folder, [CenterCrop(40)], backend="pillow")
    flipped = ImageFolder(folder, [CenterCrop(40), RandomHorizontalFlip(p=1.0)], backend="pillow")
    assert np.array_equal(flipped[1][0], plain[1][0][:, ::-1])


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("pad", [False, True])
def test_the_two_resamplers_agree(folder, pad):
    transform = [Resize(20), CenterCrop(30), ToCHW()] if pad else [Resize(36), CenterCrop(32)]
    a = ImageFolder(folder, transform, backend="pillow")
    b = ImageFolder(folder, transform, backend="torch")
    for i in (0, 11):
        assert np.abs(a[i][0].astype(int) - b[i][0].astype(int)).mean() < 4.0  # box rounding


def test_dct_scaling_decodes_big_jpegs_smaller(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    path = tmp_path / "c" / "big.jpg"
    path.parent.mkdir()
    path.write_bytes(encode_jpeg(synth_image(rng, 480, 640)))
    factors = []
    original = vdecode.Decoder.decode

    def spy(self, probe, factor=1, buffer=None):
        out = original(self, probe, factor, buffer)
        factors.append((factor, out.shape))
        return out

    monkeypatch.setattr(vdecode.Decoder, "decode", spy)
    # region_decode=False: the whole-image decoder (tests/test_crop.py: the region one)
    kw = {"backend": "pillow", "region_decode": False}
    fast = ImageFolder(tmp_path, [Resize(60), CenterCrop(56)], **kw)[0][0]
    slow = ImageFolder(tmp_path, [Resize(60), CenterCrop(56)], dct_scaling=False, **kw)[0][0]
    assert factors == [(8, (60, 80, 3)), (1, (480, 640, 3))]  # 448 px crop -> 56 px
    assert np.abs(fast.astype(int) - slow.astype(int)).mean() < 4.0


# --- image modes and errors -------------------------------------------------------------


def test_every_image_mode_comes_out_as_three_channel_uint8(tmp_path):
    root = tmp_path / "modes"
    (root / "x").mkdir(parents=True)
    rgb = Image.fromarray(synth_image(np.random.default_rng(2), 40, 48))
    files = {
        "gray.jpg": (rgb.convert("L"), "JPEG"),
        "cmyk.jpg": (rgb.convert("CMYK"), "JPEG"),
        "palette.png": (rgb.convert("P"), "PNG"),
        "rgba.png": (rgb.convert("RGBA"), "PNG"),
        "la.png": (rgb.convert("LA"), "PNG"),
        "cmyk.tif": (rgb.convert("CMYK"), "TIFF"),
        "bitmap.bmp": (rgb.convert("1"), "BMP"),
    }
    for name, (img, fmt) in files.items():
        _save(root / "x" / name, img, fmt)
    palette = rgb.convert("P")
    palette.info["transparency"] = 0
    _save(root / "x" / "transparent.png", palette, "PNG")
    _save(root / "x" / "deep.png", Image.fromarray(np.full((40, 48), 3000, np.uint16)), "PNG")
    ds = ImageFolder(root)
    assert len(ds) == 9
    for i, (path, _) in enumerate(ds.samples):
        image = ds[i][0]
        assert image.dtype == np.uint8 and image.shape == (40, 48, 3), path
        if "deep" in path:
            assert (image == 3000 >> 8).all()  # scaled from 16 bits, not clipped
        elif "gray" in path:
            assert (image[..., 0] == image[..., 1]).all()
        else:
            assert image.std() > 5, path
    spec = ImageFolder(root, [CenterCrop(16)]).sample_spec()
    batch = next(iter(DataLoader(ImageFolder(root, [CenterCrop(16)]), batch_size=9)))
    assert batch[0].shape == (9, *spec[0].shape)


@pytest.fixture
def broken(tmp_path, folder):
    """A copy of three good images plus a corrupt, a truncated and a non-image file."""
    root = tmp_path / "broken"
    (root / "a").mkdir(parents=True)
    good = sorted((folder / "class_00").iterdir())[:3]
    for p in good:
        (root / "a" / p.name).write_bytes(p.read_bytes())
    data = good[0].read_bytes()
    (root / "a" / "1_corrupt.jpg").write_bytes(
        data[:2] + bytes(np.random.default_rng(0).integers(0, 256, 500, np.uint8))
    )
    (root / "a" / "2_truncated.jpg").write_bytes(data[: len(data) // 2])
    (root / "a" / "3_text.png").write_text("not an image at all\n")
    return root


@pytest.mark.parametrize("name", ["1_corrupt.jpg", "2_truncated.jpg", "3_text.png"])
def test_a_bad_file_is_an_error_naming_it(broken, name):
    ds = ImageFolder(broken, [CenterCrop(32)])
    index = [Path(p).name for p, _ in ds.samples].index(name)
    with pytest.raises(ImageDecodeError, match=name) as info:
        ds[index]
    assert info.value.path.endswith(name) and "on_error='skip'" in str(info.value)


def test_a_bad_file_in_a_worker_names_it_in_the_consumer(broken):
    ds = ImageFolder(broken, [CenterCrop(32)], backend="pillow")
    with pytest.raises(ImageDecodeError, match=r"1_corrupt\.jpg"):
        list(DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork"))


def test_skip_mode_replaces_counts_and_warns_once(broken):
    ds = ImageFolder(broken, [CenterCrop(32)], on_error="skip", backend="pillow")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(DataLoader(ds, batch_size=3))
    assert [len(y) for _, y in batches] == [3, 3] and ds.skipped == 6  # 3 + 2 + 1 tries
    assert ds.stats()["skipped"] == 6
    assert len([w for w in caught if "skipped an unreadable image" in str(w.message)]) == 1
    good = [ds[i][0] for i in range(3)]
    assert np.array_equal(batches[1][0][0], good[0])  # 1_corrupt.jpg -> the next readable one
    loader = DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork")
    loaded = _batches(loader)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(loaded, batches, strict=False))
    assert loader.stats()["dataset"]["skipped"] == 6, "the workers' skips reach the loader's stats"


def test_skip_mode_gives_up_on_a_folder_of_non_images(tmp_path):
    (tmp_path / "a").mkdir()
    for i in range(3):
        (tmp_path / "a" / f"{i}.jpg").write_bytes(b"nope")
    with pytest.warns(RuntimeWarning), pytest.raises(ImageDecodeError, match="in a row"):
        ImageFolder(tmp_path, [CenterCrop(8)], on_error="skip")[0]


# --- the loader: write-into, determinism, start methods ----------------------------------


@pytest.mark.parametrize("method", START_METHODS)
def test_write_into_equals_getitem_and_lands_in_the_ring(folder, method):
    backend = "pillow" if method == "spawn" else "auto"  # spawn: no torch import per worker
    ds = ImageFolder(folder, RRC, backend=backend)
    assert supports(ds)
    kw = {
        "batch_size": 8,
        "shuffle": True,
        "num_workers": 2,
        "seed": 11,
        "multiprocessing_context": method,
    }
    loader = DataLoader(ds, **kw)
    written = [(x, y) for x, y in loader]
    assert loader.ring.contains(written[-1][0])  # the first batch sizes the ring
    assert written[0][0].shape == (8, 32, 32, 3) and written[0][1].dtype == np.int64
    fetched = _batches(DataLoader(GetItemOnly(ds), **kw))
    for (x1, y1), (x2, y2) in zip(written, fetched, strict=False):
        assert np.array_equal(y1, y2) and np.array_equal(x1, x2)
    assert sorted(np.concatenate([y for _, y in written]).tolist()) == sorted(ds.targets.tolist())


def test_same_seed_same_crops_for_any_number_of_workers(folder):
    ds = ImageFolder(folder, RRC)
    runs = {
        n: _batches(
            DataLoader(
                ds,
                batch_size=5,
                shuffle=True,
                num_workers=n,
                seed=5,
                multiprocessing_context="fork",
            )
        )
        for n in (1, 2, 3)
    }
    for n in (2, 3):
        assert all(
            np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
            for a, b in zip(runs[1], runs[n], strict=False)
        )
    other = _batches(
        DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, seed=6, multiprocessing_context="fork")
    )
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(runs[1], other, strict=False))
    # Epochs differ: persistent workers get a new epoch seed.
    loader = DataLoader(ds, batch_size=24, num_workers=2, persistent_workers=True, seed=5)
    first, second = (np.array(next(iter(loader))[0]) for _ in range(2))
    loader.shutdown()
    assert not np.array_equal(first, second)


def test_the_main_process_gives_the_same_crops_as_workers(folder):
    ds = ImageFolder(folder, RRC)
    kw = {"batch_size": 6, "shuffle": True, "seed": 9}
    main = _batches(DataLoader(ds, num_workers=0, **kw))
    workers = _batches(DataLoader(ds, num_workers=2, multiprocessing_context="fork", **kw))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(main, workers, strict=False))


def test_outside_a_loader_randomness_follows_numpy_s_global_seed(folder):
    ds = ImageFolder(folder, RRC)
    np.random.seed(0)
    first = ds[3][0]
    np.random.seed(0)
    assert np.array_equal(ds[3][0], first)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_dataloader_runs_imagefolder_with_the_same_crops_for_any_workers(folder):
    import torch

    ds = ImageFolder(folder, RRC)

    def run(n):
        g = torch.Generator().manual_seed(0)
        dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=n, generator=g, shuffle=True)
        return [(x.numpy(), y.numpy()) for x, y in dl]

    one, two = run(1), run(2)
    assert one[0][0].shape == (8, 32, 32, 3) and one[0][1].dtype == np.int64
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(one, two, strict=False))


# --- the command and the example ----------------------------------------------------------


def test_make_images_writes_a_photographic_jpeg_folder(tmp_path):
    from shmloader.vision import synth

    assert (
        synth.main(
            [
                str(tmp_path / "d"),
                "--count",
                "6",
                "--classes",
                "2",
                "--min-size",
                "40",
                "--max-size",
                "60",
            ]
        )
        == 0
    )
    files = sorted((tmp_path / "d").rglob("*.jpg"))
    assert len(files) == 6 and {p.parent.name for p in files} == {"class_00", "class_01"}
    img = np.asarray(Image.open(io.BytesIO(files[0].read_bytes())))
    assert min(img.shape[:2]) >= 40 and max(img.shape[:2]) <= 60
    assert img.std() > 10 and len(np.unique(img.reshape(-1, 3), axis=0)) > 200  # not flat colour


def test_the_example_iterates_a_folder_and_prints_images_per_second(folder):
    example = Path(__file__).resolve().parents[1] / "examples" / "image_folder.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [
            sys.executable,
            str(example),
            str(folder),
            "--batch-size",
            "8",
            "--workers",
            "2",
            "--size",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "images/s" in out.stdout and "24 images" in out.stdout
