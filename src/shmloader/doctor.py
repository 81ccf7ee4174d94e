"""``shmloader doctor``: check what breaks data loaders on this machine, and say what to do.

Each check reports OK, WARN or FAIL, the figure it looked at and, when it is not OK,
the remedy. The exit status is 1 when a check fails, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL = "OK", "WARN", "FAIL"

_SHM_DIR = "/dev/shm"
_DEFAULT_BATCH_BYTES = 64 * (3 * 224 * 224 + 8)  # 64 images of 3x224x224 uint8 + labels
_FDS_PER_WORKER = 3  # socket end, process sentinel, one spare
_MIN_NOFILE = 1024
_TORCH_FDS_HINT = 4096  # torch's file_descriptor strategy holds one per live batch tensor


@dataclass
class Check:
    name: str
    status: str
    detail: str
    remedy: str = ""


def default_ring_bytes(workers: int, batch_bytes: int) -> tuple[int, int, int]:
    """(total bytes, slots, bytes per slot) of the ring a loader with ``workers`` workers
    and the default prefetch_factor creates for batches of ``batch_bytes``."""
    from shmloader.leases import default_ring  # the loader's own sizing policy

    return default_ring(workers, batch_bytes)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


def check_native() -> Check:
    try:
        from shmloader import _slots  # noqa: F401
    except ImportError as exc:
        return Check(
            "native helper",
            FAIL,
            f"shmloader._native cannot be imported: {exc}",
            "reinstall so the cffi extension is built: pip install -e . (needs a C compiler "
            "and the cffi package)",
        )
    return Check("native helper", OK, "shmloader._native is built and loads")


def check_shm(workers: int, batch_bytes: int) -> Check:
    total, slots, slot_bytes = default_ring_bytes(workers, batch_bytes)
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError as exc:
        return Check(
            "/dev/shm",
            FAIL,
            f"{_SHM_DIR} cannot be read ({exc}); POSIX shared memory is unavailable",
            "mount a tmpfs on /dev/shm (docker: --shm-size=2g or --ipc=host)",
        )
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    detail = (
        f"size {_mib(size)}, free {_mib(free)}; the default ring for {workers} workers and "
        f"{_mib(batch_bytes)} batches needs {_mib(total)} ({slots} slots of {_mib(slot_bytes)})"
    )
    remedy = (
        "give the container more shared memory (docker run --shm-size=2g, or --ipc=host; "
        "Kubernetes: an emptyDir with medium: Memory mounted on /dev/shm), or ask for a "
        "smaller ring: fewer num_workers, prefetch_factor=1, or a smaller batch_size"
    )
    if free < total:
        return Check("/dev/shm", FAIL, detail + ": it does not fit", remedy)
    limit = free // 2  # the loader's default max_shm_bytes (leases.default_max_shm_bytes)
    if total > limit:
        return Check(
            "/dev/shm",
            FAIL,
            detail + f": it fits, but passes the loader's default max_shm_bytes ({_mib(limit)}, "
            "half of the free space), so the loader refuses to make it",
            remedy + ", or pass max_shm_bytes explicitly",
        )
    if free < 4 * total:
        return Check(
            "/dev/shm",
            WARN,
            detail + f": only {free // total} such ring(s) fit (one per loader and process)",
            remedy,
        )
    return Check("/dev/shm", OK, detail + f": {free // total} such rings fit")


def check_ring_creation() -> Check:
    """Create, reserve, map and drop a one-slot ring: shm_open, unlink, fallocate, mmap."""
    try:
        from shmloader.ring import Ring

        ring = Ring.create(1, 4096)
        ring.close_fd()
        del ring
    except Exception as exc:
        return Check(
            "ring creation",
            FAIL,
            f"a one-page ring could not be created: {type(exc).__name__}: {exc}",
            "check that /dev/shm is a writable tmpfs for this user",
        )
    return Check("ring creation", OK, "a test ring was created, reserved, mapped and released")


def check_nofile(workers: int) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def shown(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else str(v)

    need = workers * _FDS_PER_WORKER + 16
    detail = (
        f"ulimit -n is {shown(soft)} (hard {shown(hard)}); shmloader needs about {need} for "
        f"{workers} workers (one ring descriptor, whatever the batches held)"
    )
    raise_hint = (
        f"raise it: `ulimit -n {hard if hard != resource.RLIM_INFINITY else 65536}` in the "
        "shell, or resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)) at start-up"
    )
    if soft != resource.RLIM_INFINITY and soft < need:
        return Check("open files", FAIL, detail, raise_hint)
    if soft != resource.RLIM_INFINITY and soft < _MIN_NOFILE:
        return Check("open files", WARN, detail + "; other libraries will run short", raise_hint)
    note = ""
    if soft != resource.RLIM_INFINITY and soft < _TORCH_FDS_HINT:
        note = (
            f"; torch's DataLoader holds one descriptor per live batch tensor and can hit "
            f"'Too many open files' below ~{_TORCH_FDS_HINT}"
        )
    return Check("open files", OK, detail + note)


def check_start_method() -> Check:
    current = multiprocessing.get_start_method(allow_none=True)
    method = current or multiprocessing.get_context().get_start_method()
    available = multiprocessing.get_all_start_methods()
    detail = f"default start method is {method!r} ({'set' if current else 'not set, the default'})"
    detail += f"; available: {', '.join(available)}"
    if method == "fork":
        return Check(
            "start method",
            OK,
            detail + ": workers start fastest and the dataset is inherited, not pickled",
        )
    remedy = (
        "datasets, collate_fn and worker_init_fn are pickled: define them at module level "
        "(no lambdas or local classes) and guard the script with if __name__ == '__main__'"
    )
    if "fork" in available:
        remedy += "; or pass multiprocessing_context='fork' for faster start-up"
    return Check("start method", WARN, detail, remedy)


def _usable_cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:  # cgroup v2 CPU quota (containers)
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def check_cores(workers: int) -> Check:
    cores = _usable_cores()
    detail = f"{cores} usable core(s) for {workers} worker(s) plus the consumer"
    if workers > cores:
        return Check(
            "cores",
            WARN,
            detail + ": workers will share cores and each runs slower",
            f"use num_workers <= {cores} (CPU-bound datasets gain nothing beyond the cores)",
        )
    if workers == cores:
        return Check(
            "cores",
            OK,
            detail + ": the consumer shares a core with the workers; fine when the "
            "training step runs on an accelerator",
        )
    return Check("cores", OK, detail)


def check_pdeathsig() -> Check:
    """Set PR_SET_PDEATHSIG in a forked child, so this process's own setting is untouched."""
    if not sys.platform.startswith("linux"):
        return Check(
            "parent-death signal",
            WARN,
            f"PR_SET_PDEATHSIG is Linux-only (this is {sys.platform})",
            "workers still stop on EOF of their socket when the consumer exits",
        )
    try:
        from shmloader._slots import set_parent_death_signal
    except ImportError as exc:
        return Check("parent-death signal", FAIL, f"cannot import the helper: {exc}")
    if not hasattr(os, "fork"):
        return Check("parent-death signal", WARN, "os.fork is unavailable: not checked")
    pid = os.fork()
    if pid == 0:  # child: try it, report through the exit status, never return
        code = 0
        try:
            set_parent_death_signal(signal.SIGKILL)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return Check(
            "parent-death signal",
            WARN,
            "prctl(PR_SET_PDEATHSIG) failed (a seccomp profile or sandbox may forbid it)",
            "workers then rely on their socket's EOF to notice a dead consumer; allow prctl "
            "in the container's seccomp profile if workers outlive killed consumers",
        )
    return Check(
        "parent-death signal",
        OK,
        "PR_SET_PDEATHSIG is available: workers die with their parent thread",
    )


def check_torch() -> Check:
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return Check(
            "torch",
            OK,
            "not installed: shmloader runs without it (batches are numpy arrays); "
            "`shmloader bench` then skips its torch rows",
        )
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return Check("torch", OK, f"torch {version} is installed")


def run_checks(workers: int, batch_bytes: int) -> list[Check]:
    """Every check, in the order they are printed."""
    checks = [check_native()]
    if checks[0].status == FAIL:
        return checks
    return [
        *checks,
        check_shm(workers, batch_bytes),
        check_ring_creation(),
        check_nofile(workers),
        check_start_method(),
        check_cores(workers),
        check_pdeathsig(),
        check_torch(),
    ]


def format_checks(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"[{c.status:<4}] {c.name}: {c.detail}")
        if c.remedy and c.status != OK:
            lines.append(f"       what to do: {c.remedy}")
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    lines.append("")
    lines.append(
        "all checks passed"
        if not fails and not warns
        else f"{fails} failed, {warns} warning(s): see 'what to do' above"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``shmloader doctor``: run the checks and print them."""
    parser = argparse.ArgumentParser(
        prog="shmloader doctor",
        description="Check what breaks data loaders on this machine (/dev/shm, open-file "
        "limit, start method, cores, parent-death signal) and say what to do.",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="the num_workers you plan to use (default: the usable cores)",
    )
    parser.add_argument(
        "--batch-mb",
        type=float,
        default=_DEFAULT_BATCH_BYTES / 2**20,
        help="the size of one batch in MiB, to size the ring (default: 64 images of "
        "3x224x224 uint8, %(default).1f)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    workers = args.workers if args.workers is not None else _usable_cores()
    if workers < 1:
        parser.error("--workers must be at least 1")
    if args.batch_mb <= 0:
        parser.error("--batch-mb must be positive")
    checks = run_checks(workers, int(args.batch_mb * 2**20))
    if args.json:
        payload: dict[str, Any] = {"workers": workers, "checks": [asdict(c) for c in checks]}
        print(json.dumps(payload, indent=1))
    else:
        print(f"shmloader doctor: checking this machine for {workers} worker(s)\n")
        print(format_checks(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
