"""The worker processes of one iterator: start, watch, stop, and the errors that name them.

**Start.** Each worker gets one socket pair with the consumer (tasks one way, results the
other, see wire.py); the consumer's end is non-blocking and written through a queue, so no
write blocks its loop. SIGINT is blocked while workers start: they inherit the mask and
discard a pending Ctrl-C (see worker.worker_main); the consumer handles it. A worker dies
with the consumer through two mechanisms: ``PR_SET_PDEATHSIG`` where the consumer's main
thread is its parent (fork, spawn), and the lifeline (EOF on its socket, watched by a
thread in the worker) everywhere else (forkserver: the parent is the fork server; a
non-main thread: the death signal would fire when that thread exits).

**Watch.** One ``poll`` waits on every worker's socket and process sentinel at once: a
worker's death is noticed the moment it happens. In-order loading waits on a second
poller with only the due worker's socket (and every sentinel): a result that arrives early
from another worker does not wake the consumer (on a small machine a wake-up costs as
much CPU as a small batch); it is read when its batch is due, or when task bytes queued
for some worker make the wait use the full poller (POLLOUT on that socket).

**Stop.** A stop frame (only after whole frames), close the consumer's ends, join with a
deadline, kill stragglers, reap.
"""

from __future__ import annotations

import contextlib
import pickle
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from shmloader.errors import (
    LoaderTimeoutError,
    WorkerDiedError,
)
from shmloader.memory.leases import own_forks
from shmloader.system import fdguard
from shmloader.transport import wire
from shmloader.transport.channel import Channel
from shmloader.transport.failures import describe_exit, short_indices

JOIN_TIMEOUT_S = 5.0  # how long a graceful stop waits for workers to exit before killing them
KILL_JOIN_TIMEOUT_S = 2.0  # and for a killed worker to be reaped
# A forked worker whose own code has not started this long after its fork is stuck in it: a
# lock another thread of the consumer held at the fork was copied locked into the child (a
# fork copies one thread), and the child waits for it forever before running any Python
# of ours (CPython gh-112275, or a library's at-fork handler). Its first line marks its
# channel started; the consumer replaces a worker that has not (epoch.restarts). A healthy
# fork gets there in milliseconds; the margin is for a machine swapping or overloaded.
FORK_START_DEADLINE_S = 30.0
_STOP_FRAME = wire.frame(wire.pack(wire.TASK_STOP))
_WAKE_FRAME = wire.task_wake_frame()


class WorkerHandle:
    """One worker process, the consumer's end of its socket and its channel (task and
    result queues in shared memory: see channel.py; the first frame sends it)."""

    __slots__ = ("channel", "conn", "fd", "frames_read", "id", "proc", "reader", "start_by", "view", "writer")

    def __init__(self, wid: int, proc: Any, conn: Any, channel: Channel | None = None) -> None:
        """``channel``: made beforehand (:meth:`WorkerPool.start`), else made here."""
        self.id = wid
        self.proc = proc
        self.view = WorkerProcess(proc)  # what torch's name for the workers hands out
        self.conn = conn
        self.fd = conn.fileno()
        self.reader = wire.FrameReader(self.fd, f"worker {wid}")
        self.frames_read = 0  # frames read from the worker (the stamps of its queued results count them)
        # Non-blocking from here on: no write to a worker may block the consumer's loop.
        self.writer = wire.FrameWriter(self.fd)
        self.channel = Channel.create() if channel is None else channel
        # Forked: the time.monotonic() by which its code must have marked the channel
        # started (FORK_START_DEADLINE_S; watched while in WorkerPool._starting); None when
        # not forked.
        self.start_by: float | None = None
        try:
            frame = wire.channel_frame(self.channel.offset, self.channel.size)
            self.writer.send(frame, self.channel.fd)  # type: ignore[arg-type]
        finally:
            self.channel.close_fd()  # (the writer keeps a duplicate if the frame waits)


class WorkerProcess:
    """A worker process as torch's iterator hands it out (its private ``_workers``):
    ``pid``, ``exitcode``, ``is_alive()``, ``join()``, ``terminate()``, ``kill()``. Code
    written for torch's iterator holds these past the iterator's end; the pool closes its
    process objects when it releases them, so the view then answers from the exit it saw
    (not alive, nothing to wait for or signal)."""

    __slots__ = ("_exitcode", "_proc", "pid")

    def __init__(self, proc: Any) -> None:
        self._proc: Any = proc
        self.pid: int | None = proc.pid
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode if self._proc is not None else self._exitcode

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._proc is not None:
            self._proc.join(timeout)

    def terminate(self) -> None:
        if self._proc is not None:
            self._proc.terminate()

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()

    def detach(self) -> None:
        """The process is reaped and its object about to be closed: keep its exit code."""
        if self._proc is not None:
            self._exitcode = self._proc.exitcode
            self._proc = None

    def __repr__(self) -> str:
        return f"<WorkerProcess pid={self.pid} exitcode={self.exitcode}>"


class _Prepared(NamedTuple):
    """A worker made and not started yet: see :meth:`WorkerPool.start`."""

    wid: int
    proc: Any
    ours: Any  # the consumer's end of the socket pair
    theirs: Any  # the worker's
    channel: Channel | None


def _discard(prepared: _Prepared) -> None:
    """Close a prepared worker's descriptors (it was never started, or failed to start)."""
    for conn in (prepared.ours, prepared.theirs):
        fdguard.unregister(conn.fileno())
        conn.close()
    if prepared.channel is not None:
        prepared.channel.close_fd()


def uses_pdeathsig(method: str) -> bool:
    """Whether workers started now with ``method`` can rely on PR_SET_PDEATHSIG: only
    when their parent thread is this process's main thread (fork, spawn). Elsewhere the
    lifeline alone follows the consumer. Where a sandbox refuses the prctl, a worker
    learns it when it arms the signal and starts its lifeline watch instead (see
    worker.worker_main): the consumer needs no probe and gives no warning."""
    return method in ("fork", "spawn") and threading.current_thread() is threading.main_thread()


def unpicklable_error(exc: BaseException, method: str) -> BaseException:
    """The error for a dataset, collate_fn or worker_init_fn that cannot reach a worker."""
    return TypeError(
        f"the DataLoader's dataset, collate_fn or worker_init_fn cannot be sent to a worker "
        f"started with {method!r}: {exc}. Under 'spawn' and 'forkserver' they are pickled, "
        "so define them at module level (no lambdas or local classes), or use "
        "multiprocessing_context='fork'."
    )


class WorkerPool:
    """The workers of one iterator, their sockets and sentinels, and one wait on all."""

    def __init__(self) -> None:
        self.workers: list[WorkerHandle] = []
        self.poller = select.poll()  # every worker's socket and exit sentinel
        self.focus_poller = select.poll()  # every sentinel, and the due worker's socket
        self._focused: WorkerHandle | None = None
        # fd -> (worker, is_sentinel), for every fd watched.
        self.fd_owner: dict[int, tuple[WorkerHandle, bool]] = {}
        # Workers whose writer holds queued bytes: polled for POLLOUT too, and the wait
        # uses the full poller while any is.
        self.sending: set[WorkerHandle] = set()
        self._starting: list[WorkerHandle] = []  # forked, not yet seen started

    # --- start --------------------------------------------------------------------------

    def start(
        self,
        ctx: Any,
        num_workers: int,
        make_config: Callable[[int, bool], Any],
        target: Callable,
        started: Callable[[], None] | None = None,
    ) -> None:
        """Start ``num_workers`` processes running ``target(make_config(wid,
        use_pdeathsig), conn)``, calling ``started()`` after each is in the pool (to give
        it work while the next one is forked). Raises TypeError (see
        :func:`unpicklable_error`) when the config cannot be sent to a worker; the workers
        started so far stay in the pool (stop them with :meth:`stop`).

        Every worker's config, socket pair, process object and channel are made before
        the first fork: after a fork every page the consumer writes is copied, as the
        child shares it, so work done between two forks costs twice, and such copies are
        a large share of what the consumer does before its first batch."""
        method = ctx.get_start_method()
        use_pdeathsig = uses_pdeathsig(method)
        with _sigint_blocked():
            waiting: list[_Prepared] = []  # made, not started (a failed start discards its own)
            try:
                for wid in range(num_workers):
                    waiting.append(self._prepare(ctx, wid, make_config(wid, use_pdeathsig), target))
                while waiting:
                    self._add(self._launch(waiting.pop(0), method))
                    if started is not None:
                        started()
            finally:
                for prepared in waiting:
                    _discard(prepared)

    def add(
        self, ctx: Any, wid: int, make_config: Callable[[int, bool], Any], target: Callable
    ) -> WorkerHandle:
        """Start one more worker, ``wid`` (the pool grows: ``num_workers="auto"``), as
        :meth:`start` starts each; returns it. Nothing is sent to it."""
        method = ctx.get_start_method()
        with _sigint_blocked():
            handle = self._start_one(ctx, wid, make_config(wid, uses_pdeathsig(method)), target, method)
        self._add(handle)
        return handle

    @classmethod
    def _start_one(cls, ctx: Any, wid: int, config: Any, target: Callable, method: str) -> WorkerHandle:
        """Start worker ``wid`` (SIGINT blocked by the caller) and its socket pair."""
        return cls._launch(cls._prepare(ctx, wid, config, target), method)

    @staticmethod
    def _prepare(ctx: Any, wid: int, config: Any, target: Callable) -> _Prepared:
        """Worker ``wid``'s socket pair, process object and channel, not started. Both
        socket ends are closed in any process forked meanwhile (an earlier worker: a copy
        of this worker's end would keep the consumer from seeing its EOF)."""
        ours, theirs = ctx.Pipe(duplex=True)
        fdguard.register(ours, ours.fileno())
        fdguard.register(theirs, theirs.fileno())
        try:
            channel = Channel.create()
        except BaseException:
            _discard(_Prepared(wid, None, ours, theirs, None))
            raise
        # A forked worker gets its channel object as it is (nothing is pickled), to mark it
        # started before anything else; other start methods are not watched that way.
        args = (config, theirs, channel) if ctx.get_start_method() == "fork" else (config, theirs)
        proc = ctx.Process(target=target, args=args, name=f"shmloader-worker-{wid}", daemon=True)
        return _Prepared(wid, proc, ours, theirs, channel)

    @staticmethod
    def _launch(prepared: _Prepared, method: str) -> WorkerHandle:
        """Start a prepared worker (its end of the socket goes with it, and is closed here)."""
        wid, proc, ours, theirs, channel = prepared
        fdguard.unregister(theirs.fileno())  # (this fork keeps it)
        try:
            with own_forks():  # our workers never read the consumer's batches
                proc.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            _discard(prepared)
            raise unpicklable_error(exc, method) from exc
        except BaseException:
            _discard(prepared)
            raise
        theirs.close()
        handle = WorkerHandle(wid, proc, ours, channel)
        if method == "fork":
            handle.start_by = time.monotonic() + FORK_START_DEADLINE_S
        return handle

    def replace(
        self, old: WorkerHandle, ctx: Any, make_config: Callable[[int, bool], Any], target: Callable
    ) -> WorkerHandle:
        """Reap ``old`` (killed first if it still runs: a hung worker), then start a new
        worker with the same id in its place (see :meth:`start`); returns it. Nothing is
        sent to it: the caller sends its tasks again."""
        self.forget(old)
        old.writer.close()  # (bytes queued for the dead worker: its tasks are sent again)
        fdguard.unregister(old.fd)
        old.conn.close()
        old.reader.close()
        if old.proc.exitcode is None:
            old.proc.kill()
        old.proc.join(KILL_JOIN_TIMEOUT_S)
        # (Out of the list whatever happens next: its socket is closed, its process reaped.)
        index = self.workers.index(old)
        del self.workers[index]
        old.view.detach()
        try:
            old.proc.close()
        except ValueError:
            pass  # not reaped within the deadline: multiprocessing's reaper takes it
        method = ctx.get_start_method()
        with _sigint_blocked():
            config = make_config(old.id, uses_pdeathsig(method))
            handle = self._start_one(ctx, old.id, config, target, method)
        self.workers.insert(index, handle)
        self._add(handle, append=False)
        return handle

    def _add(self, handle: WorkerHandle, append: bool = True) -> None:
        if append:
            self.workers.append(handle)
        sentinel = handle.proc.sentinel
        self.fd_owner[handle.fd] = (handle, False)
        self.fd_owner[sentinel] = (handle, True)
        self.poller.register(handle.fd, select.POLLIN)
        self.poller.register(sentinel, select.POLLIN)
        self.focus_poller.register(sentinel, select.POLLIN)
        self.queued(handle)  # (its channel frame, if the socket did not take it at once)
        if handle.start_by is not None:
            self._starting.append(handle)

    # --- a fork that never started ------------------------------------------------------

    def start_deadline(self) -> float | None:
        """The earliest time (``time.monotonic()``) by which a forked worker not yet seen
        started must be (see FORK_START_DEADLINE_S); None when every worker started."""
        starting = self._starting
        if not starting:
            return None
        starting[:] = [w for w in starting if not w.channel.has_started()]
        return min((w.start_by for w in starting), default=None)  # type: ignore[type-var]

    def stuck_at_start(self) -> list[WorkerHandle]:
        """The forked workers past their start deadline without having started (see
        FORK_START_DEADLINE_S): stuck inside their fork."""
        self.start_deadline()  # (forgets the ones that started meanwhile)
        now = time.monotonic()
        return [w for w in self._starting if now >= w.start_by]  # type: ignore[operator]

    # --- send ---------------------------------------------------------------------------

    def send(self, worker: WorkerHandle, framed: bytes, fd: int = -1) -> None:
        """Send a frame to ``worker`` (``fd`` attached) without blocking: what its socket
        does not take now is written as it becomes writable, during :meth:`wait`. Counted
        in the worker's channel: tasks queued after it wait for it (see channel.py)."""
        worker.channel.frames_sent += 1
        if not worker.writer.send(framed, fd):
            self.queued(worker)
        worker.channel.ring_tasks()  # (a worker asleep on its futex would not see the frame)

    def wake(self, worker: WorkerHandle) -> None:
        """Wake ``worker``, asleep with an empty task queue (a task was just queued)."""
        if not worker.writer.send(_WAKE_FRAME):
            self.queued(worker)

    def queued(self, worker: WorkerHandle) -> None:
        """``worker``'s writer holds bytes its socket did not take: poll it for POLLOUT."""
        if not worker.writer.pending or worker in self.sending:
            return  # (not pending: the worker is gone, its sentinel tells)
        self.sending.add(worker)
        if worker.fd in self.fd_owner:
            self.poller.modify(worker.fd, select.POLLIN | select.POLLOUT)

    def _sent(self, worker: WorkerHandle) -> None:
        self.sending.discard(worker)
        if worker.fd in self.fd_owner:
            self.poller.modify(worker.fd, select.POLLIN)

    def _flush(self, events: list[tuple[int, int]]) -> bool:
        """Write queued bytes to the sockets ``events`` say are writable; True when any
        other event (a message, EOF, an exit) is among them."""
        other = False
        for fd, mask in events:
            worker, is_sentinel = self.fd_owner.get(fd, (None, True))
            writable = worker is not None and not is_sentinel and mask & select.POLLOUT
            if writable:
                if worker.writer.flush():  # type: ignore[union-attr]
                    self._sent(worker)  # type: ignore[arg-type]
                worker.channel.ring_tasks()  # type: ignore[union-attr]
            if mask != select.POLLOUT:
                other = True
        return other

    # --- watch --------------------------------------------------------------------------

    def wait(self, focus: WorkerHandle | None, deadline: float | None) -> list[tuple[int, int]] | None:
        """Block until a worker's socket has input (or EOF), a worker exits, or a result
        is in a result queue; the poll events (an empty list: a queued result, take it),
        or None when ``deadline`` (``time.monotonic()``) passed first. ``focus``: the
        worker whose batch is due (in order), the only one waited on while no task bytes
        are queued. Queued bytes are written meanwhile.

        Before blocking, the consumer's "sleeping" flag is set in the queues of the
        workers it waits on (channel.Channel.arm_results): a worker that publishes a
        result then writes a wake-up to its socket; a result published before is seen
        by the arm itself, and nothing blocks."""
        armed = self._arm(focus)
        if armed is None:
            return []
        try:
            while True:
                poller = self._poller_for(focus)
                wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                events = poller.poll(wait_ms)
                if events and (not self.sending or self._flush(events)):
                    return events
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        finally:
            for worker in armed:
                worker.channel.disarm_results()

    def _arm(self, focus: WorkerHandle | None) -> list[WorkerHandle] | None:
        """Set the sleeping flag in the result queues of the workers :meth:`wait` waits on
        (all of them, or ``focus``, as :meth:`_poller_for` picks); None (no flag left set)
        when a result is already queued in one of them."""
        if focus is not None and focus.fd in self.fd_owner and not self.sending:
            targets = [focus]
        else:
            targets = [w for w in self.workers if w.fd in self.fd_owner]
        armed = []
        for worker in targets:
            if not worker.channel.arm_results():
                for other in armed:
                    other.channel.disarm_results()
                return None
            armed.append(worker)
        return armed

    def _poller_for(self, focus: WorkerHandle | None) -> Any:
        if focus is None or focus.fd not in self.fd_owner or self.sending:
            return self.poller
        if self._focused is not focus:
            if self._focused is not None:
                _unpoll(self.focus_poller, self._focused.fd)
            self.focus_poller.register(focus.fd, select.POLLIN)
            self._focused = focus
        return self.focus_poller

    def readable_now(self) -> list[WorkerHandle]:
        """Workers whose sockets have input now (without waiting)."""
        out = []
        for fd, mask in self.poller.poll(0):
            worker, is_sentinel = self.fd_owner.get(fd, (None, True))
            if worker is not None and not is_sentinel and mask != select.POLLOUT:
                out.append(worker)
        return out

    @staticmethod
    def has_input(worker: WorkerHandle) -> bool:
        """Whether ``worker``'s socket has input (or EOF) now; False once closed."""
        if worker.conn.closed:
            return False
        poller = select.poll()
        poller.register(worker.fd, select.POLLIN)
        return bool(poller.poll(0))

    def forget_fd(self, fd: int) -> None:
        """Stop watching ``fd`` (a socket at EOF, or an exited worker's sentinel); idempotent."""
        owner = self.fd_owner.pop(fd, None)
        if owner is not None:
            self.sending.discard(owner[0])
            _unpoll(self.poller, fd)
            _unpoll(self.focus_poller, fd)
        if self._focused is not None and self._focused.fd == fd:
            self._focused = None

    def forget(self, worker: WorkerHandle) -> None:
        """Stop watching ``worker`` (it exited, its messages were read)."""
        for fd in (worker.fd, worker.proc.sentinel):
            self.forget_fd(fd)
        if worker in self._starting:
            self._starting.remove(worker)

    # --- stop ---------------------------------------------------------------------------

    def stop(self, graceful: bool = True) -> None:
        """Stop and reap every worker. ``graceful``: a stop frame, then JOIN_TIMEOUT_S for
        them to finish their batch and exit; else (and after that) kill them."""
        # A stop frame, then closing our end of each socket: a worker idle in read gets the
        # stop (or EOF), one blocked writing a result gets EPIPE. The stop frame goes only
        # after whole frames (nothing queued) and never blocks: when it cannot go, the
        # worker reads EOF instead, and exits the same way.
        for w in self.workers:
            if graceful and not w.writer.pending:
                w.writer.send(_STOP_FRAME)
            w.writer.close()
            fdguard.unregister(w.fd)
            w.conn.close()
            w.reader.close()
            w.channel.ring_tasks()  # asleep on its futex: it wakes to the stop (or EOF) now
        self.sending.clear()
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if graceful else 0.0)
        for w in self.workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.proc.exitcode is None:
                w.proc.kill()
                w.proc.join(KILL_JOIN_TIMEOUT_S)

    def release(self) -> None:
        """Forget the stopped workers (their process objects closed where they exited)."""
        for w in self.workers:
            w.view.detach()
            try:
                w.proc.close()
            except ValueError:
                pass  # still running after the kill: leave it to multiprocessing's reaper
        self.workers.clear()
        self.fd_owner.clear()

    # --- errors -------------------------------------------------------------------------

    @staticmethod
    def death_error(
        worker: WorkerHandle, batch: int | None, indices: Any, note: str = "", started: bool = True
    ) -> WorkerDiedError:
        """The error for ``worker``'s unexpected exit: pid, signal or exit code, where it
        was (see :func:`death_point`), ``note`` (why it was not restarted, when restarts
        are on) and the remedy."""
        proc = worker.proc
        proc.join(0.1)
        code = proc.exitcode
        how, advice = describe_exit(code)
        return WorkerDiedError(
            f"DataLoader worker (pid {proc.pid}) {how}: worker {worker.id}"
            f"{death_point(batch, indices, started)}. The other workers were stopped; start a "
            f"new iteration to go on.{note}{advice}",
            worker_id=worker.id,
            pid=proc.pid,
            exitcode=code,
        )

    def exited(self) -> list[WorkerHandle]:
        """The watched workers whose process exited, as their sentinels say now (no wait):
        a death while the consumer was not waiting on them (between epochs, at an epoch's
        end). (Not ``exitcode``: a killed worker's sentinel is ready, as :meth:`wait`
        sees it, a moment before the kernel lets it be reaped.)"""
        poller = select.poll()
        watched = {}
        for w in self.workers:
            if w.proc.sentinel in self.fd_owner:
                watched[w.proc.sentinel] = w
                poller.register(w.proc.sentinel, select.POLLIN)
        return [watched[fd] for fd, _ in poller.poll(0)] if watched else []

    @staticmethod
    def timeout_error(
        timeout: float, batch: int, indices: Any, busy: list[WorkerHandle]
    ) -> LoaderTimeoutError:
        """The error for ``timeout`` s without batch ``batch``, naming the busy workers."""
        names = sorted({f"{w.id} (pid {w.proc.pid})" for w in busy})
        what = f"batch {batch}"
        if indices is not None:
            what += f" (sample indices {short_indices(indices)})"
        return LoaderTimeoutError(
            f"DataLoader timed out after {timeout} seconds waiting for {what}; workers still busy: "
            f"{', '.join(names) or 'none'}. Raise timeout, or find what makes the dataset slow."
        )


def death_point(batch: int | None, indices: Any, started: bool = True) -> str:
    """Where a dead worker was, for messages: loading batch ``batch`` (its sample
    ``indices``), or, ``started`` False, given it but not started on it yet (still in its
    task queue), or idle (``batch`` None: it owed no batch)."""
    if batch is None:
        return " while idle, between batches"
    what = f" while loading batch {batch}" if started else f" while idle, before it started batch {batch}"
    if indices is not None:
        what += f" (sample indices {short_indices(indices)})"
    return what


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this block where this is the main thread: workers started in it
    inherit the mask (see worker.worker_main); the consumer handles a Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _unpoll(poller: Any, fd: int) -> None:
    try:
        poller.unregister(fd)
    except KeyError:
        pass
