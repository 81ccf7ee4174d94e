"""Making the loaders that libraries build through torch's name shmloader ones.

timm's ``create_loader``, HF's Trainer, detectron2 and torchvision's reference scripts
construct ``torch.utils.data.DataLoader`` themselves, with no argument to choose another
class. :func:`patch_torch` binds that name (and ``torch.utils.data.dataloader.DataLoader``,
which code importing from the module reads) to a subclass of shmloader's DataLoader that
is also torch's, so every loader built through either name while the patch holds is a
shmloader one, and an instance of torch's class as every shmloader loader is (see
:mod:`shmloader.interop.torchcompat`). ``isinstance(x, torch.utils.data.DataLoader)``
stays true, under the patch, for the torch loaders made before it too.

Patches count: the names go back to exactly what they held before the first patch when
the last one is undone; undoing one handle twice does nothing.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from shmloader.interop import torchcompat

# Where torch's DataLoader name lives: (module name, attribute).
_NAMES = (("torch.utils.data", "DataLoader"), ("torch.utils.data.dataloader", "DataLoader"))

_lock = threading.Lock()
_active = 0  # patches not undone yet
_saved: list[tuple[Any, str, Any]] = []  # (module, attribute, what it held) before the first patch


class _TorchNameMeta(type):
    """The patched name's class's type: ``isinstance``/``issubclass`` against the patched
    name accept torch's own DataLoader (and its subclasses) too, as the name did."""

    _torch_base: type

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._torch_base)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._torch_base)


_patched_classes: dict[type, type] = {}  # torch's DataLoader -> the class bound to its name


def _patched_class(torch_base: type) -> type:
    """The class bound to torch's name: shmloader's DataLoader, as torch's flavour of it."""
    cls = _patched_classes.get(torch_base)
    if cls is None:
        from shmloader.loader import DataLoader

        flavour = torchcompat.flavoured(DataLoader, "DataLoader")
        cls = _TorchNameMeta(
            "DataLoader",
            (flavour,),
            {
                "__module__": DataLoader.__module__,
                "__qualname__": DataLoader.__qualname__,
                "__doc__": DataLoader.__doc__,
            },
        )
        cls._torch_base = torch_base
        _patched_classes[torch_base] = cls
    return cls


class TorchPatch:
    """One :func:`patch_torch`: :meth:`undo` (or leaving its ``with`` block) ends it."""

    def __init__(self) -> None:
        self.active = False

    def _apply(self) -> None:
        global _active
        torch = torchcompat.torch_module()
        if torch is None:
            raise RuntimeError(
                "shmloader.patch_torch() found no torch in this process: import torch first "
                "(it binds torch.utils.data.DataLoader, which only exists with torch)."
            )
        import torch.utils.data.dataloader  # (the module holding the second name)

        base = torchcompat.torch_class("DataLoader")
        if base is None:
            raise RuntimeError(
                "shmloader.patch_torch() cannot find torch's DataLoader class: both "
                "torch.utils.data.DataLoader and torch.utils.data.dataloader.DataLoader are "
                "bound to something else. Restore them, then patch."
            )
        with _lock:
            if _active == 0:
                patched = _patched_class(base)
                _saved.clear()
                for module_name, attribute in _NAMES:
                    module = sys.modules[module_name]
                    _saved.append((module, attribute, getattr(module, attribute)))
                    setattr(module, attribute, patched)
            _active += 1
            self.active = True

    def undo(self) -> None:
        """End this patch; once every patch is undone, torch's names hold again exactly
        what they held before the first. Idempotent."""
        global _active
        with _lock:
            if not self.active:
                return
            self.active = False
            _active -= 1
            if _active == 0:
                for module, attribute, value in _saved:
                    setattr(module, attribute, value)
                _saved.clear()

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def patch_torch() -> TorchPatch:
    """Make every DataLoader built through ``torch.utils.data.DataLoader`` or
    ``torch.utils.data.dataloader.DataLoader`` a :class:`shmloader.DataLoader`, until the
    returned handle's ``undo()``; as a context manager (``with shmloader.patch_torch():``),
    until the block ends. For libraries that build torch's loader themselves (timm's
    ``create_loader``, HF's Trainer): they get shmloader's with the same arguments. Code
    that imported the class by name before the patch (``from torch.utils.data import
    DataLoader`` at its module's top) keeps torch's. Raises RuntimeError without torch."""
    patch = TorchPatch()
    patch._apply()
    return patch
