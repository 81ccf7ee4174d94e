"""What ``DataLoader(images=...)`` decided for one loader, and its ``stats()["images"]``.

:class:`ImagesChoice` recognizes the dataset when the loader is made and again for each
epoch's recipe (:func:`~shmloader.vision.torchvision_plan.recognize`), and says whether
the fused writer runs: only for batches the default collate would make (a map-style
dataset, ``batch_size`` or ``batch_sampler`` given, no ``collate_fn`` of the user's). Its
report combines the decision with the fused and fell-back sample counts, which workers
send with the dataset counters (``shmloader_stats``) and this process's writer keeps itself.
"""

from __future__ import annotations

from typing import Any

from shmloader.vision.torchvision_plan import MODES, recognize

__all__ = ["COUNTERS", "ImagesChoice", "check_mode"]

COUNTERS = ("images_fused", "images_fell_back")  # the fused writer's shmloader_stats names


def check_mode(mode: Any) -> None:
    """Raise ValueError naming ``mode`` and the choices unless it is one of :data:`MODES`."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"images should be one of {', '.join(map(repr, MODES))} (got {mode!r}): 'auto' runs a "
            "recognized torchvision ImageFolder pipeline fused and bit-identical, 'fast' also decodes "
            "JPEGs at reduced scale (close to torchvision's pixels), 'python' never fuses."
        )


class ImagesChoice:
    """The ``images=`` decision of one loader over ``dataset`` (see the module docstring)."""

    def __init__(self, mode: str, dataset: Any) -> None:
        check_mode(mode)
        self.mode = mode
        self._dataset = dataset
        self._plan: Any = None
        self._reason: str | None = "no epoch has started yet"
        self._writer: Any = None  # this process's (num_workers=0) counts live in it
        self._earlier = [0, 0]  # fused, fell back: counts of writers replaced since
        self.active = False

    def writer(self, *, iterable: bool, auto_collation: bool, user_collate: bool) -> Any:
        """The fused writer for the next epoch's recipe, or None (the dataset runs as written);
        records why not for :meth:`report`."""
        self.active = False
        # The dataset may have changed since the loader was made (a transform set for
        # another phase): recognized again for each recipe, so a stale plan never runs.
        plan, self._reason = recognize(self._dataset, self.mode)
        writer = self._writer
        if writer is not None and (plan is None or not plan.same_as(writer.plan)):
            self._earlier = [self._earlier[0] + writer.fused, self._earlier[1] + writer.fell_back]
            self._writer = None
        self._plan = plan
        if plan is None:
            return None
        if iterable or not auto_collation:
            self._reason = "samples are not batched (batch_size=None): each goes through the dataset"
            return None
        if user_collate:
            self._reason = "a collate_fn other than torch's default_collate was given"
            return None
        if self._writer is None:
            from shmloader.vision.torchvision_fused import FusedFolder

            self._writer = FusedFolder(self._dataset, plan, fast=self.mode == "fast")
        self.active = True
        self._reason = None
        return self._writer

    def report(self, dataset_counts: dict[str, Any]) -> dict[str, Any]:
        """``stats()["images"]``: ``mode``, ``active``, ``reason`` (None when active),
        ``fused`` and ``fell_back`` sample counts (this process's and the workers',
        popped from ``dataset_counts``) and ``fallback_share``."""
        fused = int(dataset_counts.pop(COUNTERS[0], 0)) + self._earlier[0]
        fell_back = int(dataset_counts.pop(COUNTERS[1], 0)) + self._earlier[1]
        if self._writer is not None:
            fused += self._writer.fused
            fell_back += self._writer.fell_back
        total = fused + fell_back
        return {
            "mode": self.mode,
            "active": self.active,
            "reason": self._reason,
            "fused": fused,
            "fell_back": fell_back,
            "fallback_share": fell_back / total if total else 0.0,
        }
