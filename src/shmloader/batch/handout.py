"""The hand-out: a result from a worker turned into the batch ``next()`` returns.

A batch in a slot (of the ring, or of a one-off segment) becomes views of the slot,
read through a reader made once per batch structure (its layout's skeleton) and cached;
the slot returns to FREE when the last view dies (a lease on the root array, see
:mod:`shmloader.memory.leases`). In a batch of at least ``layout.APART_MIN_BYTES``, arrays much
smaller than its largest (labels beside images) are copies that own their memory
(:func:`shmloader.batch.layout.make_apart_reader`): keeping them keeps no slot. A pickled
batch is unpickled; an error is rebuilt and raised.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from shmloader.batch import pinning as _pinning
from shmloader.batch.layout import APART_MIN_BYTES, decode, make_apart_reader, make_reader
from shmloader.memory import leases as _leases
from shmloader.system import slots as _slots
from shmloader.transport import wire
from shmloader.transport.failures import WorkerFailure, rebuild_error

_LAYOUT_CACHE_SIZE = 1024  # readers kept, one per distinct batch structure (skeleton)


class Counted(Protocol):
    """What the hand-out reads of the loader's working parts
    (a :class:`~shmloader.runtime.LoaderRuntime` is one)."""

    @property
    def pinner(self) -> _pinning.RingPinner | None:
        """The CUDA pinner of ``pin_memory=True`` (None: batches are not pinned)."""

    @property
    def stats(self) -> dict[str, Any]:
        """The loader's counters, which the hand-out adds its batches to."""


class Handout:
    """Batches from results, for one iterator of a loader: torch tensors where ``output``
    (the epoch's setting) is ``"torch"``, counted in and pinned by the loader's
    ``runtime`` (``copy``: batches that own their memory, the slot freed at once). The
    iterator renews them as each of its epochs begins (:meth:`renew`)."""

    __slots__ = ("_runtime", "copy", "output", "readers")

    def __init__(self, output: str, runtime: Counted, copy: bool) -> None:
        self._runtime = runtime
        self.copy = copy
        self.output = output
        # Per encoded skeleton: its reader, the struct of its layout numbers, and its
        # reader for big batches (small leaves apart), or None where it has one array.
        self.readers: dict[bytes, tuple[Callable[[np.ndarray, Any, Any], Any], Any, Any]] = {}

    def renew(self, output: str, copy: bool) -> None:
        """The next epoch's ``output`` and ``copy`` (readers made for another ``output``
        are dropped: they made the other kind of array)."""
        if output != self.output:
            self.readers.clear()
        self.output = output
        self.copy = copy

    def batch(self, kind: int, task: Any, payload: bytes) -> Any:
        """The batch of a result of ``kind`` for ``task`` (its ``ring``, ``slot`` and
        ``seq``; the ring is dropped from a one-off segment's task); raises the worker's
        error for an error result."""
        if kind == wire.RES_READY:
            return self.from_slot(task)
        runtime = self._runtime
        if kind == wire.RES_SEGMENT:
            batch = self.from_slot(task, segment=True)
            task.ring = None  # the segment lives as long as the batch's views, no longer
            if runtime.pinner is not None:
                batch = _pinning.pin_tree(batch)  # not in a registered ring: pinned by copy
            return batch
        if kind == wire.RES_PICKLED:
            runtime.stats["batches"] += 1
            runtime.stats["batches_copied"] += 1
            batch = pickle.loads(wire.pickled_batch(payload))
            if self.output == "torch":
                batch = _pinning.to_torch(batch)
            if runtime.pinner is not None:
                batch = _pinning.pin_tree(batch)  # not in the ring: pinned by copy
            return batch
        failure: WorkerFailure = pickle.loads(payload)
        raise rebuild_error(failure, task.seq)

    def from_slot(self, task: Any, segment: bool = False) -> Any:
        """The batch in ``task``'s slot, as views of it (or a copy, with copy=True);
        ``segment``: the slot is a one-off segment's, not the ring's."""
        ring = task.ring
        slot = task.slot
        runtime = self._runtime
        ring.states.store(slot, _slots.HELD)
        buffer = ring.slot_buffer(slot)  # (a memoryview: struct and slicing read it fastest)
        root = np.frombuffer(buffer, np.uint8)
        # Leased before anything can raise: the slot returns to FREE when the root dies,
        # i.e. when the last view of it does, or when this returns (copy=True: the batch
        # does not view the root) or raises. Every view keeps the mapping alive (its .base
        # chain ends at the mapping's owner).
        _leases.lease(root, ring, slot, None if segment or self.copy else runtime.pinner)
        data_end, lo, llen, ooff, olen, seq, count = wire.read_header(ring, slot)
        if seq != task.seq:
            raise RuntimeError(f"slot {slot} holds batch {seq}, expected {task.seq}")
        key = buffer[lo : lo + llen].tobytes()
        found = self.readers.get(key)
        if found is None:
            found = self._reader(key, count)
        reader, numbers_struct, apart = found
        if apart is not None and data_end >= APART_MIN_BYTES:
            reader = apart  # small leaves as copies: keeping them keeps no slot
        numbers = numbers_struct.unpack_from(buffer, wire.numbers_offset(lo, llen))
        objects = pickle.loads(root[ooff : ooff + olen].tobytes()) if olen else None
        stats = runtime.stats
        stats["batches"] += 1
        if segment:
            stats["batches_copied"] += 1  # not in the ring (in its own segment)
        if self.copy:
            # Batches that own their memory: one copy of the slot's data, and the
            # slot is free again at once (the root dies as this returns).
            batch = reader(root[:data_end].copy(), objects, numbers)
            stats["batches_copied"] += not segment
            return batch
        return reader(root, objects, numbers)

    def _reader(self, key: bytes, count: int) -> tuple[Callable[[np.ndarray, Any, Any], Any], Any, Any]:
        """The readers of the skeleton encoded in ``key`` (views; small leaves apart, or
        None) and the struct of its ``count`` layout numbers (a skeleton fixes their
        count), made and cached."""
        if len(self.readers) >= _LAYOUT_CACHE_SIZE:
            self.readers.clear()  # stay bounded (one per batch structure)
        skeleton = decode(key)
        if self.output == "torch":
            skeleton = _pinning.torch_skeleton(skeleton)
        pinner = self._runtime.pinner
        apart = make_apart_reader(skeleton, pinner.pinned_copy if pinner is not None else None)
        found = self.readers[key] = (make_reader(skeleton), wire.numbers_struct(count), apart)
        return found
