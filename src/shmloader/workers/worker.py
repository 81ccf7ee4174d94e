"""The worker process: its main loop, its lifeline and worker info (its seeding: seeding.py).

A worker takes tasks from its task queue (and, rarely, its socket: see channel.py),
fetches the samples, collates them straight into the slot it was given, publishes the
slot READY (a release store) and puts the result in its result queue. It exits when
the consumer closes the socket or dies (EOF on the same socket, whoever forked the
worker), when its parent thread exits (PR_SET_PDEATHSIG, where the consumer started
it), or on a stop message.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmloader.batch import recipe as fetch
from shmloader.batch.collate import array_views, build_in_memory
from shmloader.batch.placement import Placement, Placements
from shmloader.context import WorkerInfo, set_worker_epoch_seed, set_worker_info
from shmloader.errors import BatchLayoutError, StrayStopIteration
from shmloader.memory.ring import NO_SLOT, Ring, attach_fd
from shmloader.system import slots as _slots
from shmloader.system.process import ParentDeath, die_with_parent, use_batch_policy, yield_cpu
from shmloader.transport import wire
from shmloader.transport.channel import (
    SLEEP_FUTEX,
    SLEEP_WINDOW_NS,
    TASK_SPIN_NS,
    Channel,
)
from shmloader.transport.failures import WorkerFailure
from shmloader.transport.yielding import YIELD_MAX_NS, YieldWindow
from shmloader.workers import seeding
from shmloader.workers.policy import PolicyTuner
from shmloader.workers.resume import open_iterable

_RESULT_WAKE = wire.result_wake_frame()
_VIEW_CACHE_SIZE = 1024  # entries of the placement, skeleton and view caches (ragged batches: one per shape)
# A batch outside the ring up to this size goes pickled in its frame: a one-off segment
# (memfd, reserve, map, the memory budget's reads, the descriptor's passing, and a mapping
# in the consumer) costs far more than pickling and unpickling this many bytes.
PICKLED_MAX_BYTES = 64 * 1024
# Out of tasks, a worker yields its CPU for up to this long before it sleeps (see
# _Worker.yield_for_work and transport/yielding.py).
SPIN_MAX_NS = YIELD_MAX_NS


def _plain_numpy(layout: Any) -> bool:
    """Whether every array leaf of ``layout`` is handed out as a numpy array (torch tag
    False): such a batch, pickled, comes out as its slot's reader would give it (with
    output="torch", the consumer's ``to_torch`` makes the same tensors). Tensor leaves
    keep the slot's reader (a pickled tensor goes through torch's own pickling, which
    cannot rebuild some dtypes: float8), and so do default-collated leaves of a dtype
    torch lacks (tag None: output="torch" refuses them where the slot is read)."""
    return all(getattr(leaf, "torch", False) is False for leaf in layout.leaves)


@dataclass
class WorkerConfig:
    """Everything a worker needs; pickled under spawn/forkserver, inherited under fork."""

    worker_id: int
    num_workers: int
    seed: int
    dataset: Any
    recipe: fetch.Recipe  # how batches are made: the loader's, the same as in the main process
    worker_init_fn: Callable[[int], None] | None
    ring: Ring | None
    fixed_slot_bytes: bool
    parent_pid: int
    use_pdeathsig: bool
    rank: int = 0  # the loader's rank and world size (worker info, global shard ids)
    world_size: int = 1
    resume: dict | None = None  # iterable: this shard's saved record (see resume.open_iterable)
    # The epoch's seed for sample_rng and a DataPipe's shared seed, where they are not
    # ``seed - worker_id`` (see wire.epoch_frame).
    epoch_seed: int | None = None
    shared_seed: int | None = None
    report_state: bool = False  # iterable with shmloader_state_dict(): send it after every batch
    shm_backend: str = "auto"  # the loader's: one-off batch segments use the ring's backend
    # Answered in the consumer as the config is made (a forked worker inherits the answer
    # instead of working it out again in its first milliseconds, page by copied page):
    torch_cpu_only: bool | None = field(default_factory=seeding.torch_cpu_only)  # see seed_all
    datapipe: bool | None = None  # fetch.is_datapipe(dataset); None: asked when the config is made

    def __post_init__(self) -> None:
        if self.datapipe is None:
            self.datapipe = fetch.is_datapipe(self.dataset)


def worker_main(config: WorkerConfig, conn: Any, inherited: Channel | None = None) -> None:
    """Entry point of a worker process. ``inherited``: its channel, as a forked worker
    inherits it, marked started first thing (the consumer replaces a forked worker that
    never gets this far: see pool.FORK_START_DEADLINE_S)."""
    if inherited is not None:
        inherited.mark_started()
    # The consumer blocked SIGINT around start(), so a Ctrl-C to the process group that
    # lands now is pending, not delivered: ignoring it before unblocking discards it, and
    # the worker never prints a KeyboardInterrupt traceback. The consumer handles Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _yield_to_the_consumer()
    watch_lifeline = not config.use_pdeathsig
    if config.use_pdeathsig:
        death = die_with_parent(config.parent_pid, signal.SIGKILL)
        if death is ParentDeath.PARENT_GONE:
            return  # the consumer died before the death signal was armed
        # REFUSED: a sandbox refused prctl (a seccomp profile, gVisor): the lifeline below
        # follows the consumer instead, as it does under forkserver. No warning: the
        # worker still dies with the consumer (within _LIFELINE_GRACE_S of its exit).
        watch_lifeline = death is ParentDeath.REFUSED
    if watch_lifeline:
        # forkserver, a non-main thread, or prctl refused: no death signal follows the
        # consumer, and EOF on the socket is seen only between tasks, so a worker busy
        # in a long __getitem__ would outlive a killed consumer. Watch the socket.
        threading.Thread(
            target=_watch_lifeline, args=(conn.fileno(),), name="shmloader-lifeline", daemon=True
        ).start()
    try:
        _Worker(config, conn).run()
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the consumer is gone: nothing to report to
    finally:
        conn.close()


def _yield_to_the_consumer() -> None:
    """Run this worker (and the threads and processes it starts) under Linux's
    SCHED_BATCH policy: the same CPU share as before, but a worker that wakes up (a task
    came) no longer preempts the process running on that CPU, most often the consumer,
    which then finishes its step first. The consumer's wake-up write stops costing it a
    worker's whole batch of wall time, which small batches feel most. On a busy machine
    a worker woken late goes back to the normal policy (:mod:`shmloader.workers.policy`).
    A worker_init_fn may set another policy: it runs after this, and is left alone. Where
    the policy is refused (a sandbox) or absent, nothing changes."""
    use_batch_policy()


_LIFELINE_GRACE_S = 0.5  # after the consumer's end closed, time left to exit on our own


def _watch_lifeline(fd: int) -> None:
    """Exit this worker soon after the consumer's end of its socket closes (consumer
    gone, or iterator closed), even while the main thread is busy in user code."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)  # POLLHUP, POLLERR and POLLNVAL come anyway
    while not poller.poll():
        pass
    time.sleep(_LIFELINE_GRACE_S)
    os._exit(0)


class _Stop(Exception):
    """The consumer sent TASK_STOP: the worker returns."""


class _Worker:
    def __init__(self, config: WorkerConfig, conn: Any) -> None:
        self.cfg = config
        self.conn = conn
        self.fd = conn.fileno()
        self.reader = wire.FrameReader(self.fd, "the consumer")
        self.ring = config.ring
        self.placements = Placements(_VIEW_CACHE_SIZE)
        self.views: dict[tuple[int, Placement], list] = {}  # (slot, placement) -> views of the slot
        # A dataset's own counters (e.g. ImageFolder's skipped files), reported as they
        # change: only through the loader's protocol name, never a stats() of the dataset's.
        # (The recipe's writer: the dataset, or the images= fused writer in its place.)
        stats = getattr(config.recipe.writer, "shmloader_stats", None)
        self.stats_fn = stats if callable(stats) else None
        # Counted from what the dataset held when this worker started (a forked worker
        # inherits the consumer's counts; they are not this worker's).
        self.stats_sent: dict[str, int] = dict(self.stats_fn()) if self.stats_fn else {}
        self.iterator: Any = None
        self.exhausted = False
        self.recipe = config.recipe
        # Clocks since the last report, sent with each batch put in the ring (timing.py).
        self.fetch_ns = self.collate_ns = self.idle_ns = 0
        self.collate_from: int | None = None  # when the current batch's collation began
        self.channel: Channel | None = None  # the task and result queues (the first frame)
        self.frames_sent = 0  # frames sent to the consumer: the stamp of each queued result
        # Out of tasks: yield for the window (yield_for_work), then sleep on the task
        # queue's futex (sleep_for_work), then on the socket.
        self.futex = _slots.HAS_FUTEX
        self.policy: PolicyTuner | None = None  # made in run()
        self.yielding = YieldWindow(SPIN_MAX_NS)  # allowed by the consumer (the channel says)
        self.socket_poller = select.poll()  # (has a frame come?)
        self.socket_poller.register(self.fd, select.POLLIN)

    def start_epoch(
        self, seed: int, reseed: bool = True, epoch_seed: int | None = None, shared_seed: int | None = None
    ) -> None:
        """Begin an epoch: seed the RNGs and set the worker info (unless ``reseed`` is False:
        a persistent worker under torch's RNG keeps both, as torch's do), set the epoch's
        seed for sample_rng and start the iterable dataset afresh."""
        cfg = self.cfg
        if reseed:
            seeding.seed_all(seed, cfg.worker_id, cfg.torch_cpu_only)
            info = WorkerInfo(cfg.worker_id, cfg.num_workers, seed, cfg.dataset, cfg.rank, cfg.world_size)
            set_worker_info(info)
        # The epoch's seed, the same in every worker (a worker's seed is it plus its id).
        base = seed - cfg.worker_id
        set_worker_epoch_seed(epoch_seed)
        # torch's numbering of DataPipe shards across ranks and workers.
        fetch.prepare_datapipe(
            cfg.dataset,
            base if shared_seed is None else shared_seed,
            cfg.world_size * cfg.num_workers,
            cfg.worker_id * cfg.world_size + cfg.rank,
            cfg.datapipe,
        )
        self.recipe.begin_epoch()
        self.iterator = None
        self.exhausted = False

    def run(self) -> None:
        cfg = self.cfg
        self.start_epoch(cfg.seed, True, cfg.epoch_seed, cfg.shared_seed)
        if cfg.worker_init_fn is not None:
            try:
                cfg.worker_init_fn(cfg.worker_id)
            except Exception as exc:
                failure = WorkerFailure.capture(exc, cfg.worker_id, "running worker_init_fn", None)
                self.conn.send_bytes(wire.pack(wire.RES_INIT_ERROR, payload=pickle.dumps(failure)))
                return
        self.policy = PolicyTuner()  # (after worker_init_fn: a policy it set is kept)
        try:
            self.serve()
        except _Stop:
            pass
        finally:
            self.reader.close()

    def serve(self) -> None:
        """Handle tasks until a stop message or EOF: from the task queue and the socket,
        in the order the consumer sent them (see channel.py: a queued task waits for the
        frames sent before it; a frame waits for the tasks queued before it)."""
        frames: deque[bytes] = deque()  # read from the socket, not acted on yet
        while self.channel is None:  # the channel's frame comes first
            self.read_frames(frames)
        channel = self.channel
        take = channel.take_tasks
        tasks: deque = deque()  # taken from the queue, not done yet
        done = 0  # frames acted on (the stamps count them)
        while True:
            if not tasks:
                tasks.extend(take())
            if tasks and tasks[0][3] <= done:
                kind, slot, seq, _stamp, payload = tasks.popleft()
                self.do_task(kind, slot, seq, payload)
            elif frames:
                done += 1
                self.on_frame(frames.popleft())
            elif tasks:
                self.read_frames(frames)  # a frame sent before the next task: on its way
            elif self.wait_for_work(channel, tasks, frames):
                pass
            elif channel.arm_tasks():
                # Asleep: the consumer writes a wake-up with its next task (or a frame).
                try:
                    slept = self.read_frames(frames)
                finally:
                    channel.disarm_tasks()
                # Yield next time while it would have caught this task (a loop whose steps
                # last milliseconds soon sleeps at once again).
                self.yielding.slept(slept)

    def wait_for_work(self, channel: Channel, tasks: deque, frames: deque[bytes]) -> bool:
        """Out of tasks, before sleeping on the socket: yield the CPU for the window
        (:meth:`yield_for_work`), then sleep on the futex where there is one
        (:meth:`sleep_for_work`); True when a task or a frame came."""
        yielding = self.yielding
        yielding.allowed = channel.yielding_allowed()
        window = yielding.window()
        if window and self.yield_for_work(channel.take_tasks, tasks, frames, window):
            return True
        return self.futex and self.sleep_for_work(channel, tasks, frames)

    def sleep_for_work(self, channel: Channel, tasks: deque, frames: deque[bytes]) -> bool:
        """Out of tasks: sleep on the task queue's futex until the consumer queues a task
        (into ``tasks``) or writes a frame (read into ``frames``: a task too large for the
        queue, a new ring, an epoch, a stop), for up to SLEEP_WINDOW_NS; True when either
        came, False when nothing did (the caller then sleeps on the socket, which also
        sees the consumer's end close). Neither the sleep nor its wake-up gives up a time
        slice or writes a byte, however busy the machine."""
        clock = time.monotonic_ns  # (the clock of the consumer's wake-up stamp)
        start = clock()
        readable = self.socket_poller.poll
        if channel.arm_tasks(SLEEP_FUTEX):
            # A frame written before the arm rang nobody: look at the socket once more.
            if readable(0):
                channel.disarm_tasks()
            elif channel.sleep_tasks(SLEEP_WINDOW_NS, TASK_SPIN_NS) and self.policy is not None:
                # How late this worker runs after the consumer's wake-up (if it woke us).
                woken = channel.woken_at()
                if woken >= start:
                    self.policy.woke(clock() - woken)
        got = channel.take_tasks()
        # (With tasks, frames wait: the stamps read them when a task needs them, and the
        # queue's end does.)
        framed = not got and bool(readable(0))
        slept = clock() - start
        self.idle_ns += slept
        if framed:
            self.read_frames(frames)  # (its bytes are there: no wait)
        if got or framed:
            self.yielding.slept(slept)  # (else the socket's sleep that follows adapts it)
        tasks.extend(got)
        return bool(got) or framed

    def yield_for_work(
        self, take: Callable[[], list], tasks: deque, frames: deque[bytes], window_ns: int
    ) -> bool:
        """Out of tasks: give this CPU to whatever else is runnable on it (the other
        worker, the consumer), looking for tasks (into ``tasks``) and frames (read into
        ``frames``: a task too large for the queue, a new ring, an epoch) between yields,
        for up to ``window_ns``; True when either came. The consumer's next task is often
        that close (a small batch): a worker asleep costs the consumer a wake-up."""
        clock = time.perf_counter_ns
        start = clock()
        end = start + window_ns
        readable = self.socket_poller.poll
        while True:
            yield_cpu()
            got = take()
            framed = not got and bool(readable(0))
            now = clock()
            if got or framed or now >= end:
                break
        self.idle_ns += now - start
        if framed:
            self.read_frames(frames)  # (its bytes are there: no wait)
        tasks.extend(got)
        return bool(got) or framed

    def read_frames(self, frames: deque[bytes]) -> int:
        """One (blocking) read of the socket: frames to act on go to ``frames``; wake-ups
        are dropped, the channel's frame is taken. Returns the ns it waited."""
        clock = time.perf_counter_ns
        waited = clock()
        messages = self.reader.read()
        waited = clock() - waited
        self.idle_ns += waited
        if messages is None:
            raise EOFError
        for msg in messages:
            kind = msg[0]  # (the header's first byte)
            if kind == wire.TASK_CHANNEL:
                self.channel = Channel.attach(self.reader.take_fd(), *wire.channel_info(msg))
            elif kind == wire.TASK_STOP:
                raise _Stop
            elif kind != wire.TASK_WAKE:
                frames.append(msg)
        return waited

    def on_frame(self, msg: bytes) -> None:
        """Act on a frame from the consumer: a ring, an epoch, a task that did not go by
        the queue (a stop never waits: :meth:`read_frames` raises it)."""
        kind, slot, seq = wire.unpack(msg)
        if kind == wire.TASK_RING:
            num_slots, slot_bytes = wire.ring_info(msg)
            # Not pre-faulted: a slot's pages are faulted in by this worker's
            # first write into it (see deliver), only for the slots it writes.
            self.ring = attach_fd(self.reader.take_fd(), num_slots, slot_bytes, populate=False)
            self.views.clear()
        elif kind == wire.TASK_EPOCH:
            self.start_epoch(*wire.epoch_info(msg))
        else:
            self.do_task(kind, slot, seq, wire.body(msg))

    def do_task(self, kind: int, slot: int, seq: int, payload: Any) -> None:
        """Load batch ``seq`` into ``slot``: ``payload`` holds its int64 sample indices
        (TASK_INDICES) or its keys as the sampler gave them (TASK_SCALARS, TASK_KEYS: see
        wire.task_payload)."""
        cfg = self.cfg
        indices = None
        where = "fetching"
        clock = time.perf_counter_ns
        began = clock()
        try:
            if kind == wire.TASK_ITER:
                samples = self.next_samples()
                if samples is None:
                    self.send_message(wire.pack(wire.RES_ITER_END, slot, seq))
                    return
                if cfg.report_state:  # the shard's position after this batch, for resume
                    state = pickle.dumps(cfg.dataset.shmloader_state_dict(), protocol=pickle.HIGHEST_PROTOCOL)
                    self.send_message(wire.pack(wire.RES_SHARD_STATE, slot, seq, state))
            else:
                if kind == wire.TASK_INDICES:
                    indices = memoryview(payload).cast("q").tolist()  # (int64, native order)
                else:
                    indices = wire.task_keys(kind, payload)
                samples = self.recipe.fetch(indices, seq)
            self.collate_from = now = clock()
            self.fetch_ns += now - began
            where = "collating"
            batch = self.recipe.collate(samples, indices, seq)
            where = "writing samples (write_sample) of" if samples is None else "writing"
            self.deliver(slot, seq, batch.treedef, batch.leaves, batch.fill)
        except Exception as exc:
            failure = WorkerFailure.capture(exc, cfg.worker_id, where, indices)
            self.send_message(wire.pack(wire.RES_ERROR, slot, seq, pickle.dumps(failure)))
        if self.collate_from is not None:  # not reported yet: goes with the next batch in the ring
            self.collate_ns += clock() - self.collate_from
            self.collate_from = None

    def send_message(self, message: bytes) -> None:
        """Send a message by frame (counted: a result queued after it carries the count,
        and the consumer reads the frame before acting on that result: see channel.py)."""
        self.frames_sent += 1
        self.conn.send_bytes(message)
        self.channel.ring_results(self.frames_sent)  # (a consumer asleep on the futex would not see it)

    def send_result(self, slot: int, seq: int, collate_ns: int) -> None:
        """Batch ``seq`` is READY in ``slot``: tell the consumer, with the clocks."""
        queued = self.channel.push_result(
            wire.RES_READY, slot, seq, self.frames_sent, self.fetch_ns, collate_ns, self.idle_ns
        )
        if queued:
            if queued == 2:  # the consumer sleeps on its socket
                self.frames_sent += 1
                wire.send_frame(self.fd, _RESULT_WAKE)
            if self.policy is not None:
                self.policy.published(queued != 1)
            return
        self.frames_sent += 1  # (no room in the queue)
        wire.send_frame(self.fd, wire.ready_frame(slot, seq, self.fetch_ns, collate_ns, self.idle_ns))
        self.channel.ring_results(self.frames_sent)

    def report_stats(self) -> None:
        """Send what the dataset's ``shmloader_stats()`` counters gained since the last report (only
        when they changed: e.g. a file skipped), for the loader's ``stats()``."""
        now = self.stats_fn()
        last = self.stats_sent
        gained = {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}
        if gained:
            self.stats_sent = dict(now)
            self.send_message(wire.pack(wire.RES_STATS, payload=pickle.dumps(gained)))

    def next_samples(self) -> list[Any] | None:
        """Up to batch_size samples from this worker's iterator; None when exhausted."""
        if self.exhausted:
            return None
        if self.iterator is None:
            self.exhausted = True  # if iter() raises, this worker has nothing more to give
            try:
                if self.cfg.resume is None:
                    self.iterator = iter(self.cfg.dataset)
                else:  # the first epoch after load_state_dict: continue where the shard was
                    resume, self.cfg.resume = self.cfg.resume, None
                    self.iterator = open_iterable(self.cfg.dataset, resume)
            except StopIteration as exc:  # from the dataset's __iter__: not an end of data
                raise StrayStopIteration(
                    f"the iterable dataset's __iter__ raised StopIteration{f': {exc}' if str(exc) else ''}; "
                    "return an (empty) iterator instead."
                ) from exc
            self.exhausted = False
        samples = self.recipe.take(self.iterator, None)
        if samples is None or len(samples) < self.recipe.want:
            self.exhausted = True
        return samples

    def deliver(self, slot: int, seq: int, treedef: Any, leaves: list, fill: Any) -> None:
        """Lay the batch out, let ``fill`` write its arrays into the slot, publish it."""
        placed = self.placements.of(treedef, leaves)
        if placed.content is not None:
            content, objects = placed.content, []
        else:  # (the object leaves' values differ batch to batch)
            objects = [leaf.values for leaf in leaves if leaf.dtype is None]
            objects_bytes = pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
            content = wire.SlotContent(placed.data_bytes, placed.encoded, placed.numbers, objects_bytes)
        layout = placed.layout
        ring = self.ring
        total = content.total
        if slot == NO_SLOT or ring is None or total > ring.slot_bytes:
            if slot != NO_SLOT and ring is not None and self.cfg.fixed_slot_bytes:
                raise BatchLayoutError(
                    f"batch {seq} needs {total} bytes but slots hold {ring.slot_bytes} "
                    f"(slot_bytes was fixed). Pass a larger slot_bytes (at least {total}), "
                    "a smaller batch_size, or leave slot_bytes unset so the loader sizes it."
                )
            self.deliver_apart(slot, seq, layout, content, objects, fill)
            return
        # Views of a slot for a placement are made once: the steady state (same layout,
        # the ring's few slots) allocates no arrays here.
        key = (slot, placed)  # (hashed by identity: the layout itself is not hashed again)
        views = self.views.get(key)
        if views is None:
            if len(self.views) > _VIEW_CACHE_SIZE:
                self.views.clear()
            # (The bytes this batch writes: a sparse ring reserves only those, see Ring.slot_array.)
            views = self.views[key] = array_views(layout, ring.slot_array(slot, total))
        fill(views)
        self.publish(ring, slot, seq, content)
        if self.stats_fn is not None:
            # After the samples were made, before the result: the consumer may end the
            # epoch as soon as it has the last result.
            self.report_stats()
        collate_ns = self.collate_ns + time.perf_counter_ns() - self.collate_from  # type: ignore[operator]
        self.send_result(slot, seq, collate_ns)
        self.fetch_ns = self.collate_ns = self.idle_ns = 0
        self.collate_from = None

    def deliver_apart(
        self, slot: int, seq: int, layout: Any, content: wire.SlotContent, objects: list, fill: Any
    ) -> None:
        """Deliver a batch that has no slot in the ring (the first, which sizes the ring, or
        one that outgrew its slot): pickled in its frame when it is small
        (``PICKLED_MAX_BYTES``) and plain numpy (:func:`_plain_numpy`), else in a one-off
        segment of its own whose descriptor goes with the result, so it is not copied on
        the way; pickled too when no segment can be made (e.g. /dev/shm is full: the
        consumer's error then says so when it sizes the ring)."""
        total = content.total
        if total <= PICKLED_MAX_BYTES and _plain_numpy(layout):
            self.deliver_pickled(slot, seq, layout, content, objects, fill)
            return
        try:
            segment = Ring.create(1, total, populate=True, backend=self.cfg.shm_backend)
        except Exception:  # no room, no /dev/shm, a posix_ipc error: the batch still goes
            self.deliver_pickled(slot, seq, layout, content, objects, fill)
            return
        try:
            fill(array_views(layout, segment.slot_array(0)))
            self.publish(segment, 0, seq, content)
            if self.stats_fn is not None:
                self.report_stats()
            message = wire.pack(wire.RES_SEGMENT, slot, seq, wire.size_payload(total))
            self.frames_sent += 1
            wire.send_frame_with_fd(self.fd, wire.frame(message), segment.fd)
            self.channel.ring_results(self.frames_sent)
        finally:
            segment.close_fd()  # the consumer holds its own descriptor now; ours goes

    def deliver_pickled(
        self, slot: int, seq: int, layout: Any, content: wire.SlotContent, objects: list, fill: Any
    ) -> None:
        """Send the batch pickled in its frame, with the slot bytes it needs (to size the ring)."""
        batch = build_in_memory(layout, content.data_bytes, objects, fill)
        payload = wire.size_payload(content.total, pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        if self.stats_fn is not None:
            self.report_stats()
        self.send_message(wire.pack(wire.RES_PICKLED, slot, seq, payload))

    @staticmethod
    def publish(ring: Ring, slot: int, seq: int, content: wire.SlotContent) -> None:
        """Write the layout, its numbers, the object leaves and the header after the
        arrays that are already in ``slot``, then mark it READY."""
        ring.slot_array(slot, content.total)  # the bytes written below are reserved (sparse rings)
        content.write(ring, slot, seq)
        # Release: the batch bytes and the header above are visible to the consumer
        # before it can observe READY.
        ring.states.store(slot, _slots.READY)
