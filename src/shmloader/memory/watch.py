"""Watching a loader's workers' memory: ``stats()["memory"]`` and the copy-on-read warning.

A :class:`MemoryWatch` lives as long as its loader. It reads its workers' memory on a
schedule that thins out (0.5 s after the first worker starts, then 1 s, 2 s, ... later,
then every 16 s), at the end of an epoch of persistent workers when half the current
interval has passed since the last reading and the workers have run 0.5 s (a fresh
loader's short epoch, a small validation pass, would otherwise pay a read of its workers
at every end; workers that stop with their epoch are not read at its end), and when
``stats()`` asks, so a batch costs one comparison of two floats.
A scheduled reading takes the :data:`CHECK_WORKERS` workers read longest ago, not all of
them: a read costs the consumer 10-20 ms a worker (the kernel's walk of its page tables,
then the text), which with 8 workers held every batch for a sixth of a second, and the
workers of one loader read one dataset alike (``stats()`` reads them all). A scheduled
reading first looks at a worker's totals (``/proc/PID/smaps_rollup``: the same walk, one
block of text instead of one per mapping, a third to a half of the cost with torch
imported); only a worker whose unique memory (USS) reached 64 MiB is read in full, as its
private memory (what the warning weighs, at most its USS) may then have grown that far.
A worker's growth is its private memory: a process starts with none of its own (a forked
one shares all of its parent's pages, a spawned one is an empty interpreter), so nothing
is read when a worker starts (a read costs milliseconds per GB the process maps). When a
worker's private memory grew past both 64 MiB and a quarter of what the dataset's large
Python containers hold (:func:`~shmloader.memory.containers.large_containers`), it emits one
:class:`~shmloader.errors.CopyOnReadWarning`. It names a container, and the remedy, only on
evidence that the worker holds a copy of it: spawned workers receive the dataset pickled;
in a forked worker, a quarter or more of the pages of the container's sampled elements
(their addresses taken before the first fork) are mapped by that worker alone
(:func:`~shmloader.memory.usage.exclusive_share`). Otherwise the warning says what grew
and that the loader does not know why (a cache the dataset fills in each worker grows
so, and sharing the containers would not help).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any

from shmloader.errors import CopyOnReadWarning, user_stacklevel
from shmloader.memory import containers as _containers
from shmloader.memory.usage import ProcessMemory, exclusive_share, memory_totals, process_memory
from shmloader.system.limits import mib

FIRST_CHECK_S = 0.5
MAX_INTERVAL_S = 16.0
WARN_MIN_GROWTH = 64 << 20  # below this a worker's growth is its own work, not copies
WARN_SHARE = 0.25  # of the large containers' size, grown in one worker
REPORT_MAX_AGE_S = 1.0  # stats() reuses readings this recent
CHECK_WORKERS = 2  # workers read at one scheduled check: those read longest ago
COPIED_SHARE = 0.25  # of a container's sampled element pages a forked worker holds alone: copied


class _Worker:
    __slots__ = ("full_at", "id", "last", "pid", "read_at")

    def __init__(self, wid: int, pid: int) -> None:
        self.id = wid
        self.pid = pid
        self.last: ProcessMemory | None = None  # its last full reading (none yet)
        self.read_at = -math.inf  # its last reading, full or totals only
        self.full_at = -math.inf  # its last full reading

    def growth(self) -> int:
        return self.last.private if self.last is not None else 0


class MemoryWatch:
    """The memory of one loader's workers and of its process. ``dataset``: returns the
    loader's dataset (read only when a warning is considered). ``clock``: seconds, the
    clock ``check``'s ``now`` comes from."""

    def __init__(self, dataset: Callable[[], Any], clock: Callable[[], float]) -> None:
        self._dataset = dataset
        self._clock = clock
        self._workers: dict[int, _Worker] = {}  # by pid
        self._interval = FIRST_CHECK_S
        self._read_at = -math.inf
        self._started_at = math.inf  # when the first of the running workers started
        self._parent: ProcessMemory | None = None  # this process's memory, read by report()
        self._parent_at = -math.inf
        self.due = math.inf  # when check() should run next: none before a worker starts
        self.warned = False
        self.peak_uss = 0  # the most any worker's USS and growth reached, in the loader's life
        self.peak_growth = 0
        self._large: list[_containers.Container] | None = None  # found once, when needed
        self._forked = True  # workers are forked (not spawned: those unpickle the dataset)
        self._pages: dict[str, list[int]] = {}  # by container path: its elements' pages, before the fork
        self.sharing: _containers.SharingReport | None = None

    # --- workers coming and going ---------------------------------------------------------

    def started(self, wid: int, pid: int) -> None:
        """Worker ``wid`` runs as process ``pid`` (a pid already known is kept)."""
        if pid in self._workers:
            return
        self._workers[pid] = _Worker(wid, pid)
        if self.due == math.inf:
            self._interval = FIRST_CHECK_S
            self._started_at = self._clock()
            self.due = self._started_at + self._interval

    def stopped(self, pid: int) -> None:
        """Process ``pid`` is no longer a worker of the loader (stopped or replaced)."""
        self._workers.pop(pid, None)
        if not self._workers:
            self.due = math.inf

    # --- reading -----------------------------------------------------------------------------

    def check(self, now: float) -> None:
        """Read the memory of the CHECK_WORKERS workers read longest ago, schedule the next
        check and warn when a worker's private memory grew as copy-on-read makes it grow
        (once per loader)."""
        self._look(now, sorted(self._workers.values(), key=lambda w: w.read_at)[:CHECK_WORKERS])
        self._interval = min(self._interval * 2, MAX_INTERVAL_S)
        self.due = now + self._interval if self._workers else math.inf
        if not self.warned:
            self._consider_warning()

    def epoch_ended(self, now: float) -> None:
        """An epoch ended (where copy-on-read has done the most): check now unless the
        last reading is recent (under half the current interval, and 0.5 s) or the
        workers started under FIRST_CHECK_S ago, so short epochs do not read /proc at
        each end."""
        if (
            self._workers
            and now - self._started_at >= FIRST_CHECK_S
            and now - self._read_at >= max(FIRST_CHECK_S, self._interval / 2)
        ):
            self.check(now)

    def _look(self, now: float, workers: list[_Worker]) -> None:
        """A scheduled reading of ``workers``: their totals first; a full reading of those
        whose private memory may have reached WARN_MIN_GROWTH (their USS did), or whose
        totals cannot be read. A worker whose last full reading had reached it is read in
        full at once (totals first would only add their cost)."""
        self._read_at = now
        full = []
        for w in workers:
            w.read_at = now
            if w.last is not None and w.last.uss >= WARN_MIN_GROWTH:
                full.append(w)  # (read in full before, and big then: its totals would not spare it)
                continue
            totals = memory_totals(w.pid)
            if totals is None or totals.uss >= WARN_MIN_GROWTH:
                full.append(w)
            else:
                self.peak_uss = max(self.peak_uss, totals.uss)
        if full:
            self._read(now, full)

    def _read(self, now: float, workers: list[_Worker]) -> None:
        """A full reading of ``workers`` (``/proc/PID/smaps``)."""
        self._read_at = now
        for w in workers:
            reading = process_memory(w.pid)
            w.read_at = w.full_at = now
            if reading is not None:
                w.last = reading
                self.peak_uss = max(self.peak_uss, reading.uss)
                self.peak_growth = max(self.peak_growth, w.growth())

    def report(self) -> dict[str, Any]:
        """``stats()["memory"]``: ``workers`` (per running worker, by id: ``id``, ``pid``,
        ``uss``, ``pss``, ``private`` and ``growth``, the growth of its private memory since
        it started, in bytes), ``parent`` (this process's ``uss``, ``pss``, ``rss`` and
        ``private``, or None where /proc cannot be read), ``workers_uss`` and
        ``workers_growth`` (their sums), ``peak_worker_uss`` and ``peak_worker_growth``
        (the most one worker reached in the loader's life, stopped workers included, as
        read at the checks and here; a check reads a worker's growth only once its USS
        reached 64 MiB), ``copy_on_read_warned`` (whether the warning was
        given) and ``shared`` / ``not_shared`` (``share_dataset=True``: the attributes
        replaced, with their estimated size, and those left, with why). Full readings
        older than a second are taken again (one /proc read per process: milliseconds
        each), younger ones are reused."""
        now = self._clock()
        stale = [w for w in self._workers.values() if now - w.full_at > REPORT_MAX_AGE_S]
        if stale:
            self._read(now, stale)
        workers = []
        for w in sorted(self._workers.values(), key=lambda w: w.id):
            last = w.last.as_dict() if w.last is not None else {"uss": 0, "pss": 0, "rss": 0, "private": 0}
            workers.append({"id": w.id, "pid": w.pid, **last, "growth": w.growth()})
        if now - self._parent_at > REPORT_MAX_AGE_S:
            self._parent, self._parent_at = process_memory(os.getpid()), now
        parent = self._parent
        sharing = self.sharing
        return {
            "workers": workers,
            "parent": parent.as_dict() if parent is not None else None,
            "workers_uss": sum(w["uss"] for w in workers),
            "workers_growth": sum(w["growth"] for w in workers),
            "peak_worker_uss": self.peak_uss,
            "peak_worker_growth": self.peak_growth,
            "copy_on_read_warned": self.warned,
            "shared": dict(sharing.shared) if sharing is not None else {},
            "not_shared": dict(sharing.skipped) if sharing is not None else {},
        }

    # --- the warning and its remedy --------------------------------------------------------------

    def _consider_warning(self) -> None:
        grown = max(self._workers.values(), key=lambda w: w.growth(), default=None)
        if grown is None or grown.growth() < WARN_MIN_GROWTH:
            return
        if self._large is None:
            self._large = _containers.large_containers(self._dataset())
        large = self._large
        held = sum(c.estimated_bytes for c in large)
        if not large or grown.growth() < WARN_SHARE * held:
            return
        self.warned = True
        copied, unread = self._copied(grown, large)
        text = self._copied_text(grown, copied) if copied else self._unknown_text(grown, large, unread)
        warnings.warn(text, CopyOnReadWarning, stacklevel=user_stacklevel())

    def _copied(
        self, worker: _Worker, large: list[_containers.Container]
    ) -> tuple[list[tuple[_containers.Container, float]], bool]:
        """The containers ``worker`` holds a copy of, with the share of them copied, and
        whether the evidence could not be read for some of them (see the module)."""
        if not self._forked:
            return [(c, 1.0) for c in large], False  # each spawned worker unpickled them whole
        copied, unread = [], False
        for c in large:
            share = exclusive_share(worker.pid, self._pages[c.path]) if c.path in self._pages else None
            if share is None:
                unread = True
            elif share >= COPIED_SHARE:
                copied.append((c, share))
        return copied, unread

    @staticmethod
    def _copied_text(worker: _Worker, copied: list[tuple[_containers.Container, float]]) -> str:
        held = sum(c.estimated_bytes for c, _ in copied)
        names = ", ".join(
            f"{c.describe()}, {share:.0%} of it copied" if share < 1 else c.describe()
            for c, share in copied[:5]
        ) + (", ..." if len(copied) > 5 else "")
        return (
            f"Worker {worker.id} (pid {worker.pid}) grew by {mib(worker.growth())} "
            f"of private memory since it started, and every worker grows so: the dataset holds "
            f"Python containers of ~{mib(held)} ({names}), and each worker "
            "copies the pages it reads (reading a Python object writes its reference count; "
            "spawned workers receive the whole dataset pickled). Pass share_dataset=True to the "
            "DataLoader to store them once in shared memory, read-only (or wrap them with "
            "shmloader.share() yourself): see docs/share.md. loader.stats()['memory'] shows "
            "the workers' memory."
        )

    @staticmethod
    def _unknown_text(worker: _Worker, large: list[_containers.Container], unread: bool) -> str:
        names = ", ".join(c.describe() for c in large[:5]) + (", ..." if len(large) > 5 else "")
        if unread:
            evidence = (
                f"whether the dataset's large Python containers ({names}) are what grew could not "
                f"be read (/proc/{worker.pid}/pagemap), so"
            )
        else:
            evidence = (
                f"the dataset's large Python containers ({names}) are not what grew (the pages "
                "of their elements are still shared with the main process), and sharing them "
                "(share_dataset=True) would not help, so"
            )
        return (
            f"Worker {worker.id} (pid {worker.pid}) grew by {mib(worker.growth())} of private "
            f"memory since it started: {evidence} the cause of the growth is unknown to the "
            "loader; memory the dataset or its transforms keep in each worker (a cache, "
            "buffers) grows so, once per worker. loader.stats()['memory'] shows the workers' "
            "memory; see docs/share.md."
        )

    def before_fork(self, forked: bool) -> None:
        """Workers are about to start (``forked``: by fork; else spawned or from a
        forkserver). Forked: note where the elements of the dataset's large containers
        lie now, before the workers share their pages, to tell later whether a worker
        copied them (the evidence the warning names a container on)."""
        self._forked = forked
        if not forked or self._pages:
            return
        self._large = _containers.large_containers(self._dataset())
        for c in self._large:
            value = getattr(c.owner, c.attribute, None)
            if isinstance(value, (list, tuple, dict)):
                self._pages[c.path] = _containers.element_pages(value)

    def share_dataset(self) -> None:
        """``share_dataset=True``: replace the dataset's large containers with shared views
        before the first worker starts (once per loader)."""
        if self.sharing is None:
            self.sharing = _containers.share_containers(self._dataset())
            self._large = None  # what is left large, if anything, is found again
            self._pages = {}
