"""``RandomResizedCrop``'s box and ``RandomHorizontalFlip``'s coin, drawn as torchvision
draws them, without its per-call overhead.

torchvision's ``RandomResizedCrop.get_params`` (v1) and ``make_params`` (v2) draw the box
with a few torch calls (a uniform area share, a uniform log aspect ratio, two ``randint``
for the corner, up to ten tries, then a centred fallback); ``RandomHorizontalFlip`` flips
when ``torch.rand(1) < p``. Around those calls they spend as much again on Python: reading
the image's dimensions through the functional API, building the log-ratio tensor anew at
every call, comparing tensors. :class:`CropDraw` makes the same torch calls, in the same
order, on the same global generator, with what does not depend on the image computed once.

Exactness is checked, not assumed: :func:`checked_draw` compares it with the op's own code
on sizes that take every branch (first try, later tries, each fallback), the generator's
state after each included, and returns None on any difference; the caller then calls the
op's own code. The CPU generator's state is restored after the check; no other generator
is touched.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CropDraw", "checked_draw"]

_TRIES = 10
# (width, height) the check draws on: ordinary, tall, wide, tiny, and shapes where
# the tries fail and the fallback's three branches run for the default arguments.
_CHECK_SIZES = ((500, 375), (375, 500), (1200, 900), (1, 1), (3, 2), (4000, 3), (3, 4000), (7, 9))
_CHECK_SEEDS = 6


class CropDraw:
    """``RandomResizedCrop(scale, ratio)``'s box and ``RandomHorizontalFlip(p)``'s coin,
    drawn by the same torch calls as torchvision's code (see the module docstring)."""

    def __init__(self, scale: Any, ratio: Any, flip_p: float | None) -> None:
        import numpy as np
        import torch

        self._torch = torch
        self._scale = (scale[0], scale[1])
        log_ratio = torch.log(torch.tensor(ratio))  # float32, as torchvision computes it
        self._log_ratio = (float(log_ratio[0]), float(log_ratio[1]))
        self._ratio = (min(ratio), max(ratio))
        # ``torch.rand(1) < p`` compares in float32: p rounded to float32 compares alike.
        self._flip_p = None if flip_p is None else float(np.float32(flip_p))

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """``(top, left, height, width)`` of the crop of a ``width`` x ``height`` image."""
        torch = self._torch
        area = height * width
        lo, hi = self._scale
        log_lo, log_hi = self._log_ratio
        for _ in range(_TRIES):
            target_area = area * torch.empty(1).uniform_(lo, hi).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_lo, log_hi)).item()
            w = round(math.sqrt(target_area * aspect_ratio))
            h = round(math.sqrt(target_area / aspect_ratio))
            if 0 < w <= width and 0 < h <= height:
                top = torch.randint(0, height - h + 1, size=(1,)).item()
                left = torch.randint(0, width - w + 1, size=(1,)).item()
                return int(top), int(left), h, w
        in_ratio = float(width) / float(height)
        if in_ratio < self._ratio[0]:
            w, h = width, round(width / self._ratio[0])
        elif in_ratio > self._ratio[1]:
            w, h = round(height * self._ratio[1]), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def flip(self) -> bool:
        """The flip's coin (False when the pipeline has no flip: no draw)."""
        if self._flip_p is None:
            return False
        return self._torch.rand(1).item() < self._flip_p


def checked_draw(crop_op: Any, flip_op: Any, own_box: Any, own_flip: Any) -> CropDraw | None:
    """A :class:`CropDraw` for ``crop_op`` (and ``flip_op``, or None) that gives what the
    ops' own code gives: ``own_box(op, width, height)`` -> (top, left, height, width) and
    ``own_flip(op)`` -> bool call it; None where any draw or generator state differs."""
    import torch

    try:
        draw = CropDraw(crop_op.scale, crop_op.ratio, None if flip_op is None else flip_op.p)
    except (TypeError, ValueError, IndexError, RuntimeError):
        return None
    # Only the CPU generator the ops draw from is seeded and restored (torch.manual_seed
    # would also reseed the accelerators' generators, which the user's training draws from).
    generator = torch.default_generator
    saved = generator.get_state()
    try:
        for seed in range(_CHECK_SEEDS):
            for width, height in _CHECK_SIZES:
                generator.manual_seed(seed)
                want = own_box(crop_op, width, height), flip_op is not None and own_flip(flip_op)
                want_state = torch.get_rng_state()
                generator.manual_seed(seed)
                got = draw.box(width, height), draw.flip()
                if got != want or not torch.equal(torch.get_rng_state(), want_state):
                    return None
    except Exception:  # the op's own code refused a size: keep to it
        return None
    finally:
        generator.set_state(saved)
    return draw
