"""The exception hierarchy of shmloader.

Every error a user can cause says what happened, which input caused it and what to do.
All of them derive from :class:`ShmLoaderError`, and each also derives from the builtin
exception a torch user would catch for the same failure, so ``except`` clauses written for
torch's DataLoader keep working: torch raises ``RuntimeError`` for a timeout, a dead
worker, shared memory running out and samples ``torch.stack`` cannot stack, so every
error here that stands for one of those is a ``RuntimeError`` too, beside the builtin
that names it best (``TimeoutError``, ``MemoryError``, ``ValueError``, ``TypeError``,
``KeyError``). An exception raised by the dataset in a worker is re-raised in the
consumer with its own type, as torch does (:class:`WorkerError` only when that type
cannot be rebuilt).
"""

from __future__ import annotations

import os
import sys
import warnings


class ShmLoaderError(Exception):
    """Base class of every error raised by shmloader."""


class WorkerError(ShmLoaderError, RuntimeError):
    """A worker raised an exception whose type could not be rebuilt in the consumer.

    The message carries the original type name, its text, the worker id, the batch's
    sample indices and the worker's traceback.
    """


class WorkerDiedError(ShmLoaderError, RuntimeError):
    """A worker process exited while its iterator ran (signal, crash, ``os._exit``), whether
    it was loading a batch or idle.

    Attributes ``worker_id``, ``pid`` and ``exitcode`` (negative for a signal) describe it.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        pid: int | None = None,
        exitcode: int | None = None,
    ):
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode

    def __reduce__(self) -> tuple:
        # Pickled whole (multiprocessing, DDP launchers and torch's ExceptionWrapper ship
        # exceptions between processes); the keyword arguments would otherwise be lost.
        return (_rebuild_worker_died, (str(self), self.worker_id, self.pid, self.exitcode, type(self)))


class WorkerStartError(WorkerDiedError):
    """Forked workers kept getting stuck inside their fork, before running any code of
    their own (a lock another thread held at the fork, copied locked into the child); the
    loader replaced them a few times, then stopped the iterator. Attributes as
    :class:`WorkerDiedError` (``exitcode`` is None: the last one was killed)."""


class LoaderTimeoutError(ShmLoaderError, TimeoutError, RuntimeError):
    """No batch arrived within the loader's ``timeout``: a ``TimeoutError``, and a
    ``RuntimeError`` as torch's DataLoader raises for it."""


class ShmSpaceError(ShmLoaderError, MemoryError, RuntimeError):
    """The memory a ring needs is not there: the message leads with the limit that binds
    (the cgroup's memory limit with its figures, the machine's available memory, or
    /dev/shm's free space for the ``posix`` backend) and names the remedy. Raised before
    anything is reserved. A ``MemoryError``, and a ``RuntimeError`` as torch raises when
    /dev/shm runs out."""


class ShmBackendError(ShmLoaderError, RuntimeError):
    """The shared-memory backend cannot be used here: ``memfd_create`` refused (a seccomp
    profile, an old kernel) where ``shm_backend='memfd'`` was asked for, or no writable
    /dev/shm (none mounted, or read-only) for ``posix``. The message names the cause and
    the remedy."""


class BatchLayoutError(ShmLoaderError, ValueError, RuntimeError):
    """Samples of one batch cannot be collated (shapes, dtypes or structure differ), or a
    batch does not fit a slot of a fixed ``slot_bytes``: a ``ValueError``, and a
    ``RuntimeError`` as ``torch.stack`` raises in torch's ``default_collate`` for samples
    of different shapes."""


class BatchTypeError(BatchLayoutError, TypeError):
    """A sample holds a value the default collate cannot batch: None, or an object that
    is not an array, tensor, number, str/bytes, dict, list or tuple. A ``TypeError`` as
    torch's ``default_collate`` raises, and a :class:`BatchLayoutError` as documented."""


class BatchKeyError(BatchLayoutError, KeyError):
    """A sample's dict lacks a key the batch's first sample has: a ``KeyError`` as torch's
    ``default_collate`` raises, and a :class:`BatchLayoutError` as documented."""

    def __str__(self) -> str:  # the sentence, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class CorruptDataError(ShmLoaderError, ValueError):
    """Bytes shmloader reads back are not what it wrote: a shared structure's segment
    (:func:`shmloader.share`) whose nodes point outside it, loop, or hold what no encoder
    writes, or a frame on a worker's socket with an impossible length. The message says
    what was found where (and, for a frame, which worker sent it). Every such failure is
    this one type, never a stray read, a hang or another exception: a sealed memfd
    segment cannot change after ``share()``, so it means an encoder bug, a segment of
    the ``posix`` backend written by a process of the same user, or stray bytes on a
    socket. A ``ValueError``: the input's value is wrong."""


class StrayStopIteration(ShmLoaderError, RuntimeError):
    """Dataset, sampler-free fetch or collate code raised ``StopIteration`` while a batch
    was made. An epoch ends only when its sampler (or iterable dataset) is exhausted, so
    this is an error naming the batch and its samples, never a silent end of the epoch
    (as Python turns a ``StopIteration`` leaking out of a generator into a RuntimeError)."""


class RingLimitError(ShmLoaderError, MemoryError, RuntimeError):
    """A ring would pass ``max_shm_bytes``: the message leads with what binds (an explicit
    ``max_shm_bytes``, the memory limit under the default one, or the batches the consumer
    holds when it holds any), the bytes involved, and what to do. A ``MemoryError``,
    and a ``RuntimeError`` as torch's shared-memory failures are."""


class RingSizeWarning(UserWarning):
    """The loader's first ring got fewer slots than the default because the memory the
    backend can give (or ``max_shm_bytes``) is short: workers prefetch less. A
    ``UserWarning`` (shown by default, unlike ``ResourceWarning``), emitted once per
    loader, naming the slots wanted and given, the binding limit and the remedy."""


class WorkerRestartWarning(UserWarning):
    """A worker died (a signal, a crash, ``os._exit``) or hung past the loader's
    ``timeout``, and was replaced under ``max_worker_restarts``: its batches in flight are
    loaded again by the new worker, so the epoch goes on with the same batches. The
    message names the worker, its pid, the signal or exit code, the batch it was loading
    and the restarts left. A ``UserWarning``, shown by default."""


class CopyOnReadWarning(ResourceWarning):
    """Workers' private memory grew as copy-on-read makes it grow: the dataset holds large
    Python containers (lists, tuples, dicts of Python objects) and each worker copies
    the pages it reads, since reading an object writes its reference count (spawned
    workers receive the dataset pickled, whole). Emitted once per loader, naming the
    containers and the remedy: ``DataLoader(..., share_dataset=True)`` or
    :func:`shmloader.share`. A ``ResourceWarning``; unlike other ResourceWarnings it is
    shown by default: importing shmloader adds a ``"default"`` filter for this class
    alone, unless ``-W`` or ``PYTHONWARNINGS`` set the filters; filters set later
    override it."""


class KeyErrorMessage(str):
    """The text of a ``KeyError`` re-raised from a worker. ``str()`` of a KeyError is the
    ``repr()`` of its argument, which would print the worker's traceback as one quoted
    line of ``\\n``s; this text's repr is itself, so it reads as lines (torch's
    ``KeyErrorMessage`` does the same)."""

    def __repr__(self) -> str:
        return str.__str__(self)


def _rebuild_worker_died(
    message: str,
    worker_id: int | None,
    pid: int | None,
    exitcode: int | None,
    cls: type[WorkerDiedError] = WorkerDiedError,
) -> WorkerDiedError:
    return cls(message, worker_id=worker_id, pid=pid, exitcode=exitcode)


def user_stacklevel() -> int:
    """The stacklevel of the first caller outside this package (the user's loop), so a
    warning points at the user's line, not at the loader's insides."""
    package = os.path.dirname(os.path.abspath(__file__))  # shmloader/, where this module is
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


# ResourceWarnings are ignored by Python's default filters; this one says why a training
# job may run out of memory, so it is shown (once per place) unless the user chose the
# filters (-W, PYTHONWARNINGS) or sets one later.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=CopyOnReadWarning)
