"""Being torch's DataLoader and samplers where torch is in use, and nothing of torch elsewhere.

Training stacks (Lightning, Fabric, Accelerate, HF Trainer, timm) test
``isinstance(loader, torch.utils.data.DataLoader)`` and ``isinstance(sampler,
torch.utils.data.RandomSampler)`` before they shard, wrap or resume a loader. So when torch
is imported in the process at the moment a shmloader loader or sampler is made, the object
is made an instance of a *flavour* of its class: a subclass of both the shmloader class and
its torch counterpart (shmloader's methods first in the method order, so behaviour is
shmloader's; torch's ``__init__`` is never called). Without torch in ``sys.modules``
nothing of torch is imported or touched: a numpy or JAX user never pays for torch.

Whether torch "is in use" is read from ``sys.modules`` (never by importing torch): a
process that imported torch before building its loader is a torch program.
"""

from __future__ import annotations

import sys
from typing import Any

# (shmloader class, torch base) -> flavour; a class is made once per pair.
_flavours: dict[tuple[type, type], type] = {}


def torch_module() -> Any:
    """The imported torch module, or None where torch is not in use."""
    return sys.modules.get("torch")


# torch's own classes by name, once found: code may rebind the names in torch.utils.data
# (``torch.utils.data.DataLoader = shmloader.DataLoader``, or patch_torch()), and a flavour
# must still derive from the class torch defined.
_originals: dict[str, type] = {}
_originals_of: Any = None  # the torch module _originals were read from
# The modules of torch.utils.data that define its public classes, where a name rebound on
# torch.utils.data itself still holds torch's class.
_HOMES = ("torch.utils.data.dataloader", "torch.utils.data.sampler", "torch.utils.data.dataset")


def torch_class(name: str) -> type | None:
    """torch's own ``torch.utils.data.<name>`` where torch is in use, else None: the class
    torch defined, whatever that name (or the name in its defining module) is bound to
    now, once it was seen bound to it (at the import of shmloader, at :func:`remember`,
    or at any earlier call)."""
    global _originals_of
    torch = torch_module()
    if torch is None:
        return None
    if _originals_of is not torch:  # (a first call, or torch imported again)
        _originals.clear()
        _originals_of = torch
    found = _originals.get(name)
    if found is not None:
        return found
    candidates = [getattr(torch.utils.data, name, None)]
    candidates += [getattr(sys.modules.get(home), name, None) for home in _HOMES]
    for cls in candidates:
        if isinstance(cls, type) and cls.__module__.startswith("torch."):
            _originals[name] = cls
            return cls
    return None


def remember(*names: str) -> None:
    """Record torch's classes of ``names`` now (before code rebinds them); nothing
    without torch."""
    for name in names:
        torch_class(name)


def flavoured(cls: type, torch_name: str) -> type:
    """The class an instance of ``cls`` is made as: ``cls`` itself without torch (or when
    it already derives from ``torch.utils.data.<torch_name>``), else the cached subclass of
    ``cls`` and that torch class."""
    base = torch_class(torch_name)
    if base is None or issubclass(cls, base):
        return cls
    flavour = _flavours.get((cls, base))
    if flavour is None:
        flavour = type(
            cls.__name__,
            (cls, base),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
                "__reduce_ex__": _reduce_flavoured,
                "_shm_plain_class": cls,
            },
        )
        _flavours[(cls, base)] = flavour
    return flavour


def _reduce_flavoured(obj: Any, protocol: int) -> tuple[Any, ...]:
    # A flavour is not importable by name (its qualname is the plain class's), so pickle
    # rebuilds the plain class's object, flavoured again where it is unpickled.
    return (_rebuild, (obj._shm_plain_class, obj.__dict__))


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def default_collate_of(auto_collation: bool) -> Any:
    """What torch's DataLoader reports as ``collate_fn`` when none was given:
    ``default_collate`` when batching, ``default_convert`` with ``batch_size=None``;
    None without torch."""
    torch = torch_module()
    if torch is None:
        return None
    fns = torch.utils.data._utils.collate
    return fns.default_collate if auto_collation else fns.default_convert


def is_datapipe(dataset: Any) -> bool:
    """Whether ``dataset`` is a torch ``IterDataPipe``."""
    cls = torch_class("IterDataPipe")
    return cls is not None and isinstance(dataset, cls)


remember("DataLoader")  # torch imported before shmloader: its class, before anyone rebinds it
