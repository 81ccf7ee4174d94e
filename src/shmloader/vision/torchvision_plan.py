"""Which torchvision image-folder pipelines the loader can run fused, and how.

``DataLoader(images="auto")`` asks :func:`recognize` about its dataset once. A plan is
made only where every sample can come out bit-identical to torchvision's own
``dataset[index]`` followed by torch's ``default_collate``:

- the dataset is exactly torchvision's ``ImageFolder`` or ``DatasetFolder`` (not a
  subclass: it may change ``__getitem__``), with torchvision's PIL loader
  (``default_loader`` under the PIL image backend, or ``pil_loader``), no
  ``target_transform`` and integer targets;
- its ``transform`` is exactly a ``transforms.Compose`` or a ``transforms.v2.Compose``
  (the ops of one API) of: geometric ops on the PIL image (``Resize``, ``CenterCrop``,
  ``RandomResizedCrop``, ``RandomHorizontalFlip``, any arguments), then one op to a
  tensor (``ToTensor``, ``PILToTensor``; v2 also ``ToImage``), then per-value ops
  (``Normalize``, v2's ``ToDtype`` to one dtype);
- a dry run of the transform on blank images of two sizes gives 3-channel tensors of
  one shape and dtype (so the batch stacks), and the tensor ops, run once on a ramp of
  the 256 levels, give the table that the fused writer reads per channel and level.

The dry run draws from torch's global generator inside ``torch.random.fork_rng``: the
state the user seeded is left as it was. Everything else is a reason string saying
which dataset property, op or argument kept the pipeline unfused.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MODES", "FusedPlan", "recognize"]

MODES = ("auto", "fast", "python")

_HEAD = ("Resize", "CenterCrop", "RandomResizedCrop", "RandomHorizontalFlip")
_TO_TENSOR = {"v1": ("ToTensor", "PILToTensor"), "v2": ("ToImage", "ToTensor", "PILToTensor")}
_VALUES = {"v1": ("Normalize",), "v2": ("Normalize", "ToDtype")}
_PROBE_SIZES = ((37, 23), (777, 555))  # (width, height) of the dry run's blank images


@dataclass(frozen=True)
class FusedPlan:
    """A recognized pipeline: ``api`` ("v1" or "v2"), the geometric ``head`` ops (the
    user's torchvision objects, in order), ``shape`` (C, H, W) and ``dtype`` (numpy) of
    each image, and ``table``: (3, 256) values of channel c at level k after the tensor
    ops (None when they leave uint8 levels as they are)."""

    api: str
    head: tuple[Any, ...]
    shape: tuple[int, int, int]
    dtype: np.dtype
    table: np.ndarray | None

    def same_as(self, other: FusedPlan) -> bool:
        """Whether ``other`` runs the same ops (the same objects) to the same output."""
        same_table = (self.table is None and other.table is None) or (
            self.table is not None and other.table is not None and np.array_equal(self.table, other.table)
        )
        return (
            (self.api, self.shape, self.dtype) == (other.api, other.shape, other.dtype)
            and len(self.head) == len(other.head)
            and all(a is b for a, b in zip(self.head, other.head))
            and same_table
        )


def recognize(dataset: Any, mode: str) -> tuple[FusedPlan | None, str | None]:
    """``(plan, None)`` when ``dataset`` can run fused under ``images=mode``, else
    ``(None, reason)``: one sentence naming what kept it unfused."""
    if mode == "python":
        return None, "images='python' was asked: the dataset runs as written"
    if sys.modules.get("torchvision") is None:
        return None, "the dataset is not a torchvision dataset (torchvision is not imported)"
    why = _dataset_refusal(dataset)
    if why is not None:
        return None, why
    api, ops, why = _compose_ops(dataset.transform)
    if why is not None:
        return None, why
    head, tail, why = _split(api, ops)
    if why is not None:
        return None, why
    try:
        shape, dtype, table = _dry_run(dataset.transform, tail)
    except Exception as exc:  # the pipeline itself fails on a plain RGB image
        return None, f"the transform failed on a blank RGB image ({type(exc).__name__}: {exc})"
    if isinstance(shape, str):
        return None, shape
    return FusedPlan(api, tuple(head), shape, dtype, table), None


def _dataset_refusal(dataset: Any) -> str | None:
    import torchvision
    from torchvision.datasets import folder

    if type(dataset) not in (folder.ImageFolder, folder.DatasetFolder):
        return (
            f"the dataset is a {type(dataset).__module__}.{type(dataset).__qualname__}, not exactly "
            "torchvision's ImageFolder or DatasetFolder (a subclass may change __getitem__)"
        )
    loader = getattr(dataset, "loader", None)
    if loader is folder.default_loader:
        if torchvision.get_image_backend() != "PIL":
            return f"torchvision's image backend is {torchvision.get_image_backend()!r}, not 'PIL'"
    elif loader is not folder.pil_loader:
        return f"the dataset's loader is {_name(loader)}, not torchvision's default_loader or pil_loader"
    if getattr(dataset, "target_transform", None) is not None:
        return f"the dataset has a target_transform ({_name(dataset.target_transform)})"
    bad = next((t for _, t in getattr(dataset, "samples", ()) if type(t) is not int), None)
    if bad is not None:
        return f"a target in dataset.samples is a {type(bad).__name__}, not an int"
    return None


def _compose_ops(transform: Any) -> tuple[str, list[Any], str | None]:
    from torchvision import transforms as v1
    from torchvision.transforms import v2

    if type(transform) is v1.Compose:
        api = "v1"
    elif type(transform) is v2.Compose:
        api = "v2"
    else:
        return (
            "",
            [],
            (
                f"the dataset's transform is {_name(transform)}, not a torchvision transforms.Compose "
                "or transforms.v2.Compose"
            ),
        )
    module = v1 if api == "v1" else v2
    for op in transform.transforms:
        name = type(op).__name__
        if getattr(module, name, None) is not type(op) or name not in (
            *_HEAD,
            *_TO_TENSOR[api],
            *_VALUES[api],
        ):
            return (
                api,
                [],
                (
                    f"transform op {op!r} is not one the fused path reproduces exactly (recognized: "
                    f"{', '.join((*_HEAD, *_TO_TENSOR[api], *_VALUES[api]))} of transforms"
                    f"{'' if api == 'v1' else '.v2'})"
                ),
            )
    return api, list(transform.transforms), None


def _split(api: str, ops: list[Any]) -> tuple[list[Any], list[Any], str | None]:
    """The geometric ops before the op to a tensor, and that op with the ones after it."""
    names = [type(op).__name__ for op in ops]
    first = next((i for i, n in enumerate(names) if n in _TO_TENSOR[api]), None)
    if first is None:
        return [], [], "the transform has no op to a tensor (ToTensor, PILToTensor, ToImage) to batch"
    for i, name in enumerate(names):
        if i < first and name not in _HEAD:
            return [], [], f"transform op {name} runs on the PIL image before the tensor: not reproduced"
        if i > first and name not in _VALUES[api]:
            return (
                [],
                [],
                (f"transform op {name} runs on the tensor (torch's kernels, not Pillow's): not reproduced"),
            )
    return ops[:first], ops[first:], None


def _dry_run(transform: Any, tail: list[Any]) -> tuple[Any, Any, Any]:
    """The output's (C, H, W) and numpy dtype, and the tail's table, computed under a
    forked torch RNG; a reason string in place of the shape when it does not batch."""
    import torch
    from PIL import Image

    with torch.random.fork_rng(devices=[]):
        outs = [transform(Image.new("RGB", size, (90, 160, 30))) for size in _PROBE_SIZES]
        ramp = Image.frombytes("RGB", (256, 1), np.repeat(np.arange(256, dtype=np.uint8), 3).tobytes())
        for op in tail:
            ramp = op(ramp)
    if not all(isinstance(o, torch.Tensor) and o.dim() == 3 and o.shape[0] == 3 for o in outs):
        return "the transform's output is not a 3-channel image tensor", None, None
    if outs[0].shape != outs[1].shape:
        return (
            (
                "the transform's output size depends on the image's (e.g. Resize(int) without a crop): "
                f"{tuple(outs[0].shape)} and {tuple(outs[1].shape)} from two sizes"
            ),
            None,
            None,
        )
    if not isinstance(ramp, torch.Tensor) or ramp.dtype != outs[0].dtype:
        return "the tensor ops' output differs in type from the transform's", None, None
    dtype = np.dtype(torch.empty(0, dtype=ramp.dtype).numpy().dtype)
    table = ramp.as_subclass(torch.Tensor).reshape(3, 256).numpy().copy()
    identity = dtype == np.uint8 and np.array_equal(table, np.tile(np.arange(256, dtype=np.uint8), (3, 1)))
    return tuple(int(d) for d in outs[0].shape), dtype, None if identity else table


def _name(obj: Any) -> str:
    kind = type(obj)
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else repr(obj)
