"""A worker's channel: its task and result queues in shared memory, beside its socket.

Each worker has a small shared segment of its own (made by the consumer with the worker's
socket, sent to it as the first frame: a restarted worker gets a fresh one) holding two
single-producer single-consumer queues of int64 records (``native/slots.c``): tasks from
the consumer (the submission queue) and results from the worker (the completion queue).
A busy consumer and busy workers exchange batches through them without a system call.
A side out of work sleeps on its queue's "sleeping" word (a futex, where the system has
one: :data:`~shmloader.system.slots.HAS_FUTEX`) for up to :data:`SLEEP_WINDOW_NS`: the
other side's next record clears the word and wakes it with one ``FUTEX_WAKE``, and a frame
written to its socket meanwhile rings it the same way (:meth:`Channel.ring_tasks`,
:meth:`Channel.ring_results`). Past the window, and where there is no futex, it blocks on
its socket (``poll`` or ``read``: worker deaths, the lifeline and timeouts are seen there)
and the wake-up is a byte written to it. Either way the word is set with a full fence
before the side looks at the queue one last time (``sl_q_arm``): no wake-up is lost.

What stays on the socket: the rare messages (errors, shard states, stats, batches in
one-off segments, new rings and epochs: anything that carries a descriptor or a pickle,
or is too large for the queue), the wake-ups, and the lifeline (EOF when a side dies).

**Order.** The worker must act on frames and queue records in the order the consumer sent
them (a task for a slot of a new ring after that ring's frame). Each task record carries
the count of frames the consumer had sent to that worker before it (its *stamp*); the
worker acts on a record only after that many frames (:meth:`Channel.take_tasks` gives
the records, the worker compares). A frame needs no stamp: every record pushed before it
was sent is visible to the worker once it has read the frame (the socket orders them), so
the worker pops the queue before acting on a frame and finishes the records stamped
before it. Results are stamped the same way, with the frames the worker had sent before
each: the consumer reads the socket up to that count before it acts on a queued result,
so a frame about a batch (its shard state, an error, stats) is never overtaken by that
batch's result, nor a result sent by frame (a batch in a one-off segment, a full queue) by
a later one from the queue (``in_order=False`` hands batches out in the order they came).
"""

from __future__ import annotations

import os
import struct
from typing import Any

from shmloader._native import ffi, lib
from shmloader.memory.ring import Ring
from shmloader.system import fdguard
from shmloader.system.segment import small_memfd
from shmloader.system.slots import Mapping

TASK_WORDS = 16384  # the submission queue: 128 KiB of int64 words
RESULT_WORDS = 4096  # the completion queue: 512 results of 8 words
RECORD_WORDS = 5  # n, kind, slot, seq, stamp; then the payload
# The largest task payload (wire.task_payload's words) that goes by the queue; larger ones go by frame
# (a quarter of the queue: a few of them fit at once).
MAX_TASK_PAYLOAD = TASK_WORDS // 4 * 8
_CTL_BYTES = 3 * 64  # head, tail, sleeping flag: a cache line each
_HEAD_WORD, _TAIL_WORD = 0, 8  # their uint64 words (native/slots.c: SL_Q_HEAD, SL_Q_TAIL)
# In the task queue's third line, after native/slots.c's words (SL_Q_SLEEPING to
# SL_Q_FRAMES): 1 while the consumer allows the worker to yield before it sleeps
# (transport/yielding.py), 0 (as made) otherwise. Only Python reads and writes it.
_YIELD_WORD = 19
# Then 1 once the worker's own code runs (:meth:`Channel.mark_started`), written through
# the channel a forked worker inherits, before any frame: a worker stuck inside its fork
# never writes it (see workers/pool.py, FORK_START_DEADLINE_S).
_STARTED_WORD = 20
_TASK_CTL = 0
_RESULT_CTL = _CTL_BYTES
_TASK_DATA = 2 * _CTL_BYTES
_RESULT_DATA = _TASK_DATA + 8 * TASK_WORDS
CHANNEL_BYTES = _RESULT_DATA + 8 * RESULT_WORDS
_RESULT = struct.Struct("<8q")  # n, kind, slot, seq, stamp, fetch_ns, collate_ns, idle_ns
_RESULT_BYTES = _RESULT.size

# Results popped by the consumer at once (more wait for the next pop).
_POP_RESULTS = 64

# How a side sleeps (native/slots.c: SL_Q_SOCKET, SL_Q_FUTEX).
SLEEP_SOCKET = 1
SLEEP_FUTEX = 2

# How long a side sleeps on its queue's futex before it blocks on its socket instead: the
# socket sleep sees what no futex does (a worker's exit, the consumer's end closing), and
# this bounds how late those are seen; a wait this long is no per-batch cost.
SLEEP_WINDOW_NS = 20_000_000
# Before its futex wait, the consumer watches the result queue for up to this long without
# a system call or a yield (a pause loop): a result that close costs it no sleep and the
# worker no wake-up. A worker does not (TASK_SPIN_NS): on a quiet machine it has yielded
# for its window already (transport/yielding.py), and on a busy one a worker that spins
# without yielding takes the CPU the consumer needs to send it its next task.
RESULT_SPIN_NS = 5_000
TASK_SPIN_NS = 0


class Channel:
    """One worker's queues (see the module's doc). The consumer makes it
    (:meth:`create`), the worker maps it from the descriptor it received (:meth:`attach`).
    Each side calls only its own half of the methods."""

    __slots__ = (
        "__weakref__",
        "_fd",
        "_mapping",
        "_out",
        "_out_ptr",
        "_result_ctl",
        "_result_data",
        "_task_ctl",
        "_task_data",
        "frames_sent",
        "offset",
        "size",
    )

    def __init__(self, mapping: Mapping, offset: int, fd: int | None, out_words: int) -> None:
        self._mapping = mapping  # keeps the segment mapped while the pointers below are used
        self._fd = fd
        self.offset = offset  # where the queues start in the segment
        self.size = mapping.size
        self._task_ctl = mapping.pointer(offset + _TASK_CTL, "uint64_t *")
        self._result_ctl = mapping.pointer(offset + _RESULT_CTL, "uint64_t *")
        self._task_data = mapping.pointer(offset + _TASK_DATA, "int64_t *")
        self._result_data = mapping.pointer(offset + _RESULT_DATA, "int64_t *")
        # Where pops copy records to: this side's own memory, read with struct.
        self._out = bytearray(8 * out_words)
        self._out_ptr = ffi.from_buffer("int64_t[]", self._out)  # (holds the export: no resize)
        self.frames_sent = 0  # consumer: frames sent to the worker since the channel (stamps)

    @classmethod
    def create(cls) -> Channel:
        """A new channel, for the consumer (send :attr:`fd` to the worker, then
        :meth:`close_fd`). A memfd wherever the system allows one, whatever shm_backend
        says (that choice is about batch memory): nothing named in /dev/shm per worker,
        and no more than a mapping to make (a worker's start waits for it)."""
        fd = small_memfd("shmloader-channel")
        if fd is None:  # (no memfd here: Ring.create below knows the fallback)
            ring = Ring.create(1, CHANNEL_BYTES, populate=True, whole=True)
            channel = cls(ring.mapping, ring.slot_offset(0), os.dup(ring.fd), _POP_RESULTS * 8)  # type: ignore[arg-type]
            ring.close_fd()
        else:
            try:
                os.ftruncate(fd, CHANNEL_BYTES)
                channel = cls(Mapping(fd, CHANNEL_BYTES, populate=True), 0, fd, _POP_RESULTS * 8)
            except BaseException:
                os.close(fd)
                raise
        fdguard.register(channel, channel._fd, closer="close_fd")  # type: ignore[arg-type]
        return channel

    @classmethod
    def attach(cls, fd: int, offset: int, size: int) -> Channel:
        """The worker's side of a channel from its descriptor (closed here), the queues at
        ``offset`` of its ``size`` bytes."""
        try:
            mapping = Mapping(fd, size, populate=True)
        finally:
            os.close(fd)
        return cls(mapping, offset, None, TASK_WORDS)

    @property
    def fd(self) -> int | None:
        """The segment's descriptor (the consumer's, until :meth:`close_fd`)."""
        return self._fd

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays while this object lives)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            fdguard.unregister(fd)
            os.close(fd)

    # --- the consumer's half -------------------------------------------------------------

    def push_task(self, kind: int, slot: int, seq: int, payload: bytes) -> int:
        """Queue a task (``payload``: whole 8-byte words, at most MAX_TASK_PAYLOAD), stamped with
        :attr:`frames_sent`. 0: no room now (send it by frame); 1: queued; 2: queued and
        the worker sleeps: it stays asleep until :meth:`take_sleeper` says to wake it (the
        consumer may queue more first: one wake-up for several tasks)."""
        return lib.sl_q_push(
            self._task_ctl,
            self._task_data,
            TASK_WORDS,
            kind,
            slot,
            seq,
            self.frames_sent,
            payload,
            len(payload) >> 3,
            0,
        )

    def take_sleeper(self) -> bool:
        """Whether the worker still sleeps on its socket with tasks queued (then write it a
        wake-up now: this cleared its flag); False when it woke meanwhile (it takes them
        anyway) or slept on its futex (woken here, with one system call)."""
        return bool(lib.sl_q_take_sleeper(self._task_ctl))

    def ring_tasks(self) -> None:
        """A frame was just written to the worker's socket: wake it if it sleeps on its
        futex (it would not see the frame there); one asleep on the socket wakes anyway."""
        lib.sl_q_ring(self._task_ctl, self.frames_sent)

    def frames_written(self) -> int:
        """The frames the worker said it wrote to its socket (:meth:`ring_results`): more
        than the consumer read means some wait there. Read after :meth:`arm_results`, it
        sees every frame whose ring did not see the arm."""
        return lib.sl_q_frames(self._result_ctl)

    def take_results(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """Results the worker published, oldest first: (kind, slot, seq, stamp, fetch_ns,
        collate_ns, idle_ns) each (at most a few dozen per call)."""
        words = lib.sl_q_pop(
            self._result_ctl, self._result_data, RESULT_WORDS, self._out_ptr, _POP_RESULTS * 8
        )
        if not words:
            return []
        if words == 8:  # the common case: one result
            return [_RESULT.unpack_from(self._out)[1:]]
        return [r[1:] for r in _RESULT.iter_unpack(memoryview(self._out)[: 8 * words])]

    def arm_results(self, how: int = SLEEP_SOCKET) -> bool:
        """The consumer is about to sleep, on the worker's socket (SLEEP_SOCKET) or on the
        result queue's futex (SLEEP_FUTEX, then :meth:`sleep_results`): True when it may
        (the worker will wake it with its next result), False when a result came meanwhile
        (take it instead)."""
        return bool(lib.sl_q_arm(self._result_ctl, how))

    def sleep_results(self, timeout_ns: int, spin_ns: int) -> bool:
        """After :meth:`arm_results` (SLEEP_FUTEX) said True: sleep until the worker
        publishes a result or rings (:meth:`ring_results`), for up to ``timeout_ns``
        (after ``spin_ns`` of watching the queue). True when a result is queued; the
        consumer is awake again either way."""
        return bool(lib.sl_q_sleep(self._result_ctl, spin_ns, timeout_ns))

    def disarm_results(self) -> None:
        """The consumer is awake: the worker need not wake it."""
        lib.sl_q_disarm(self._result_ctl)

    # --- the worker's half ---------------------------------------------------------------

    def take_tasks(self) -> list[tuple[int, int, int, int, Any]]:
        """Tasks queued for this worker, oldest first: (kind, slot, seq, stamp, payload)
        each, the payload a memoryview of its words (valid until the next call)."""
        words = lib.sl_q_pop(self._task_ctl, self._task_data, TASK_WORDS, self._out_ptr, TASK_WORDS)
        if not words:
            return []
        out = memoryview(self._out)
        tasks = []
        pos = 0
        end = 8 * words
        while pos < end:
            n, kind, slot, seq, stamp = _HEAD.unpack_from(out, pos)
            tasks.append((kind, slot, seq, stamp, out[pos + 40 : pos + 8 * n]))
            pos += 8 * n
        return tasks

    def push_result(
        self, kind: int, slot: int, seq: int, stamp: int, fetch: int, collate: int, idle: int
    ) -> int:
        """Publish a result and the worker's clocks (ns: fetch, collate, idle), stamped with
        the frames the worker sent before it; 0: no room, send it by frame; 1: published,
        the consumer awake; 2: published and the consumer sleeps on its socket: write it a
        wake-up; 3: published and the consumer, asleep on the futex, woken here."""
        return lib.sl_q_push3(
            self._result_ctl, self._result_data, RESULT_WORDS, kind, slot, seq, stamp, fetch, collate, idle
        )

    def allow_yielding(self, allowed: bool) -> None:
        """Consumer: let the worker yield its CPU before it sleeps (the machine is
        quiet), or not (:mod:`shmloader.transport.yielding`)."""
        self._task_ctl[_YIELD_WORD] = 1 if allowed else 0

    def mark_started(self) -> None:
        """Worker (forked, through the channel it inherited): its own code runs."""
        self._task_ctl[_STARTED_WORD] = 1

    def has_started(self) -> bool:
        """Consumer: whether the worker marked itself started (:meth:`mark_started`)."""
        return self._task_ctl[_STARTED_WORD] == 1

    def yielding_allowed(self) -> bool:
        """Worker (or consumer): whether the consumer allows the worker to yield."""
        return self._task_ctl[_YIELD_WORD] == 1

    def woken_at(self) -> int:
        """When (``time.monotonic_ns()``) the consumer last woke this worker from its
        futex (0: never)."""
        return lib.sl_q_woken_at(self._task_ctl)

    def ring_results(self, frames_sent: int) -> None:
        """A frame was just written to the consumer's socket, ``frames_sent`` frames in all
        (the stamps' count): publish the count and wake the consumer if it sleeps on the
        result queue's futex (it would not see the frame there)."""
        lib.sl_q_ring(self._result_ctl, frames_sent)

    def arm_tasks(self, how: int = SLEEP_SOCKET) -> bool:
        """The worker is about to sleep, reading its socket (SLEEP_SOCKET) or on the task
        queue's futex (SLEEP_FUTEX, then :meth:`sleep_tasks`): True when it may (the
        consumer will wake it with its next task), False when a task came meanwhile."""
        return bool(lib.sl_q_arm(self._task_ctl, how))

    def sleep_tasks(self, timeout_ns: int, spin_ns: int) -> bool:
        """After :meth:`arm_tasks` (SLEEP_FUTEX) said True: sleep until the consumer queues
        a task or rings (:meth:`ring_tasks`), for up to ``timeout_ns`` (after ``spin_ns`` of
        watching the queue). True when a task is queued; awake again either way."""
        return bool(lib.sl_q_sleep(self._task_ctl, spin_ns, timeout_ns))

    def disarm_tasks(self) -> None:
        """The worker is awake: the consumer need not wake it."""
        lib.sl_q_disarm(self._task_ctl)

    def pending_tasks(self) -> int:
        """Task words queued and not yet taken (a snapshot, for tests)."""
        return lib.sl_q_used(self._task_ctl)

    def queued_seqs(self) -> list[int]:
        """The batch numbers of the tasks queued and not yet taken by the worker, oldest
        first: after the worker died, the batches it never started (off the per-batch
        path; a record that does not parse ends the list)."""
        ctl, data = self._task_ctl, self._task_data
        pos, tail = ctl[_HEAD_WORD], ctl[_TAIL_WORD]
        seqs = []
        while pos < tail:
            n = data[pos % TASK_WORDS]
            if n < RECORD_WORDS or pos + n > tail:
                break
            seqs.append(data[(pos + 3) % TASK_WORDS])
            pos += n
        return seqs


_HEAD = struct.Struct("<5q")
