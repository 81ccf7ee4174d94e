"""``--busy N``: CPU-bound processes that run beside the loaders while they are measured,
the way a training machine's other work does (the training step itself, other ranks,
augmentation in more workers than cores).

Each burner is a forked child spinning in a loop of its own; the bench ends every one of
them (SIGTERM, then SIGKILL, and reaps it) whatever way the run ends, and a burner dies
with the bench if the bench is killed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import signal
import time
from types import TracebackType

_STOP_WAIT_S = 2.0  # how long a burner may take to exit after SIGTERM before SIGKILL


def _burn(parent: int) -> None:
    """A burner's life: spin until a signal ends it (never returns)."""
    from shmloader.system.process import ParentDeath, die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench ends it, not a Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if die_with_parent(parent, signal.SIGKILL) is ParentDeath.PARENT_GONE:
        return
    n = 0
    while True:
        n += 1


class Burners:
    """``count`` CPU-bound processes, started by :meth:`start` (or ``with``), ended and
    reaped by :meth:`stop` (idempotent). :attr:`pids` are the ones started."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"--busy wants a number of processes (0 or more), got {count}.")
        self.count = count
        self.pids: list[int] = []

    def start(self) -> Burners:
        """Fork the burners (each starts spinning at once)."""
        parent = os.getpid()
        try:
            for _ in range(self.count):
                pid = os.fork()
                if pid == 0:  # the child: never returns into the bench's code
                    try:
                        _burn(parent)
                    finally:
                        os._exit(0)
                self.pids.append(pid)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End every burner: SIGTERM, up to _STOP_WAIT_S to exit, then SIGKILL; each is
        reaped (no zombie, no process left)."""
        pids, self.pids = self.pids, []
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_WAIT_S
        left = list(pids)
        while left and time.monotonic() < deadline:
            left = [pid for pid in left if not _reaped(pid)]
            if left:
                time.sleep(0.01)
        for pid in left:
            _signal(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass

    def __enter__(self) -> Burners:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _reaped(pid: int) -> bool:
    """Whether ``pid`` has exited and is reaped now (True: it is gone)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid
