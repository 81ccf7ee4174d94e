"""The exception hierarchy of shmloader.

Every error a user can cause says what happened, which input caused it and what to do.
All of them derive from :class:`ShmLoaderError`, and each also derives from the builtin
exception a torch user would catch for the same failure (``RuntimeError``,
``TimeoutError``, ``ValueError``, ``MemoryError``), so existing ``except`` clauses keep
working.
"""

from __future__ import annotations


class ShmLoaderError(Exception):
    """Base class of every error raised by shmloader."""


class WorkerError(ShmLoaderError, RuntimeError):
    """A worker raised an exception whose type could not be rebuilt in the consumer.

    The message carries the original type name, its text, the worker id, the batch's
    sample indices and the worker's traceback.
    """


class WorkerDiedError(ShmLoaderError, RuntimeError):
    """A worker process exited while it still owed batches (signal, crash, ``os._exit``).

    Attributes ``worker_id``, ``pid`` and ``exitcode`` (negative for a signal) describe it.
    """

    def __init__(self, message: str, *, worker_id: int, pid: int | None, exitcode: int | None):
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode


class LoaderTimeoutError(ShmLoaderError, TimeoutError):
    """No batch arrived within the loader's ``timeout``."""


class ShmSpaceError(ShmLoaderError, MemoryError):
    """The shared-memory filesystem cannot hold the ring that was asked for."""


class BatchLayoutError(ShmLoaderError, ValueError):
    """Samples of one batch cannot be collated (shapes, dtypes or structure differ), or a
    batch does not fit a slot of a fixed ``slot_bytes``."""


class RingLimitError(ShmLoaderError, MemoryError):
    """The ring would have to grow past ``max_shm_bytes``: the message says how many
    batches the consumer holds, the bytes they pin, and what to do."""
