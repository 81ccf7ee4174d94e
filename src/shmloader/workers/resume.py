"""An iterable dataset's shard opened where a saved record left it (an exact resume of
an iterable dataset, :mod:`shmloader.epoch.state`): in a worker, or in the consumer
without workers."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any


def is_stateful(dataset: Any) -> bool:
    """Whether an iterable dataset saves and restores its own position for the loader:
    ``shmloader_state_dict`` and ``shmloader_load_state_dict`` (never a ``state_dict`` the
    dataset has for itself: torch's loader calls none)."""
    return callable(getattr(dataset, "shmloader_state_dict", None)) and callable(
        getattr(dataset, "shmloader_load_state_dict", None)
    )


def open_iterable(dataset: Any, record: dict[str, Any] | None) -> Iterator[Any]:
    """``iter(dataset)`` positioned where ``record`` (a worker's saved record) left it:
    the dataset's own state is loaded first when saved, else the delivered samples are
    skipped."""
    if record is not None and record.get("state") is not None and is_stateful(dataset):
        dataset.shmloader_load_state_dict(record["state"])
        return iter(dataset)
    it = iter(dataset)
    skip = int(record["samples"]) if record is not None else 0
    if skip:
        next(islice(it, skip, skip), None)
    return it
