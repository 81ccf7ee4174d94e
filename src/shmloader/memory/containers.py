"""The large Python containers a dataset holds, and storing them once in shared memory.

A list, tuple or dict of Python objects held by a dataset is what forked workers copy page
by page (reading an object writes its reference count) and what spawned workers receive
pickled, whole. :func:`large_containers` finds them among the dataset's attributes (and
the attributes of the objects it holds, as a ``Subset``'s ``dataset``) with an estimate of
their size; :func:`share_containers` replaces them with :func:`shmloader.share` views.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np

from shmloader.memory.shared import SharedDict, SharedList, SharedTuple, share
from shmloader.system.limits import mib

# A container is large from this estimated size: smaller ones cost little per worker.
LARGE_BYTES = 16 << 20
_SAMPLED = 256  # elements measured to estimate a container's size
_DEPTH = 3  # objects within objects searched for containers (dataset.base.records)
_SIZE_DEPTH = 6  # nesting measured within one element


@dataclass(frozen=True)
class Container:
    """One large container: where it is (``path``, as written from the dataset, e.g.
    ``"records"`` or ``"dataset.records"``), the object holding it and its attribute
    name, its type's name, its length and its estimated size in bytes (the Python
    objects it holds, measured on a sample)."""

    path: str
    owner: Any = field(repr=False, compare=False)
    attribute: str
    kind: str
    length: int
    estimated_bytes: int

    def describe(self) -> str:
        """e.g. ``records (list of 1,000,000, ~545 MiB)``."""
        return f"{self.path} ({self.kind} of {self.length:,}, ~{mib(self.estimated_bytes)})"


@dataclass
class SharingReport:
    """What :func:`share_containers` did: ``shared`` maps each replaced attribute's path to
    its estimated size; ``skipped`` maps each large container left as it was to why."""

    shared: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def large_containers(dataset: Any, min_bytes: int = LARGE_BYTES) -> list[Container]:
    """The lists, tuples and dicts of at least ``min_bytes`` (estimated) that ``dataset``
    holds as attributes, or that objects among its attributes hold (to a depth of three:
    a wrapper's wrapped dataset's records), largest first. Shared views, numpy arrays and
    other objects are not containers of Python objects and are not listed. Costs a few
    milliseconds: each container is sized from a sample of its elements."""
    found: list[Container] = []
    seen: set[int] = set()

    def visit(obj: Any, prefix: str, depth: int) -> None:
        if id(obj) in seen or depth > _DEPTH:
            return
        seen.add(id(obj))
        for name, value in _attributes(obj):
            path = prefix + name
            if _is_container(value):
                if id(value) in seen:
                    continue
                seen.add(id(value))
                size = estimate_bytes(value)
                if size >= min_bytes:
                    found.append(Container(path, obj, name, type(value).__name__, len(value), size))
            elif _is_plain_object(value):
                visit(value, path + ".", depth + 1)

    visit(dataset, "", 1)
    return sorted(found, key=lambda c: -c.estimated_bytes)


def share_containers(dataset: Any, min_bytes: int = LARGE_BYTES) -> SharingReport:
    """Replace the large containers of ``dataset`` (:func:`large_containers`) with
    :func:`shmloader.share` views of them, in place: the dataset's attribute then reads
    the same values, from one read-only segment every worker maps. A container whose
    type is a subclass (its behaviour would change), that holds what share() cannot
    store, or whose attribute cannot be set is left as it was, with the reason."""
    report = SharingReport()
    for found in large_containers(dataset, min_bytes):
        value = getattr(found.owner, found.attribute)
        if type(value) not in (list, tuple, dict):
            report.skipped[found.path] = (
                f"a {type(value).__name__} (a subclass: share() would make it a plain "
                f"{type(value).__mro__[1].__name__} view)"
            )
            continue
        try:
            shared = share(value)
        except TypeError as exc:
            report.skipped[found.path] = str(exc)
            continue
        try:
            setattr(found.owner, found.attribute, shared)
        except (AttributeError, TypeError) as exc:
            report.skipped[found.path] = f"its attribute cannot be set ({exc})"
            continue
        report.shared[found.path] = found.estimated_bytes
    return report


def estimate_bytes(container: list | tuple | dict) -> int:
    """The memory the Python objects of ``container`` take, estimated from up to 256
    elements spread over it (dicts: their first 256 items), nested containers included."""
    n = len(container)
    total = sys.getsizeof(container)
    if n == 0:
        return total
    if isinstance(container, dict):
        sample = list(islice(container.items(), _SAMPLED))
    else:
        step = max(1, n // _SAMPLED)
        sample = [container[i] for i in range(0, n, step)][:_SAMPLED]
    seen: set[int] = set()  # objects met in an earlier sampled element are shared by many
    measured = sum(_deep_size(item, _SIZE_DEPTH, seen) for item in sample)
    return total + measured * n // len(sample)


def element_pages(container: list | tuple | dict) -> list[int]:
    """The memory pages (address // page size) of up to 256 elements spread over
    ``container`` (dicts: keys and values of their first 256 items): where a forked
    worker that reads the elements copies them. Taken before workers fork: reading an
    element after the fork writes its reference count in this process, which makes the
    worker's copy of the page its own as well."""
    from shmloader.memory.usage import PAGE_SIZE

    n = len(container)
    if n == 0:
        return []
    if isinstance(container, dict):
        sample = [x for item in islice(container.items(), _SAMPLED) for x in item]
    else:
        step = max(1, n // _SAMPLED)
        sample = [container[i] for i in range(0, n, step)][:_SAMPLED]
    return sorted({id(x) // PAGE_SIZE for x in sample})


def _deep_size(value: Any, depth: int, seen: set[int]) -> int:
    """The size of ``value`` and what it holds, less the objects in ``seen`` (interned
    keys, small ints, constants: counted once, not once per element)."""
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if depth == 0:
        return size
    if isinstance(value, dict):
        return size + sum(
            _deep_size(k, depth - 1, seen) + _deep_size(v, depth - 1, seen) for k, v in value.items()
        )
    if isinstance(value, (list, tuple, set, frozenset)):
        return size + sum(_deep_size(v, depth - 1, seen) for v in value)
    return size


def _is_container(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict)) and not isinstance(
        value, (SharedList, SharedTuple, SharedDict)
    )


def _is_plain_object(value: Any) -> bool:
    """An object whose attributes may hold containers (a wrapped dataset), not a module,
    class, function or array."""
    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType, np.ndarray)):
        return False
    return hasattr(value, "__dict__") and not callable(getattr(value, "__self__", None))


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    try:
        return list(vars(obj).items())
    except TypeError:  # no __dict__ (slots only)
        return []
