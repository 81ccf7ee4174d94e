"""Optional base classes for datasets, as in ``torch.utils.data``.

Any object with ``__getitem__`` and ``__len__`` works as a map-style dataset, and any
object with ``__iter__`` as an iterable one; these classes only make the intent explicit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Dataset:
    """A map-style dataset: ``dataset[i]`` returns sample ``i`` for ``0 <= i < len(dataset)``."""

    def __getitem__(self, index: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__")


class IterableDataset:
    """An iterable-style dataset: ``iter(dataset)`` yields samples. With workers, each
    worker iterates its own copy; use :func:`shmloader.get_worker_info` to split the work."""

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")
