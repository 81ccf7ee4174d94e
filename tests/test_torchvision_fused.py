"""images=: a torchvision ImageFolder pipeline run fused, against torch's DataLoader over the same dataset."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("PIL")

import torch
from PIL import Image
from torchvision import datasets
from torchvision import transforms as T
from torchvision.transforms import v2

from shmloader import DataLoader
from shmloader.vision.pil_resample import resampler
from shmloader.vision.synth import synth_image

NORM = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
KINDS = ("baseline", "progressive", "444", "gray", "cmyk", "png", "rgba", "gif", "422")


def pipeline(api: str, kind: str):
    if api == "v1":
        if kind == "train":
            ops = [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(**NORM)]
        else:
            ops = [T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(**NORM)]
        return T.Compose(ops)
    if kind == "train":
        ops = [v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(), v2.ToImage()]
        ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(**NORM)]
    else:
        ops = [v2.Resize(256), v2.CenterCrop(224), v2.PILToTensor()]
    return v2.Compose(ops)


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> Path:
    """27 images in 3 classes: JPEGs from 180x120 to 1200x900 (baseline, progressive,
    4:2:0, 4:2:2, 4:4:4, grayscale, CMYK), PNG RGB and RGBA, palette GIF."""
    root = tmp_path_factory.mktemp("varied")
    rng = np.random.default_rng(7)
    sizes = [(180, 120), (1200, 900), (500, 375), (224, 224), (640, 427), (333, 500), (900, 300)]
    for i in range(27):
        kind = KINDS[i % len(KINDS)]
        w, h = sizes[i % len(sizes)]
        folder = root / f"class{i % 3}"
        folder.mkdir(exist_ok=True)
        im = Image.fromarray(synth_image(rng, h, w, i % 3))
        stem = folder / f"img{i:02d}"
        if kind == "baseline":
            im.save(f"{stem}.jpg", quality=90)
        elif kind == "progressive":
            im.save(f"{stem}.jpg", quality=85, progressive=True)
        elif kind == "444":
            im.save(f"{stem}.jpeg", quality=95, subsampling=0)
        elif kind == "422":
            im.save(f"{stem}.jpg", quality=80, subsampling=1)
        elif kind == "gray":
            im.convert("L").save(f"{stem}.jpg", quality=90)
        elif kind == "cmyk":
            im.convert("CMYK").save(f"{stem}.jpg", quality=90)
        elif kind == "png":
            im.save(f"{stem}.png")
        elif kind == "rgba":
            im.convert("RGBA").save(f"{stem}.png")
        else:
            im.convert("P").save(f"{stem}.gif")
    return root


def folder_dataset(root: Path, transform) -> datasets.ImageFolder:
    # is_valid_file: torchvision's extension list leaves GIFs out; the loader stays the default.
    return datasets.ImageFolder(str(root), transform, is_valid_file=lambda p: True)


def epochs(loader_cls, dataset, num_workers: int, n_epochs: int = 1, **kw):
    torch.manual_seed(1234)
    loader = loader_cls(dataset, batch_size=5, shuffle=True, num_workers=num_workers, **kw)
    out = [[(x.clone(), y.clone()) for x, y in loader] for _ in range(n_epochs)]
    return loader, out, torch.rand(3)


def assert_identical(ref, got) -> None:
    assert len(ref) == len(got)
    for epoch_ref, epoch_got in zip(ref, got):
        assert len(epoch_ref) == len(epoch_got)
        for (x0, y0), (x1, y1) in zip(epoch_ref, epoch_got):
            assert type(x1) is type(x0) and x1.dtype == x0.dtype and x1.shape == x0.shape
            assert torch.equal(x0, x1), f"max difference {(x0.double() - x1.double()).abs().max()}"
            assert y1.dtype == y0.dtype and torch.equal(y0, y1)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["train", "eval"])
@pytest.mark.parametrize("api", ["v1", "v2"])
def test_bit_identical_to_torch(varied, api, kind, num_workers):
    dataset = folder_dataset(varied, pipeline(api, kind))
    _, ref, after_ref = epochs(torch.utils.data.DataLoader, dataset, num_workers, n_epochs=2)
    loader, got, after_got = epochs(DataLoader, dataset, num_workers, n_epochs=2)
    assert_identical(ref, got)
    assert torch.equal(after_ref, after_got)  # the global RNG consumed alike
    images = loader.stats()["images"]
    assert images["mode"] == "auto" and images["active"] and images["reason"] is None
    # Per epoch: 15 JPEGs run fused (RGB and grayscale), CMYK, PNG and GIF (12) fall back.
    assert (images["fused"], images["fell_back"]) == (30, 24)
    assert images["fallback_share"] == pytest.approx(24 / 54)


def test_persistent_workers_identical(varied):
    dataset = folder_dataset(varied, pipeline("v1", "train"))
    kw = {"persistent_workers": True}
    _, ref, _ = epochs(torch.utils.data.DataLoader, dataset, 2, n_epochs=3, **kw)
    _, got, _ = epochs(DataLoader, dataset, 2, n_epochs=3, **kw)
    assert_identical(ref, got)


def test_fast_within_tolerance(varied):
    dataset = folder_dataset(
        varied, T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])
    )
    _, ref, after_ref = epochs(torch.utils.data.DataLoader, dataset, 0, n_epochs=2)
    loader, got, after_got = epochs(DataLoader, dataset, 0, n_epochs=2, images="fast")
    assert torch.equal(after_ref, after_got)  # the same draws: the same crops and flips
    assert max(per_image_differences(ref, got)) <= 2 / 255
    assert loader.stats()["images"]["active"] and loader.stats()["images"]["mode"] == "fast"


def per_image_differences(ref, got) -> list[float]:
    """The mean absolute difference of each image of two loaders' epochs."""
    out = []
    for epoch_ref, epoch_got in zip(ref, got, strict=True):
        for (x0, y0), (x1, y1) in zip(epoch_ref, epoch_got, strict=True):
            assert torch.equal(y0, y1)
            out += (x0 - x1).abs().mean(dim=(1, 2, 3)).tolist()
    return out


def test_fast_decodes_reduced_from_one_and_a_half_times(tmp_path, monkeypatch):
    """Crops 1.5-1.6 times the output on both sides are decoded at 1/2 scale and resampled
    from their fractional edges: within the tolerance, the same crops and flips."""
    from shmloader.vision import region

    rng = np.random.default_rng(5)
    for i in range(12):
        folder = tmp_path / f"class{i % 2}"
        folder.mkdir(exist_ok=True)
        Image.fromarray(synth_image(rng, 375, 500, i % 3)).save(folder / f"img{i:02d}.jpg", quality=90)
    # sides of 342-361 px: 1.53-1.61 times 224
    crop = T.RandomResizedCrop(224, scale=(0.64, 0.68), ratio=(0.98, 1.02))
    dataset = datasets.ImageFolder(str(tmp_path), T.Compose([crop, T.RandomHorizontalFlip(), T.ToTensor()]))
    factors = []
    decode = region.RegionDecoder.decode

    def spy(self, data, factor, *args, **kwargs):
        factors.append(factor)
        return decode(self, data, factor, *args, **kwargs)

    monkeypatch.setattr(region.RegionDecoder, "decode", spy)
    _, ref, after_ref = epochs(torch.utils.data.DataLoader, dataset, 0, n_epochs=2)
    assert factors == []  # torch's own code decodes with Pillow
    _, got, after_got = epochs(DataLoader, dataset, 0, n_epochs=2, images="fast")
    if region.decoder() is None or resampler() is None:
        pytest.skip("the C helper (shmloader._jpeg) or its libjpeg-turbo is not available here")
    assert torch.equal(after_ref, after_got)
    assert factors == [2] * 24
    diffs = per_image_differences(ref, got)
    assert max(diffs) <= 2 / 255 and min(diffs) > 0  # not the full-scale path's pixels


def test_unrecognized_op_runs_as_written(varied):
    tf = T.Compose([T.RandomResizedCrop(224), T.ColorJitter(0.4, 0.4), T.ToTensor()])
    dataset = folder_dataset(varied, tf)
    _, ref, _ = epochs(torch.utils.data.DataLoader, dataset, 0)
    loader, got, _ = epochs(DataLoader, dataset, 0)
    assert_identical(ref, got)
    images = loader.stats()["images"]
    assert not images["active"] and "ColorJitter" in images["reason"]
    assert images["fused"] == images["fell_back"] == 0


class SubFolder(datasets.ImageFolder):
    def __getitem__(self, index):
        image, target = super().__getitem__(index)
        return image, target + 10


def test_subclass_and_target_transform_run_as_written(varied):
    for dataset, needle in (
        (SubFolder(str(varied), pipeline("v1", "train"), is_valid_file=lambda p: True), "SubFolder"),
        (
            datasets.ImageFolder(
                str(varied), pipeline("v1", "train"), target_transform=abs, is_valid_file=lambda p: True
            ),
            "target_transform",
        ),
    ):
        _, ref, _ = epochs(torch.utils.data.DataLoader, dataset, 0)
        loader, got, _ = epochs(DataLoader, dataset, 0)
        assert_identical(ref, got)
        images = loader.stats()["images"]
        assert not images["active"] and needle in images["reason"], images["reason"]


@pytest.mark.parametrize(
    "ops, needle",
    [
        ([T.RandomResizedCrop(224)], "op to a tensor"),
        ([T.Resize(64), T.ToTensor()], "output size depends"),
        ([T.ToTensor(), T.RandomHorizontalFlip()], "runs on the tensor"),
        ([T.Grayscale(3), T.ToTensor()], "Grayscale"),
    ],
)
def test_reasons(varied, ops, needle):
    loader = DataLoader(folder_dataset(varied, T.Compose(ops)), batch_size=5)
    images = loader.stats()["images"]  # said before the first epoch
    assert not images["active"] and needle in images["reason"], images["reason"]
    fused = DataLoader(folder_dataset(varied, pipeline("v1", "eval")), batch_size=5).stats()["images"]
    assert fused["active"] and fused["reason"] is None and fused["fused"] == 0


def test_python_and_collate_fn_never_fuse(varied):
    dataset = folder_dataset(varied, pipeline("v2", "train"))
    _, ref, _ = epochs(torch.utils.data.DataLoader, dataset, 0)
    loader, got, _ = epochs(DataLoader, dataset, 0, images="python")
    assert_identical(ref, got)
    images = loader.stats()["images"]
    assert (images["mode"], images["active"], images["fused"]) == ("python", False, 0)
    assert "python" in images["reason"]
    loader = DataLoader(dataset, batch_size=5, collate_fn=lambda batch: len(batch))
    assert list(loader)[:1] == [5]
    images = loader.stats()["images"]
    assert not images["active"] and "collate_fn" in images["reason"]


def test_bad_images_value():
    with pytest.raises(ValueError, match=r"images should be one of 'auto', 'fast', 'python' \(got 'turbo'\)"):
        DataLoader(list(range(4)), images="turbo")


def test_resampler_matches_pillow():
    checked = resampler()
    if checked is None:
        pytest.skip("the C helper (shmloader._jpeg) is not built here")
    rng = np.random.default_rng(3)
    for i in range(300):
        w, h = (int(v) for v in rng.integers(1, 700, 2))
        ow, oh = (max(w - 5, 1), max(h // 4, 1)) if i % 4 == 0 else (int(v) for v in rng.integers(1, 400, 2))
        src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(src).resize((ow, oh), Image.BILINEAR))
        got = np.empty_like(want)
        checked.resize(src, got)
        assert np.array_equal(got, want), (w, h, ow, oh)


def test_resampler_box_matches_pillow():
    """The fractional-box resize images="fast" resamples reduced-scale boxes with is
    Pillow's ``resize(box=...)``, bit for bit."""
    checked = resampler()
    if checked is None:
        pytest.skip("the C helper (shmloader._jpeg) is not built here")
    rng = np.random.default_rng(4)
    for _ in range(300):
        w, h = (int(v) for v in rng.integers(2, 400, 2))
        x0, y0 = rng.uniform(0, w / 3), rng.uniform(0, h / 3)
        box = (x0, y0, rng.uniform(x0 + 1, w), rng.uniform(y0 + 1, h))
        ow, oh = (int(v) for v in rng.integers(1, 300, 2))
        src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(src).resize((ow, oh), Image.BILINEAR, box=box))
        got = np.empty_like(want)
        checked.resize_box(src, box, got)
        assert np.array_equal(got, want), (w, h, box, ow, oh)


@pytest.mark.parametrize("api", ["v1", "v2"])
def test_crop_draw_is_torchvisions(api):
    """The fused path's box and coin are the ops' own draws, the generator's state after
    them included, on sizes and arguments that take every branch; a draw that differs from
    the op's is refused, and the check leaves the generator as it found it."""
    from shmloader.vision import crop_draw, jpeg_header

    ns = T if api == "v1" else v2

    def own_box(op, width, height):
        img = jpeg_header.header_image((width, height), "RGB")
        if api == "v1":
            return op.get_params(img, op.scale, op.ratio)
        params = op.make_params([img])
        return params["top"], params["left"], params["height"], params["width"]

    def own_flip(op):
        return bool(torch.rand(1) < op.p)

    crops = [ns.RandomResizedCrop(224), ns.RandomResizedCrop(64, scale=(0.5, 0.55), ratio=(0.2, 5.0))]
    crops.append(ns.RandomResizedCrop(32, scale=(0.95, 1.0), ratio=(3.0, 4.0)))  # tries fail: fallbacks
    for crop in crops:
        for flip in (ns.RandomHorizontalFlip(), ns.RandomHorizontalFlip(0.3), None):
            before = torch.get_rng_state()
            draw = crop_draw.checked_draw(crop, flip, own_box, own_flip)
            assert draw is not None and torch.equal(before, torch.get_rng_state())
            for seed in range(8):
                for size in ((500, 375), (640, 427), (20, 900), (900, 20), (2, 3)):
                    torch.manual_seed(seed)
                    want = own_box(crop, *size), flip is not None and own_flip(flip)
                    after = torch.rand(1)
                    torch.manual_seed(seed)
                    assert (draw.box(*size), draw.flip()) == want
                    assert torch.equal(torch.rand(1), after)

    def one_more_draw(op, width, height):
        torch.rand(1)
        return own_box(op, width, height)

    before = torch.get_rng_state()
    assert crop_draw.checked_draw(crops[0], None, one_more_draw, own_flip) is None
    assert torch.equal(before, torch.get_rng_state())


def test_crop_draw_check_seeds_only_the_cpu_generator(monkeypatch):
    """The check must not reseed the accelerators' generators (torch.manual_seed would),
    which a training run on a GPU draws from."""
    from shmloader.vision import crop_draw

    def reseeds_everything(seed):
        raise AssertionError("torch.manual_seed called by the check")

    monkeypatch.setattr(torch, "manual_seed", reseeds_everything)
    crop = T.RandomResizedCrop(224)
    draw = crop_draw.checked_draw(
        crop, None, lambda op, w, h: op.get_params(Image.new("L", (w, h)), op.scale, op.ratio), None
    )
    assert draw is not None


def test_without_torchvision_nothing_changes():
    code = (
        "import sys; sys.modules['torchvision'] = None\n"
        "from shmloader import DataLoader\n"
        "loader = DataLoader(list(range(10)), batch_size=4, output='numpy')\n"
        "assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]\n"
        "images = loader.stats()['images']\n"
        "assert images['active'] is False and 'not a torchvision dataset' in images['reason'], images\n"
        "assert 'torchvision' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_doctor_says_the_same(varied, tmp_path, monkeypatch):
    from shmloader import doctor

    good = doctor.check_dataset_images(folder_dataset(varied, pipeline("v2", "train")))
    assert good.status == doctor.OK and "runs it fused" in good.detail
    # CMYK, PNG and GIF files: 12 of the 27
    assert "12 of the first 27 files go through torchvision's code" in good.detail
    jitter = T.Compose([T.RandomResizedCrop(224), T.ColorJitter(0.4), T.ToTensor()])
    bad = doctor.check_dataset_images(folder_dataset(varied, jitter))
    assert bad.status == doctor.WARN and "ColorJitter" in bad.detail
    other = doctor.check_dataset_images(list(range(3)))
    assert other.status == doctor.OK and "does not apply" in other.detail


def test_transform_changed_between_epochs(varied):
    """A transform swapped on the dataset (train, then eval) is what the next epoch runs."""
    dataset = folder_dataset(varied, pipeline("v1", "train"))
    results = []
    for loader_cls in (torch.utils.data.DataLoader, DataLoader):
        dataset.transform = pipeline("v1", "train")
        torch.manual_seed(5)
        loader = loader_cls(dataset, batch_size=5, shuffle=True, num_workers=0)
        first = [x.clone() for x, _ in loader]
        dataset.transform = pipeline("v1", "eval")
        second = [x.clone() for x, _ in loader]
        results.append((first, second))
    for ref, got in zip(results[0], results[1]):
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    images = loader.stats()["images"]
    assert images["active"] and images["fused"] == 30 and images["fell_back"] == 24


def test_spawned_workers(varied):
    dataset = folder_dataset(varied, pipeline("v2", "train"))
    kw = {"multiprocessing_context": "spawn"}
    _, ref, _ = epochs(torch.utils.data.DataLoader, dataset, 2, **kw)
    loader, got, _ = epochs(DataLoader, dataset, 2, **kw)
    assert_identical(ref, got)
    assert loader.stats()["images"]["fused"] == 15


def _init_sees_the_dataset(worker_id):
    info = torch.utils.data.get_worker_info()
    assert type(info.dataset) is datasets.ImageFolder, type(info.dataset)


def test_workers_see_the_users_dataset(varied):
    dataset = folder_dataset(varied, pipeline("v1", "train"))
    loader = DataLoader(dataset, batch_size=9, num_workers=2, worker_init_fn=_init_sees_the_dataset)
    assert sum(len(y) for _, y in loader) == 27
    assert loader.stats()["images"]["active"]
