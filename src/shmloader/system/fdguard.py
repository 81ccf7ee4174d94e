"""Descriptors that only the consumer may hold, closed in every process forked from it.

A process forked from the consumer (a worker under the fork start method, a torch
DataLoader's worker, a user's ``os.fork()``) inherits every descriptor: the consumer's
ends of its workers' sockets, and its rings' descriptors. A copy of a consumer-side
socket end keeps the worker from seeing EOF when the consumer closes it or dies (the
worker's lifeline), and a copy of a ring descriptor is one more per process. So the
consumer registers the objects that own such descriptors here, and an at-fork hook closes
them in the child, through the objects themselves: closing the raw numbers instead would
leave objects that close them a second time later, when the numbers may name other files.
"""

from __future__ import annotations

import weakref
from typing import Any

from shmloader.system import forks

# Objects with a .close()-like method that closes their descriptor and marks them closed.
_owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_closers: dict[int, str] = {}


def register(owner: Any, fd: int, closer: str = "close") -> None:
    """Mark ``owner``'s descriptor ``fd`` as the consumer's only: in a forked child,
    ``getattr(owner, closer)()`` is called."""
    _owners[fd] = owner
    _closers[fd] = closer


def unregister(fd: int) -> None:
    """Forget ``fd`` (call before closing it)."""
    _owners.pop(fd, None)
    _closers.pop(fd, None)


def _close_in_child() -> None:
    for fd, owner in list(_owners.items()):
        try:
            getattr(owner, _closers[fd])()
        except Exception:  # (one owner that fails must not keep the others' open here)
            pass
    _owners.clear()
    _closers.clear()


forks.register(__name__, after_in_child=_close_in_child)
