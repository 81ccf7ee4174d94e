"""Which worker loads which batch, the order batches are handed out in, and the replay of
both for ``state_dict``: plain bookkeeping, no processes, no I/O.

Batches are numbered by ``seq`` in the order their tasks are sent. Workers are chosen in
strict round robin, as torch's DataLoader does, so which worker loads which batch depends
only on ``num_workers``, never on timing: the workers' seeded RNGs make the same draws in
every run. With ``in_order=False`` (also as torch does) a worker that already has its
share of the tasks in flight is passed over, so a slow worker is given fewer batches
instead of holding the others up, and results are handed out as they arrive.

Prefetch across an epoch's end (persistent workers, :mod:`shmloader.epoch.ahead`): the next
epoch's tasks are numbered on from this epoch's last (:meth:`Scheduler.open_next`), and
:meth:`Scheduler.pop` hands out nothing at or past that number until the next epoch
takes them over (:meth:`Scheduler.take_next`); an epoch's batches count from its
``base``.

Nothing is recorded per batch for the replay: an iterable dataset's worker that runs out
(its first end) is the only event kept, and :meth:`Scheduler.handed_out_per_worker`
replays the round robin from those.
"""

from __future__ import annotations

from typing import Any

from shmloader.tuning.counts import WorkerCounts


class Scheduler:
    """Round robin over the workers of ``counts`` (read from it: a tuner may add one),
    reordering of their results, and the position of what was handed out.

    Results are stored with :meth:`put` as tuples whose first item is a kind; those of
    kind ``end_kind`` (a worker's end of an iterable dataset) take their batch number
    and are never handed out.
    """

    __slots__ = (
        "_counts",
        "_ends",
        "_iter_ends",
        "_shard_blobs",
        "_start_worker",
        "active",
        "base",
        "end_kind",
        "in_order",
        "limit",
        "next_worker",
        "outstanding",
        "rcvd_seq",
        "results",
        "send_seq",
    )

    def __init__(self, counts: WorkerCounts, in_order: bool, end_kind: int) -> None:
        self._counts = counts
        self.in_order = in_order
        self.end_kind = end_kind
        # One dict for the whole life of the scheduler (cleared, never replaced), so a
        # holder of a reference to it always sees the current epoch's results.
        self.results: dict[int, tuple[Any, ...]] = {}
        self.begin_epoch(0)

    def begin_epoch(self, start_worker: int = 0) -> None:
        """Start an epoch: batch numbers from 0, the round robin at ``start_worker``
        (where a resumed run would have gone on), every worker active, nothing in flight."""
        n = self._counts.workers
        self.base = 0  # the epoch's first batch number
        self.limit: int | None = None  # the next epoch's first, once its tasks go out
        self.send_seq = 0  # the next batch number to send
        self.rcvd_seq = 0  # in order: the next batch number to hand out
        self.results.clear()
        self.active = [True] * n  # False once an iterable dataset's worker ran out
        self.outstanding = [0] * n  # tasks sent to each worker and not answered yet
        self._start_worker = self.next_worker = start_worker % n if n else 0
        self._iter_ends: list[tuple[int, int, int]] = []  # (send_seq, worker, seq) of first ends
        self._ends = 0  # end results received (every one, not only first ends)
        self._shard_blobs: dict[int, list[tuple[int, bytes]]] = {}

    def open_next(self, start_worker: int = 0) -> None:
        """Every task of this epoch was sent: the tasks sent from now on are the next
        epoch's (numbered on), the round robin at ``start_worker`` as that epoch's start
        would put it; nothing of them is handed out before :meth:`take_next`."""
        self.limit = self.send_seq
        n = self._counts.workers
        self.next_worker = start_worker % n if n else 0

    def is_next(self, seq: int) -> bool:
        """Whether batch ``seq`` belongs to the next epoch (sent after :meth:`open_next`)."""
        return self.limit is not None and seq >= self.limit

    def take_next(self, start_worker: int = 0) -> None:
        """Begin the epoch :meth:`open_next` opened: its tasks and results (already here)
        are this epoch's; those of the last epoch must be gone (handed out, or dropped
        with :meth:`drop_before`)."""
        base = self.limit if self.limit is not None else self.send_seq
        self.base = self.rcvd_seq = base
        self.limit = None
        n = self._counts.workers
        self.active = [True] * n
        self._start_worker = start_worker % n if n else 0
        self._iter_ends = []
        self._ends = 0
        self._shard_blobs = {}

    def drop_before(self, seq: int) -> list[tuple[Any, ...]]:
        """Remove and return the results numbered below ``seq`` (an epoch left before its
        end: results nobody will hand out)."""
        old = [k for k in self.results if k < seq]
        return [self.results.pop(k) for k in old]

    def grow(self) -> None:
        """Workers were added mid-epoch to the counts (``num_workers="auto"``, map-style
        datasets): the round robin goes on from where it is, over all of them from its next
        turn on."""
        extra = self._counts.workers - len(self.active)
        if extra <= 0:
            return
        self.active.extend([True] * extra)
        self.outstanding.extend([0] * extra)

    # --- sending ------------------------------------------------------------------------

    def any_active(self) -> bool:
        """Whether any worker can still be given tasks this epoch."""
        return any(self.active)

    def pick(self, cap: int, started: int | None = None) -> int | None:
        """The worker to send the next task to, or None when none can take one now.

        ``cap``: tasks allowed in flight (sent and not handed out) for all workers
        together; with ``in_order=False`` each active worker's share of it bounds that
        worker's tasks in flight. ``started``: only workers ``0 .. started-1`` run yet
        (they are being started); the round robin waits at the first that does not,
        never skips it (which worker loads which batch decides its seed)."""
        active, outstanding = self.active, self.outstanding
        n = len(active)  # (one entry per worker of the counts: begin_epoch and grow size it)
        start = self.next_worker
        if self.in_order and start < n and (started is None or start < started) and active[start]:
            self.next_worker = (start + 1) % n  # (the loop's first turn, for the common case)
            return start
        share = None
        if not self.in_order:
            share = cap // max(1, sum(active))
        for k in range(n):
            w = (start + k) % n
            if started is not None and w >= started:
                return None
            if active[w] and (share is None or outstanding[w] < share):
                self.next_worker = (w + 1) % n
                return w
        return None

    def assign(self, worker: int) -> int:
        """Record a task sent to ``worker``; returns its batch number."""
        seq = self.send_seq
        self.send_seq = seq + 1
        self.outstanding[worker] += 1
        return seq

    # --- receiving ----------------------------------------------------------------------

    def answered(self, worker: int) -> None:
        """``worker`` answered one of its tasks (a batch, an error, an end)."""
        self.outstanding[worker] -= 1

    def ended(self, worker: int, seq: int) -> None:
        """``worker``'s iterable dataset ran out at batch ``seq``: it gets no more tasks
        this epoch (its first end is what the replay needs)."""
        if self.active[worker]:
            self._iter_ends.append((self.send_seq, worker, seq))
        self.active[worker] = False
        self._ends += 1

    def retire(self, worker: int) -> None:
        """``worker`` is gone for the epoch (it failed to start): nothing in flight, no
        more tasks."""
        self.outstanding[worker] = 0
        self.active[worker] = False

    def put(self, seq: int, result: tuple[Any, ...]) -> None:
        """Keep batch ``seq``'s result until it is its turn."""
        self.results[seq] = result

    def pop(self) -> tuple[Any, ...] | None:
        """The next result to hand out now, or None when it has not arrived: in order,
        batch ``rcvd_seq`` (ends skipped); otherwise the oldest result that arrived."""
        results = self.results
        end = self.end_kind
        limit = self.limit
        if self.in_order:
            while True:
                if limit is not None and self.rcvd_seq >= limit:
                    return None  # the next epoch's: handed out once it begins
                item = results.pop(self.rcvd_seq, None)
                if item is None:
                    return None
                self.rcvd_seq += 1
                if item[0] != end:
                    return item
        if limit is not None:
            for seq in [k for k in results if k < limit]:
                item = results.pop(seq)
                if item[0] != end:
                    return item
            return None
        while results:
            item = results.pop(next(iter(results)))
            if item[0] != end:
                return item
        return None

    def yielded_nothing(self) -> bool:
        """Whether every task sent this epoch was answered by an end (or none was sent):
        the epoch has no batch at all. Call it at the epoch's end."""
        sent = self.send_seq if self.limit is None else self.limit
        return sent - self.base == self._ends

    def exhausted(self) -> bool:
        """Whether every worker ran out (iterable datasets), nothing is in flight and
        only ends are left to hand out: the next pop() finds nothing more."""
        if any(self.active) or any(self.outstanding):
            return False
        end = self.end_kind
        return all(item[0] == end for item in self.results.values())

    def due(self) -> int:
        """In order: the batch number to hand out next."""
        return self.rcvd_seq

    # --- position, for state_dict (see state.py) ----------------------------------------

    def handed_out(self) -> int:
        """Batches handed out (or raised) this epoch, iterable workers' ends included
        (in order: every batch number from the epoch's base below this one)."""
        return self.rcvd_seq - self.base

    def keep_shard_state(self, worker: int, seq: int, blob: bytes) -> None:
        """``worker``'s dataset state after batch ``seq``: the newest handed-out one and
        those still to hand out are kept (at most prefetch_factor + 1 per worker)."""
        states = self._shard_blobs.setdefault(worker, [])
        states.append((seq, blob))
        while len(states) > 1 and states[1][0] < self.rcvd_seq:
            del states[0]

    def shard_state_before(self, worker: int, pending: list[int]) -> bytes | None:
        """A replaced worker's resume point: the newest state ``worker`` reported after a
        batch that is not in ``pending`` (its unanswered batches, whose states are dropped:
        the new worker reports them again), or None when there is none."""
        owed = set(pending)
        kept = self._shard_blobs.get(worker, [])
        kept[:] = [(seq, blob) for seq, blob in kept if seq not in owed]
        return kept[-1][1] if kept else None

    def shard_states_handed_out(self) -> dict[int, bytes]:
        """Per worker, the pickled dataset state after its last handed-out batch."""
        out = {}
        for wid, states in self._shard_blobs.items():
            done = [blob for seq, blob in states if seq < self.rcvd_seq]
            if done:
                out[wid] = done[-1]
        return out

    def handed_out_per_worker(self) -> tuple[list[int], int]:
        """Iterable datasets: batches each worker produced among those handed out, and
        the worker the next one comes from. Replays the strict round robin from the
        recorded first ends: nothing is recorded per batch."""
        n = self._counts.workers
        active = [True] * n
        first_end = {wid: seq for _, wid, seq in self._iter_ends}
        ends = self._iter_ends
        counts = [0] * n
        ptr = self._start_worker
        e = 0
        for s in range(self.rcvd_seq + 1):
            while e < len(ends) and ends[e][0] <= s:
                active[ends[e][1]] = False
                e += 1
            wid = next((w % n for w in range(ptr, ptr + n) if active[w % n]), None)
            if wid is None:
                return counts, ptr
            if s == self.rcvd_seq:
                return counts, wid
            ptr = (wid + 1) % n
            if s < first_end.get(wid, s + 1):
                counts[wid] += 1
        return counts, ptr
