"""Image pipelines that decode and transform straight into the loader's slots.

``ImageFolder`` reads JPEG (libjpeg-turbo: only the rows and MCU columns the crop
needs, see :mod:`shmloader.vision.region`, with DCT-domain downscaling) and anything
Pillow opens, applies the transforms of :mod:`shmloader.vision.transforms` as one
resample per image, and writes the result into its row of the batch slot (the write-into
protocol). Needs the ``vision`` extra: ``pip install "shmloader[vision]"``.
"""

from shmloader.vision.decode import Decoder, ImageDecodeError
from shmloader.vision.folder import IMG_EXTENSIONS, ImageFolder, epoch_seed, sample_rng
from shmloader.vision.synth import make_images
from shmloader.vision.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Compose,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToCHW,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMG_EXTENSIONS",
    "CenterCrop",
    "Compose",
    "Decoder",
    "ImageDecodeError",
    "ImageFolder",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "ToCHW",
    "epoch_seed",
    "make_images",
    "sample_rng",
]
