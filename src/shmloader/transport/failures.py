"""A worker's failure: the exception a worker raised, in a form that crosses processes
(:class:`WorkerFailure`), rebuilt in the consumer's words (:func:`rebuild_error`), and
how a worker that died ended (:func:`describe_exit`)."""

from __future__ import annotations

import pickle
import signal
import traceback
from dataclasses import dataclass
from typing import Any

from shmloader.errors import KeyErrorMessage, StrayStopIteration, WorkerError
from shmloader.system.limits import cgroup_limit


@dataclass
class WorkerFailure:
    """An exception raised in a worker, in a form that always crosses processes."""

    worker_id: int
    where: str  # what the worker was doing: "fetching", "collating", "worker_init_fn", ...
    type_module: str
    type_name: str
    message: str
    traceback: str
    indices: list[Any] | None = None
    pickled: bytes | None = None  # the exception itself, when it pickles

    @classmethod
    def capture(cls, exc: BaseException, worker_id: int, where: str, indices: Any) -> WorkerFailure:
        try:
            pickled = pickle.dumps(exc)
            pickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt
        except Exception:
            pickled = None
        return cls(
            worker_id=worker_id,
            where=where,
            type_module=type(exc).__module__,
            type_name=type(exc).__qualname__,
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            indices=None if indices is None else list(indices),
            pickled=pickled,
        )


def short_indices(indices: Any) -> str:
    """The first few sample indices of a batch, for error messages."""
    items = list(indices)
    return f"{items[:8]}" + (f" (+{len(items) - 8} more)" if len(items) > 8 else "")


def describe_exit(code: int | None) -> tuple[str, str]:
    """How a worker with exit code ``code`` ended (torch's words: "is killed by signal:
    ...", "exited unexpectedly with exit code N"), and advice for a SIGKILL (the OOM
    killer), else an empty string."""
    advice = ""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"is killed by signal: {signal.strsignal(-code) or name} ({name})"
        if -code == signal.SIGKILL:
            advice = (
                " SIGKILL usually comes from the kernel's out-of-memory killer: check "
                "`dmesg`, and lower batch_size, num_workers or the dataset's memory use." + _cgroup_advice()
            )
    elif code is not None:
        how = f"exited unexpectedly with exit code {code}"
    else:
        how = "exited unexpectedly (it closed its connection)"
    return how, advice


def rebuild_error(failure: WorkerFailure, seq: int) -> BaseException:
    """The worker's exception in the consumer: its own type where it can be rebuilt. A
    ``StopIteration`` becomes :class:`StrayStopIteration`: raised from ``__next__`` it
    would end the epoch silently."""
    where = f" while {failure.where}" if failure.where else ""
    batch = f" batch {seq}" if failure.where != "running worker_init_fn" else ""
    indices = f" (sample indices {short_indices(failure.indices)})" if failure.indices is not None else ""
    text = (
        f"Caught {failure.type_name} in DataLoader worker {failure.worker_id}{where}{batch}"
        f"{indices}.\nOriginal {failure.traceback}"
    )
    exc: BaseException | None = None
    if failure.pickled is not None:
        try:
            original = pickle.loads(failure.pickled)
            # A KeyError's str() is the repr of its argument: the message would print as
            # one quoted line; KeyErrorMessage prints it as written (as torch's does).
            exc = type(original)(KeyErrorMessage(text) if isinstance(original, KeyError) else text)
        except Exception:
            exc = None
    if isinstance(exc, StopIteration):
        exc = StrayStopIteration(text)
    if exc is None:
        exc = WorkerError(text)
    exc.worker_id = failure.worker_id  # type: ignore[attr-defined]
    exc.indices = failure.indices  # type: ignore[attr-defined]
    exc.worker_traceback = failure.traceback  # type: ignore[attr-defined]
    return exc


def _cgroup_advice() -> str:
    """For a SIGKILLed worker: the memory cgroup limit this process runs under, and the
    OOM kills the kernel counted there (the likely killer), or nothing without a limit."""
    limit = cgroup_limit()
    if limit is None:
        return ""
    kills = f"; the kernel counts {limit.oom_kills} OOM kill(s) there" if limit.oom_kills else ""
    return (
        f" This process runs under a memory limit ({limit.describe()}{kills}): raise the "
        "container's memory limit, or load with less memory."
    )
