"""``shmloader doctor``: check what breaks data loaders on this machine, and say what to do.

Each check reports OK, WARN or FAIL, the figure it looked at and, when it is not OK,
the remedy. The exit status is 1 when a check fails, 0 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import multiprocessing
import os
import platform
import resource
import signal
import sys
import types
from dataclasses import asdict, dataclass
from typing import Any

from shmloader.system.cores import usable_cores  # (nor this)
from shmloader.system.limits import mib, shm_problem  # imports nothing else of the package

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
    from shmloader.memory.sizing import default_ring  # the loader's own sizing policy

    return default_ring(workers, batch_bytes)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


def check_native() -> Check:
    """The C helpers every loader needs: the slots' atomics (cffi) and the shared-structure
    reader (a CPython extension)."""
    try:
        from shmloader import _shared_read  # noqa: F401
        from shmloader.system import slots as _slots  # noqa: F401
    except ImportError as exc:
        return Check(
            "native helper",
            FAIL,
            f"a C extension of shmloader cannot be imported: {exc}",
            "reinstall so the extensions are built: pip install -e . (needs a C compiler, "
            "Python's headers and the cffi package)",
        )
    return Check("native helper", OK, "shmloader._native and shmloader._shared_read are built and load")


def _budget_text(budget: Any) -> str:
    """The memory figures doctor prints: what the backend can give, each limit read."""
    cg = budget.cgroup
    cg_text = f"cgroup limit: {cg.describe()}" if cg is not None else "cgroup limit: no limit"
    avail = "unknown" if budget.mem_available is None else _mib(budget.mem_available)
    parts = [
        f"the {budget.backend} backend can use {_mib(budget.bytes) if budget.bytes else 'an unknown amount'}"
    ]
    if budget.limit:
        names = {
            "cgroup": "the cgroup's limit",
            "machine": "the machine's available memory",
            "/dev/shm": "/dev/shm's free space",
        }
        parts.append(f"bound by {names.get(budget.limit, budget.limit)}")
    parts.append(f"MemAvailable {avail}")
    parts.append(cg_text)
    if budget.shm_free is not None:
        parts.append(f"/dev/shm free {_mib(budget.shm_free)}")
    return "; ".join(parts)


def check_backend(backend: str = "auto") -> Check:
    """Which backend the loader's rings use here, and whether memfd_create is refused."""
    from shmloader.system import segment

    kind = segment.resolve_backend(backend)
    if kind == "memfd":
        try:  # what a ring does first: refused by a seccomp profile, ENOSYS on old kernels
            os.close(os.memfd_create("shmloader-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
        except OSError as exc:
            if backend == "memfd":
                return Check(
                    "shm backend",
                    FAIL,
                    f"memfd_create is refused here ({exc}) and shm_backend='memfd' was asked for",
                    "use shm_backend='auto' or 'posix', or allow memfd_create in the container's "
                    "seccomp profile",
                )
            return Check(
                "shm backend",
                WARN,
                f"posix (memfd_create is refused here: {exc}); rings live in /dev/shm",
                "allow memfd_create in the container's seccomp profile, or give /dev/shm room "
                "(docker run --shm-size=2g or --ipc=host)",
            )
        return Check(
            "shm backend",
            OK,
            f"memfd (memfd_create works; shm_backend={backend!r}): rings are charged to this "
            "process's memory and cgroup, not to /dev/shm",
        )
    why = "asked for" if backend == "posix" or os.environ.get(segment.BACKEND_ENV) else "memfd is unavailable"
    refused = segment.memfd_refusal()
    if refused is not None:
        why = f"memfd_create was refused: {refused}"
    return Check("shm backend", OK, f"posix ({why}): rings live in /dev/shm (shm_open, unlinked at once)")


def check_memory(workers: int, batch_bytes: int, backend: str = "auto") -> Check:
    """Whether the default ring fits what the loader lets its first ring take (half of
    what the backend can give, less a margin for the processes: sizing.first_ring_room):
    OK, WARN (the ring gets fewer slots), FAIL (not even the minimum fits)."""
    from shmloader.memory import sizing
    from shmloader.memory.ring import ring_bytes
    from shmloader.system import limits as memory
    from shmloader.system.segment import resolve_backend

    budget = memory.budget(resolve_backend(backend))
    total, slots, slot_bytes = default_ring_bytes(workers, batch_bytes)
    detail = _budget_text(budget)
    room = sizing.first_ring_room(budget, workers, slot_bytes)
    if room is None:
        return Check("memory", WARN, detail + ": no memory figure could be read", "")
    least = sizing.min_num_slots(workers)
    fit = sizing.fit_slots(slots, slot_bytes, room, least)
    detail += (
        f"; the default ring for {workers} workers and {_mib(batch_bytes)} batches needs "
        f"{_mib(total)} ({slots} slots of {_mib(slot_bytes)}), the loader lets it take "
        f"{_mib(room)} (at most half, and a margin for the processes' own memory)"
    )
    remedy = budget.remedy() + ", or pass max_shm_bytes explicitly"
    if fit is None:
        need = ring_bytes(least, slot_bytes)
        return Check(
            "memory",
            FAIL,
            detail + f": not even {least} slots ({_mib(need)}) fit: the loader refuses",
            remedy,
        )
    if fit < slots:
        return Check("memory", WARN, detail + f": the ring gets {fit} slots, workers prefetch less", remedy)
    return Check("memory", OK, detail + ": it fits")


def check_shm(workers: int, batch_bytes: int, backend: str = "auto") -> Check:
    """/dev/shm's size against the default ring: it holds the rings of the posix backend
    only, so it can FAIL only there; with memfd a small /dev/shm is fine."""
    from shmloader.system.segment import resolve_backend

    kind = resolve_backend(backend)
    total, slots, slot_bytes = default_ring_bytes(workers, batch_bytes)
    problem = shm_problem(_SHM_DIR)  # none there, or read-only (the posix backend's own check)
    if problem is not None:
        if kind == "memfd":
            return Check("/dev/shm", OK, f"{problem}; rings use memfd, not /dev/shm")
        return Check(
            "/dev/shm",
            FAIL,
            f"{problem}: the posix backend cannot put rings there",
            "use shm_backend='memfd' (Linux), or mount a writable tmpfs on /dev/shm "
            "(docker run --shm-size=2g or --ipc=host)",
        )
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError as exc:
        status = OK if kind == "memfd" else FAIL
        return Check("/dev/shm", status, f"{_SHM_DIR} cannot be read ({exc})", "check /dev/shm's mount")
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    detail = (
        f"size {_mib(size)}, free {_mib(free)}; the default ring for {workers} workers and "
        f"{_mib(batch_bytes)} batches needs {_mib(total)} ({slots} slots of {_mib(slot_bytes)})"
    )
    if kind == "memfd":
        fits = "it would fit" if total <= free // 2 else "it would not fit"
        return Check(
            "/dev/shm",
            OK,
            detail + f"; {fits} here, but rings use memfd and do not live in /dev/shm: a small "
            "/dev/shm is fine (the posix backend, and torch's DataLoader, need it)",
        )
    remedy = (
        "give the container more shared memory (docker run --shm-size=2g, or --ipc=host; "
        "Kubernetes: an emptyDir with medium: Memory mounted on /dev/shm), or ask for a "
        "smaller ring: fewer num_workers, prefetch_factor=1, or a smaller batch_size; or use "
        "shm_backend='memfd' (Linux), whose rings do not live in /dev/shm"
    )
    # The posix backend's default max_shm_bytes is at most half of the free space; a ring
    # that passes it gets fewer slots, down to workers + 2, and fails below that.
    from shmloader.memory import sizing
    from shmloader.memory.ring import ring_bytes

    limit = free // 2
    if total > limit:
        least = sizing.min_num_slots(workers)
        fit = sizing.fit_slots(slots, slot_bytes, limit, least)
        if fit is None:
            return Check(
                "/dev/shm",
                FAIL,
                detail + f": not even {least} slots ({_mib(ring_bytes(least, slot_bytes))}) fit in "
                f"the loader's default max_shm_bytes ({_mib(limit)}, half of the free space), "
                "so the loader refuses to make it",
                remedy + ", or pass max_shm_bytes explicitly",
            )
        return Check(
            "/dev/shm",
            WARN,
            detail + f": it passes the loader's default max_shm_bytes ({_mib(limit)}, half of the "
            f"free space), so the ring gets {fit} slots and workers prefetch less",
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


def check_ring_creation(backend: str = "auto") -> Check:
    """Create, reserve, map and drop a one-slot ring with ``backend``."""
    try:
        from shmloader.memory.ring import Ring

        ring = Ring.create(1, 4096, backend=backend)
        kind = ring.backend
        ring.close_fd()
        del ring
    except Exception as exc:
        return Check(
            "ring creation",
            FAIL,
            f"a one-page ring could not be created: {type(exc).__name__}: {exc}",
            "check that /dev/shm is a writable tmpfs for this user (posix), or that memfd_create "
            "is allowed (memfd)",
        )
    return Check("ring creation", OK, f"a test ring ({kind}) was created, reserved, mapped and released")


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


def fork_can_get_stuck(version: tuple[int, ...] | None = None, implementation: str | None = None) -> bool:
    """Whether this interpreter has CPython gh-112275: a forked child can wait forever,
    before running any Python, for an interpreter lock another thread held at the fork
    (CPython 3.11 before 3.11.8; the loader replaces such a worker, see
    workers.pool.FORK_START_DEADLINE_S)."""
    version = tuple(sys.version_info[:3]) if version is None else tuple(version)
    implementation = sys.implementation.name if implementation is None else implementation
    return implementation == "cpython" and (3, 11, 0) <= version < (3, 11, 8)


def check_start_method(stuck_forks: bool | None = None) -> Check:
    """The default start method, and (fork) whether this Python's forks can get stuck
    (``stuck_forks``: as :func:`fork_can_get_stuck` says, unless given)."""
    current = multiprocessing.get_start_method(allow_none=True)
    method = current or multiprocessing.get_context().get_start_method()
    available = multiprocessing.get_all_start_methods()
    detail = f"default start method is {method!r} ({'set' if current else 'not set, the default'})"
    detail += f"; available: {', '.join(available)}"
    if method == "fork":
        detail += ": workers start fastest and the dataset is inherited, not pickled"
        if fork_can_get_stuck() if stuck_forks is None else stuck_forks:
            return Check(
                "start method",
                WARN,
                detail + f"; but Python {platform.python_version()} has CPython gh-112275: a worker "
                "forked while another thread of the process holds an interpreter lock waits "
                "forever inside its fork (the loader kills and replaces it after 30 s)",
                "upgrade to Python 3.11.8 or later, or pass multiprocessing_context='forkserver' "
                "where the training process runs threads (torch, data readers, loggers)",
            )
        return Check("start method", OK, detail)
    remedy = (
        "datasets, collate_fn and worker_init_fn are pickled: define them at module level "
        "(no lambdas or local classes) and guard the script with if __name__ == '__main__'"
    )
    if "fork" in available:
        remedy += "; or pass multiprocessing_context='fork' for faster start-up"
    return Check("start method", WARN, detail, remedy)


def check_cores(workers: int) -> Check:
    cores = usable_cores()
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
        from shmloader.system.slots import set_parent_death_signal
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
            OK,
            "prctl(PR_SET_PDEATHSIG) is refused here (a seccomp profile or sandbox forbids it): "
            "workers watch their socket instead and exit within about 0.5 s of the consumer's "
            "death, as they do under forkserver",
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


def check_region_decoder() -> Check:
    """Whether ImageFolder decodes only the part of a JPEG a crop needs (the optional C
    helper ``shmloader._jpeg`` bound to a libjpeg-turbo) or whole images."""
    import importlib.util

    from shmloader.vision import region

    name = "region JPEG decoder"
    helper = region.native()[0]
    if helper is None and importlib.util.find_spec("simplejpeg") is None:
        return Check(
            name,
            OK,
            "not built, and shmloader.vision's extra is not installed either (pip install "
            "'shmloader[vision]'): nothing here decodes JPEGs",
        )
    if helper is None:
        return Check(
            name,
            WARN,
            "shmloader._jpeg is not built: libjpeg-turbo's headers (jpeglib.h) were missing when "
            "shmloader was installed, so ImageFolder decodes whole JPEGs where a crop needs only "
            "part of one",
            f"install libjpeg-turbo's headers ({region.HEADERS_PACKAGES}), then reinstall "
            "shmloader from source (pip install -e . in a checkout)",
        )
    dec = region.decoder()
    if dec is not None:
        return Check(name, OK, f"shmloader._jpeg is built and bound to {dec.library}")
    reason = str(region.unavailable_reason())
    if region.ENV_OFF in reason:
        return Check(name, OK, f"{reason}: ImageFolder decodes whole JPEGs")
    return Check(
        name,
        WARN,
        f"shmloader._jpeg is built but cannot be used: {reason}; ImageFolder decodes whole JPEGs",
        "pip install Pillow (its wheel ships the libjpeg-turbo the decoder binds to)",
    )


def load_dataset(spec: str) -> Any:
    """The object ``spec`` names, ``"module:name"`` (a module importable from the current
    directory; ``name`` may be dotted), called with no arguments when it is a class or
    a function (a dataset's constructor or a factory)."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(
            f"--dataset takes MODULE:NAME (got {spec!r}), e.g. --dataset train:make_dataset "
            "for the function make_dataset in train.py, called with no arguments."
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj: Any = importlib.import_module(module_name)
    for part in name.split("."):
        obj = getattr(obj, part)
    called = isinstance(obj, (type, types.FunctionType, functools.partial))
    return obj() if called else obj


def check_dataset_memory(dataset: Any) -> Check:
    """Whether ``dataset`` holds large Python containers, which every worker copies."""
    from shmloader.memory.containers import large_containers

    found = large_containers(dataset)
    if not found:
        return Check(
            "dataset memory",
            OK,
            "no list, tuple or dict of 16 MiB or more of Python objects among its attributes: "
            "workers copy nothing of it by reading it",
        )
    held = sum(c.estimated_bytes for c in found)
    return Check(
        "dataset memory",
        WARN,
        f"Python containers of ~{mib(held)}: "
        + ", ".join(c.describe() for c in found)
        + "; every forked worker copies the pages it reads of them (spawned workers get them "
        "pickled, whole)",
        "DataLoader(..., share_dataset=True) stores them once in shared memory, read-only "
        "(or wrap them with shmloader.share()); see docs/share.md",
    )


def check_dataset_images(dataset: Any) -> Check:
    """Whether ``DataLoader(dataset, images="auto")`` runs a torchvision folder pipeline
    fused, why not, and the share of its first files that would go through torchvision's
    code (:mod:`shmloader.vision.torchvision_plan`)."""
    from shmloader.vision.torchvision_plan import recognize

    name = "images (fused torchvision pipeline)"
    plan, reason = recognize(dataset, "auto")
    if plan is None:
        if reason is not None and ("not a torchvision" in reason or "not exactly" in reason):
            return Check(name, OK, f"does not apply: {reason}")
        return Check(
            name,
            WARN,
            f"images='auto' leaves it as written (torchvision's speed): {reason}",
            "keep the transform to the ops docs/vision.md lists (Resize, CenterCrop, RandomResizedCrop, "
            "RandomHorizontalFlip, then ToTensor/PILToTensor/ToImage, ToDtype, Normalize) to run it fused",
        )
    from shmloader.vision.pil_resample import resampler
    from shmloader.vision.torchvision_fused import fallback_count

    read, fell_back = fallback_count(dataset)
    share = f"{fell_back} of the first {read} files" if read else "no files"
    native = "Pillow's resize reproduced in C" if resampler() is not None else "Pillow's own resize"
    return Check(
        name,
        OK,
        f"images='auto' runs it fused ({plan.api} transforms, {native}, output {plan.shape} "
        f"{plan.dtype}); {share} go through torchvision's code (not RGB/grayscale JPEGs)",
    )


def run_checks(workers: int, batch_bytes: int, backend: str = "auto") -> list[Check]:
    """Every check, in the order they are printed (``backend``: the loader's shm_backend)."""
    checks = [check_native()]
    if checks[0].status == FAIL:
        return checks
    return [
        *checks,
        check_backend(backend),
        check_memory(workers, batch_bytes, backend),
        check_shm(workers, batch_bytes, backend),
        check_ring_creation(backend),
        check_nofile(workers),
        check_start_method(),
        check_cores(workers),
        check_pdeathsig(),
        check_region_decoder(),
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
        description="Check what breaks data loaders on this machine (shared-memory backend, "
        "memory and cgroup limit, /dev/shm, open-file limit, start method, cores, "
        "parent-death signal) and say what to do.",
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
    parser.add_argument(
        "--backend",
        choices=["auto", "memfd", "posix"],
        default="auto",
        help="the shm_backend you plan to use (default: %(default)s, memfd on Linux)",
    )
    parser.add_argument(
        "--dataset",
        metavar="MODULE:NAME",
        help="also check a dataset's memory and whether images='auto' runs its torchvision "
        "pipeline fused: the object NAME in MODULE (importable from the "
        "current directory; called with no arguments if it is a class or function), e.g. "
        "train:make_dataset",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    workers = args.workers if args.workers is not None else usable_cores()
    if workers < 1:
        parser.error("--workers must be at least 1")
    if args.batch_mb <= 0:
        parser.error("--batch-mb must be positive")
    try:
        checks = run_checks(workers, int(args.batch_mb * 2**20), args.backend)
    except ValueError as exc:  # e.g. a bad $SHMLOADER_SHM_BACKEND
        parser.error(str(exc))
    if args.dataset:
        try:
            dataset = load_dataset(args.dataset)
        except ValueError as exc:
            parser.error(str(exc))
        except (ImportError, AttributeError) as exc:
            parser.error(f"--dataset {args.dataset}: {exc}")
        checks.append(check_dataset_memory(dataset))
        checks.append(check_dataset_images(dataset))
    if args.json:
        payload: dict[str, Any] = {
            "workers": workers,
            "backend": args.backend,
            "checks": [asdict(c) for c in checks],
        }
        print(json.dumps(payload, indent=1))
    else:
        print(f"shmloader doctor: checking this machine for {workers} worker(s)\n")
        print(format_checks(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
