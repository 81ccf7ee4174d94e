"""Torch interop and the pin-memory seam.

``output="torch"``: batches are torch tensors sharing the slot's memory (``torch.from_numpy``
on the slot's views, so the slot lease rule is the numpy one: the slot is reused only once
no tensor viewing it is alive). :func:`torch_layout` makes the reader of a layout hand out
tensors; :func:`to_torch` converts batches built outside the ring.

``pin_memory=True``: torch's loader copies every batch into a fresh page-locked buffer.
Here the ring is already the batch's home, so it is registered once as page-locked
(``cudaHostRegister``) and ``tensor.to("cuda", non_blocking=True)`` copies straight from
the slot. A slot must not be rewritten while such a copy may still be reading it: when the
last view of a pinned slot dies, :meth:`RingPinner.release` records a CUDA event on the
current stream and the slot goes back to the workers only once that event has completed.

Everything that touches CUDA is in :class:`CudaHost` (the seam): tests on machines
without a GPU drive :class:`RingPinner` with a stand-in host.
"""

from __future__ import annotations

import collections
import sys
import warnings
import weakref
from typing import Any

import numpy as np

from shmloader.batch.layout import Skeleton
from shmloader.batch.tree import tree_map
from shmloader.errors import BatchTypeError
from shmloader.system import slots as _slots

NO_CUDA_WARNING = "pin_memory=True but CUDA is not available; batches stay in shared host memory"
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as torch registers memory


# --- torch output -----------------------------------------------------------------------


def torch_skeleton(skeleton: Skeleton) -> Skeleton:
    """``skeleton`` with every array leaf torch can hold handed out as a torch tensor
    (numbers and bools; a collate_fn's str, datetime... arrays stay numpy arrays, as
    :func:`to_torch` leaves them). Raises :func:`numpy_only_error` for a default-collated
    leaf of such a dtype (torch's collate raises TypeError for it too)."""
    leaves = []
    for leaf in skeleton.leaves:
        if leaf[0] != "o" and leaf[-1] is None:
            raise numpy_only_error(np.dtype(leaf[1]))
        if leaf[0] == "o" or leaf[-1] or not torch_can_hold(np.dtype(leaf[1])):
            leaves.append(leaf)
        else:
            leaves.append((*leaf[:-1], True))
    return skeleton._replace(leaves=tuple(leaves))


def numpy_only_error(dtype: np.dtype) -> BatchTypeError:
    """The error for a default-collated field of a dtype no tensor holds, with output="torch"."""
    package = dtype.type.__module__.partition(".")[0]
    if package != "numpy":  # ml_dtypes' bfloat16, float8...: torch converts no such array
        return BatchTypeError(
            f"output='torch' cannot hand out a batch field of numpy dtype {dtype} (from "
            f"{package}): torch cannot make a tensor of such an array (its default_collate "
            "raises TypeError too). Use output='numpy' (the batch keeps the dtype), return "
            f"torch tensors from the dataset (e.g. of torch.{dtype}, where torch has it), or "
            "pass a collate_fn (its output passes through as it is)."
        )
    return BatchTypeError(
        f"output='torch' cannot hand out a batch field of numpy dtype {dtype}: torch has no "
        "such dtype (its default_collate raises TypeError too). Use output='numpy', convert "
        "the field in the dataset (numbers, or str/bytes objects rather than arrays), or "
        "pass a collate_fn (its output passes through as it is)."
    )


def torch_can_hold(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one torch has (numpy's numbers and bools): such arrays become
    tensors. Not a dtype another package defines (ml_dtypes' float8_e5m2 says it is a
    float), which ``torch.from_numpy`` refuses. (A non-native byte order is one: there
    ``torch.from_numpy`` raises ValueError, as torch's own collate does.)"""
    return dtype.kind in "biufc" and dtype.num < _USER_DTYPES


_USER_DTYPES = 256  # NPY_USERDEF: numpy numbers its own dtypes below this


def to_torch(batch: Any) -> Any:
    """``batch`` with numpy arrays torch can hold replaced by tensors sharing their memory
    (nodes rebuilt with their types by :mod:`shmloader.batch.tree`; other leaves are kept)."""
    import torch

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray) and torch_can_hold(leaf.dtype):
            if any(stride < 0 for stride in leaf.strides):  # from_numpy refuses them
                leaf = leaf.copy()  # (a worker's slot holds a contiguous copy too)
            return torch.from_numpy(leaf)
        return leaf

    return tree_map(convert, batch)


def pin_tree(batch: Any) -> Any:
    """``batch`` with every CPU tensor copied into page-locked memory (what torch's loader
    does per batch; used only for batches that do not live in the ring)."""
    torch = sys.modules["torch"]

    def pin(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and not leaf.is_pinned():
            return leaf.pin_memory()
        return leaf

    return tree_map(pin, batch)  # (nodes keep their items: a batch in the ring is pinned in place)


# --- pinning ----------------------------------------------------------------------------


class CudaHost:
    """The seam: every CUDA call the loader makes, through torch."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._cudart = torch.cuda.cudart()

    def register(self, address: int, size: int) -> None:
        """Page-lock ``size`` bytes at ``address`` for DMA (``cudaHostRegister``)."""
        err = int(self._cudart.cudaHostRegister(address, size, _CUDA_HOST_REGISTER_PORTABLE))
        if err:
            raise RuntimeError(
                f"cudaHostRegister of the loader's {size}-byte ring failed with cudaError {err}; "
                "the locked-memory limit (ulimit -l) may be too low. Use pin_memory=False, or "
                "raise the limit."
            )
        # Drivers that pin memory may mark it MADV_DONTFORK (no mapping in a forked child),
        # and workers forked later must write into this ring. The mapping is MAP_SHARED, so
        # a child maps the same pages (no copy-on-write to break DMA): keep it inherited.
        _madvise_dofork(address, size)

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` (before the memory is unmapped)."""
        self._cudart.cudaHostUnregister(address)

    def pinned_copy(self, tensor: Any) -> Any:
        """A copy of the CPU ``tensor`` in page-locked memory (torch's caching host
        allocator, as torch's loader pins each tensor)."""
        return tensor.pin_memory()

    def record(self) -> Any:
        """An event recorded on the current stream: it completes after every copy
        issued on that stream so far."""
        event = self._torch.cuda.Event()
        event.record()
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any) -> None:
        event.synchronize()


class RingPinner:
    """Registers rings as page-locked memory and keeps a pinned slot leased until the
    device copies issued from it have completed."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self._pending: collections.deque = collections.deque()  # (event, states, slot)

    def register(self, ring: Any) -> None:
        """Page-lock the whole of ``ring``'s mapping, once; it is unregistered when the
        mapping's owner dies (its weakref callbacks run before the memory is unmapped, and
        every view of the ring keeps the owner alive)."""
        mapping = ring.mapping
        self.host.register(mapping.address, mapping.size)
        weakref.finalize(mapping.owner, self.host.unregister, mapping.address).atexit = False

    def release(self, states: Any, slot: int) -> None:
        """The last view of ``slot`` died: free it once the copies issued so far are done.
        (``states`` keeps the ring mapped until then.)"""
        self._pending.append((self.host.record(), states, slot))
        self.reclaim()

    def pinned_copy(self, tensor: Any) -> Any:
        """A page-locked copy of ``tensor``: a small leaf handed out apart from its slot
        (see layout.make_apart_reader) is pinned as torch pins every tensor."""
        return self.host.pinned_copy(tensor)

    def reclaim(self, block: bool = False) -> int:
        """Return to FREE the released slots whose copies have completed; with ``block``,
        wait for the oldest one if none has. How many slots were freed."""
        freed = 0
        pending = self._pending
        while True:
            try:
                item = pending.popleft()
            except IndexError:
                return freed
            event, states, slot = item
            if not self.host.done(event):
                if not block or freed:
                    pending.appendleft(item)
                    return freed
                self.host.wait(event)
            states.store(slot, _slots.FREE)
            freed += 1

    @property
    def pending(self) -> int:
        """Slots released by the consumer whose copies may still run."""
        return len(self._pending)

    def waiting(self) -> list[tuple[Any, Any, int]]:
        """The slots released by the consumer whose copies may still run, oldest first:
        (the host's event recorded at the release, the ring's slot states, the slot); a copy."""
        return list(self._pending)


_MADV_DOFORK = 11  # linux/mman.h: inherit across fork (undoes MADV_DONTFORK, 10)


def _madvise_dofork(address: int, size: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), _MADV_DOFORK)


def make_pinner(pin_memory: bool, stacklevel: int = 3) -> RingPinner | None:
    """The loader's pinner for ``pin_memory``: None when off, or (with one warning, as
    torch does) when CUDA is not available."""
    if not pin_memory:
        return None
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        warnings.warn(NO_CUDA_WARNING, stacklevel=stacklevel)
        return None
    return RingPinner(CudaHost(torch))
