"""The write-into protocol: datasets that produce samples straight into the batch.

A dataset that declares the shape and dtype of its samples and knows how to write
sample ``i`` into arrays it is given skips the per-sample allocation and the collate
copy: the worker hands it views of the rows of its slot. Protocol (both are needed)::

    class Images:
        def sample_spec(self):
            return {"image": ArraySpec((224, 224, 3), "uint8"), "label": ArraySpec((), "int64")}

        def write_sample(self, index, out):
            decode_into(self.files[index], out["image"])   # out["image"]: a (224, 224, 3) view
            out["label"][...] = self.labels[index]

``sample_spec()`` returns a tree (dict / tuple / list / namedtuple) whose leaves are
:class:`ArraySpec`; ``write_sample(index, out)`` receives the same tree of writable
numpy views, one sample's row of each leaf, and fills them (its return value is
ignored). The batch the consumer gets has each leaf stacked along a new first axis, as
the default collate would give. A user ``collate_fn`` turns the protocol off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmloader.batch.collate import Leaf
from shmloader.batch.tree import flatten, leaf_paths, path_text, unflatten
from shmloader.errors import BatchLayoutError


@dataclass(frozen=True)
class ArraySpec:
    """The shape and dtype of one array leaf of a sample (any numpy dtype spelling)."""

    shape: tuple[int, ...]
    dtype: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))


def supports(dataset: Any) -> bool:
    """Whether ``dataset`` implements the write-into protocol."""
    return callable(getattr(dataset, "write_sample", None)) and callable(
        getattr(dataset, "sample_spec", None)
    )


def spec_for(dataset: Any, *, iterable: bool, auto_collation: bool, collate_fn: Any) -> Any:
    """The parsed spec when the protocol applies (a map-style dataset that implements it,
    batched with the default collate), else None. Workers and the main process ask this."""
    if iterable or not auto_collation or collate_fn is not None or not supports(dataset):
        return None
    return parse_spec(dataset.sample_spec())


def parse_spec(spec: Any) -> tuple[Any, list[ArraySpec]]:
    """Treedef and leaves of a sample spec tree; a clear error for anything else."""
    treedef, leaves = flatten(spec)
    for path, leaf in zip(leaf_paths(spec), leaves):
        if not isinstance(leaf, ArraySpec):
            raise BatchLayoutError(
                f"sample_spec() returned {type(leaf).__name__} at {path_text(path)}; every leaf "
                "must be a shmloader.ArraySpec(shape, dtype)."
            )
    if not leaves:
        raise BatchLayoutError("sample_spec() declared no arrays; declare at least one ArraySpec.")
    return treedef, leaves


def plan_leaves(treedef: Any, specs: list[ArraySpec], batch: int) -> list[Leaf]:
    """Leaves of a batch of ``batch`` samples of this spec (no values: written in place)."""
    return [Leaf((i,), None, "stack", (batch, *s.shape), s.dtype) for i, s in enumerate(specs)]


def writer(dataset: Any, treedef: Any, indices: Sequence[Any]) -> Callable[[list[np.ndarray | None]], None]:
    """A filler that asks ``dataset`` to write each sample into its row of the views."""
    write_sample = dataset.write_sample

    def fill(views: list[np.ndarray | None]) -> None:
        for row, index in enumerate(indices):
            # v[row, ...] is a view even for 1-d leaves (v[row] would be a scalar copy).
            write_sample(index, unflatten(treedef, (v[row, ...] for v in views)))  # type: ignore[index]

    return fill
