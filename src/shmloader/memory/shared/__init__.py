"""Python structures stored once in shared memory, read by every process without copying.

:func:`share` turns nested lists, tuples and dicts (of str, bytes, int, float, bool,
None, numpy arrays and scalars) into read-only views of one sealed anonymous segment
(:mod:`.layout`: the format; :mod:`.encode`: writing it; :mod:`.store`: the segment;
:mod:`.views`: reading it).
"""

from __future__ import annotations

from typing import Any

import shmloader.memory.shared.layout as L
from shmloader.memory.shared.encode import SUPPORTED, Writer
from shmloader.memory.shared.store import create
from shmloader.memory.shared.views import SharedDict, SharedList, SharedTuple, view_at

__all__ = ["SharedDict", "SharedList", "SharedTuple", "share"]


def share(obj: Any, *, backend: str = "auto") -> SharedList | SharedTuple | SharedDict:
    """``obj`` (a list, tuple or dict, nested, of str, bytes, int, float, bool, None,
    numpy arrays and numpy scalars) stored once in an anonymous shared-memory segment,
    as a read-only view equal to it.

    Reads build ordinary values on access (numpy arrays: read-only views of the segment)
    and write no shared page, so forked workers reading it copy nothing; under spawn and
    forkserver a DataLoader's workers receive its descriptor, not its data. Writes raise
    TypeError. A view that is already shared is returned as is. ``backend``: as
    DataLoader's ``shm_backend`` (``"auto"``, ``"memfd"``, ``"posix"``).
    """
    if isinstance(obj, (SharedList, SharedTuple, SharedDict)):
        return obj
    if type(obj) is not tuple and not isinstance(obj, (list, dict)):
        raise TypeError(
            f"share() takes a list, a tuple or a dict (got {type(obj).__name__}): it stores "
            f"{SUPPORTED} inside one. Wrap the value in a list, or keep a numpy array as it is "
            "(an array's buffer is not copied by reading it)."
        )
    data = Writer().finish(obj)
    store = create(data, backend)
    del data
    return view_at(store, L.ROOT)
