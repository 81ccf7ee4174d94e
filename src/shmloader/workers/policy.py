"""A worker's scheduling policy, chosen by how late it runs after the consumer wakes it.

A worker starts under SCHED_BATCH (see ``worker._yield_to_the_consumer``): woken for a
task it does not preempt the process on its CPU, most often the consumer, which on a quiet
machine keeps the consumer's step whole. On a busy machine the process on that CPU is
someone else's CPU-bound work, and a SCHED_BATCH worker woken for a task waits for the end
of that process's time slice (milliseconds) before it runs: every batch pays it. So the
worker measures the delay between the consumer's FUTEX_WAKE (stamped in the queue) and its
own run; when the median of a round of wake-ups is over :data:`LATE_NS` it goes back to
the normal policy, whose wake-ups preempt by the scheduler's usual rules, and tries
SCHED_BATCH again every :data:`RETRY_S` (the machine may be quiet again). A late round
counts only when the consumer waited for at least :data:`WAITED_SHARE` of the results
published in it: with more workers than cores, a worker's wake-up is late behind its
sibling workers while the consumer has batches in hand, and a worker under the normal
policy would then preempt the consumer, the bottleneck, for nothing. A worker whose
worker_init_fn chose its own policy, or whose system refused SCHED_BATCH, is left alone.
"""

from __future__ import annotations

import time

from shmloader.system.process import batch_policy_in_force, use_batch_policy, use_normal_policy

LATE_NS = 500_000  # a wake-up this late lost the CPU to other work for most of a time slice
ROUND = 16  # wake-ups per verdict (their median decides)
RETRY_S = 2.0  # under the normal policy: SCHED_BATCH is tried again this often
# A late round takes the normal policy only when the consumer was asleep, waiting, for at
# least this share of the results published in it (the lateness cost it batches).
WAITED_SHARE = 0.25


class PolicyTuner:
    """Switches the calling worker between SCHED_BATCH and the normal policy by the
    delays of its wake-ups (:meth:`woke`). Inactive unless SCHED_BATCH is in force when it
    is made (after worker_init_fn)."""

    __slots__ = ("_delays", "_published", "_since", "_waited", "active", "batch")

    def __init__(self) -> None:
        self.active = self.batch = batch_policy_in_force()
        self._delays: list[int] = []
        self._published = self._waited = 0  # results this round; those the consumer slept for
        self._since = 0.0  # when the normal policy was taken

    def published(self, consumer_waited: bool) -> None:
        """The worker published a result; ``consumer_waited``: the consumer was asleep,
        waiting for it."""
        self._published += 1
        self._waited += consumer_waited

    def woke(self, delay_ns: int) -> None:
        """The worker ran ``delay_ns`` after the consumer woke it from its futex."""
        if not self.active:
            return
        if not self.batch:
            if time.monotonic() - self._since >= RETRY_S:
                self.batch = use_batch_policy()
                self._delays.clear()
                self._published = self._waited = 0
            return
        delays = self._delays
        delays.append(delay_ns)
        if len(delays) < ROUND:
            return
        delays.sort()
        late = delays[ROUND // 2] > LATE_NS and self._waited >= WAITED_SHARE * self._published
        delays.clear()
        self._published = self._waited = 0
        if late and use_normal_policy():
            self.batch = False
            self._since = time.monotonic()
