"""The first ring of a loader, made in the background while the first batches go out.

A loader's first ring is sized from its first batch, which a worker delivers outside the
ring (in a segment of its own), unless the dataset declared its batch's bytes and rings
are sparse (the ring is then made before the workers start: epoch.rings). Reserving the
ring (``posix_fallocate`` of every slot, the kernel allocating every page: long for a big
ring) would otherwise happen in the
consumer between two batches, with the workers idle. A :class:`RingMaker` starts it on a thread as
soon as that first batch arrives (``posix_fallocate`` releases the GIL), while the
consumer hands out the first batches; the consumer takes the ring when it has nothing
else to hand out, and an error (no room, ``max_shm_bytes``) is raised there, exactly
where a ring made in line would have raised it. (Not earlier, say as soon as a worker
knows the size: the ring is sized from the memory there is when it is made, and the
workers' first batches must be counted in that by then.)

Only for big batches (:data:`BACKGROUND_MIN_BATCH_BYTES`): a small ring takes less time
to make than starting a thread costs, and is made in line at the next call. And only
where a ring is reserved whole when it is made: where the kernel lets each writer
reserve its own slots (:func:`shmloader.memory.ring.populate_supported`) a sparse ring
costs little to make, whatever its size, so the maker makes it at once, in
line, when the first batch arrives (no thread): the workers get it as soon as that batch
is handed out.

A fork waits for running makers first (an at-fork hook), so a child never inherits a
half-made ring or a lock held by the maker's thread.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from shmloader.system import forks

# A first batch this big gets its ring made on a thread: from this size on, reserving a
# ring of such slots takes longer than starting a thread.
BACKGROUND_MIN_BATCH_BYTES = 512 * 1024

_running: weakref.WeakSet = weakref.WeakSet()


class RingMaker:
    """Makes ``leases.ring_for_batch(batch_bytes, like)`` on a thread."""

    __slots__ = ("__weakref__", "_error", "_leases", "_ring", "_thread", "batch_bytes")

    def __init__(self, leases: Any, batch_bytes: int, like: Any) -> None:
        """Start making a ring whose slots hold ``batch_bytes`` (``like``: the ring it
        replaces, or None)."""
        self.batch_bytes = batch_bytes
        self._leases = leases
        self._ring: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if leases.rings_are_cheap():
            self._make(leases, batch_bytes, like)  # a sparse ring: cheaper than a thread
            return
        self._thread = threading.Thread(
            target=self._make, args=(leases, batch_bytes, like), name="shmloader-ring", daemon=True
        )
        _running.add(self)
        self._thread.start()

    def _make(self, leases: Any, batch_bytes: int, like: Any) -> None:
        try:
            with leases.warnings_deferred():  # emitted by result(), on the consumer's thread
                self._ring = leases.ring_for_batch(batch_bytes, like)
        except BaseException as exc:  # re-raised in the consumer by result()
            self._error = exc

    def done(self) -> bool:
        """True when result() would not block."""
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> Any:
        """The ring (waiting for it), or the error that making it raised."""
        self.wait()
        _running.discard(self)
        self._leases.emit_warnings()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._ring

    def wait(self) -> None:
        """Wait for the thread; the result (or error) stays for result()."""
        if self._thread is not None:
            self._thread.join()


def _wait_for_makers() -> None:
    # Before any fork in this process: no child copies a ring being made.
    for maker in list(_running):
        maker.wait()


forks.register(__name__, before=_wait_for_makers)
