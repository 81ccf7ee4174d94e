"""The calling process's own OS settings and yields: its CPU yield, its scheduling policy
(batch or normal), and the signal that follows its parent's death.

Each call here changes nothing but the calling process; the callers say when and why
(:mod:`shmloader.workers.worker`, :mod:`shmloader.epoch.collector`).
"""

from __future__ import annotations

import enum
import os
import signal

from shmloader.system import slots as _slots

# Give this CPU to whatever else is runnable on it (releases the GIL while it does, so
# this process's other threads run too). The OS call itself, bound once: the collector and
# the worker call it in their yield loops, where another Python call layer would show.
yield_cpu = os.sched_yield


def use_batch_policy() -> bool:
    """Put this process (and the threads and processes it starts after this) under
    Linux's SCHED_BATCH policy, at the same CPU share. True where it took; False where
    the policy is refused (a sandbox) or absent, and nothing changes then."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def use_normal_policy() -> bool:
    """Put the calling thread back under Linux's default policy (SCHED_OTHER, nice
    unchanged). True where it took."""
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def batch_policy_in_force() -> bool:
    """Whether the calling thread runs under SCHED_BATCH now."""
    try:
        return os.sched_getscheduler(0) == os.SCHED_BATCH
    except (AttributeError, OSError):
        return False


class ParentDeath(enum.Enum):
    """What :func:`die_with_parent` could set up."""

    ARMED = "armed"  # the kernel signals this process when its parent thread exits
    REFUSED = "refused"  # prctl refused (a seccomp profile, gVisor): nothing is armed
    PARENT_GONE = "parent gone"  # armed, but the parent had exited before: no signal will come


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> ParentDeath:
    """Ask the kernel to send ``signum`` to this process when its parent thread exits
    (``prctl(PR_SET_PDEATHSIG)``), then check that the parent is still ``parent_pid``.

    Returns :attr:`ParentDeath.REFUSED` where the prctl fails (no signal will follow the
    parent), :attr:`ParentDeath.PARENT_GONE` where the parent had already exited (this
    process was reparented before the signal was armed, so the signal never comes), and
    :attr:`ParentDeath.ARMED` otherwise."""
    try:
        _slots.set_parent_death_signal(signum)
    except OSError:
        return ParentDeath.REFUSED
    if os.getppid() != parent_pid:
        return ParentDeath.PARENT_GONE
    return ParentDeath.ARMED
