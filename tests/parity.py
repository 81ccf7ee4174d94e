"""Runners and comparison of the differential suite against torch (tests/test_torch_parity.py).

- *runners*: :func:`run_torch` and :func:`run_ours` load a dataset and return an
  :class:`Outcome` (the batches, and the exception that ended the epoch, if any);
- *comparison*: :func:`compare_outcomes` asserts that our outcome matches torch's under
  the rules written in the docstring of tests/test_torch_parity.py;
- :func:`parity_failure` does both for one case and says what differs.

The samples (schemas, datasets) are in tests/parity_samples.py.
"""

from __future__ import annotations

import collections
import copy
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import shmloader
from shmloader.errors import BatchLayoutError
from tests.parity_samples import IterableSamples, RaisingSamples

# torch dtype -> the numpy dtype our output="numpy" batches must have for a leaf torch
# hands out as a tensor of that dtype (Rule 2). bfloat16 and float8 have no numpy dtype:
# their leaves come from tensor samples, which we hand out as tensors (Rule 3).
NUMPY_OF_TORCH = {
    torch.bool: np.dtype("bool"),
    torch.uint8: np.dtype("uint8"),
    torch.uint16: np.dtype("uint16"),
    torch.uint32: np.dtype("uint32"),
    torch.uint64: np.dtype("uint64"),
    torch.int8: np.dtype("int8"),
    torch.int16: np.dtype("int16"),
    torch.int32: np.dtype("int32"),
    torch.int64: np.dtype("int64"),
    torch.float16: np.dtype("float16"),
    torch.float32: np.dtype("float32"),
    torch.float64: np.dtype("float64"),
    torch.complex64: np.dtype("complex64"),
    torch.complex128: np.dtype("complex128"),
}


# --- runners ------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one epoch gave: the batches before the end, and the exception that ended it
    (None if the sampler was exhausted)."""

    batches: list[Any] = field(default_factory=list)
    error: BaseException | None = None

    def describe(self) -> str:
        err = f", then {type(self.error).__name__}: {str(self.error)[:300]}" if self.error else ""
        return f"{len(self.batches)} batches{err}"


def run_torch(dataset: Any, **kwargs: Any) -> Outcome:
    """One epoch of torch's DataLoader in this process. Its collate runs the same code in a
    worker, so num_workers is left at 0: the oracle costs no process."""
    out = Outcome()
    try:
        for batch in torch.utils.data.DataLoader(dataset, **kwargs):
            out.batches.append(batch)
    except Exception as exc:
        out.error = exc
    return out


def run_ours(dataset: Any, epochs: int = 1, **kwargs: Any) -> list[Outcome]:
    """``epochs`` epochs of shmloader's DataLoader (fork workers when num_workers > 0),
    each stopped at its first exception; workers are stopped before returning."""
    if kwargs.get("num_workers"):
        kwargs.setdefault("multiprocessing_context", "fork")
    outcomes = []
    try:
        loader = shmloader.DataLoader(dataset, **kwargs)
    except Exception as exc:
        return [Outcome(error=exc) for _ in range(epochs)]
    try:
        for _ in range(epochs):
            out = Outcome()
            it = None
            try:
                it = iter(loader)
                for batch in it:
                    out.batches.append(batch)
            except Exception as exc:
                out.error = exc
            finally:
                # Persistent workers that finished their epoch stay for the next one (the
                # case under test); loader.shutdown() below stops them.
                close = getattr(it, "close", None)
                if close is not None and (out.error is not None or not kwargs.get("persistent_workers")):
                    close()
                del it
            outcomes.append(out)
    finally:
        loader.shutdown()
    return outcomes


# --- comparison ---------------------------------------------------------------------------


class Mismatch(AssertionError):
    pass


def is_sequence(v: Any) -> bool:
    """Whether torch's collate walks ``v`` as a sequence (lists, tuples, a deque, a
    UserList...; not str or bytes)."""
    return isinstance(v, collections.abc.Sequence) and not isinstance(v, (str, bytes))


def attributes(v: Any) -> dict:
    """A container's own attributes (torch's collate copies the first sample's): its
    ``__dict__`` without a UserList's or UserDict's ``data`` (their items), and a deque's
    ``maxlen``."""
    out = {k: x for k, x in getattr(v, "__dict__", {}).items() if k != "data"}
    if isinstance(v, collections.deque):
        out["maxlen"] = v.maxlen
    return out


def tensor_paths(sample: Any, path: tuple = ()) -> set[tuple]:
    """Paths of the leaves of ``sample`` that are torch tensors (Rule 3)."""
    if isinstance(sample, torch.Tensor):
        return {path}
    if isinstance(sample, collections.abc.Mapping):
        return set().union(*(tensor_paths(v, (*path, k)) for k, v in sample.items()))
    if is_sequence(sample):
        return set().union(*(tensor_paths(v, (*path, i)) for i, v in enumerate(sample)))
    return set()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's values as bytes (every dtype, bfloat16 and float8 included; NaNs compare
    by their bits)."""
    if t.numel() == 0:
        return b""
    # A fresh contiguous copy: contiguous() keeps the stride of a one-element tensor,
    # which view() then refuses.
    t = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


def compare_batch(
    ours: Any, theirs: Any, *, as_torch: bool, tensors: set[tuple] | None, path: tuple = ()
) -> None:
    """Assert that our batch ``ours`` matches torch's ``theirs`` (Rules 1-4, 6).

    ``tensors``: the paths whose samples were tensors (Rule 3); None for the output of a
    user collate_fn, which torch hands out unchanged: every tensor in it came from it."""
    where = "batch" + "".join(f"[{p!r}]" for p in path)
    if isinstance(theirs, torch.Tensor):
        if as_torch or tensors is None or path in tensors:
            if not isinstance(ours, torch.Tensor):
                raise Mismatch(f"{where}: torch gives a tensor {_show(theirs)}, ours is {_show(ours)}")
            if ours.dtype != theirs.dtype or tuple(ours.shape) != tuple(theirs.shape):
                raise Mismatch(f"{where}: torch gives {_show(theirs)}, ours is {_show(ours)}")
            if tensor_bytes(ours) != tensor_bytes(theirs):
                raise Mismatch(f"{where}: values differ: torch {theirs!r}, ours {ours!r}")
            return
        if not isinstance(ours, np.ndarray):
            raise Mismatch(f"{where}: torch gives a tensor {_show(theirs)}, ours (numpy) is {_show(ours)}")
        want = NUMPY_OF_TORCH[theirs.dtype]
        if ours.dtype.newbyteorder("=") != want or ours.shape != tuple(theirs.shape):
            raise Mismatch(f"{where}: torch gives {_show(theirs)}, ours is {_show(ours)} (want {want})")
        mine = np.ascontiguousarray(ours.astype(ours.dtype.newbyteorder("=")))
        if mine.tobytes() != tensor_bytes(theirs):
            raise Mismatch(f"{where}: values differ: torch {theirs!r}, ours {ours!r}")
        return
    if isinstance(theirs, np.ndarray) and as_torch and theirs.dtype.kind in "biufc":
        # A numeric array torch hands out as it is (a user collate_fn's output) is a tensor
        # with output="torch" (docs/training.md, "Torch tensors"). Rule 4.
        theirs = torch.from_numpy(theirs.copy())  # copy: keeps a 0-d array 0-d
        return compare_batch(ours, theirs, as_torch=as_torch, tensors=tensors, path=path)
    if isinstance(theirs, np.ndarray):  # arrays torch passes through (strings, a collate_fn's output)
        # Byte order aside (Rule 5: torch was given native arrays).
        same_dtype = type(ours) is np.ndarray and ours.dtype.newbyteorder("=") == theirs.dtype.newbyteorder(
            "="
        )
        if (
            not same_dtype
            or ours.shape != theirs.shape
            or not np.array_equal(ours, theirs, equal_nan=theirs.dtype.kind in "fc")
        ):
            raise Mismatch(f"{where}: torch gives {_show(theirs)}, ours is {_show(ours)}")
        return
    if type(theirs) is tuple and type(ours) is list and theirs and isinstance(theirs[0], (str, bytes)):
        # A batched field of strings or bytes is a list here; torch's collate_str_fn
        # returns the samples' column as it gets it: a list below a dict, a tuple (from
        # zip) below a tuple, list or namedtuple. Rule 4: strings as lists.
        theirs = list(theirs)
    if type(ours) is not type(theirs):
        raise Mismatch(
            f"{where}: torch gives a {_type(theirs)} ({theirs!r:.80}), ours a {_type(ours)} ({ours!r:.80})"
        )
    if (isinstance(theirs, collections.abc.Mapping) or is_sequence(theirs)) and not isinstance(theirs, tuple):
        mine, want = attributes(ours), attributes(theirs)
        if list(mine) != list(want):
            raise Mismatch(f"{where}: attributes differ: torch {list(want)}, ours {list(mine)}")
        for k in want:  # (as torch's collate copies them from the first sample: unchanged)
            compare_batch(mine[k], want[k], as_torch=False, tensors=set(), path=(*path, f".{k}"))
    if isinstance(theirs, collections.abc.Mapping):
        if list(ours.keys()) != list(theirs.keys()):
            raise Mismatch(f"{where}: keys differ: torch {list(theirs)}, ours {list(ours)}")
        for k in theirs:
            compare_batch(ours[k], theirs[k], as_torch=as_torch, tensors=tensors, path=(*path, k))
        return
    if is_sequence(theirs):
        if len(ours) != len(theirs):
            raise Mismatch(f"{where}: torch gives {len(theirs)} items, ours {len(ours)}")
        for i, (o, t) in enumerate(zip(ours, theirs)):
            # Below a list of Python leaves (strings, bytes, None...), the batch axis: the
            # tensor paths of the samples do not apply.
            compare_batch(o, t, as_torch=as_torch, tensors=tensors, path=(*path, i))
        return
    if not _same_scalar(ours, theirs):
        raise Mismatch(f"{where}: torch gives {theirs!r}, ours {ours!r}")


def _same_scalar(a: Any, b: Any) -> bool:
    """Equal values of one type; floats and complex numbers: NaN equals NaN, -0.0 is not 0.0."""
    if isinstance(b, (complex, np.complexfloating)):
        return _same_scalar(a.real, b.real) and _same_scalar(a.imag, b.imag)
    if isinstance(b, (float, np.floating)):
        if math.isnan(b):
            return math.isnan(a)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def _type(v: Any) -> str:
    return type(v).__qualname__


def _show(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
    if isinstance(v, np.ndarray):
        return f"ndarray of shape {v.shape} and dtype {v.dtype}"
    return f"{_type(v)} {v!r:.80}"


# --- exception kinds ----------------------------------------------------------------------

BUILTIN_KINDS = (TypeError, ValueError, OverflowError, RuntimeError, IndexError, KeyError, MemoryError)


def builtin_kind(exc: BaseException) -> type:
    """The builtin exception class a user would catch ``exc`` by."""
    for cls in type(exc).__mro__:
        if cls in BUILTIN_KINDS:
            return cls
    return type(exc)


def has_none(samples: list[Any]) -> bool:
    """Whether some sample holds a None below its containers (Rule 7)."""

    def nones(v: Any, path: tuple = ()) -> set:
        if v is None:
            return {path}
        if isinstance(v, collections.abc.Mapping):
            return set().union(*(nones(x, (*path, k)) for k, x in v.items()))
        if is_sequence(v):
            return set().union(*(nones(x, (*path, i)) for i, x in enumerate(v)))
        return set()

    return any(nones(s) for s in samples)


def dtype_differs(samples: list[Any]) -> bool:
    """Whether two samples hold values of different dtypes at one place where one of them
    is a tensor (torch promotes them; we refuse: Rule 8). Arrays of different dtypes are
    promoted here as in torch: no exemption for them."""

    def dtypes(v: Any, path: tuple = ()) -> dict:
        if isinstance(v, (np.ndarray, torch.Tensor)):
            return {path: (str(v.dtype), isinstance(v, torch.Tensor))}
        out: dict = {}
        if isinstance(v, collections.abc.Mapping):
            for k, x in v.items():
                out.update(dtypes(x, (*path, k)))
        elif is_sequence(v):
            for i, x in enumerate(v):
                out.update(dtypes(x, (*path, i)))
        return out

    maps = [dtypes(s) for s in samples]
    return any((t or m[p][1]) and m[p][0] != d for m in maps[1:] for p, (d, t) in maps[0].items() if p in m)


def error_matches(ours: BaseException, theirs: BaseException, batch_samples: list[Any] | None) -> bool:
    """Whether our exception is the same kind as torch's (Rule 7)."""
    kind = builtin_kind(theirs)
    if isinstance(ours, kind):
        return True
    # Documented: samples that cannot be stacked (shapes, structure, None) are a
    # BatchLayoutError (a ValueError) where torch raises RuntimeError, or TypeError for a
    # None sample. README "Reliability": rows "Samples of different shapes or dtypes in
    # one batch" and "__getitem__ returns None"; errors.py BatchLayoutError.
    if isinstance(ours, BatchLayoutError):
        if kind is RuntimeError:
            return True
        if kind is TypeError and batch_samples is not None and has_none(batch_samples):
            return True
    return False


def batch_plan(
    n: int,
    *,
    batch_size: int | None = 1,
    drop_last: bool = False,
    sampler: list[int] | None = None,
    batch_sampler: list[list[int]] | None = None,
) -> list[list[int]]:
    """The sample indices of each batch a loader over ``n`` samples yields."""
    if batch_sampler is not None:
        return [list(b) for b in batch_sampler]
    order = list(sampler) if sampler is not None else list(range(n))
    if batch_size is None:
        return [[i] for i in order]
    plan = [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    if drop_last and plan and len(plan[-1]) < batch_size:
        plan.pop()
    return plan


def compare_outcomes(
    ours: Outcome, theirs: Outcome, *, batches: list[list[Any]], as_torch: bool, user_collate: bool = False
) -> None:
    """Assert that our epoch matches torch's: the same batches, then the same kind of
    exception or none (Rules 1-8 of test_torch_parity.py). ``batches``: the samples of
    each batch the sampler yields."""

    def batch_samples(k: int) -> list[Any]:
        return batches[k] if k < len(batches) else []

    shared = min(len(ours.batches), len(theirs.batches))
    for k in range(shared):
        # Rule 3: tensors where the batch's first sample holds a tensor (both collates
        # decide a field's kind by its first sample).
        tensors = None if user_collate else set().union(*map(tensor_paths, batch_samples(k)[:1]))
        try:
            compare_batch(ours.batches[k], theirs.batches[k], as_torch=as_torch, tensors=tensors)
        except Mismatch as exc:
            raise Mismatch(f"batch {k} of {batch_samples(k)!r:.300}: {exc}") from None
    if ours.error is None and theirs.error is None:
        if len(ours.batches) != len(theirs.batches):
            raise Mismatch(
                f"torch gives {len(theirs.batches)} batches, ours {len(ours.batches)}, without an error"
            )
        return
    if theirs.error is not None and ours.error is None:
        raise Mismatch(f"torch: {theirs.describe()}; ours: {ours.describe()}")
    k = len(ours.batches)
    culprits = batch_samples(k)
    if theirs.error is None:
        # Documented: samples of one batch with tensors of different dtypes are a
        # BatchLayoutError where torch promotes them (README "Migration", row "arrays of
        # different dtypes in one field"). Rule 8.
        if isinstance(ours.error, BatchLayoutError) and dtype_differs(culprits):
            return
        raise Mismatch(f"torch: {theirs.describe()}; ours: {ours.describe()}")
    if len(ours.batches) != len(theirs.batches):
        raise Mismatch(f"torch: {theirs.describe()}; ours: {ours.describe()}")
    if not error_matches(ours.error, theirs.error, culprits):
        raise Mismatch(
            f"another kind of exception: torch raises {builtin_kind(theirs.error).__name__} "
            f"({theirs.describe()}), ours raises {type(ours.error).__name__} "
            f"[{', '.join(c.__name__ for c in type(ours.error).__mro__[1:-2])}] ({ours.describe()}) "
            f"on samples {culprits!r:.300}"
        )


def torch_input(samples: list[Any], *, as_torch: bool) -> list[Any]:
    """The dataset torch's loader is given (Rule 5): arrays with negative strides copied
    (torch cannot view them; we copy every leaf into the slot anyway), and, for
    output="numpy", big-endian arrays in native byte order (torch has no such dtype;
    numpy batches keep the sample's byte order)."""

    def fix(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            if not as_torch and not v.dtype.isnative:
                v = v.astype(v.dtype.newbyteorder("="))
            # copy(), not ascontiguousarray: an array of one element counts as contiguous
            # whatever its stride, and torch still refuses a negative one.
            return v.copy() if any(s < 0 for s in v.strides) else v
        if isinstance(v, collections.abc.MutableMapping):
            out = copy.copy(v)  # the same type and attributes (OrderedDict, subclasses...)
            out.update({k: fix(x) for k, x in v.items()})
            return out
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            return type(v)(*map(fix, v))
        if isinstance(v, collections.abc.MutableSequence):
            out = copy.copy(v)  # (a deque's maxlen, a list subclass's attributes)
            for i, x in enumerate(v):
                out[i] = fix(x)
            return out
        if isinstance(v, tuple):
            return type(v)(map(fix, v))
        return v

    return [fix(s) for s in samples]


def compare_exact(a: Any, b: Any, path: str = "batch") -> None:
    """Assert two of our batches are the same: types, dtypes, shapes and bytes."""
    if type(a) is not type(b):
        raise Mismatch(f"{path}: {_type(a)} ({a!r:.80}) vs {_type(b)} ({b!r:.80})")
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or tensor_bytes(a) != tensor_bytes(b):
            raise Mismatch(f"{path}: {a!r} vs {b!r}")
    elif isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            raise Mismatch(f"{path}: {a!r} vs {b!r}")
    elif isinstance(a, collections.abc.Mapping):
        if list(a) != list(b):
            raise Mismatch(f"{path}: keys {list(a)} vs {list(b)}")
        if attributes(a).keys() != attributes(b).keys():
            raise Mismatch(f"{path}: attributes {list(attributes(a))} vs {list(attributes(b))}")
        for k, x in attributes(a).items():
            compare_exact(x, attributes(b)[k], f"{path}.{k}")
        for k in a:
            compare_exact(a[k], b[k], f"{path}[{k!r}]")
    elif is_sequence(a):
        if attributes(a).keys() != attributes(b).keys():
            raise Mismatch(f"{path}: attributes {list(attributes(a))} vs {list(attributes(b))}")
        for k, x in attributes(a).items():
            compare_exact(x, attributes(b)[k], f"{path}.{k}")
        if len(a) != len(b):
            raise Mismatch(f"{path}: {len(a)} vs {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b)):
            compare_exact(x, y, f"{path}[{i}]")
    elif not (a == b or (isinstance(a, (float, np.floating)) and math.isnan(a) and math.isnan(b))):
        raise Mismatch(f"{path}: {a!r} vs {b!r}")


def parity_failure(
    samples: list[Any],
    *,
    num_workers: int,
    output: str,
    batch_size: int | None = 1,
    drop_last: bool = False,
    sampler: list[int] | None = None,
    batch_sampler: list[list[int]] | None = None,
    iterable: bool = False,
    raise_at: dict[int, type] | None = None,
    epochs: int = 1,
    ours_kw: dict[str, Any] | None = None,
    check_main_process: bool = False,
    **kwargs: Any,
) -> str | None:
    """Load ``samples`` with both loaders and return what differs (None: nothing).

    Both loaders get ``batch_size``, ``drop_last``, ``sampler``, ``batch_sampler`` and
    ``kwargs``; ours also ``ours_kw`` (``copy``, ``persistent_workers``...), for
    ``epochs`` epochs, each compared with torch's one (sequential sampling repeats).
    ``iterable``: the samples come from an IterableDataset (num_workers=0: with workers
    each worker would yield every sample, in both loaders). ``raise_at``: indices whose
    ``__getitem__`` raises that exception type.
    ``check_main_process``: also load with num_workers=0 and require the same batches
    (Rule 9). Returns a message, not an exception, so that a failing test keeps no
    reference to a batch (a held batch keeps its shared memory, which the leak check
    would report as a second failure)."""
    # output="auto" (torch is imported here): tensors where torch's default collate makes
    # them; a user collate_fn's output as it returns it (Rule 4).
    as_torch = output == "torch" or (output == "auto" and kwargs.get("collate_fn") is None)
    kw = dict(kwargs)
    if batch_sampler is not None:
        kw["batch_sampler"] = batch_sampler
    else:
        kw.update(batch_size=batch_size, drop_last=drop_last)
        if sampler is not None:
            kw["sampler"] = sampler
    plan = batch_plan(
        len(samples), batch_size=batch_size, drop_last=drop_last, sampler=sampler, batch_sampler=batch_sampler
    )
    # An index out of range (a batch sampler may yield one) stands for itself.
    batches = [[samples[i] if 0 <= i < len(samples) else ("index", i) for i in b] for b in plan]

    def dataset(values: list[Any]) -> Any:
        if iterable:
            return IterableSamples(values)
        return RaisingSamples(values, raise_at) if raise_at else values

    theirs = run_torch(dataset(torch_input(samples, as_torch=as_torch)), **kw)
    outcomes = run_ours(
        dataset(samples), epochs=epochs, num_workers=num_workers, output=output, **kw, **(ours_kw or {})
    )
    try:
        for epoch, ours in enumerate(outcomes):
            try:
                compare_outcomes(
                    ours,
                    theirs,
                    batches=batches,
                    as_torch=as_torch,
                    user_collate=kwargs.get("collate_fn") is not None,
                )
            except Mismatch as exc:
                raise Mismatch(f"epoch {epoch}: {exc}" if epoch else str(exc)) from None
        if check_main_process:
            ours = outcomes[0]
            (ours0,) = run_ours(dataset(samples), num_workers=0, output=output, **kw)
            if len(ours.batches) != len(ours0.batches) or type(ours.error) is not type(ours0.error):
                raise Mismatch(f"{num_workers} workers: {ours.describe()}; 0 workers: {ours0.describe()}")
            for k, (a, b) in enumerate(zip(ours.batches, ours0.batches)):
                compare_exact(a, b, f"batch {k} ({num_workers} workers vs 0)")
    except Mismatch as exc:
        return str(exc)
    return None
