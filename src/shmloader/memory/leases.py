"""Rings and slot leases: the one owner of a loader's shared memory.

A :class:`Leases` holds a loader's current ring (where new batches go) and counts the
retired ones (rings that grew or were shared with a forked child: freed when the last
batch viewing them dies). It makes each ring as :mod:`shmloader.memory.sizing` says (the bound
``max_shm_bytes``, fewer slots for the first ring where memory is short, the one
:class:`~shmloader.errors.RingSizeWarning`), and names the limit that binds when a ring
cannot be made. It claims slots for tasks, grows the ring
when the consumer holds every slot, and leases a handed-out slot to its batch: the slot
returns to FREE when the batch's root array dies.

A grown ring goes back to the first ring's slot count once the batches that made it
grow are gone (checked at a claim, every few batches and at each epoch's start): a new
ring of that size takes the next batches, and the grown one, retired, is freed when its
last batch dies (its free slots' memory at once). A shrink that the loop's own pattern
undoes at once (a ring that grows again within the wait) doubles the wait before the
next mid-epoch check, so a loop that keeps batches in bursts does not remake rings.

Three rules keep a held slot from being rewritten:

- **Only the owning process releases.** A lease's finalizer remembers the pid that took
  it; in a forked child (the next epoch's workers, ``os.fork()``, multiprocessing), which
  inherits the finalizer, it does nothing.
- **A batch a forked child can see is never rewritten.** On a fork the loader did not
  make itself (its own worker starts are marked with :func:`own_forks`), a ring with a
  HELD slot is retired for new batches at the next claim, as a ring that grows is.
- **A slot's state is returned whatever raises**: the lease is taken on the root array
  before anything can raise, and the slot is freed when that root dies.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from shmloader.errors import RingLimitError, ShmSpaceError
from shmloader.memory import sizing
from shmloader.memory.ring import NO_SLOT, Ring, populate_supported, ring_bytes
from shmloader.memory.sizing import half_budget, slot_bytes_for
from shmloader.system import forks
from shmloader.system import limits as memory
from shmloader.system import slots as _slots
from shmloader.system.segment import check_usable, resolve_backend, shm_free_bytes

# --- leases -------------------------------------------------------------------------------

_this_pid = os.getpid()  # updated in a forked child (at-fork hook): no syscall per release


class _SlotLeases:
    """The leases of one ring's slots in the process that made them: at most one live
    batch root per slot, watched by a weak reference whose callback frees the slot.
    (A weakref with a callback made once per slot costs a fraction of a
    ``weakref.finalize`` per batch.)"""

    __slots__ = ("callbacks", "pinners", "refs")

    def __init__(self, states: Any, num_slots: int) -> None:
        pid = _this_pid  # the owner: a forked child inherits the callbacks, and they do nothing
        pinners: list[Any] = [None] * num_slots

        def make(slot: int) -> Any:
            # ``states`` keeps the ring's state words mapped for the callbacks.
            free = states.setter(slot, _slots.FREE)

            def release(_ref: Any) -> None:
                if _this_pid == pid:
                    pinner = pinners[slot]
                    if pinner is None:
                        free()
                    else:  # FREE once the device copies issued from the slot are done
                        pinner.release(states, slot)

            return release

        self.callbacks = [make(i) for i in range(num_slots)]
        self.pinners = pinners
        self.refs: list[Any] = [None] * num_slots


def lease(root: Any, ring: Any, slot: int, pinner: Any = None) -> None:
    """Lease ``slot`` of ``ring`` (already HELD) to the batch viewing ``root``: it returns
    to FREE when ``root`` dies (with ``pinner``: once the device copies issued from it are
    done too), in this process only."""
    table = ring.lease_table
    if table is None:
        table = ring.lease_table = _SlotLeases(ring.states, ring.num_slots)
    # A slot is leased again only once FREE, i.e. after the previous root's callback ran.
    table.pinners[slot] = pinner
    table.refs[slot] = weakref.ref(root, table.callbacks[slot])


def give_back(ring: Any, slot: int) -> None:
    """Return ``slot`` of ``ring``, never handed out (or copied out), to FREE; nothing
    for a task without a slot or outside the process that took it."""
    if slot >= 0 and ring is not None:
        ring.states.store(slot, _slots.FREE)


def held_slots(ring: Ring) -> int:
    """How many of ``ring``'s slots are HELD (by batches, or pinned copies in flight)."""
    load = ring.states.load
    return sum(load(i) == _slots.HELD for i in range(ring.num_slots))


_live: weakref.WeakSet = weakref.WeakSet()
_forking = threading.local()
_MAX_CHECK_EVERY = 4096  # batches: the longest wait between looks at a grown ring
_SOON_WAITS = 4  # a shrunk ring that grows again within this many waits: a burst


class Leases:
    """The rings of one loader: the current one and the retired ones still alive.

    Live iterators of one loader (``zip(dl, dl)``) share them: each claims from the
    current ring, and one whose ring another iterator retired moves to the current ring
    (:meth:`ring_for_batch`) rather than hand its workers a closed descriptor."""

    def __init__(
        self,
        num_slots: int,
        max_shm_bytes: int | None,
        pinner: Any,
        stats: dict[str, Any],
        *,
        backend: str = "auto",
        min_slots: int | None = None,
        num_workers: int = 0,
    ) -> None:
        """``num_slots``: slots of the first ring; ``max_shm_bytes``: the user's bound, or
        None for the default (:func:`default_max_shm_bytes`); ``pinner``: a
        pinning.RingPinner or None; ``stats``: the loader's counters (``rings_created`` is
        bumped here); ``backend``: the rings' (segment.resolve_backend); ``min_slots``: where
        given, the first ring may get fewer slots, down to this, when memory is short
        (None: ``num_slots`` was the user's, and is kept); ``num_workers``: the loader's,
        for the memory margin (each worker holds a batch's samples while it collates)."""
        self.num_slots = num_slots
        self.num_workers = num_workers
        self.backend = backend
        self.min_slots = min_slots
        if num_workers > 0:
            # Where neither backend can work here (memfd refused and no writable /dev/shm,
            # or the one asked for), say so now, when the loader is made.
            check_usable(backend)
        self.explicit_max = max_shm_bytes is not None
        # The default bound: half of what the backend could give when the loader was made.
        self._start_budget = None if self.explicit_max else memory.budget(resolve_backend(backend))
        self._max_shm_bytes = max_shm_bytes if max_shm_bytes is not None else half_budget(self._start_budget)
        self._notes = sizing.SizeWarnings()  # the one RingSizeWarning (deferred on a maker's thread)
        self.pinner = pinner
        self._stats = stats
        self._current: Ring | None = None
        self._steady_slots = num_slots  # the first ring's slots (fewer where memory was short)
        self._grown: Ring | None = None  # the current ring while it has more slots than that
        # When to look at a grown ring again, counted in batches handed out (no counting
        # on the per-batch path): at _check_at; then every _check_every batches.
        self._check_at = 0
        self._check_every = num_slots
        self._shrunk_at: int | None = None  # batches when a shrink made the current ring
        self._lock = threading.Lock()
        self._mappings: list[tuple[weakref.ref, int]] = []  # every ring made: (owner, bytes)
        # The current ring when a fork the loader did not make saw a HELD slot in it.
        self._shared_ring: Ring | None = None
        _live.add(self)

    @property
    def max_shm_bytes(self) -> int:
        """The bound on the bytes of all of this loader's rings together."""
        return self._max_shm_bytes

    @max_shm_bytes.setter
    def max_shm_bytes(self, value: int) -> None:
        self._max_shm_bytes = value
        self.explicit_max = True
        self._start_budget = None

    @property
    def current(self) -> Ring | None:
        """The ring new batches go to, or None before the first batch sized it."""
        return self._current

    def usable(self) -> Ring | None:
        """The current ring when this process can hand it to new workers (a process
        forked from the one that made it has no ring of its own yet)."""
        ring = self._current
        return ring if ring is not None and ring.fd is not None else None

    def rings_are_cheap(self) -> bool:
        """True when this loader's rings are made sparse (each slot reserved by its first
        writer: ring.populate_supported), so making one takes well under a millisecond."""
        return self.pinner is None and populate_supported()

    def pinned_bytes(self) -> int:
        """Bytes of shared memory mapped by this loader's rings now: the current ring,
        and retired rings that batches still reference."""
        self._mappings = [(ref, size) for ref, size in self._mappings if ref() is not None]
        return sum(size for _, size in self._mappings)

    def new_ring(self, num_slots: int, slot_bytes: int, *, held: int = 0) -> Ring:
        """Make a new current ring (the old one is retired: it is freed when the last
        batch viewing it dies). The first ring may get fewer slots where memory is short
        (see ``min_slots``). Raises :class:`RingLimitError` when that would pass
        ``max_shm_bytes`` (``held``: batches the consumer holds, for the message), and
        :class:`ShmSpaceError` when the memory is not there (the margin kept), naming
        the limit that binds."""
        with self._lock:
            pinned = self.pinned_bytes()
            fresh = memory.budget(resolve_backend(self.backend))
            if self._current is None and self.min_slots is not None:
                num_slots = self._fit_first(num_slots, slot_bytes, pinned, fresh)
            need = ring_bytes(num_slots, slot_bytes)
            room = memory.ring_room(fresh, self._reserve(slot_bytes))
            if pinned + need > self.max_shm_bytes or (room is not None and need > room):
                raise self._limit_error(need, pinned, held, fresh, room)
            # A ring page-locked for a GPU locks every page at once: reserved whole.
            ring = Ring.create(
                num_slots, slot_bytes, backend=self.backend, whole=self.pinner is not None, budget=fresh
            )
            self._stats["rings_created"] += 1
            if self.pinner is not None:
                self.pinner.register(ring)  # page-locked once, for the ring's whole life
            owner = ring.mapping.owner
            self._mappings.append((weakref.ref(owner), len(owner)))
            old, self._current = self._current, ring
            if old is None:
                self._steady_slots = self._check_every = num_slots
            self._grown = ring if num_slots > self._steady_slots else None
            self._check_at = self._stats.get("batches", 0) + self._check_every
            self._shrunk_at = None
            if old is not None:
                old.close_fd()  # its memory stays mapped while batches view it
            return ring

    def need_slots(self, num_slots: int, num_workers: int) -> None:
        """An epoch's counts (``num_workers``, each with its prefetch in flight, as torch's
        iterator keeps them) need ``num_slots``, more than the loader was made for (its
        ``num_workers`` or ``prefetch_factor`` were raised since): rings made from now on
        get that many, and a current ring with fewer is replaced now (it retires: batches
        viewing it stay valid), or kept where the memory for more is not there. A slot
        count the user gave (``num_slots=``) is kept."""
        if self.min_slots is None or num_slots <= self.num_slots:
            return
        self.num_slots = self._steady_slots = self._check_every = num_slots
        self.min_slots = max(self.min_slots, sizing.min_num_slots(num_workers))
        self.num_workers = max(self.num_workers, num_workers)
        ring = self._current
        if ring is not None and ring.num_slots < num_slots:
            try:
                self.new_ring(num_slots, ring.slot_bytes, held=held_slots(ring))
            except (RingLimitError, ShmSpaceError):
                pass  # (the smaller ring serves, as a first ring fitted to short memory)

    def _reserve(self, slot_bytes: int) -> int:
        return sizing.margin_reserve(self.num_workers, slot_bytes)

    def _fit_first(self, num_slots: int, slot_bytes: int, pinned: int, fresh: memory.Budget) -> int:
        """The slots of the first ring: ``num_slots`` where they fit ``max_shm_bytes`` and
        the memory there now (less the margin), else fewer (one warning), down to
        ``min_slots``; an error naming the binding limit first when not even those fit
        (sizing.first_ring_slots)."""
        now = memory.ring_room(fresh, self._reserve(slot_bytes))
        least = min(self.min_slots or num_slots, num_slots)
        return sizing.first_ring_slots(
            num_slots,
            slot_bytes,
            least,
            self.max_shm_bytes - pinned,
            now,
            lambda room, max_binds: self._why(room, max_binds, fresh),
            self._notes,
        )

    def warnings_deferred(self) -> contextlib.AbstractContextManager[None]:
        """Rings made in this block (on this thread) keep their warning for
        :meth:`emit_warnings`."""
        return self._notes.deferred()

    def emit_warnings(self) -> None:
        """Emit the warnings kept so far (from the consumer's thread)."""
        self._notes.emit()

    def _why(self, room: int, max_binds: bool, fresh: memory.Budget) -> tuple[str, str, bool]:
        """sizing.explain with this loader's bound."""
        return sizing.explain(
            room,
            max_binds,
            fresh,
            max_shm_bytes=self.max_shm_bytes,
            explicit_max=self.explicit_max,
            start_budget=self._start_budget,
        )

    def _limit_error(
        self, need: int, pinned: int, held: int, fresh: memory.Budget, room: int | None
    ) -> MemoryError:
        """The error for a ring of ``need`` bytes that passes max_shm_bytes, or ``room``
        (what the memory there now leaves it): what binds first, then the remedy."""
        kind = resolve_backend(self.backend)
        max_binds = pinned + need > self.max_shm_bytes
        if max_binds and (held or self.explicit_max):
            # The user's bound, or the batches the user keeps: RingLimitError says which.
            return limit_error(self.max_shm_bytes, need, pinned, held, backend=kind)
        # The memory there (now, or behind the default max_shm_bytes): ShmSpaceError.
        mapped = f" (the loader's rings already map {memory.mib(pinned)})" if pinned else ""
        if held:
            mapped += f"; it grows because the consumer holds {held} batch{'es' if held != 1 else ''}"
        left = self.max_shm_bytes - pinned if max_binds else room or 0
        why, remedy, _ = self._why(left, max_binds, fresh)
        return ShmSpaceError(
            f"{memory.sentence(why)}; the loader's next ring needs {need} bytes ({memory.mib(need)})"
            f"{mapped}. To fix it: {remedy}, or ask for a smaller ring with a lower num_slots "
            "or prefetch_factor."
        )

    def ring_for_batch(self, batch_bytes: int, like: Ring | None) -> Ring:
        """A new current ring whose slots hold a batch of ``batch_bytes`` (the first
        batch, or one that outgrew the slots of ``like``), with ``like``'s slot count;
        or the current ring, where another iterator of the loader made it since ``like``
        and its slots hold such a batch (live iterators share the loader's rings)."""
        with self._lock:
            current = self._current
            if (
                current is not None
                and current is not like
                and current.fd is not None
                and batch_bytes <= current.slot_bytes
            ):
                return current
        num_slots = self.num_slots if like is None else like.num_slots
        return self.new_ring(num_slots, slot_bytes_for(batch_bytes))

    def claim(self, start: int) -> tuple[Ring | None, int]:
        """Claim a FREE slot of the current ring for a task, from ``start`` on; returns
        the ring (a new one when the current had to grow or retire) and the slot, or
        (None, NO_SLOT) before the first ring."""
        ring = self._current
        if ring is None:
            return None, NO_SLOT
        slot = ring.states.claim(start % ring.num_slots, _slots.FREE, _slots.ASSIGNED)
        if slot < 0 or self._shared_ring is not None or self._grown is not None:
            return self._claim_slow(ring, slot)
        return ring, slot

    def _claim_slow(self, ring: Ring, slot: int) -> tuple[Ring, int]:
        if self._grown is ring and slot >= 0:
            smaller = self._shrink(ring)
            if smaller is not None:
                ring.states.store(slot, _slots.FREE)  # (the grown ring takes no new batch)
                return smaller, smaller.states.claim(0, _slots.FREE, _slots.ASSIGNED)
        shared = self._shared_ring
        if shared is ring:
            # A forked child may view batches in this ring: no new batch goes there (the
            # slot just claimed stays unused; the ring is freed when its batches die).
            if slot >= 0:
                ring.states.store(slot, _slots.FREE)
            # (If this raises, the ring stays shared: the next claim tries again.)
            ring = self.new_ring(ring.num_slots, ring.slot_bytes, held=held_slots(ring))
            if self._shared_ring is shared:
                self._shared_ring = None
            return ring, ring.states.claim(0, _slots.FREE, _slots.ASSIGNED)
        if shared is not None:
            self._shared_ring = None  # a ring retired since: nothing claims from it
        if slot >= 0:
            return ring, slot
        states = ring.states
        # Pinned: released slots whose device copies are done, else wait for the oldest.
        if self.pinner is not None and self.pinner.reclaim(block=True):
            slot = states.claim(0, _slots.FREE, _slots.ASSIGNED)
        # Batches kept alive only by reference cycles: a young collection first (batches
        # just dropped into cycles are young; it walks only recent objects), the full one
        # only if that freed no slot. A full collection walks the whole heap, slow with big
        # libraries imported: so at most once per exhausted ring.
        for generation in (1, 2):
            if slot >= 0:
                break
            gc.collect(generation)
            slot = states.claim(0, _slots.FREE, _slots.ASSIGNED)
        if slot < 0:
            # Every slot is held by batches the consumer keeps (the loader's own in-flight
            # batches are bounded below num_slots): grow rather than stall.
            self._note_regrowth()
            ring = self.new_ring(ring.num_slots * 2, ring.slot_bytes, held=held_slots(ring))
            slot = ring.states.claim(0, _slots.FREE, _slots.ASSIGNED)
        return ring, slot

    def _shrink(self, ring: Ring, due: bool = True) -> Ring | None:
        """A new current ring of the first ring's slot count in place of the grown
        ``ring``, when it is time to look (``due``: by the schedule, else now) and the
        slots in use there now (held by the consumer, in flight, the one just claimed)
        leave that count the slots a steady loop keeps spare; else None (also when the
        new ring cannot be made now: the grown one serves on). The grown ring retires:
        its free slots' memory goes back at once, the rest as its batches die."""
        batches = self._stats.get("batches", 0)
        if due and batches < self._check_at:
            return None
        self._check_at = batches + self._check_every
        steady = self._steady_slots
        in_use = ring.num_slots - ring.states.count(_slots.FREE)
        if in_use + sizing.IN_FLIGHT_EXTRA_SLOTS > steady:
            return None
        try:
            smaller = self.new_ring(steady, ring.slot_bytes)
        except (RingLimitError, ShmSpaceError):
            return None  # (the grown ring serves until the memory is there)
        self._shrunk_at = batches
        if self.pinner is None:  # (a page-locked ring keeps its pages until unmapped)
            ring.release_free_slots()
        if self._shared_ring is ring:
            self._shared_ring = None
        return smaller

    def _note_regrowth(self) -> None:
        """The current ring must grow: when a shrink made it a short while ago (a few
        waits), the loop keeps batches in bursts: wait twice as long before the next
        mid-epoch look (else back to the first ring's slot count)."""
        if self._shrunk_at is None:
            return
        soon = self._stats.get("batches", 0) - self._shrunk_at < _SOON_WAITS * self._check_every
        self._check_every = min(2 * self._check_every, _MAX_CHECK_EVERY) if soon else self._steady_slots

    def new_epoch(self) -> Ring | None:
        """An epoch begins, nothing of the loader's in flight: a grown ring whose slots in
        use (batches the loop still holds) leave the first ring's count its spare slots
        is replaced now, whatever the wait (a loop that kept an epoch's batches dropped
        them at its end). Returns the new current ring, or None where none was made."""
        ring = self._current
        if ring is None or self._grown is not ring:
            return None
        return self._shrink(ring, due=False)

    def _note_fork(self) -> None:
        ring = self._current
        if ring is not None and self._shared_ring is not ring and held_slots(ring):
            self._shared_ring = ring

    def _forget_parent(self) -> None:
        # In a forked child: the parent's ring is the parent's; this process makes its own.
        self._current = None
        self._shared_ring = None


@contextlib.contextmanager
def own_forks() -> Iterator[None]:
    """Forks made in this block (in this thread) are the loader's own worker starts:
    they do not see the consumer's batches, so they retire no ring."""
    _forking.own = True
    try:
        yield
    finally:
        _forking.own = False


def _note_fork() -> None:
    # Runs before the fork and again after it in the parent: a batch handed out in
    # another thread between the two is seen by one of them.
    if getattr(_forking, "own", False):
        return
    for leases in list(_live):
        leases._note_fork()


def _after_fork_in_child() -> None:
    global _this_pid
    _this_pid = os.getpid()
    for leases in list(_live):
        leases._forget_parent()


forks.register(__name__, before=_note_fork, after_in_parent=_note_fork, after_in_child=_after_fork_in_child)


# --- errors -------------------------------------------------------------------------------


def limit_error(
    max_shm_bytes: int, need: int, pinned: int, held: int, backend: str = "posix"
) -> RingLimitError:
    """The error for a ring of ``need`` bytes that would pass ``max_shm_bytes`` with
    ``pinned`` bytes of rings mapped and ``held`` batches held by the consumer. It leads
    with what binds: the held batches where there are any, else max_shm_bytes.
    (``backend``: the rings', for the /dev/shm hint.)"""
    hint = shm_size_hint(need) if backend == "posix" else ""
    if held:
        return RingLimitError(
            f"The consumer holds {held} batch{'es' if held != 1 else ''}, which pin {pinned} bytes "
            "of rings, and the next "
            f"ring needs {need} more: that passes max_shm_bytes={max_shm_bytes} bytes. Drop "
            "batches you no longer need, keep .copy() of the ones you keep (or iterate with "
            "copy=True), or pass a larger max_shm_bytes." + hint
        )
    mapped = f" (the loader's rings already map {pinned} bytes)" if pinned else ""
    return RingLimitError(
        f"max_shm_bytes={max_shm_bytes} bytes (passed to the loader) is too small: the loader's "
        f"next ring needs {need} bytes{mapped}. Pass a larger max_shm_bytes, use a smaller "
        "batch_size or fewer num_workers, or ask for a smaller ring with a lower num_slots or "
        "prefetch_factor." + hint
    )


def shm_size_hint(need: int) -> str:
    """When /dev/shm itself is small (the posix backend's default max_shm_bytes is at most
    half its free space), say so and name the container remedies, as ShmSpaceError does."""
    free = shm_free_bytes()
    if free is None or need <= free // 2:
        return ""
    return (
        f" /dev/shm has only {free / 2**20:.1f} MiB free for a ring of {need} bytes: give the "
        "container more shared memory (docker run --shm-size=2g or --ipc=host), or ask for a "
        "smaller ring with a lower num_slots, slot_bytes, prefetch_factor or num_workers."
    )
