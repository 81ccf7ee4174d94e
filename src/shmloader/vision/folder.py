"""ImageFolder: image files and int64 labels, decoded and transformed into the slot."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shmloader.batch.writeinto import ArraySpec
from shmloader.sampling.rng import epoch_seed, sample_rng  # noqa: F401 - re-exported by shmloader.vision
from shmloader.vision.decode import Decoder, ImageDecodeError, dct_factor
from shmloader.vision.region import decoder as region_decoder
from shmloader.vision.region import region_bounds
from shmloader.vision.resample import flip_inplace, int_box, resample_into, resolve_backend
from shmloader.vision.transforms import Compose, Plan, Transform

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
ON_ERROR = ("raise", "skip")
_MAX_SKIPS_IN_A_ROW = 32  # on_error="skip": give up after this many unreadable files in a row


def find_classes(root: str | os.PathLike) -> tuple[list[str], dict[str, int]]:
    """Sorted class folder names under ``root`` and their indices (torchvision's rule)."""
    try:
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    except FileNotFoundError:
        raise FileNotFoundError(f"image folder {os.fspath(root)!r} does not exist.") from None
    if not classes:
        raise FileNotFoundError(
            f"no class folder in {os.fspath(root)!r}: ImageFolder expects root/<class>/<image> "
            "(use ImageFolder.from_files for a flat list of files and labels)."
        )
    return classes, {name: i for i, name in enumerate(classes)}


class ImageFolder:
    """Images in class-per-subfolder layout (``root/<class>/**/<file>``), as torchvision's
    ``ImageFolder``, or a flat list of (path, label) (:meth:`from_files`).

    Sample ``i`` is ``(image, label)``: ``image`` a numpy array shaped by ``transform``
    (a :class:`~shmloader.vision.transforms.Compose` or a list of transforms; default
    none: the whole image, HxWx3 uint8) and ``label`` an ``np.int64``. ``__getitem__``
    works with any loader (torch's included); with a fixed output size (the pipeline
    ends in a crop or a sized resize) the dataset also implements the write-into
    protocol, so shmloader's workers decode and resample straight into the batch slot.

    ``on_error``: ``"raise"`` (default) raises :class:`ImageDecodeError` naming the file
    that cannot be decoded; ``"skip"`` replaces it with the next readable sample, warns
    once per process and counts it in :attr:`skipped`. ``backend``: the resampler
    (``"auto"``: torch's vectorized kernel when torch is installed, else Pillow).
    ``dct_scaling``: let libjpeg-turbo decode JPEGs at 1/2, 1/4 or 1/8 size when the
    output is that much smaller than the crop. ``fast_decode`` (default True): decode
    JPEGs with libjpeg-turbo's fast integer IDCT (about 4% less decoding time; pixels
    within about one level of the accurate decode on average and a few levels at most
    at usual qualities, more above quality 95); False gives exactly libjpeg-turbo's
    accurate decode (as Pillow's). ``fast_upsample`` (default False): replicate
    subsampled chroma instead of interpolating it (about 7% less decoding time on 4:2:0
    JPEGs, but errors of tens of levels at sharp colour edges: beyond JPEG decoding
    tolerance, hence opt-in). ``region_decode`` (default True): decode only the rows and
    MCU columns of a JPEG that the crop (plus the resampling filter's reach) needs
    (libjpeg-turbo's ``jpeg_skip_scanlines``/``jpeg_crop_scanline``, combined with the
    DCT scaling): the same pixels as a full decode, for less work (see
    :mod:`shmloader.vision.region`). JPEGs it does not apply to (CMYK/YCCK, corrupt
    data, or no usable libjpeg-turbo) are decoded whole and counted in
    :meth:`stats` (``region_fallbacks``; ``region_decodes`` counts the others), which the
    loader sums over its workers (``DataLoader.stats()["dataset"]``, through
    :meth:`shmloader_stats`).

    Randomness (random crops, flips) comes from a generator per sample derived from the
    loader's epoch seed and the sample index: a seeded loader gives the same batches for
    any ``num_workers``.
    """

    def __init__(
        self,
        root: str | os.PathLike | None,
        transform: Compose | Sequence[Any] | None = None,
        *,
        extensions: Sequence[str] = IMG_EXTENSIONS,
        is_valid_file: Callable[[str], bool] | None = None,
        on_error: str = "raise",
        backend: str = "auto",
        dct_scaling: bool = True,
        fast_decode: bool = True,
        fast_upsample: bool = False,
        region_decode: bool = True,
        samples: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}.")
        if transform is None:
            transform = Compose([])
        elif not isinstance(transform, Compose):
            transform = Compose([transform] if isinstance(transform, Transform) else transform)
        self.transform = transform
        self.on_error = on_error
        self.backend = resolve_backend(backend)
        self.dct_scaling = dct_scaling
        self.fast_decode = bool(fast_decode)
        self.fast_upsample = bool(fast_upsample)
        self.region_decode = bool(region_decode)
        if self.region_decode:
            region_decoder()  # bind it here, once: forked workers inherit the binding
        self.root = None if root is None else os.fspath(root)
        if samples is not None:
            self.samples = [(os.fspath(p), int(label)) for p, label in samples]
            self.classes = sorted({label for _, label in self.samples})
            self.class_to_idx = {str(c): c for c in self.classes}
        else:
            if root is None:
                raise ValueError("give ImageFolder a root folder, or use ImageFolder.from_files.")
            self.classes, self.class_to_idx = find_classes(root)
            self.samples = self._scan(extensions, is_valid_file)
        self.targets = np.array([label for _, label in self.samples], np.int64)
        self.skipped = 0  # files replaced under on_error="skip", in this process
        self.region_decodes = 0  # JPEGs decoded only where the crop needs, in this process
        self.region_fallbacks = 0  # JPEGs it did not apply to, decoded whole instead
        self._warned_pid = 0
        self._decoder = Decoder(fast_dct=self.fast_decode, fast_upsample=self.fast_upsample)
        self._scratch: dict[tuple[int, ...], np.ndarray] = {}

    @classmethod
    def from_files(
        cls,
        paths: Sequence[str | os.PathLike],
        labels: Sequence[int],
        transform: Any = None,
        **kwargs: Any,
    ) -> ImageFolder:
        """A dataset over a flat list of files and their integer labels."""
        if len(paths) != len(labels):
            raise ValueError(f"got {len(paths)} paths but {len(labels)} labels; give one label per file.")
        return cls(None, transform, samples=list(zip(paths, labels, strict=False)), **kwargs)

    def _scan(self, extensions: Sequence[str], is_valid_file: Callable[[str], bool] | None) -> list:
        exts = tuple(e.lower() for e in extensions)
        valid = is_valid_file or (lambda p: p.lower().endswith(exts))
        samples = []
        for name in self.classes:
            label = self.class_to_idx[name]
            folder = os.path.join(self.root, name)
            for dirpath, _, files in sorted(os.walk(folder, followlinks=True)):
                samples.extend(
                    (os.path.join(dirpath, f), label)
                    for f in sorted(files)
                    if valid(os.path.join(dirpath, f))
                )
        if not samples:
            raise FileNotFoundError(
                f"no image files with extensions {list(exts)} under the class folders of {self.root!r}."
            )
        return samples

    def stats(self) -> dict[str, int]:
        """Counters of this process's copy of the dataset (for the loader's statistics):
        ``skipped`` (unreadable files replaced under ``on_error="skip"``),
        ``region_decodes`` (JPEGs decoded only where the crop needs) and
        ``region_fallbacks`` (JPEGs the region decode did not apply to, decoded whole:
        CMYK/YCCK, corrupt data, no usable libjpeg-turbo; see
        :func:`shmloader.vision.region.unavailable_reason`)."""
        return {
            "skipped": self.skipped,
            "region_decodes": self.region_decodes,
            "region_fallbacks": self.region_fallbacks,
        }

    def shmloader_stats(self) -> dict[str, int]:
        """:meth:`stats`, under the name the loader reads (summed over its workers into
        ``DataLoader.stats()["dataset"]``)."""
        return self.stats()

    @property
    def imgs(self) -> list[tuple[str, int]]:
        return self.samples

    def __len__(self) -> int:
        return len(self.samples)

    def __repr__(self) -> str:
        where = f"root={self.root!r}" if self.root is not None else "files"
        n, k = len(self), len(self.classes)
        return f"ImageFolder({where}, {n} images, {k} classes, {self.transform!r})"

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_scratch"] = {}
        return state

    # --- the two ways to get a sample ----------------------------------------------------

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        image, label = self._load(index, None)
        return image, np.int64(label)

    @property
    def sample_spec(self) -> Callable[[], Any]:
        """Write-into protocol (only with a fixed output size): the sample's arrays."""
        size = self.transform.fixed_size
        if size is None:
            raise AttributeError("sample_spec needs a transform with a fixed output size")

        def spec() -> tuple[ArraySpec, ArraySpec]:
            shape = self.transform.output_shape(*size)
            return ArraySpec(shape, self.transform.dtype), ArraySpec((), np.int64)

        return spec

    @property
    def write_sample(self) -> Callable[[Any, Any], None]:
        """Write-into protocol: decode and resample sample ``index`` into ``out``."""
        if self.transform.fixed_size is None:
            raise AttributeError("write_sample needs a transform with a fixed output size")

        def write(index: Any, out: Any) -> None:
            image, label = out
            _, label_value = self._load(index, image)
            label[...] = label_value

        return write

    # --- loading ------------------------------------------------------------------------

    def _load(self, index: Any, dst: np.ndarray | None) -> tuple[np.ndarray, int]:
        n = len(self.samples)
        index = int(index)
        if not -n <= index < n:
            raise IndexError(f"sample index {index} out of range for {n} images.")
        index %= n
        for _ in range(min(n, _MAX_SKIPS_IN_A_ROW)):
            try:
                return self._render(index, dst), self.samples[index][1]
            except ImageDecodeError as exc:
                if self.on_error == "raise":
                    raise
                self._note_skip(exc)
                index = (index + 1) % n
        raise ImageDecodeError(
            f"{min(n, _MAX_SKIPS_IN_A_ROW)} images in a row could not be decoded (the last: "
            f"{self.samples[(index - 1) % n][0]!r}); is this an image folder?",
            self.samples[(index - 1) % n][0],
        )

    def _note_skip(self, exc: ImageDecodeError) -> None:
        self.skipped += 1
        if self._warned_pid != os.getpid():
            self._warned_pid = os.getpid()
            warnings.warn(
                "ImageFolder skipped an unreadable image and used another sample in its place: "
                f"{exc} "
                "(warned once per process; the dataset's `skipped` counts them).",
                RuntimeWarning,
                stacklevel=4,
            )

    def _render(self, index: int, dst: np.ndarray | None) -> np.ndarray:
        path = self.samples[index][0]
        transform = self.transform
        try:
            with open(path, "rb", buffering=0) as f:  # unbuffered: one read of the whole file
                data = f.readall()
            probe = self._decoder.probe(data)
        except Exception as exc:
            raise _decode_error(path, index, exc) from exc
        rng = sample_rng(index) if transform.random else None
        plan = transform.plan(probe.width, probe.height, rng)
        shape = transform.output_shape(*plan.out_size)
        if dst is None:
            dst = np.empty(shape, transform.dtype)
        elif dst.shape != shape:
            raise ValueError(f"output view has shape {dst.shape}, the transform gives {shape}.")
        target = dst if transform.normalize is None else self._uint8_scratch(shape)
        try:
            self._draw(probe, plan, target)
        except ImageDecodeError:
            raise
        except Exception as exc:
            if isinstance(exc, (MemoryError, KeyboardInterrupt)):
                raise
            raise _decode_error(path, index, exc) from exc
        if transform.normalize is not None:
            _normalize_into(target, dst, transform.normalize, transform.chw)
        return dst

    def _uint8_scratch(self, shape: tuple[int, ...]) -> np.ndarray:
        buf = self._scratch.get(shape)
        if buf is None:
            buf = self._scratch[shape] = np.empty(shape, np.uint8)
        return buf

    def _draw(self, probe: Any, plan: Plan, target: np.ndarray) -> None:
        """Decode and resample one image into ``target`` (uint8, the output's shape)."""
        chw = self.transform.chw
        oh, ow = plan.out_size
        x0, y0, x1, y1 = plan.content
        full = (x0, y0, x1, y1) == (0, 0, ow, oh)
        if not full:
            target[...] = 0  # padding (a crop larger than the image)
        if x1 <= x0 or y1 <= y0:
            return
        view = target[:, y0:y1, x0:x1] if chw else target[y0:y1, x0:x1]
        bx0, by0, bx1, by1 = plan.box
        whole = (bx0, by0, bx1, by1) == (0.0, 0.0, float(probe.width), float(probe.height))
        if (
            probe.jpeg
            and full
            and whole
            and not chw
            and (oh, ow) == (probe.height, probe.width)
            and target.flags.c_contiguous
        ):
            # Nothing to resample: libjpeg-turbo decodes straight into the output.
            self._decoder.decode(probe, 1, buffer=target)
            if plan.flip:
                flip_inplace(target, chw, self.backend)
            return
        factor = 1
        if self.dct_scaling:
            factor = dct_factor(probe.width, probe.height, bx1 - bx0, by1 - by0, x1 - x0, y1 - y0)
        if self.region_decode and self._draw_region(probe, factor, plan.box, view, plan.flip):
            return
        image = self._decoder.decode(probe, factor)
        sx, sy = image.shape[1] / probe.width, image.shape[0] / probe.height
        resample_into(image, (bx0 * sx, by0 * sy, bx1 * sx, by1 * sy), view, chw, plan.flip, self.backend)

    def _draw_region(
        self, probe: Any, factor: int, box: tuple[float, float, float, float], view: np.ndarray, flip: bool
    ) -> bool:
        """Decode only the part of the JPEG that resampling ``box`` reads, and resample it
        into ``view``; False when the image must be decoded whole (counted as a fallback
        where the region decode did not apply)."""
        if not probe.jpeg:
            if getattr(probe.pil, "format", None) == "JPEG":
                self.region_fallbacks += 1  # CMYK/YCCK: Pillow decodes those
            return False
        chw = self.transform.chw
        oh, ow = view.shape[1:] if chw else view.shape[:2]
        # The scaled image's size: libjpeg's (and simplejpeg's) ceil(size / factor).
        sw, sh = -(-probe.width // factor), -(-probe.height // factor)
        sx, sy = sw / probe.width, sh / probe.height
        sbox = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        keep = None
        if self.backend == "torch":
            # torch resamples exactly the whole-pixel box: decode it (and one more column
            # each side, chroma upsampling's edge), keep exactly its columns, contiguous.
            kx0, ky0, kx1, ky1 = int_box(sbox, sw, sh)
            bounds, keep = (max(kx0 - 1, 0), ky0, min(kx1 + 1, sw), ky1), (kx0, kx1)
        else:
            bounds = region_bounds(sbox, ow, oh, sw, sh)
        if bounds == (0, 0, sw, sh):
            return False  # the crop needs all of it: the whole-image decode, as before
        got = self._decoder.decode_region(probe, factor, bounds, keep)
        if got is None:
            self.region_fallbacks += 1
            return False
        pixels, left, top, full_w, full_h = got
        if (full_w, full_h) != (sw, sh):  # not expected: a library that scales otherwise
            self.region_fallbacks += 1
            return False
        if keep is not None and (left, pixels.shape[1]) == (keep[0], keep[1] - keep[0]):
            local = (0.0, 0.0, float(pixels.shape[1]), float(pixels.shape[0]))  # exactly the box
        else:
            local = (sbox[0] - left, sbox[1] - top, sbox[2] - left, sbox[3] - top)
        resample_into(pixels, local, view, chw, flip, self.backend)
        self.region_decodes += 1
        return True


def _decode_error(path: str, index: int, exc: BaseException) -> ImageDecodeError:
    return ImageDecodeError(
        f"cannot decode image file {path!r} (sample {index}): {type(exc).__name__}: {exc}. "
        "The file is "
        "missing, corrupt, truncated or not an image: replace or remove it, or pass "
        "on_error='skip' to ImageFolder to load another sample in its place.",
        path,
    )


def _normalize_into(src: np.ndarray, dst: np.ndarray, norm: Any, chw: bool) -> None:
    scale = 1.0 / (255.0 * norm.std)
    shift = -norm.mean / norm.std
    if chw:
        scale, shift = scale[:, None, None], shift[:, None, None]
    np.multiply(src, scale, out=dst, casting="unsafe")
    np.add(dst, shift, out=dst)
