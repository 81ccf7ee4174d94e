"""How deep a shared structure's containers nest below a node: what tells a structure that
is merely deep from a corrupt segment when a whole-structure read (a copy, ``==``,
``repr``) runs out of Python's recursion limit.

share() writes containers nested at most :data:`layout.MAX_NESTING` deep, each one after
its children. A path through a segment deeper than that was not written by share(): the
segment is corrupt, and the read ends in a CorruptDataError. A path within it is a
structure as deep as the original, which plain Python's recursive operations refuse
just as they would the original's: the RecursionError stands.

The walk is iterative (it needs no stack of its own) and measures each container node
once: a structure whose sub-containers sit at many places costs its node count, not the
number of its paths.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

import shmloader.memory.shared.layout as L
from shmloader.errors import CorruptDataError
from shmloader.memory.shared.store import Store

_CONTAINERS = (L.LIST, L.TUPLE, L.DICT, L.RECORD)


def _corrupt(what: str) -> CorruptDataError:
    return CorruptDataError(
        f"a shared structure's segment is corrupt: {what}. shmloader.share() never writes "
        "this; a memfd segment is sealed, so another process of this user wrote to a "
        "'posix' segment, or share() has a bug: please report it."
    )


def _too_deep(off: int) -> CorruptDataError:
    return _corrupt(
        f"its containers nest more than {L.MAX_NESTING} deep below byte {off} (share() writes none deeper)"
    )


def _refs(store: Store, start: int, n: int) -> np.ndarray:
    """The ``n`` references at ``start``, checked to lie in the segment."""
    if start < 0 or n < 0 or start + L.REF_SIZE * n > store.size:
        raise _corrupt(f"{n} references at byte {start} lie past the segment's end ({store.size} bytes)")
    return np.frombuffer(store.mm, L.REF_DTYPE, n, start)


def _children(store: Store, tag: int, off: int) -> Iterator[tuple[int, int]]:
    """The (tag, offset) of every container the container node at ``off`` refers to
    directly, each checked to lie before it (so no walk loops)."""
    if off < 0 or off + 16 > store.size:
        raise _corrupt(f"a container at byte {off} lies past the segment's end ({store.size} bytes)")
    if tag in (L.LIST, L.TUPLE):
        form, n = L.SEQ_HEAD.unpack_from(store.mm, off)
        if form != L.REFS:
            return iter(())  # packed str, int or float items: no container below
        refs = _refs(store, off + L.SEQ_HEAD.size, n)
    elif tag == L.RECORD:
        refs = _refs(store, off + L.RECORD_HEAD.size, L.U64.unpack_from(store.mm, off + 8)[0])
    else:
        n = L.U64.unpack_from(store.mm, off)[0]
        refs = _refs(store, off + L.DICT_HEAD.size + L.pad(4 * n), 2 * n)  # keys, then values
    inner = refs[np.isin(refs["tag"], _CONTAINERS)]
    if len(inner) and int(inner["payload"].max()) >= off:
        raise _corrupt(f"the container at byte {off} refers to one at or after itself")
    return zip(inner["tag"].tolist(), inner["payload"].tolist())


def check(store: Store, tag: int, off: int) -> None:
    """A CorruptDataError where containers below the container node at ``off`` (tag
    ``tag``, itself level 1) nest deeper than :data:`layout.MAX_NESTING`. Heights
    measured are kept in ``store.heights`` for the next check."""
    heights = store.heights
    known = heights.get(off)
    if known is not None:
        if known > L.MAX_NESTING:
            raise _too_deep(off)
        return
    # One entry per open container: its offset, its children not yet measured, and the
    # greatest height of those measured.
    path: list[list] = [[off, _children(store, tag, off), 0]]
    while path:
        top = path[-1]
        for child_tag, child in top[1]:
            height = heights.get(child)
            if height is None:
                if len(path) >= L.MAX_NESTING:
                    raise _too_deep(off)
                path.append([child, _children(store, child_tag, child), 0])
                break
            top[2] = max(top[2], height)
        else:
            path.pop()
            height = heights[top[0]] = top[2] + 1
            if len(path) + height > L.MAX_NESTING:
                raise _too_deep(off)
            if path:
                path[-1][2] = max(path[-1][2], height)
