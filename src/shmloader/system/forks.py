"""Every hook the package runs at a fork of this process, and the order they run in.

A module with something to do around a fork (``os.fork()``: a worker's start under the
fork start method, a torch DataLoader's worker, a user's own fork) hands its functions to
:func:`register` under its module name; the tuples below place each one, so this module
alone shows what runs at a fork and in which order. A name must be placed there before it
can register: a new hook takes a deliberate place, not the one its import happens to give.

Each place is its own ``os.register_at_fork`` callback, registered when this module is
first imported (before any of the package's hooks exist): one hook that raises is reported
by the interpreter ("Exception ignored in ...") and the others still run, as if each owner
had registered its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable

Hook = Callable[[], None]

# The order the hooks run in, phase by phase. It is the order the owners' own
# registrations gave when each registered at its import (``import shmloader`` imports
# fdguard, then leases, then ringmaker, then the epoch's iterator), kept because it matters:
#
# Before the fork, in the forking thread:
# - ringmaker first: the threads making a ring in the background finish, so no child copies
#   a ring half made, and the leases' current ring (which a maker's thread sets) stands
#   still before the leases look at it;
# - leases: a current ring with slots the consumer holds (batches handed out, which the
#   child can see) is retired for new batches at the next claim.
BEFORE: tuple[str, ...] = ("shmloader.memory.ringmaker", "shmloader.memory.leases")
# After the fork, in the parent: leases look again (a batch handed out by another thread
# between the fork's two moments is seen by one of the two looks).
AFTER_IN_PARENT: tuple[str, ...] = ("shmloader.memory.leases",)
# After the fork, in the child:
# - fdguard first: the consumer's own descriptors (worker sockets' consumer ends, ring
#   descriptors) are closed through their owners, before anything else runs in the child;
# - leases: the parent's rings are the parent's, this process makes its own;
# - the epoch's iterator: the parent's workers are not this process's children, so
#   multiprocessing must not signal and join them at the child's exit.
AFTER_IN_CHILD: tuple[str, ...] = (
    "shmloader.system.fdguard",
    "shmloader.memory.leases",
    "shmloader.epoch.multiprocess",
)

_before: dict[str, Hook] = {}
_after_in_parent: dict[str, Hook] = {}
_after_in_child: dict[str, Hook] = {}


def register(
    name: str,
    *,
    before: Hook | None = None,
    after_in_parent: Hook | None = None,
    after_in_child: Hook | None = None,
) -> None:
    """Run ``name``'s hooks at every fork of this process from now on, each at the place
    its phase's tuple above gives ``name`` (as ``os.register_at_fork``'s arguments of the
    same names). Registering ``name`` again replaces its hooks. Raises ValueError where a
    hook is given for a phase whose tuple does not place ``name``."""
    for phase, order, hooks, hook in (
        ("before", BEFORE, _before, before),
        ("after_in_parent", AFTER_IN_PARENT, _after_in_parent, after_in_parent),
        ("after_in_child", AFTER_IN_CHILD, _after_in_child, after_in_child),
    ):
        if hook is None:
            continue
        if name not in order:
            raise ValueError(
                f"{name!r} has no place among the {phase} fork hooks: add it to "
                f"shmloader.system.forks's order first"
            )
        hooks[name] = hook


def registered(phase: str) -> dict[str, Hook]:
    """The hooks registered for ``phase`` ("before", "after_in_parent" or
    "after_in_child"), by name: a copy, in no particular order (the tuples above give it).
    Raises ValueError for another phase."""
    hooks = {"before": _before, "after_in_parent": _after_in_parent, "after_in_child": _after_in_child}
    if phase not in hooks:
        raise ValueError(f"{phase!r} is not a fork phase: give one of {sorted(hooks)}")
    return dict(hooks[phase])


class _Place:
    """One place in a phase's order: calls the hook registered there, if any."""

    __slots__ = ("_hooks", "_name", "_phase")

    def __init__(self, phase: str, hooks: dict[str, Hook], name: str) -> None:
        self._phase = phase
        self._hooks = hooks
        self._name = name

    def __call__(self) -> None:
        hook = self._hooks.get(self._name)
        if hook is not None:
            hook()

    def __repr__(self) -> str:  # (named in the interpreter's report of a hook that raised)
        hook = self._hooks.get(self._name)
        return f"<fork hook {self._phase} of {self._name}: {hook!r}>"


def _install() -> None:
    # The interpreter runs "before" callbacks in the reverse of their registration, the
    # "after" ones in it: BEFORE is registered backwards so each tuple reads as it runs.
    for name in reversed(BEFORE):
        os.register_at_fork(before=_Place("before", _before, name))
    for name in AFTER_IN_PARENT:
        os.register_at_fork(after_in_parent=_Place("after_in_parent", _after_in_parent, name))
    for name in AFTER_IN_CHILD:
        os.register_at_fork(after_in_child=_Place("after_in_child", _after_in_child, name))


_install()
