"""Progress of a run: a one-line bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable


class Progress:
    """Reports steps done out of ``total``: a one-line bar on a terminal (stderr), plain
    lines on ``out`` otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, out: Callable[[str], None], enabled: bool = True):
        self.total = max(total, 1)
        self.done = 0
        self.out = out
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, text: str) -> None:
        """One more step done; ``text`` says which."""
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            width = 28
            fill = int(width * self.done / self.total)
            bar = "#" * fill + "-" * (width - fill)
            cols = max(40, shutil.get_terminal_size((100, 20)).columns - 1)
            line = f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {text}"
            sys.stderr.write("\r" + line[:cols].ljust(cols))
            sys.stderr.flush()
        else:
            self.out(f"[{self.done}/{self.total} {elapsed:.0f}s] {text}")

    def close(self) -> None:
        """Clear the bar (on a terminal)."""
        if self.tty:
            cols = max(40, shutil.get_terminal_size((100, 20)).columns - 1)
            sys.stderr.write("\r" + " " * cols + "\r")
            sys.stderr.flush()
