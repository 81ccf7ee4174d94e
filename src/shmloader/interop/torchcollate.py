"""torch's ``default_collate_fn_map`` registrations, honoured by the loader's default collate.

torch documents extending ``default_collate`` by registering a type in
``torch.utils.data._utils.collate.default_collate_fn_map`` (a new type, or one of the
built-in ones such as ``int``). Where the collate in use is torch's default (no
``collate_fn``, or torch's ``default_collate`` given), the loader's default collate takes
those entries too: :func:`honoured_map` adds them to shmloader's own
:data:`~shmloader.batch.collate.default_collate_fn_map`, each called as torch calls it (with
torch's map). An entry is torch's own where its function is defined in torch's collate
module; every other entry is a registration.

The map is read once per epoch (and per worker), not per batch: while torch's map holds
only its own entries (the common case) the default collate runs on shmloader's map
unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

_TORCH_COLLATE = "torch.utils.data._utils.collate"


class TorchEntry:
    """A function registered in torch's map, as an entry of shmloader's: called with the
    field's values and torch's map (what torch's ``collate`` passes it)."""

    __slots__ = ("fn", "torch_map")

    def __init__(self, fn: Any, torch_map: Mapping[Any, Any]) -> None:
        self.fn = fn
        self.torch_map = torch_map

    def __call__(self, batch: Any, *, collate_fn_map: Any = None) -> Any:
        return self.fn(batch, collate_fn_map=self.torch_map)

    def __repr__(self) -> str:
        return f"<torch's default_collate_fn_map entry {self.fn!r}>"


def registrations() -> dict[Any, Any]:
    """The entries of torch's ``default_collate_fn_map`` that torch did not put there
    (empty where torch's collate module is not imported, or its map is as torch made it)."""
    module = sys.modules.get(_TORCH_COLLATE)
    if module is None:
        return {}
    theirs = getattr(module, "default_collate_fn_map", None)
    if not isinstance(theirs, Mapping):
        return {}
    return {key: fn for key, fn in theirs.items() if getattr(fn, "__module__", None) != _TORCH_COLLATE}


def honoured_map(ours: dict[Any, Any]) -> dict[Any, Any]:
    """``ours`` itself where torch's map holds no registration; else a copy of it with
    torch's registrations added (a key ``ours`` has, such as ``int``, taking the
    registered function in its place)."""
    extra = registrations()
    if not extra:
        return ours
    theirs = sys.modules[_TORCH_COLLATE].default_collate_fn_map
    merged = dict(ours)
    for key, fn in extra.items():
        merged[key] = TorchEntry(fn, theirs)
    return merged
