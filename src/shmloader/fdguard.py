"""Descriptors that only the consumer may hold.

Under the fork start method a worker inherits every descriptor of the consumer: the
consumer's ends of the other workers' sockets, and the rings' descriptors. A worker that
kept a sibling's consumer-side socket end open would stop that sibling from ever seeing
EOF when the consumer dies, and would hold one descriptor per ring. So the consumer
registers such descriptors here, and a forked worker closes all of them first thing.
"""

from __future__ import annotations

import os

_consumer_only: set[int] = set()


def register(fd: int) -> None:
    """Mark ``fd`` as one a forked worker must close."""
    _consumer_only.add(fd)


def unregister(fd: int) -> None:
    """Forget ``fd`` (call before closing it)."""
    _consumer_only.discard(fd)


def snapshot() -> list[int]:
    """The registered descriptors now (taken by the consumer just before a fork)."""
    return list(_consumer_only)


def close_inherited(fds: list[int], keep: int) -> None:
    """In a forked worker: close ``fds`` except ``keep``."""
    for fd in fds:
        if fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass
