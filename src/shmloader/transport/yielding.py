"""How long a side out of work yields its CPU before it sleeps.

A worker without tasks, or the consumer without a result, may give its CPU to whatever
else is runnable (``sched_yield``) and look at its queue between yields before it goes to
sleep: the other side's next record is often that close, and then nobody sleeps and
nobody pays a wake-up (a system call for the waker, and on a virtual machine an idle
virtual CPU to bring back). Two things bound it:

- the window adapts to the waits seen (:func:`next_yield_window`): a loop whose waits last
  milliseconds (a slow training step, slow batches) soon sleeps at once, spending no CPU;
- it is allowed only while no other process keeps the CPUs busy
  (:class:`~shmloader.system.cpuload.OthersLoad`: the consumer measures, and tells its
  workers through their channels): beside CPU-bound processes a yield hands a time slice
  away, and a side that stays runnable is woken late behind them afterwards.
"""

from __future__ import annotations

YIELD_MAX_NS = 200_000  # a worker's window: the consumer's next task is often that close
# The consumer's window: it waits for a batch in progress, and yielding longer than this
# spends more of its CPU (counted as its own, taken from the workers on a small machine)
# than a sleep and a wake-up cost (W3 and W7: fewer batches/s with 200 us).
RESULT_YIELD_MAX_NS = 50_000
YIELD_MIN_NS = 2_000


def next_yield_window(window_ns: int, slept_ns: int, maximum_ns: int = YIELD_MAX_NS) -> int:
    """The window to yield for before the next sleep, after a sleep of ``slept_ns``: the
    whole ``maximum_ns`` again when yielding that long would have caught what woke it,
    else half of ``window_ns``, none below YIELD_MIN_NS (a loop whose waits last
    milliseconds soon sleeps at once: no CPU spent yielding)."""
    if slept_ns <= maximum_ns:
        return maximum_ns
    return window_ns // 2 if window_ns >= YIELD_MIN_NS else 0


class YieldWindow:
    """One side's yield window: how long to yield before the next sleep (:meth:`window`),
    adapted to its sleeps (:meth:`slept`); none while :attr:`allowed` is False."""

    __slots__ = ("_window_ns", "allowed", "maximum_ns")

    def __init__(self, maximum_ns: int = YIELD_MAX_NS, allowed: bool = False) -> None:
        self.maximum_ns = maximum_ns
        self._window_ns = maximum_ns
        self.allowed = allowed  # set from the machine's load (the consumer measures it)

    def window(self) -> int:
        """The ns to yield for now before sleeping (0: sleep at once)."""
        return self._window_ns if self.allowed else 0

    def slept(self, slept_ns: int) -> None:
        """The side slept ``slept_ns`` before its work came: adapt the window."""
        self._window_ns = next_yield_window(self._window_ns, slept_ns, self.maximum_ns)
