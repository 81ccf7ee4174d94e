"""Iterate an image folder as a training loop would, and print images/s.

    shmloader make-images /tmp/images --count 2000      # or: --make 2000 below
    python examples/image_folder.py /tmp/images --workers 2 --batch-size 64

Each batch is ``images`` (uint8, (B, 224, 224, 3), a view of the loader's shared ring)
and ``labels`` (int64): move them to the accelerator and normalize there.
"""

from __future__ import annotations

import argparse
import os
import time

from shmloader import DataLoader
from shmloader.vision import (
    ImageFolder,
    RandomHorizontalFlip,
    RandomResizedCrop,
    ToCHW,
    make_images,
)


def progress(iterable, total):
    """tqdm when installed, else a plain line every 10 batches."""
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, unit="batch")
    except ImportError:

        def plain():
            for n, item in enumerate(iterable, 1):
                if n % 10 == 0 or n == total:
                    print(f"  batch {n}/{total}", flush=True)
                yield item

        return plain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", help="image folder: root/<class>/<image>")
    parser.add_argument(
        "--make", type=int, metavar="N", help="first write N synthetic JPEGs there if it is missing"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--size", type=int, default=224, help="crop size (default 224)")
    parser.add_argument("--chw", action="store_true", help="channels-first output")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.make and not os.path.isdir(args.root):
        print(f"writing {args.make} synthetic JPEGs under {args.root} ...")
        make_images(args.root, args.make)
    transform = [RandomResizedCrop(args.size), RandomHorizontalFlip()] + ([ToCHW()] if args.chw else [])
    dataset = ImageFolder(args.root, transform, on_error="skip")
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        seed=args.seed,
    )
    print(f"{dataset}\n{len(loader)} batches of {args.batch_size} per epoch, {args.workers} workers")
    for epoch in range(args.epochs):
        images_seen = 0
        start = time.perf_counter()
        for images, labels in progress(loader, len(loader)):  # noqa: B007 (used below)
            images_seen += len(labels)  # a training step would go here
        elapsed = time.perf_counter() - start
        print(
            f"epoch {epoch}: {images_seen} images in {elapsed:.2f} s: {images_seen / elapsed:,.0f} images/s"
        )
        print(
            f"  last batch: images {images.dtype}{tuple(images.shape)}, "
            f"labels {labels.dtype}{tuple(labels.shape)}"
        )
    loader.shutdown()


if __name__ == "__main__":
    main()
