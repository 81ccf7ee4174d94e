"""Child-process side of tests/test_faults.py: datasets that fail on purpose, and the
scenarios each fault test runs in a child process.

Everything here is module level so that spawn and forkserver workers can unpickle it.
A child runs ``python -c "from tests.faultcases import main; main()" CASE JSON_KWARGS``;
``main`` runs the scenario, then checks in the child itself that nothing is left (no live
descendant, no extra descriptor, no mapping of a ring) and prints one JSON line
``RESULT {...}`` for the test to read. Worker pids are reported so that the test can also
check from outside, after the child exited, that none of them survived it.
"""

from __future__ import annotations

import faulthandler
import gc
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
import warnings
from typing import Any

import numpy as np
import psutil

from shmloader import (
    DataLoader,
    IterableDataset,
    Sampler,
    get_worker_info,
)

# --------------------------------------------------------------------------- helpers


def mp_helper_pids() -> set[int]:
    """Pids of multiprocessing's session helpers (fork server, resource tracker)."""
    from multiprocessing import forkserver, resource_tracker

    pids = set()
    for obj in (forkserver._forkserver, resource_tracker._resource_tracker):
        for attr in ("_forkserver_pid", "_pid"):
            pid = getattr(obj, attr, None)
            if isinstance(pid, int):
                pids.add(pid)
    return pids


def live_descendants() -> list[int]:
    """Descendants of this process that are running (zombies do not count), helpers aside."""
    helpers = mp_helper_pids()
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.pid not in helpers:
                out.append(p.pid)
        except psutil.Error:
            pass
    return sorted(out)


def alive(pid: int) -> bool:
    """True when ``pid`` runs (a zombie has exited: not alive)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def read_line(proc: Any, prefix: str, timeout: float) -> str:
    """The first line starting with ``prefix`` that the child ``proc`` (a Popen with text
    pipes) writes to stdout within ``timeout`` s; else kill it and fail with its stderr."""
    import select

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    _, err = proc.communicate()
    raise AssertionError(f"no {prefix!r} line from the child within {timeout} s\n{err[-3000:]}")


def worker_pids(it: Any) -> list[int]:
    """The pids of an iterator's workers (read from the loader's internals). Starts its
    epoch first (as the first next() would): iter() alone starts no worker."""
    it.start()
    return [w.proc.pid for w in it.workers]


def fd_set() -> set[int]:
    helpers = set()
    from multiprocessing import forkserver, resource_tracker

    for v in (
        getattr(forkserver._forkserver, "_forkserver_alive_fd", None),
        getattr(resource_tracker._resource_tracker, "_fd", None),
    ):
        if isinstance(v, int):
            helpers.add(v)
    return {int(fd) for fd in os.listdir("/proc/self/fd")} - helpers


def describe_fd(fd: int) -> str:
    try:
        return f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"
    except OSError:
        return str(fd)


def ring_mappings() -> list[str]:
    """Lines of /proc/self/maps that map a shared-memory segment."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if "/dev/shm/" in line or "shmloader-" in line]


def ring_mapped_bytes() -> int:
    total = 0
    for line in ring_mappings():
        lo, hi = line.split()[0].split("-")
        total += int(hi, 16) - int(lo, 16)
    return total


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def wait_gone(pids: list[int], within: float) -> list[int]:
    """Wait up to ``within`` s for ``pids`` to stop running; the ones still running."""
    deadline = time.monotonic() + within
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


def describe(exc: BaseException | None) -> dict[str, Any] | None:
    if exc is None:
        return None
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "msg": str(exc),
        "worker_id": getattr(exc, "worker_id", None),
        "pid": getattr(exc, "pid", None),
        "exitcode": getattr(exc, "exitcode", None),
        "indices": getattr(exc, "indices", None),
        "worker_traceback": getattr(exc, "worker_traceback", None),
    }


def _stamp(path: str | None, text: str) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text)


def crash(mode: str, stamp: str | None) -> None:
    """Die the way ``mode`` says, after writing 'worker_id pid monotonic-time' to ``stamp``."""
    info = get_worker_info()
    _stamp(stamp, f"{info.id if info else -1} {os.getpid()} {time.monotonic()}")
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "segv":
        faulthandler._sigsegv()
    elif mode == "exit3":
        os._exit(3)
    time.sleep(60)  # not reached


# --------------------------------------------------------------------------- datasets


class Arange:
    """Map-style: sample i is ``np.full(shape, i, int64)``. Optional faults: crash at
    ``crash_at`` (only once the file ``arm`` exists, when given), raise ValueError for
    the indices in ``bad``, sleep ``sleep`` s per sample or ``slow_s`` at ``slow_at``."""

    def __init__(
        self,
        n: int = 40,
        shape: tuple[int, ...] = (4,),
        sleep: float = 0.0,
        crash_at: int | None = None,
        crash: str | None = None,
        stamp: str | None = None,
        arm: str | None = None,
        bad: tuple[int, ...] = (),
        slow_at: int | None = None,
        slow_s: float = 0.0,
        dtype: str = "int64",
        bad_message_bytes: int = 0,
    ) -> None:
        self.n, self.shape, self.sleep = n, tuple(shape), sleep
        self.crash_at, self.crash, self.stamp, self.arm = crash_at, crash, stamp, arm
        self.bad, self.slow_at, self.slow_s, self.dtype = set(bad), slow_at, slow_s, dtype
        self.bad_message_bytes = bad_message_bytes  # pads the ValueError's message

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} is out of range for a dataset of {self.n} samples")
        if self.sleep:
            time.sleep(self.sleep)
        if i == self.slow_at:
            time.sleep(self.slow_s)
        if i == self.crash_at and (self.arm is None or os.path.exists(self.arm)):
            crash(self.crash, self.stamp)  # type: ignore[arg-type]
        if i in self.bad:
            raise ValueError(f"bad sample {i}" + "!" * self.bad_message_bytes)
        return np.full(self.shape, i, self.dtype)


class Stream(IterableDataset):
    """Iterable: items ``0..n-1`` split round robin over the workers, each yielded as
    ``np.full(shape, item, int64)``; crashes at item ``crash_at`` (once ``arm`` exists)."""

    def __init__(
        self,
        n: int = 40,
        shape: tuple[int, ...] = (4,),
        sleep: float = 0.0,
        crash_at: int | None = None,
        crash: str | None = None,
        stamp: str | None = None,
        arm: str | None = None,
        raise_in_iter: bool = False,
    ) -> None:
        self.n, self.shape, self.sleep = n, tuple(shape), sleep
        self.crash_at, self.crash, self.stamp, self.arm = crash_at, crash, stamp, arm
        self.raise_in_iter = raise_in_iter

    def __iter__(self):
        if self.raise_in_iter:
            raise KeyError("no such shard")
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for item in range(wid, self.n, nw):
            if self.sleep:
                time.sleep(self.sleep)
            if item == self.crash_at and (self.arm is None or os.path.exists(self.arm)):
                crash(self.crash, self.stamp)  # type: ignore[arg-type]
            yield np.full(self.shape, item, np.int64)


class Ragged(Arange):
    def __getitem__(self, i):
        return np.zeros((3 + (i == 5), 2), np.float32)


class MixedDtype(Arange):
    # (float64 among float32 is promoted, as torch does: a dtype no number promotes to.)
    def __getitem__(self, i):
        return np.array(["a", "b", "c"]) if i == 6 else np.zeros(3, np.float32)


class ObjectArray(Arange):
    def __getitem__(self, i):
        return {"label": np.array(["a", 1], dtype=object)}


class ReturnsNone(Arange):
    def __getitem__(self, i):
        if i == 2:
            return None
        return np.zeros(2, np.float32)


class Big(Arange):
    """Samples 6 and 7 (batch 3 at batch_size=2) are 1 MiB; the others are 64 bytes."""

    def __getitem__(self, i):
        return np.zeros(2**20 if i in (6, 7) else 64, np.uint8)


class LenRaises(Arange):
    def __len__(self):
        raise TypeError("this dataset has no length")


class BadShard(Exception):
    """An exception whose constructor needs two arguments: it pickles, but unpickling
    it (which calls BadShard(message)) fails, so the consumer cannot rebuild it."""

    def __init__(self, shard: str, reason: str) -> None:
        super().__init__(f"shard {shard}: {reason}")


class RaisesUnrebuildable(Arange):
    def __getitem__(self, i):
        raise BadShard("s3://x", "checksum mismatch")


class OutOfRangeSampler(Sampler):
    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __iter__(self):
        yield from range(self.n)
        yield self.bad

    def __len__(self):
        return self.n + 1


class FailingSampler(Sampler):
    def __init__(self, n: int, fail_after: int) -> None:
        self.n, self.fail_after = n, fail_after

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_after:
                raise LookupError(f"sampler failed at position {i}")
            yield i

    def __len__(self):
        return self.n


def init_raises(worker_id: int) -> None:
    if worker_id == 1:
        raise ZeroDivisionError(f"init of worker {worker_id} failed")


def collate_raises(samples):
    if int(samples[0][0]) == 8:
        raise AttributeError("collate cannot handle batch starting at 8")
    return np.stack(samples)


# --------------------------------------------------------------------------- scenarios


def _loader(ds: Any, method: str, **kw: Any) -> DataLoader:
    kw.setdefault("batch_size", 2)
    kw.setdefault("num_workers", 2)
    return DataLoader(ds, multiprocessing_context=method, **kw)


def case_death(method: str, tmp: str) -> dict[str, Any]:
    """Worker SIGKILL / segfault / os._exit(3), map and iterable, persistent on and off:
    under fork every pairing of the dataset's kind and persistence; under the other start
    methods two (map without persistent workers, iterable with them), each with the three
    deaths: how the consumer handles a death does not depend on how its workers started
    (how the death reaches it does: the three deaths run under each), and each of their
    workers costs a fresh interpreter."""
    out = []
    if method == "fork":
        pairings = [(kind, persistent) for kind in ("map", "iter") for persistent in (False, True)]
    else:
        pairings = [("map", False), ("iter", True)]
    for kind, persistent in pairings:
        for mode in ("sigkill", "segv", "exit3"):
            stamp = os.path.join(tmp, f"stamp-{kind}-{persistent}-{mode}")
            arm = os.path.join(tmp, f"arm-{kind}-{persistent}-{mode}") if persistent else None
            cls = Arange if kind == "map" else Stream
            ds = cls(n=40, sleep=0.005, crash_at=13, crash=mode, stamp=stamp, arm=arm)
            dl = _loader(ds, method, persistent_workers=persistent)
            full_epochs = 0
            if persistent:
                full_epochs = sum(1 for _ in dl) and 1
                open(arm, "w").close()  # type: ignore[arg-type]
            it = iter(dl)
            pids = worker_pids(it)
            err, n, t_err = None, 0, 0.0
            try:
                for _ in it:
                    n += 1
            except Exception as exc:
                t_err = time.monotonic()
                err = exc
            still_running = [p for p in pids if alive(p)]
            with open(stamp) as f:
                wid, wpid, t_crash = f.read().split()
            out.append(
                {
                    "kind": kind,
                    "persistent": persistent,
                    "mode": mode,
                    "full_epochs_before": full_epochs,
                    "batches": n,
                    "error": describe(err),
                    "crashed_worker": int(wid),
                    "crashed_pid": int(wpid),
                    "latency_s": t_err - float(t_crash),
                    "pids": pids,
                    "running_after_error": still_running,
                }
            )
            del it
            dl.shutdown()
            del dl
    return {"cases": out}


def case_exceptions(method: str) -> dict[str, Any]:
    """Exceptions in __getitem__, __iter__, worker_init_fn, collate_fn and the sampler."""
    out: dict[str, Any] = {}
    for persistent in (False, True):
        # __getitem__: batches of 4 over 40 samples, samples 3, 17 and 18 bad: batches
        # 0 and 4 fail; iteration goes on and the other 8 batches arrive.
        dl = _loader(Arange(n=40, bad=(3, 17, 18)), method, batch_size=4, persistent_workers=persistent)
        for epoch in range(2 if persistent else 1):
            errors, got = [], []
            it = iter(dl)
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                except ValueError as exc:
                    errors.append(describe(exc))
                    continue
                got.append(batch[:, 0].tolist())
            out[f"getitem-p{int(persistent)}-e{epoch}"] = {"errors": errors, "got": got}
            del it
        dl.shutdown()
        del dl
    # __iter__ of an iterable dataset
    out["iter"] = _first_error(_loader(Stream(raise_in_iter=True), method))
    out["worker_init_fn"] = _first_error(_loader(Arange(), method, worker_init_fn=init_raises))
    out["collate_fn"] = _first_error(_loader(Arange(), method, collate_fn=collate_raises, batch_size=4))
    out["sampler"] = _first_error(_loader(Arange(n=40), method, sampler=FailingSampler(40, 9)))
    out["unrebuildable"] = _first_error(_loader(RaisesUnrebuildable(), method))
    return out


def _first_error(dl: DataLoader, steps: int = 1000) -> dict[str, Any]:
    """Iterate ``dl`` until it raises; the error, the batches before it, and whether the
    workers were still running after the error (they are reaped once the iterator goes)."""
    n, err, pids = 0, None, []
    t0 = time.monotonic()
    try:
        it = iter(dl)
        pids = worker_pids(it)
        for _ in range(steps):
            next(it)
            n += 1
    except StopIteration:
        pass
    except Exception as exc:
        err = describe(exc)  # not the exception: its traceback keeps the iterator alive
    elapsed = time.monotonic() - t0
    it = None  # drop the iterator: its workers stop
    del dl
    t1 = time.monotonic()
    gc.collect()
    left = wait_gone(pids, 3)
    return {
        "error": err,
        "batches": n,
        "elapsed_s": elapsed,
        "left": left,
        "stop_s": time.monotonic() - t1,
    }


def case_bad_input(method: str) -> dict[str, Any]:
    out = {
        "ragged": _first_error(_loader(Ragged(), method, batch_size=4)),
        "dtype": _first_error(_loader(MixedDtype(), method, batch_size=4)),
        "object": _first_error(_loader(ObjectArray(), method, batch_size=4)),
        "none": _first_error(_loader(ReturnsNone(), method, batch_size=4)),
        "too_big": _first_error(_loader(Big(), method, batch_size=2, slot_bytes=8192, num_slots=8)),
        "len_raises": _first_error(_loader(LenRaises(), method)),
        "sampler_out_of_range": _first_error(
            _loader(Arange(n=10), method, sampler=OutOfRangeSampler(10, 99))
        ),
    }
    if method != "fork":
        out["lambda_collate"] = _first_error(_loader(Arange(), method, collate_fn=lambda b: b))

        class Local(Arange):
            pass

        out["local_dataset"] = _first_error(_loader(Local(), method))
    return out


def case_timeout(method: str) -> dict[str, Any]:
    dl = _loader(Arange(n=20, slow_at=5, slow_s=5.0), method, batch_size=2, timeout=1)
    it = iter(dl)
    pids = worker_pids(it)
    # Wait until each worker has sent its first batch (0 and 1), however long a start
    # takes on a loaded machine, so the timeout that fires is the slow sample's (batch 2).
    for w in it.workers:
        assert w.conn.poll(60), "a worker sent nothing within 60 s"
    n, err = 0, None
    t0 = time.monotonic()
    try:
        for _ in it:
            n += 1
            t0 = time.monotonic()
    except Exception as exc:
        err = exc
    waited = time.monotonic() - t0
    running = [p for p in pids if alive(p)]
    reaped = [p for p in pids if not psutil.pid_exists(p)]
    del it, dl
    return {
        "error": describe(err),
        "batches": n,
        "waited_s": waited,
        "running_after": running,
        "reaped": reaped,
        "pids": pids,
    }


def case_held(method: str) -> dict[str, Any]:
    """Keep 10,000 batches alive: the ring runs out of slots, later batches come by copy."""
    n = 10_000
    dl = _loader(Arange(n=n, shape=(2,)), method, batch_size=1, num_slots=16)
    held = []
    fd_counts = []
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, batch in enumerate(dl):
            held.append(batch)
            if k % 500 == 100:  # the ring exists from the first batches on
                fds = fd_set()
                fd_counts.append(len(fds))
                ring_fds = [fd for fd in fds if "/dev/shm/" in describe_fd(fd)]
    elapsed = time.monotonic() - t0
    ok = all(int(b[0, 0]) == i and int(b[0, 1]) == i for i, b in enumerate(held))
    pinned = dl.pinned_shm_bytes() if hasattr(dl, "pinned_shm_bytes") else None
    num_slots = dl.ring.num_slots if dl.ring is not None else None
    views = sum(1 for b in held if dl.ring is not None and dl.ring.contains(b))
    warns = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    del held, batch
    del dl
    return {
        "count": len(held_ok := [ok]) and n,
        "values_ok": held_ok[0],
        "views": views,
        "fd_counts": sorted(set(fd_counts)),
        "ring_fds": len(ring_fds),
        "pinned_shm_bytes": pinned,
        "final_num_slots": num_slots,
        "warnings": warns,
        "iterate_s": elapsed,
    }


def case_churn(method: str, iterators: int) -> dict[str, Any]:
    """Create ``iterators`` iterators, read 3 batches from each, drop them: on one loader,
    then on fresh loaders. Figures after a warm-up and at the end."""

    def figures() -> dict[str, int]:
        gc.collect()
        return {
            "processes": len(live_descendants()),
            "fds": len(fd_set()),
            "ring_mapped_bytes": ring_mapped_bytes(),
            "rss": rss_bytes(),
        }

    out: dict[str, Any] = {}
    t0 = time.monotonic()
    dl = _loader(Arange(n=64, shape=(256,)), method, batch_size=4)
    for phase in ("one_loader", "fresh_loaders"):
        warm = 20
        for k in range(iterators + warm):
            if k == warm:
                before = figures()
            if phase == "one_loader":
                loader = dl
            else:
                loader = _loader(Arange(n=64, shape=(256,)), method, batch_size=4)
            it = iter(loader)
            for _ in range(3):
                next(it)
            del it, loader
        out[phase] = {"before": before, "after": figures()}
    out["elapsed_s"] = time.monotonic() - t0
    del dl
    return out


def case_early_exit(method: str, kind: str) -> dict[str, Any]:
    """break after 1 batch, after half an epoch; then leave an iterator referenced and a
    persistent loader's iterator alive at interpreter exit (the test times the exit)."""
    cls = Arange if kind == "map" else Stream
    out: dict[str, Any] = {}
    for name, stop in (("break1", 1), ("half", 10)):
        dl = _loader(cls(n=40), method)
        it = iter(dl)
        pids = worker_pids(it)
        for k, _ in enumerate(it):
            if k + 1 >= stop:
                break
        # Timed from the break: a spawned worker's start, seconds on a loaded machine, is
        # not what the bound is about (a stop that waited for JOIN_TIMEOUT_S would be).
        t0 = time.monotonic()
        del it, dl
        out[name] = {"close_s": time.monotonic() - t0, "left": wait_gone(pids, 0)}
    # Left for interpreter exit: an iterator still referenced from a global, and a
    # persistent loader whose iterator is only reachable from the loader. Each has had a
    # batch from both of its workers (in turn), so both are running their loop at exit,
    # not still starting (a spawned worker reads the stop only once it has started).
    global _KEEP
    dl1 = _loader(cls(n=40), method)
    it1 = iter(dl1)
    next(it1)
    next(it1)
    dl2 = _loader(cls(n=40), method, persistent_workers=True)
    it2 = iter(dl2)
    next(it2)
    next(it2)
    exit_pids = worker_pids(it1) + worker_pids(it2)
    _KEEP = (dl1, it1, dl2)
    del it2
    out["exit_pids"] = exit_pids
    out["no_leak_check"] = True  # workers are alive on purpose until exit
    return out


_KEEP: Any = None


def case_interrupted(method: str) -> dict[str, Any]:
    """Iterate a slow epoch; the test sends SIGINT to the process group."""
    # How this process receives SIGINT (a disposition or mask inherited from the test
    # process would keep the Ctrl-C from ever arriving; the test reports it).
    sigint = {
        "handler": str(signal.getsignal(signal.SIGINT)),
        "blocked": signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []),
    }
    dl = _loader(Arange(n=400, sleep=0.02), method)
    it = iter(dl)
    pids = worker_pids(it)
    interrupts = 0
    n = 0
    try:
        for _ in it:
            n += 1
            if n == 1:
                print("READY", json.dumps(pids), flush=True)
    except KeyboardInterrupt:
        interrupts += 1
    del it, dl
    gc.collect()
    left = wait_gone(pids, 3)
    return {"interrupts": interrupts, "batches": n, "pids": pids, "left": left, "sigint": sigint}


def case_victim(method: str, mode: str) -> dict[str, Any]:
    """The consumer the test SIGKILLs: 'busy' workers sleep in __getitem__ over a 64 MiB
    ring; 'blocked' workers are stuck sending a 16 MiB error (its message is that long)."""
    if mode == "busy":
        dl = _loader(Arange(n=100, sleep=1.5), method, slot_bytes=8 * 2**20, num_slots=8)
    else:
        dataset = Arange(n=100, bad=tuple(range(100)), bad_message_bytes=16 * 2**20)
        dl = _loader(dataset, method, batch_size=2)
    it = iter(dl)
    pids = worker_pids(it)
    if mode == "busy":
        next(it)
    else:
        # Wait until each worker has started sending its 16 MiB error: it is then
        # blocked writing (the socket buffer holds far less), whatever the machine's load.
        for w in it.workers:
            w.conn.poll(60)
    print("READY", json.dumps(pids), flush=True)
    time.sleep(60)
    return {}


def case_fork_consumer(method: str) -> dict[str, Any]:
    """os.fork() while an iterator is alive; the copy exits normally (atexit and all)."""
    dl = _loader(Arange(n=40, sleep=0.01), method)
    it = iter(dl)
    first = [next(it)[:, 0].tolist() for _ in range(3)]
    pids = worker_pids(it)
    pid = os.fork()
    if pid == 0:
        # The copy: use numpy, drop its copy of the iterator, exit normally.
        ok = 0
        try:
            del it
            gc.collect()
            ok = 1
        finally:
            sys.stdout.flush()
            sys.exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    rest = [b[:, 0].tolist() for b in it]
    got = [v for b in first + rest for v in b]
    del it, dl
    return {
        "copy_exit": os.waitstatus_to_exitcode(status),
        "values_ok": got == list(range(40)),
        "pids": pids,
    }


def case_two_loaders(method: str) -> dict[str, Any]:
    a = _loader(Arange(n=40), method)
    b = _loader(Arange(n=60, shape=(3,), dtype="float32"), method, batch_size=3)
    ia, ib = iter(a), iter(b)
    got_a, got_b = [], []
    for x in ia:
        got_a.extend(x[:, 0].tolist())
        y = next(ib, None)
        if y is not None:
            got_b.extend(y[:, 0].tolist())
    got_b.extend(v for y in ib for v in y[:, 0].tolist())
    del ia, ib, a, b
    return {"a_ok": got_a == list(range(40)), "b_ok": got_b == [float(i) for i in range(60)]}


def case_solo(method: str, n: int) -> dict[str, Any]:
    """One loader per process, for two processes run at once."""
    dl = _loader(Arange(n=n, shape=(64,)), method, batch_size=4)
    ok = True
    for _epoch in range(3):
        got = [v for x in dl for v in x[:, 0].tolist()]
        ok &= got == list(range(n))
    del dl
    return {"ok": ok}


def case_shm_small(method: str) -> dict[str, Any]:
    """Inside a 16 MiB /dev/shm: a 64 MiB ring (fixed slot_bytes), then one sized from
    the first batch (8 x 8 MiB)."""
    out = {"shm_size": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize}
    for name, kw, shape in (
        ("fixed", {"slot_bytes": 8 * 2**20, "num_slots": 8}, (4,)),
        ("sized", {"num_slots": 8}, (2**20,)),
    ):
        t0 = time.monotonic()
        err, pids, n, stage = None, [], 0, "construction"
        try:
            # The ring is made when the loader is built (slot_bytes given) or after
            # the first batch (sized from it).
            dl = _loader(Arange(n=40, shape=shape), method, **kw)
            stage = "iteration"
            it = iter(dl)
            pids = worker_pids(it)
            for _ in it:
                n += 1
        except Exception as exc:
            err = describe(exc)
        it = dl = None
        gc.collect()
        out[name] = {
            "error": err,
            "stage": stage,
            "batches": n,
            "elapsed_s": time.monotonic() - t0,
            "left": wait_gone(pids, 3),
            "shm_entries": os.listdir("/dev/shm"),
        }
    return out


def case_security(method: str) -> dict[str, Any]:
    """The segment: mode 0600, unlinked before workers start, never someone else's."""
    import secrets

    import posix_ipc

    import shmloader.system.segment as segment_mod

    real_shm = posix_ipc.SharedMemory
    created: list[dict[str, Any]] = []
    segment_mod._tmpfile_refused = True  # the named segments (O_TMPFILE makes none)

    def recording_shm(name, flags=0, mode=0o600, *args, **kw):
        shm = real_shm(name, flags, mode, *args, **kw)
        st = os.fstat(shm.fd)
        created.append({"name": name, "mode": st.st_mode & 0o777, "ino": st.st_ino})
        return shm

    segment_mod.posix_ipc = type(
        "P",
        (),
        {
            "SharedMemory": recording_shm,
            "O_CREX": posix_ipc.O_CREX,
            "ExistentialError": posix_ipc.ExistentialError,
        },
    )
    # A name chosen by someone else beforehand: the first name the loader will draw.
    hexes = iter(["00" * 8, "11" * 8] + [secrets.token_hex(8) for _ in range(100)])
    real_token_hex = secrets.token_hex
    secrets.token_hex = lambda n=None: next(hexes)
    squatted = f"/dev/shm/shmloader-{os.getpid()}-{'00' * 8}"
    fd = os.open(squatted, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    os.write(fd, b"attacker")
    os.close(fd)
    os.chmod(squatted, 0o666)
    squat_ino = os.stat(squatted).st_ino
    try:
        dl = _loader(Arange(n=40), method, slot_bytes=4096, num_slots=8)
        it = iter(dl)
        batches = [b[:, 0].tolist() for b in it]
        ring = dl.ring
        ring_fd = ring.fd
        ring_ino = os.fstat(ring_fd).st_ino
        link = os.readlink(f"/proc/self/fd/{ring_fd}")
        names = [c["name"] for c in created]
        # Another process tries to open each name the loader used.
        probe = (
            "import posix_ipc, sys\n"
            "for n in sys.argv[1:]:\n"
            "    try:\n"
            "        posix_ipc.SharedMemory(n); print('OPENED', n)\n"
            "    except posix_ipc.ExistentialError:\n"
            "        print('ABSENT', n)\n"
        )
        import subprocess

        probe_out = subprocess.run(
            [sys.executable, "-c", probe, *names], capture_output=True, text=True, timeout=30
        ).stdout.split("\n")
        with open(squatted, "rb") as f:
            squat_content = f.read()
        del it, dl, ring
        squat_still_there = os.path.exists(squatted)
    finally:
        secrets.token_hex = real_token_hex
        segment_mod.posix_ipc = posix_ipc
        if os.path.exists(squatted):  # the test's own file: never left in /dev/shm
            os.unlink(squatted)
    # Every name taken: a clear error, nothing created.
    secrets.token_hex = lambda n=None: "22" * 8
    taken = f"/dev/shm/shmloader-{os.getpid()}-{'22' * 8}"
    os.close(os.open(taken, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        err = None
        try:
            iter(_loader(Arange(n=40), method, slot_bytes=4096, num_slots=8))
        except Exception as exc:
            err = exc
    finally:
        secrets.token_hex = real_token_hex
        os.unlink(taken)
    return {
        "created": created,
        "batches_ok": [v for b in batches for v in b] == list(range(40)),
        "ring_link": link,
        "ring_ino": ring_ino,
        "squat_ino": squat_ino,
        "squat_content": squat_content.decode(),
        "squat_still_there": squat_still_there,
        "probe": [line for line in probe_out if line],
        "all_taken_error": describe(err),
    }


class SeesNoName(Arange):
    """Reports, from inside the worker, the consumer's shmloader names in /dev/shm."""

    def __init__(self, n: int, consumer: int) -> None:
        super().__init__(n)
        self.consumer = consumer

    def __getitem__(self, i):
        mine = f"shmloader-{self.consumer}-"
        names = [n for n in os.listdir("/dev/shm") if n.startswith(mine)]
        return {"x": np.full(2, i), "names": ",".join(names)}


def case_unlinked_before_start(method: str) -> dict[str, Any]:
    dl = _loader(SeesNoName(8, os.getpid()), method, slot_bytes=4096, num_slots=8)
    seen = [s for b in dl for s in b["names"]]
    return {"names_seen_by_workers": sorted(set(seen))}


# --------------------------------------------------------------------------- big frames (issue 12, item 6)

WIDE = 65_536  # samples per batch: a task frame of 512 KiB, more than a socket buffer holds
WIDE_BAD = (2, 3, 5, 6)


class Wide:
    """Map-style: sample i is the int i. In batch b (of ``WIDE`` samples), sample 7
    raises ValueError when b is in ``bad_batches`` (the error carries all 65,536 indices
    back), and the first sample sleeps ``hang_s`` when b == ``hang_batch``."""

    def __init__(
        self, batches: int, bad_batches: tuple[int, ...] = (), hang_batch: int = -1, hang_s: float = 0.0
    ):
        self.n, self.bad, self.hang_batch, self.hang_s = batches * WIDE, set(bad_batches), hang_batch, hang_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        b, k = divmod(i, WIDE)
        if k == 7 and b in self.bad:
            raise ValueError(f"sample {i} is bad")
        if k == 0 and b == self.hang_batch:
            time.sleep(self.hang_s)
        return i


def case_big_frames(method: str, scenario: str) -> dict[str, Any]:
    """Frames larger than a socket's buffer both ways. 'raises': a sample of batch 2
    raises (the worker writes a big error while the consumer writes it a big task).
    'hang': worker 0 hangs in batch 2 with a big task queued for it, timeout=5.
    'continue': the batches in WIDE_BAD raise, and the loop catches each error and goes on."""
    if scenario == "raises":
        dl = _loader(Wide(6, bad_batches=(2,)), method, batch_size=WIDE)
    elif scenario == "hang":
        dl = _loader(Wide(8, hang_batch=2, hang_s=60.0), method, batch_size=WIDE, timeout=5)
    else:
        dl = _loader(Wide(8, bad_batches=WIDE_BAD), method, batch_size=WIDE)
    it = iter(dl)
    pids = worker_pids(it)
    got: list[Any] = []
    err = None
    t0 = time.monotonic()
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except Exception as exc:
            got.append(describe(exc))
            if scenario != "continue":
                err = got[-1]
                break
            continue
        got.append([int(batch[0]), int(batch[-1]), len(batch)])
    waited = time.monotonic() - t0
    del it, dl
    gc.collect()
    return {"got": got, "error": err, "waited_s": waited, "pids": pids, "left": wait_gone(pids, 3)}


def case_stuck_in_fork(method: str, tmp: str, every: bool, kinds: list[str]) -> dict[str, Any]:
    """A thread of this process holds a lock while workers fork, and an at-fork handler
    takes it in the child: the child copied it locked and waits forever before any of the
    worker's code runs (as CPython gh-112275 does inside the interpreter). ``every``
    False: only the first fork of each loader takes it (a token file); True: every fork
    does. One loader per dataset kind of ``kinds`` ("map": Arange, "iter": Stream), one
    after the other. The start deadline is shortened to 1 s."""
    import threading

    from shmloader.workers import pool

    pool.FORK_START_DEADLINE_S = 1.0
    lock = threading.Lock()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    token = os.path.join(tmp, "token")

    def take_the_lock_in_the_child() -> None:
        if not every:
            try:
                os.unlink(token)  # only one child wins it
            except FileNotFoundError:
                return
        lock.acquire()  # held by a thread that does not exist here: never returns

    os.register_at_fork(after_in_child=take_the_lock_in_the_child)
    out = {}
    for kind in kinds:
        open(token, "w").close()
        dl = _loader(Arange(n=20) if kind == "map" else Stream(n=20), method, num_workers=2)
        it = iter(dl)
        first_pids = worker_pids(it)
        batches, err = [], None
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                batches = [b.tolist() for b in it]
            except Exception as exc:
                err = exc
        elapsed = time.monotonic() - t0
        del it
        dl.shutdown()
        del dl
        out[kind] = {
            "batches": batches,
            "error": describe(err),
            "warnings": [str(w.message) for w in caught],
            "categories": [w.category.__name__ for w in caught],
            "first_pids": first_pids,
            "elapsed_s": elapsed,
            "token_left": os.path.exists(token),
        }
    release.set()
    holder.join()
    return {"kinds": out, "pids": [p for k in out.values() for p in k["first_pids"]]}


class StrayBytes(Arange):
    """Map-style, as Arange; sample ``at`` writes ``stray`` to this worker's socket to the
    consumer (the one whose peer is the consumer's pid), between two of the worker's own
    frames: what a library writing to a descriptor number it no longer owns would do.
    Then the sample comes ``pause`` seconds late."""

    def __init__(self, at: int, stray: bytes, pause: float = 1.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.at, self.stray, self.pause, self.consumer = at, stray, pause, os.getpid()

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.at:
            os.write(self._consumer_socket(), self.stray)
            # The consumer reads a socket when its wait for a result lasts (a result that
            # comes while it yields or sleeps on the futex is taken without a poll), and at
            # the epoch's end: a pause makes the batch it waits for next come late, so it
            # polls, as it would for a slow one.
            time.sleep(self.pause)
        return super().__getitem__(i)

    def _consumer_socket(self) -> int:
        import socket
        import struct

        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            with sock:
                if sock.family != socket.AF_UNIX:
                    continue
                creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                if struct.unpack("3i", creds)[0] == self.consumer:
                    return fd
        raise RuntimeError("no socket to the consumer in this worker")


def case_stray_bytes(method: str) -> dict[str, Any]:
    """Stray bytes on a worker's socket: a frame length no frame has (-4, which once made
    the consumer loop forever), and one past the largest frame."""
    import struct

    out = {}
    minus_four = struct.pack("!i", -4) + b"junk"
    for name, stray in (("minus_four", minus_four), ("huge", struct.pack("!iQ", -1, 2**62))):
        ds = StrayBytes(at=9, stray=stray, n=60, sleep=0.05)
        out[name] = _first_error(_loader(ds, method, batch_size=2, num_workers=2))
    # In the epoch's last batch, on time: no wait of the consumer's lasts, and the bytes
    # are read as the epoch ends.
    ds = StrayBytes(at=58, stray=minus_four, pause=0.0, n=60, sleep=0.05)
    out["at_the_end"] = _first_error(_loader(ds, method, batch_size=2, num_workers=2))
    return out


CASES = {name[len("case_") :]: fn for name, fn in globals().items() if name.startswith("case_")}


def main() -> None:
    case, kwargs = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    multiprocessing.set_start_method(kwargs.get("method", "fork"), force=True)
    # Warm up multiprocessing's helpers so their descriptors are in the baseline.
    fds0 = fd_set()
    maps0 = ring_mappings()
    t0 = time.monotonic()
    try:
        result = CASES[case](**kwargs)
    except SystemExit:
        raise  # a forked copy of the consumer leaving (case_fork_consumer)
    except BaseException as exc:
        result = {"crash": "".join(traceback.format_exception(exc))}
    gc.collect()
    result["elapsed_s"] = time.monotonic() - t0
    if not result.pop("no_leak_check", False):
        result["leftover_children"] = live_descendants()
        result["leftover_fds"] = [describe_fd(fd) for fd in sorted(fd_set() - fds0)]
        result["leftover_mappings"] = [m for m in ring_mappings() if m not in maps0]
    print("RESULT", json.dumps(result, default=repr), flush=True)
    print("T_END", time.monotonic(), flush=True)


# --------------------------------------------------------------------------- leases (issue 12)


class Growing:
    """Map-style: sample i is ``np.full(16, i)`` below ``grow_at`` and ``np.full(4096, i)``
    from it on: a batch outgrows its slot, and the ring grows to larger slots."""

    def __init__(self, n: int = 40, grow_at: int = 20) -> None:
        self.n = n
        self.grow_at = grow_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(16 if i < self.grow_at else 4096, i, np.int64)


def case_base_outlives_ring(method: str) -> dict[str, Any]:
    """Keep ``batch.base.base`` of a batch of the first ring, let the ring grow and retire,
    drop everything else, then read it: it must keep its memory mapped (no SIGSEGV)."""
    dl = _loader(Growing(), method)
    kept, first_ring = None, None
    for i, b in enumerate(dl):
        if i == 4:  # past each worker's first batch (a segment of its own): in the ring
            first_ring = dl.ring.contains(b)
            kept = b.base.base
        del b
    rings = dl.stats()["rings_created"]
    dl = None
    gc.collect()
    total = int(np.frombuffer(kept, np.uint8).sum())  # reads every byte of the slot
    kept = None
    gc.collect()
    return {"first_ring": first_ring, "rings_created": rings, "read": total >= 0}


def case_shm_full_mid_epoch(method: str) -> dict[str, Any]:
    """In a 16 MiB /dev/shm: the first ring (8 slots of ~1.25 MiB) fits; the consumer
    keeps every batch, so the ring must grow to 16 slots (~20 MiB), which does not fit:
    ShmSpaceError, with the iterator closed and its workers reaped."""
    dl = _loader(Arange(n=40, shape=(2**17,)), method, batch_size=1, max_shm_bytes=2**40)
    it = iter(dl)
    pids = worker_pids(it)
    kept: list[Any] = []
    err = None
    try:
        for b in it:
            kept.append(b)
    except Exception as exc:
        err = describe(exc)
    closed = it.closed
    running = [p for p in pids if alive(p)]
    after = next(it, "end")
    n = len(kept)
    kept.clear()
    it = dl = None
    gc.collect()
    return {"error": err, "closed": closed, "running": running, "batches": n, "after": repr(after)}


CASES.update(base_outlives_ring=case_base_outlives_ring, shm_full_mid_epoch=case_shm_full_mid_epoch)


# --------------------------------------------------------------------------- restarts (issue 16)


class RngArange:
    """Map-style: sample i is ``[i, three draws of shmloader.sample_rng(i)]`` (per-sample
    randomness: the same whichever worker, or restarted worker, loads it). Optional
    faults at index ``crash_at``: die the ``crash`` way (or hang ``hang_s`` s) while the
    file ``once`` does not exist yet (it is made first: a restarted worker loads the sample
    normally), or every time when ``once`` is None."""

    def __init__(
        self,
        n: int = 60,
        sleep: float = 0.004,
        crash_at: int | None = None,
        crash: str = "sigkill",
        once: str | None = None,
        hang_s: float = 0.0,
        width: int = 4,
    ) -> None:
        self.n, self.sleep, self.crash_at, self.crash = n, sleep, crash_at, crash
        self.once, self.hang_s = once, hang_s
        self.width = width  # columns: past the first 4, the last draw again (a big sample)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        from shmloader import sample_rng

        if self.sleep:
            time.sleep(self.sleep)
        if i == self.crash_at and (self.once is None or not os.path.exists(self.once)):
            if self.once is not None:
                open(self.once, "w").close()
            if self.hang_s:
                time.sleep(self.hang_s)
            else:
                crash(self.crash, None)
        row = np.empty(self.width, np.int64)
        row[:4] = [i, *sample_rng(i).integers(0, 1 << 40, 3)]
        row[4:] = row[3]
        return row


class StatefulStream(IterableDataset):
    """Iterable with shmloader_state_dict/shmloader_load_state_dict: items ``wid, wid + nw, ...`` below ``n``;
    the state is how many items this worker's shard yielded; a loaded state is where the
    next ``iter()`` starts (later ones start at the beginning)."""

    def __init__(self, n: int = 60, sleep: float = 0.004) -> None:
        self.n, self.sleep, self.pos, self.start = n, sleep, 0, 0

    def shmloader_state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def shmloader_load_state_dict(self, state: dict[str, int]) -> None:
        self.start = int(state["pos"])

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        items = range(wid, self.n, nw)
        start, self.start = self.start, 0
        self.pos = start
        for k in range(start, len(items)):
            if self.sleep:
                time.sleep(self.sleep)
            self.pos = k + 1  # before the yield: the state after a batch counts its items
            yield np.full(3, items[k], np.int64)


def exit_once(worker_id: int) -> None:
    """worker_init_fn: worker 0 dies (exit code 5) the first time (SHMLOADER_TEST_ONCE names a
    marker file); every worker dies every time when the variable is 'always'."""
    once = os.environ["SHMLOADER_TEST_ONCE"]
    if once == "always":
        os._exit(5)
    if worker_id == 0 and not os.path.exists(once):
        open(once, "w").close()
        os._exit(5)


def _epoch(dl: DataLoader, kills: dict[int, int], seen: set[int]) -> list[list[int]]:
    """The batches of one epoch of ``dl`` as lists; after batch k in ``kills``, SIGKILL
    worker ``kills[k]`` (from here, at whatever it is doing). Worker pids go to ``seen``."""
    out: list[Any] = []
    it = iter(dl)
    for k, batch in enumerate(it):
        b = np.asarray(batch)
        # A big batch by its first columns and a digest of all of it (a half-written slot
        # would differ).
        out.append(
            b.tolist() if b.shape[1] <= 4 else [b[:, :4].tolist(), hashlib.sha1(b.tobytes()).hexdigest()]
        )
        seen.update(w.proc.pid for w in it.workers)
        if k in kills:
            os.kill(it.workers[kills[k]].proc.pid, signal.SIGKILL)
    del it
    return out


def case_restart_kill(
    method: str,
    kind: str = "map",
    in_order: bool = True,
    seed: int = 0,
    kills: int = 3,
    epochs: int = 1,
    width: int = 4,
    between: bool = False,
    generator: bool = False,
) -> dict[str, Any]:
    """The epoch(s) of an undisturbed loader, then of one whose workers are SIGKILLed
    after ``kills`` batches drawn from ``seed`` (never among the last few: a worker killed
    with nothing left to load is not replaced), with max_worker_restarts=kills.
    ``between``: also SIGKILL worker 1 between epochs (idle, persistent workers), one
    more restart allowed for each. ``generator``: both loaders shuffle, under torch's RNG
    from a torch generator seeded alike, instead of ``seed=7``."""
    rng = np.random.default_rng(seed)
    ds = RngArange(width=width) if kind == "map" else StatefulStream()
    kw: dict[str, Any] = dict(batch_size=3, in_order=in_order, persistent_workers=epochs > 1)
    if generator:
        import torch

        kw["shuffle"] = kind == "map"
        kw["generator"] = torch.Generator().manual_seed(7)
    else:
        kw["seed"] = 7
    batches = 20  # 60 samples in batches of 3 (map and iterable alike)
    plan = [
        {
            int(k): int(rng.integers(0, 2))
            for k in rng.choice(batches - 6, kills // epochs or 1, replace=False)
        }
        for _ in range(epochs)
    ]
    seen: set[int] = set()
    ref_dl = _loader(ds, method, **kw)
    ref = [_epoch(ref_dl, {}, seen) for _ in range(epochs)]
    ref_dl.shutdown()
    del ref_dl
    if generator:
        kw["generator"].manual_seed(7)  # (the same draws again)
    dl = _loader(ds, method, max_worker_restarts=kills + (epochs - 1 if between else 0), **kw)
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for e in range(epochs):
            got.append(_epoch(dl, plan[e], seen))
            if between and e < epochs - 1:
                victim = dl.persistent_iterator.workers[1].proc.pid
                os.kill(victim, signal.SIGKILL)
                wait_gone([victim], 2.0)
    restarts = dl.stats()["worker_restarts"]
    gc.collect()
    ring = dl.ring
    # Slots are checked after shutdown(), which frees any still READY with the workers
    # (the next epoch's first batches, where prefetch_next_epoch=True loaded them).
    dl.shutdown()
    # Every slot FREE again: none kept by a dead worker's task.
    states = [ring.states.load(i) for i in range(ring.num_slots)] if ring is not None else []
    del dl
    return {
        "slot_states": states,
        "ref": ref,
        "got": got,
        "plan": [{str(k): v for k, v in p.items()} for p in plan],
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "restarts": restarts,
        "pids": sorted(seen),
    }


def case_restart_faults(method: str, tmp: str) -> dict[str, Any]:
    """Worker deaths inside the dataset and worker_init_fn, a hung worker, restarts used
    up, an iterable dataset without state, and the default (no restarts)."""
    out: dict[str, Any] = {}

    def run(name: str, ds: Any, env_once: str | None = None, **kw: Any) -> None:
        if env_once is not None:
            os.environ["SHMLOADER_TEST_ONCE"] = env_once
        dl = _loader(ds, method, batch_size=3, seed=7, **kw)
        got, err, t0 = [], None, time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for batch in dl:
                    got.append(np.asarray(batch).tolist())
            except Exception as exc:
                err = describe(exc)
        out[name] = {
            "got": got,
            "error": err,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            "restarts": dl.stats()["worker_restarts"],
            "elapsed_s": time.monotonic() - t0,
        }
        dl.shutdown()

    run("ref", RngArange())
    run(
        "segv_once",
        RngArange(crash_at=13, crash="segv", once=os.path.join(tmp, "segv")),
        max_worker_restarts=1,
    )
    run("exit_always", RngArange(crash_at=13, crash="exit3"), max_worker_restarts=2)
    run(
        "init_once",
        RngArange(),
        env_once=os.path.join(tmp, "init"),
        worker_init_fn=exit_once,
        max_worker_restarts=1,
    )
    run("init_always", RngArange(), env_once="always", worker_init_fn=exit_once, max_worker_restarts=3)
    run(
        "hung_once",
        RngArange(crash_at=13, hang_s=60, once=os.path.join(tmp, "hang")),
        timeout=2.0,
        max_worker_restarts=1,
    )
    run("hung_always", RngArange(crash_at=13, hang_s=60), timeout=2.0, max_worker_restarts=1)
    run("iter_stateless", Stream(n=60, crash_at=13, crash="sigkill"), max_worker_restarts=2)
    run("default", RngArange(crash_at=13, crash="sigkill"))
    return out


CASES.update(restart_kill=case_restart_kill, restart_faults=case_restart_faults)


# --------------------------------------------------------------------------- idle deaths (issue 27)


class InOrder(Sampler):
    """``0 .. n-1`` in order: a user's sampler (the loader prefetches nothing of the next
    epoch for it, so a worker between epochs is idle)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


# Where in an epoch a worker is SIGKILLed while it has no batch to load (map-style unless
# said): after epoch 0, before epoch 1 (persistent workers; map and iterable); after batch
# 1 of 4 with 3 workers (worker 1 has no batch left this epoch); after the epoch's last
# batch, before the next() that ends it.
IDLE_POINTS = ("between_epochs", "between_epochs_iter", "idle_mid_epoch", "after_last")


def _idle_death_run(
    method: str, point: str, persistent: bool, restarts: int, timeout: float
) -> dict[str, Any]:
    """Two epochs of 8 samples in batches of 2; one idle worker SIGKILLed at ``point`` of
    epoch 0 (waited for until it is gone, so the death precedes the next ``next()``)."""
    iterable = point == "between_epochs_iter"
    ds = Stream(n=8) if iterable else Arange(n=8)
    kw: dict[str, Any] = dict(
        num_workers=3 if point == "idle_mid_epoch" else 2,
        persistent_workers=persistent,
        timeout=timeout,
        max_worker_restarts=restarts,
    )
    if not iterable:
        kw["sampler"] = InOrder(8)
    dl = _loader(ds, method, **kw)
    victim = {"between_epochs": 1, "between_epochs_iter": 1, "idle_mid_epoch": 1, "after_last": 0}[point]
    epochs: list[list[list[int]]] = []
    killed: dict[str, Any] = {}
    err, t_err, pids = None, 0.0, set()

    def kill(it: Any) -> None:
        proc = it.workers[victim].proc
        os.kill(proc.pid, signal.SIGKILL)
        # Dead as the consumer sees it: its sentinel is ready (the process and all its
        # threads are gone; under forkserver, once the fork server wrote its status).
        gone = bool(multiprocessing.connection.wait([proc.sentinel], 5.0))
        killed.update(pid=proc.pid, gone=gone, at=time.monotonic())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for epoch in range(2):
                got: list[list[int]] = []
                epochs.append(got)
                it = iter(dl)
                for k, batch in enumerate(it):
                    got.append(np.asarray(batch)[:, 0].tolist())
                    pids.update(w.proc.pid for w in it.workers)
                    if epoch == 0 and (point, k) in (("idle_mid_epoch", 1), ("after_last", 3)):
                        kill(it)
                if epoch == 0 and point.startswith("between_epochs"):
                    kill(it)
                del it
        except Exception as exc:
            t_err = time.monotonic()
            err = describe(exc)
    restarted = dl.stats()["worker_restarts"]
    dl.shutdown()
    del dl
    return {
        "point": point,
        "persistent": persistent,
        "restarts": restarts,
        "timeout": timeout,
        "victim": victim,
        "killed_pid": killed.get("pid"),
        "victim_gone": killed.get("gone"),
        "latency_s": t_err - killed["at"] if err is not None and "at" in killed else None,
        "epochs": epochs,
        "error": err,
        "worker_restarts": restarted,
        "restart_warnings": [str(w.message) for w in caught if w.category.__name__ == "WorkerRestartWarning"],
        "pids": sorted(pids),
    }


def case_idle_death(method: str, point: str) -> dict[str, Any]:
    """An idle worker's death at ``point`` (IDLE_POINTS), without and with
    max_worker_restarts, with timeout=0 and a timeout; persistent workers on and off
    where the point exists without them. Under fork every pairing of restarts and
    timeout; under the other start methods two (no restart with timeout=0, a restart with
    a timeout): how the consumer waits does not depend on how its workers started, and
    each of their workers costs a fresh interpreter."""
    persistence = (True,) if point.startswith("between_epochs") else (False, True)
    if method == "fork":
        pairings = [(restarts, timeout) for restarts in (0, 1) for timeout in (0.0, 5.0)]
    else:
        pairings = [(0, 0.0), (1, 5.0)]
    return {
        "runs": [
            _idle_death_run(method, point, persistent, restarts, timeout)
            for persistent in persistence
            for restarts, timeout in pairings
        ]
    }


CASES.update(idle_death=case_idle_death)
