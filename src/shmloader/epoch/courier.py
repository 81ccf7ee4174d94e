"""What the consumer sends its workers during an epoch: tasks, wake-ups, a new ring, an
epoch's seeds.

A task goes into the worker's task queue in shared memory (:mod:`shmloader.transport.channel`):
a busy consumer and busy workers exchange batches without a system call. Only a worker that
sleeps is written a wake-up, on the socket that also carries the rare frames, and once for
all the tasks queued for it since it fell asleep (:meth:`Courier.wake_sleepers`): on a
small machine a wake-up costs the consumer as much CPU as the rest of a small batch's path.
Every write goes through the pool, which never blocks on a full socket.
"""

from __future__ import annotations

from typing import Any

from shmloader.memory.ring import Ring
from shmloader.transport import wire
from shmloader.transport.channel import MAX_TASK_PAYLOAD
from shmloader.workers.pool import WorkerHandle, WorkerPool


class Courier:
    """The consumer's writes to the workers of one pool."""

    __slots__ = ("_asleep", "_pool")

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        self._asleep: list[WorkerHandle] = []  # asleep with tasks queued since: owed a wake-up

    def task(self, worker: WorkerHandle, kind: int, slot: int, seq: int, payload: bytes) -> None:
        """Give ``worker`` a task: in its task queue (no system call; a sleeping worker is
        woken by :meth:`wake_sleepers`), or by frame when the queue has no room or the
        payload is too large for it."""
        if len(payload) <= MAX_TASK_PAYLOAD:
            queued = worker.channel.push_task(kind, slot, seq, payload)
            if queued:
                if queued == 2 and worker not in self._asleep:
                    self._asleep.append(worker)
                return
        self.task_frame(worker, kind, slot, seq, payload)

    def task_frame(self, worker: WorkerHandle, kind: int, slot: int, seq: int, payload: bytes) -> None:
        """Give ``worker`` a task by frame (a worker just started in place of another: its
        frames come in the order they are sent, after the epoch frame that may precede them)."""
        self._pool.send(worker, wire.frame(wire.pack(kind, slot, seq, payload)))

    @property
    def owes_wake_ups(self) -> bool:
        """Whether a worker sleeps with tasks queued for it."""
        return bool(self._asleep)

    def wake_sleepers(self) -> None:
        """Wake the workers that sleep with tasks queued (one wake-up each, however many
        tasks were queued since they fell asleep)."""
        for worker in self._asleep:
            if worker.channel.take_sleeper():
                self._pool.wake(worker)
        self._asleep.clear()

    def forget_sleepers(self) -> None:
        """The workers are being stopped: nobody is owed a wake-up."""
        self._asleep.clear()

    def ring(self, ring: Ring) -> None:
        """Tell every live worker to write into ``ring`` from its next task on (each reads
        its socket in order: tasks sent before keep their old ring)."""
        message = wire.ring_frame(ring.num_slots, ring.slot_bytes)
        for worker in self._pool.workers:
            if worker.proc.is_alive():  # (a dead worker is reported by its sentinel)
                self._pool.send(worker, message, ring.fd)

    def epoch(self, worker: WorkerHandle, plan: Any) -> None:
        """Tell ``worker`` that the epoch of ``plan`` begins (its seeds)."""
        frame = wire.epoch_frame(plan.epoch_seed + worker.id, plan.reseed, plan.sample_seed, plan.shared_seed)
        self._pool.send(worker, frame)

    def epoch_ahead(self, worker: WorkerHandle, plan: Any) -> None:
        """Tell ``worker`` that the tasks sent from now on are the next epoch's, ``plan``
        (prefetched: seeded by the seed scheme, so its worker seed alone says it)."""
        self._pool.send(worker, wire.epoch_frame(plan.epoch_seed + worker.id))
