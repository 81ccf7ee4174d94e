"""The sizing policy of a loader's rings: how many slots, how big, how much memory.

Used by the leases (:mod:`shmloader.memory.leases`, which make the rings), ``shmloader doctor``
and ``shmloader bench`` (which report what a loader would make). The bound on a loader's
rings is ``max_shm_bytes`` (default: half of what the backend can give,
:mod:`shmloader.system.limits`); each ring also leaves a margin of what is there when it is made
(:func:`shmloader.system.limits.ring_room`, with :func:`margin_reserve`). The first ring gets
fewer slots than the default where memory is short, down to one in flight per worker
plus two (:func:`min_num_slots`), with one :class:`~shmloader.errors.RingSizeWarning`
(:class:`SizeWarnings`: emitted from the consumer's thread even for a ring made on
another); when not even those fit, the error names the limit that binds first
(:func:`explain`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

from shmloader.errors import RingLimitError, RingSizeWarning, ShmSpaceError, user_stacklevel
from shmloader.memory.ring import (
    SLOT_HEADROOM,
    SLOT_SLACK_BYTES,
    ring_bytes,
)
from shmloader.system import limits as memory

HELD_SLOTS_RESERVE = 4  # slots for batches the consumer still holds (the current one,
# the previous one still bound to the loop variable during next(), a few more)
DEFAULT_PREFETCH_FACTOR = 2  # torch's default prefetch_factor
DEFAULT_MAX_SHM_BYTES = 8 * 2**30  # where no memory figure can be read
IN_FLIGHT_EXTRA_SLOTS = 2  # beside one in flight per worker: the batch being handed
# out and the previous one, still bound to the loop variable during next()


def default_num_slots(num_workers: int, prefetch_factor: int = DEFAULT_PREFETCH_FACTOR) -> int:
    """Slots of a loader's first ring: every worker's prefetched batches, plus a reserve
    for the batches the consumer holds. (Slots nothing writes take no memory where rings
    are made sparse: :func:`shmloader.memory.ring.populate_supported`.)"""
    return num_workers * prefetch_factor + HELD_SLOTS_RESERVE


def slot_bytes_for(batch_bytes: int) -> int:
    """Bytes per slot of a ring sized from a batch of ``batch_bytes``."""
    return int(batch_bytes * SLOT_HEADROOM) + SLOT_SLACK_BYTES


def min_num_slots(num_workers: int) -> int:
    """The fewest slots a ring adapted to short memory gets: one batch in flight per
    worker, the batch being handed out and the previous one."""
    return num_workers + IN_FLIGHT_EXTRA_SLOTS


def default_max_shm_bytes(backend: str = "auto") -> int:
    """The default bound on a loader's rings: half of what ``backend`` can give now
    (:func:`shmloader.system.limits.budget`: the machine's available memory, the cgroup's
    headroom and, for posix, /dev/shm's free space). Each ring is also held to what is
    there when it is made, less a margin (:func:`shmloader.system.limits.ring_room`), which keeps
    the cgroup's OOM killer away from the processes."""
    from shmloader.system.segment import resolve_backend

    return half_budget(memory.budget(resolve_backend(backend)))


def half_budget(budget: memory.Budget | None) -> int:
    """Half of ``budget``'s bytes (the default max_shm_bytes), or the fixed default where
    nothing could be read."""
    return budget.bytes // 2 if budget is not None and budget.bytes else DEFAULT_MAX_SHM_BYTES


def have(budget: memory.Budget) -> str:
    """``budget``'s bytes in words, for messages."""
    return "an unknown amount" if budget.bytes is None else memory.mib(budget.bytes)


def margin_reserve(num_workers: int, slot_bytes: int) -> int:
    """What the processes allocate beside a ring of ``slot_bytes`` slots once it is made:
    about one batch (the batch such a slot was sized for) per worker, which holds its
    samples while it collates the next one. Kept free, with 32 MiB more, by
    :func:`shmloader.system.limits.ring_room`. (Under a cgroup limit the peak is the
    usage when the ring was made, plus the ring, plus one batch per worker. The consumer
    hands out views of the ring and needs no batch of its own: reserving one for it too
    would refuse limits under which torch's DataLoader works.)"""
    batch = max(0, int((slot_bytes - SLOT_SLACK_BYTES) / SLOT_HEADROOM))
    return num_workers * batch


def first_ring_room(budget: memory.Budget, num_workers: int, slot_bytes: int) -> int | None:
    """The bytes a loader with the default max_shm_bytes, made where ``budget`` is what
    the backend can give, lets its first ring take (what ``shmloader doctor`` reports):
    half of the budget, and no more than it leaves beside the margin."""
    if budget.bytes is None:
        return None
    now = memory.ring_room(budget, margin_reserve(num_workers, slot_bytes))
    return min(half_budget(budget), now if now is not None else budget.bytes)


def fit_slots(num_slots: int, slot_bytes: int, room: int, least: int) -> int | None:
    """The most slots, at most ``num_slots`` and at least ``least``, of a ring of
    ``slot_bytes`` slots that fits in ``room`` bytes; None when not even ``least`` fits."""
    for n in range(num_slots, least - 1, -1):
        if ring_bytes(n, slot_bytes) <= room:
            return n
    return None


def default_ring(
    num_workers: int, batch_bytes: int, prefetch_factor: int = DEFAULT_PREFETCH_FACTOR
) -> tuple[int, int, int]:
    """(total bytes, slots, bytes per slot) of the ring a loader makes for batches of
    ``batch_bytes`` (what doctor and bench report)."""
    slots = default_num_slots(num_workers, prefetch_factor)
    slot_bytes = slot_bytes_for(batch_bytes)
    return ring_bytes(slots, slot_bytes), slots, slot_bytes


# --- what binds, in words -------------------------------------------------------------------


def explain(
    room: int,
    max_binds: bool,
    fresh: memory.Budget,
    *,
    max_shm_bytes: int,
    explicit_max: bool,
    start_budget: memory.Budget | None,
) -> tuple[str, str, bool]:
    """(What leaves only ``room`` bytes for a loader's rings, its figures first; the
    remedy; whether it is an explicit max_shm_bytes rather than the memory there.)
    ``max_binds``: the bound is ``max_shm_bytes`` (``explicit_max``: the user's; else half
    of ``start_budget``, what was there when the loader was made), not the memory there
    now (``fresh``) less the margin."""
    if max_binds and explicit_max:
        return (
            f"max_shm_bytes={max_shm_bytes} (passed to the loader) leaves {memory.mib(room)}",
            "pass a larger max_shm_bytes, or use a smaller batch_size or fewer num_workers",
            True,
        )
    start = start_budget
    if max_binds and start is not None and start.bytes is not None:
        return (
            f"{start.cause()} left {memory.mib(start.bytes)} when the loader was made, of "
            f"which its rings take at most half by default ({memory.mib(max_shm_bytes)})",
            f"{start.remedy()}, or pass a larger max_shm_bytes",
            False,
        )
    return (
        f"{fresh.cause()} leaves {have(fresh)}, of which the loader's rings may take "
        f"{memory.mib(room)} (the rest is margin for the processes' own memory)",
        fresh.remedy(),
        False,
    )


def first_ring_slots(
    num_slots: int,
    slot_bytes: int,
    least: int,
    bound: int,
    now: int | None,
    why: Callable[[int, bool], tuple[str, str, bool]],
    notes: SizeWarnings,
) -> int:
    """The slots of a loader's first ring: ``num_slots`` where they fit ``bound`` (what
    max_shm_bytes leaves) and ``now`` (what the memory there leaves beside the margin;
    None: unknown), else fewer, down to ``least``, with one warning (``notes``); an
    error naming the binding limit first (``why(room, max_binds)``: see :func:`explain`)
    when not even those fit."""
    room = bound if now is None else min(bound, now)
    fit = fit_slots(num_slots, slot_bytes, room, least)
    text, remedy, limit_binds = why(room, now is None or bound <= now)
    if fit is None:
        need = ring_bytes(least, slot_bytes)
        message = (
            f"{memory.sentence(text)}; the loader's shared-memory ring needs at least {need} bytes "
            f"({memory.mib(need)}: {least} slots of {memory.mib(slot_bytes)}, one batch in "
            f"flight per worker, the batch being handed out and the previous one). "
            f"To fix it: {remedy}."
        )
        raise RingLimitError(message) if limit_binds else ShmSpaceError(message)
    if fit < num_slots:
        notes.warn_once(
            f"the loader's ring has {fit} slots instead of {num_slots} "
            f"({memory.mib(slot_bytes)} each) because {text}; workers prefetch fewer batches "
            f"(the ring needs {memory.mib(ring_bytes(num_slots, slot_bytes))} for "
            f"{num_slots}). To keep them all: {remedy}."
        )
    return fit


# --- the one warning ------------------------------------------------------------------------


class SizeWarnings:
    """A loader's one :class:`~shmloader.errors.RingSizeWarning`. A ring made on a ring
    maker's thread (:mod:`shmloader.memory.ringmaker`) keeps its warning for the consumer's
    thread to emit: a warning must point at the user's line and reach the warning
    filters the user set, not a thread's."""

    def __init__(self) -> None:
        self.warned = False
        self._deferring = threading.local()
        self._deferred: list[str] = []

    def warn_once(self, text: str) -> None:
        """Warn with ``text`` unless this loader already did (kept for :meth:`emit` in a
        :meth:`deferred` block)."""
        if self.warned:
            return
        self.warned = True
        self._deferred.append(text)
        if not getattr(self._deferring, "on", False):
            self.emit()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Warnings raised in this block (on this thread) are kept for :meth:`emit`."""
        self._deferring.on = True
        try:
            yield
        finally:
            self._deferring.on = False

    def emit(self) -> None:
        """Emit the warnings kept so far (from the consumer's thread)."""
        while self._deferred:
            warnings.warn(self._deferred.pop(0), RingSizeWarning, stacklevel=user_stacklevel())
