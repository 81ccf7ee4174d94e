"""Where a worker puts a batch in a slot, worked out once per batch structure.

A batch's placement (:func:`shmloader.batch.collate.plan`: each leaf's offset; the encoded
skeleton of its layout; the layout's numbers) depends only on its structure and on each
leaf's kind, shape, dtype and torch tag, never on its values: a worker makes it the first
time it sees that structure (:func:`signature`) and reuses it for every batch like it, so
a steady stream of same-shaped batches plans, splits and encodes nothing per batch.
"""

from __future__ import annotations

from array import array
from typing import Any

from shmloader.batch.collate import Leaf, plan
from shmloader.batch.layout import encode, split
from shmloader.transport import wire


def signature(treedef: Any, leaves: list[Leaf]) -> tuple | None:
    """All that :func:`~shmloader.batch.collate.plan` reads of a batch (its structure; each
    leaf's kind, shape, dtype and torch tag) as a key; None for a batch with a ``"list"``
    leaf (its per-sample shapes differ batch to batch)."""
    key = [treedef]
    for leaf in leaves:
        if leaf.kind == "list":
            return None
        key.append((leaf.kind, leaf.shape, leaf.dtype, leaf.torch))
    return tuple(key)


class Placement:
    """One batch structure's placement: its layout, the bytes its arrays take, its encoded
    skeleton and layout numbers and, without object leaves (whose values differ batch to
    batch), the whole slot content."""

    __slots__ = ("content", "data_bytes", "encoded", "layout", "numbers")

    def __init__(self, layout: Any, data_bytes: int, encoded: bytes, numbers: bytes, objects: bool) -> None:
        self.layout = layout
        self.data_bytes = data_bytes
        self.encoded = encoded
        self.numbers = numbers
        self.content = None if objects else wire.SlotContent(data_bytes, encoded, numbers, b"")


class Placements:
    """A worker's placements by :func:`signature`, and the encodings of their skeletons
    (fewer: padded batches of new lengths share one), each at most ``limit`` entries."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_key: dict[tuple, Placement] = {}
        self._encoded: dict[Any, bytes] = {}

    def of(self, treedef: Any, leaves: list[Leaf]) -> Placement:
        """The placement of a batch of this structure (a ragged batch's is made anew)."""
        key = signature(treedef, leaves)
        placed = self._by_key.get(key) if key is not None else None
        if placed is not None:
            return placed
        layout, data_bytes, objects = plan(treedef, leaves)
        skeleton, numbers = split(layout)
        encoded = self._encoded.get(skeleton)
        if encoded is None:
            if len(self._encoded) >= self.limit:
                self._encoded.clear()  # stay bounded (one per batch structure)
            encoded = self._encoded[skeleton] = encode(skeleton)
        placed = Placement(layout, data_bytes, encoded, array("q", numbers).tobytes(), bool(objects))
        if key is not None:
            if len(self._by_key) >= self.limit:
                self._by_key.clear()
            self._by_key[key] = placed
        return placed
