"""Which ring an iterator's workers write into: the slots its tasks claim, a ring to make
when a batch came outside the ring, and the workers (running or about to start) that must
learn of a new one.

The first batch of each worker comes outside any ring (a one-off segment, or pickled) and
sizes the ring, unless the batch's bytes were known before any batch (a write-into
dataset's ``sample_spec``) and a ring is cheap to make: then the first ring is made
before the workers start (:meth:`RingKeeper.make_first`). A batch that outgrew its slot
asks for a ring of larger slots (unless the
user fixed ``slot_bytes``). Reserving a ring of big slots takes tens of ms, so such a ring
is made on a thread (:class:`~shmloader.memory.ringmaker.RingMaker`) while the batches
already here are handed out; a small one is made in line. A new ring goes to every
worker as a frame: each reads its socket in order, so the tasks it was given before keep
their old ring.
"""

from __future__ import annotations

from shmloader.epoch.courier import Courier
from shmloader.memory import leases as _leases
from shmloader.memory.leases import Leases
from shmloader.memory.ring import NO_SLOT, Ring
from shmloader.memory.ringmaker import BACKGROUND_MIN_BATCH_BYTES, RingMaker
from shmloader.system import slots as _slots
from shmloader.workers.worker import WorkerConfig


class RingKeeper:
    """The current ring of one iterator, the slot claims of its tasks, the ring a batch
    asked for, and the configs of workers made and not started yet (they take a new ring
    as the running workers take its frame)."""

    __slots__ = ("_courier", "_fixed_slot_bytes", "_leases", "_maker", "_unlaunched", "ring", "wanted")

    def __init__(self, leases: Leases, courier: Courier, fixed_slot_bytes: bool) -> None:
        self._leases = leases
        self._courier = courier
        self._fixed_slot_bytes = fixed_slot_bytes  # the user chose slot_bytes: the ring never grows
        self.ring: Ring | None = None
        self.wanted = 0  # slot bytes a batch that came outside the ring needs: a ring to make
        self._maker: RingMaker | None = None  # making that ring meanwhile, on a thread
        self._unlaunched: dict[int, WorkerConfig] = {}

    # --- the ring at an epoch's start ------------------------------------------------------

    def need_slots(self, num_slots: int, num_workers: int) -> None:
        """The epoch's counts need ``num_slots`` in the loader's rings
        (:meth:`~shmloader.memory.leases.Leases.need_slots`); call before
        :meth:`take_current`."""
        self._leases.need_slots(num_slots, num_workers)

    def take_current(self) -> None:
        """Start from the loader's current ring. One whose descriptor is closed (this
        process was forked from the one that made it) cannot be handed to new workers:
        the first batch sizes a new one."""
        self.ring = self._leases.usable()

    def new_epoch(self, workers_running: bool) -> None:
        """An epoch begins with nothing in flight: a ring that grew for batches the loop
        kept last epoch goes back to its first size when they are gone (running workers
        get it now; new ones start with it)."""
        smaller = self._leases.new_epoch()
        if smaller is not None and workers_running:
            self.adopt(smaller)

    def make_first(self, batch_bytes: int) -> None:
        """Where there is no ring yet, a batch's slot bytes are known before any batch
        (``batch_bytes``; 0: not known) and a ring costs little to make (sparse: each
        slot reserved by its first writer), make the first ring now, before the workers
        start: their first batches go straight into it instead of one-off segments of
        their own (fresh pages never reused, mapped and unmapped again, then a ring)."""
        if self.ring is None and batch_bytes > 0 and self._leases.rings_are_cheap():
            self.adopt(self._leases.ring_for_batch(batch_bytes, None))

    def for_new_worker(self) -> Ring | None:
        """The ring a worker starting now writes into. Where another iterator of the loader
        retired this one (its descriptor is closed), every worker moves to the current one,
        as when the ring grows."""
        ring = self.ring
        if ring is not None and ring.fd is None:
            ring = self._leases.usable()
            if ring is not None:
                self.adopt(ring)
        return ring

    def starting(self, wid: int, config: WorkerConfig) -> None:
        """Worker ``wid`` is made with ``config`` and not started yet: a new ring goes into it."""
        self._unlaunched[wid] = config

    def started(self, wid: int) -> None:
        """Worker ``wid`` runs: a new ring reaches it by frame."""
        self._unlaunched.pop(wid, None)

    def forget_starting(self) -> None:
        """The workers being started are all started (or failed to start)."""
        self._unlaunched.clear()

    # --- slots ---------------------------------------------------------------------------

    def claim(self, wid: int, num_workers: int) -> int:
        """A slot for worker ``wid``'s next task (NO_SLOT before the first batch sized the
        ring). The leases may hand back a new ring (grown, or the old one shared with a
        forked child): the workers get it before the task that uses it."""
        ring = self.ring
        if ring is None:
            return NO_SLOT
        # Each worker looks first in its own share of the slots: a worker keeps writing the
        # few slots it already faulted in (pages are mapped per process), instead of every
        # worker faulting in every slot.
        ring, slot = self._leases.claim(wid * ring.num_slots // num_workers)
        if ring is not self.ring and ring is not None:
            self.adopt(ring)
        return slot

    def reclaim(self, ring: Ring | None, slot: int, wid: int, num_workers: int) -> tuple[Ring | None, int]:
        """The slot of a task sent again to the worker that replaced ``wid``'s last: a
        slot of the current ring is kept (the old worker is reaped: nothing writes it now,
        and it is handed out only on the new worker's result); a slot of a retired ring
        goes back and the task gets one of the current ring (the only one the new worker
        knows)."""
        if slot != NO_SLOT and ring is self.ring and ring is not None:
            ring.states.store(slot, _slots.ASSIGNED)
            return ring, slot
        _leases.give_back(ring, slot)
        slot = self.claim(wid, num_workers)
        return self.ring, slot

    # --- a ring for a batch that came outside it --------------------------------------------

    def outside(self, needed: int) -> None:
        """A batch needing ``needed`` slot bytes came outside the ring: where there is no
        ring yet, or its slots are too small and may grow, a ring is wanted (:meth:`want`)."""
        ring = self.ring
        if ring is None or (needed > ring.slot_bytes and not self._fixed_slot_bytes):
            self.want(needed)

    def want(self, needed: int) -> None:
        """A ring of ``needed``-byte slots is wanted: a big one is made on a thread from now
        on, a small one in line by :meth:`make_wanted`."""
        self.wanted = max(self.wanted, needed)
        if self._maker is None and needed >= BACKGROUND_MIN_BATCH_BYTES:
            self._maker = RingMaker(self._leases, needed, self.ring)

    def wanted_ready(self) -> bool:
        """True when the wanted ring can be taken without waiting for its maker."""
        maker = self._maker
        return maker is None or maker.done()

    def make_wanted(self) -> None:
        """Take (waiting if need be) the wanted ring and hand it to the workers; the old
        ring retires as its batches die. A maker's error (no room, max_shm_bytes) is
        raised here."""
        wanted, self.wanted = self.wanted, 0
        maker, self._maker = self._maker, None
        ring = maker.result() if maker is not None else None
        if ring is None or wanted > ring.slot_bytes or ring.fd is None:
            # A batch larger than the one the maker sized for arrived meanwhile, or another
            # iterator of the loader made a ring since (this one is retired).
            ring = self._leases.ring_for_batch(wanted, ring if ring is not None else self.ring)
        self.adopt(ring)

    def adopt(self, ring: Ring) -> None:
        """Make ``ring`` the one new tasks use, and tell every worker."""
        self.ring = ring
        for config in self._unlaunched.values():
            config.ring = ring
        self._courier.ring(ring)

    def stop(self) -> None:
        """The iterator closes: a ring being made is waited for (it stays the loader's
        current ring, for later epochs)."""
        maker, self._maker = self._maker, None
        if maker is not None:
            maker.wait()
