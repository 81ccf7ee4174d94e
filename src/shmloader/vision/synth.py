"""Synthetic JPEG datasets for demos, benchmarks and tests.

Images look like photographs to a JPEG codec: smooth colour gradients, blurred blobs,
low-frequency texture and a little sensor-like noise, so files compress (and decode)
like real photos rather than flat colour. Sizes vary around 300-500 px, or are fixed
(``size=(500, 375)``: ImageNet's median; ``(1200, 800)``: a camera photo scaled down).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

_DEFAULT_CLASSES = 4


def _field(rng: np.random.Generator, cells: int, height: int, width: int) -> np.ndarray:
    """Smooth random RGB texture: a ``cells`` x ``cells`` grid of noise, bicubic-upscaled."""
    from PIL import Image

    small = rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), dtype=np.int16) - 128


def synth_image(rng: np.random.Generator, height: int, width: int, label: int = 0) -> np.ndarray:
    """One photographic-looking RGB uint8 image of the given size (needs Pillow)."""
    from PIL import Image, ImageDraw, ImageFilter

    # Background: a colour gradient with cloud-like texture at three scales.
    corners = rng.integers(30, 226, (2, 2, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(corners).resize((width, height), Image.BILINEAR), dtype=np.int16)
    img = img + (_field(rng, 5, height, width) * 3) // 8
    img += _field(rng, 30, height, width) // 4
    img += _field(rng, 120, height, width) // 8
    canvas = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    # Objects: shapes with hard and soft edges, their colour tied to the class a little.
    draw = ImageDraw.Draw(canvas)
    hue = np.array([(label * 97) % 256, (label * 57) % 256, (label * 151) % 256])
    for _ in range(int(rng.integers(3, 8))):
        colour = tuple(int(c) for c in np.clip(hue + rng.normal(0, 40, 3), 0, 255))
        x0, x1 = sorted(rng.uniform(-0.1, 1.1, 2) * width)
        y0, y1 = sorted(rng.uniform(-0.1, 1.1, 2) * height)
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1 + 4, y1 + 4), fill=colour)
        else:
            pts = [(float(x), float(y)) for x, y in rng.uniform(0, 1, (5, 2)) * (width, height)]
            draw.polygon(pts, fill=colour)
    canvas = canvas.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 2.0))))
    out = np.asarray(canvas, dtype=np.int16) + _field(rng, 60, height, width) // 5
    out += rng.integers(-6, 7, out.shape, dtype=np.int16)  # sensor noise
    return np.clip(out, 0, 255).astype(np.uint8)


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    """JPEG bytes of an RGB uint8 image (simplejpeg when installed, else Pillow)."""
    try:
        import simplejpeg

        return simplejpeg.encode_jpeg(np.ascontiguousarray(image), quality=quality, colorsubsampling="420")
    except ImportError:
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=quality)
        return buf.getvalue()


def make_images(
    root: str | os.PathLike,
    count: int,
    *,
    classes: int = _DEFAULT_CLASSES,
    min_size: int = 300,
    max_size: int = 500,
    quality: int = 90,
    seed: int = 0,
    size: tuple[int, int] | None = None,
) -> Path:
    """Write ``count`` synthetic JPEGs under ``root/class_XX/NNNNNN.jpg``.

    Sides are drawn uniformly in ``[min_size, max_size]``, or every image is ``size``
    (width, height) when given; the same arguments always give the same files. Existing
    files of the same name are overwritten. Returns ``root``.
    """
    if count < 1 or classes < 1:
        raise ValueError(f"count and classes must be positive (got count={count}, classes={classes}).")
    if size is not None:
        if len(size) != 2 or min(size) < 8:
            raise ValueError(f"size must be (width, height) of at least 8 px each, got {size!r}.")
    elif not 8 <= min_size <= max_size:
        raise ValueError(f"need 8 <= min_size <= max_size (got {min_size}, {max_size}).")
    root = Path(root)
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        label = i % classes
        if size is None:
            h, w = (int(v) for v in rng.integers(min_size, max_size + 1, 2))
        else:
            w, h = int(size[0]), int(size[1])
        data = encode_jpeg(synth_image(rng, h, w, label), quality)
        (root / f"class_{label:02d}" / f"{i:06d}.jpg").write_bytes(data)
    return root


def parse_size(text: str) -> tuple[int, int]:
    """``"500x375"`` -> ``(500, 375)`` (width, height)."""
    import argparse

    parts = text.lower().replace("\u00d7", "x").split("x")  # the multiplication sign too
    try:
        w, h = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--size wants WIDTHxHEIGHT in pixels, e.g. 500x375, got {text!r}."
        ) from None
    if min(w, h) < 8:
        raise argparse.ArgumentTypeError(f"--size must be at least 8x8 px, got {text!r}.")
    return w, h


def main(argv: list[str] | None = None) -> int:
    """``shmloader make-images DIR --count N [--size WxH]``: write a synthetic JPEG dataset."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="shmloader make-images",
        description="Write a synthetic JPEG image folder (class-per-subfolder) for demos and benchmarks.",
    )
    parser.add_argument("dir", help="folder to write into (created if missing)")
    parser.add_argument("--count", type=int, default=1000, help="number of images (default 1000)")
    parser.add_argument("--classes", type=int, default=_DEFAULT_CLASSES, help="number of class folders")
    parser.add_argument("--min-size", type=int, default=300, help="smallest side in px (default 300)")
    parser.add_argument("--max-size", type=int, default=500, help="largest side in px (default 500)")
    parser.add_argument(
        "--size",
        type=parse_size,
        default=None,
        metavar="WxH",
        help="every image this size instead (e.g. 500x375, ImageNet's median; 1200x800, a camera photo)",
    )
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    try:
        make_images(
            args.dir,
            args.count,
            classes=args.classes,
            min_size=args.min_size,
            max_size=args.max_size,
            quality=args.quality,
            seed=args.seed,
            size=args.size,
        )
    except ValueError as exc:
        parser.error(str(exc))
    sizes = f"{args.size[0]}x{args.size[1]}" if args.size else f"{args.min_size}-{args.max_size} px"
    print(f"wrote {args.count} JPEGs in {args.classes} classes under {args.dir} ({sizes})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
