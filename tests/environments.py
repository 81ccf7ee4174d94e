"""Where the loader runs: the environments of tests/test_where_it_runs.py, and the child
script each case runs inside one.

**Parent side** (used by the tests): :func:`run_child` starts
``python -c "from tests.environments import main; main()" JSON`` with a deadline, placed
in an environment by a command prefix (a private mount namespace: :data:`SMALL_SHM`,
:data:`NO_SHM`, :data:`READONLY_SHM`) and/or a memory cgroup (:class:`MemoryCgroup`: the
child waits on stdin until the parent moved it, before it imports numpy or the loader).
Each ``can_*`` probe says why the machine refuses a mechanism, for ``pytest.skip``.

**Child side** (:func:`main`): optionally lowers ``RLIMIT_NOFILE`` and installs a seccomp
filter (prctl(PR_SET_PDEATHSIG), memfd_create or sched_setscheduler refused with EPERM, inherited by every
worker), then runs a 2-worker loader (shmloader's or torch's) over an in-memory numpy
dataset for one epoch, checks every batch against the dataset, and prints one line
``RESULT {json}``: batches, mismatches, the error (type, base classes, message), the
warnings, the worker pids. Everything a worker unpickles is module level.

Run one by hand (as root)::

    unshare --mount sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"' sh \\
        python -c "from tests.environments import main; main()" '{"dtype": "float32"}'
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHILD_CODE = "from tests.environments import main; main()"

# --------------------------------------------------------------------------- environments

# A private mount namespace (never the host's: unshare makes its mounts private) whose
# /dev/shm is a 64 MiB tmpfs: Docker's default.
SMALL_SHM = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]
# A read-only 64 MiB tmpfs on /dev/shm.
READONLY_SHM = [
    "unshare",
    "--mount",
    "sh",
    "-c",
    'mount -t tmpfs -o ro,size=64m tmpfs /dev/shm && exec "$@"',
    "sh",
]
# No /dev/shm at all: a fresh /dev (a small tmpfs holding only the character devices a
# Python process needs, and the fd links) moved over /dev. Unmounting /dev/shm alone is
# not "no /dev/shm" here: the directory left behind lies on /dev's devtmpfs, writable by
# root, and shm_open simply creates its files there.
_FRESH_DEV = (
    "d=$(mktemp -d) && mount -t tmpfs -o size=1m,mode=755 tmpfs $d && "
    "for n in null zero full random urandom tty; do "
    "touch $d/$n && mount --bind /dev/$n $d/$n; done && "
    "ln -s /proc/self/fd $d/fd && ln -s /proc/self/fd/0 $d/stdin && "
    "ln -s /proc/self/fd/1 $d/stdout && ln -s /proc/self/fd/2 $d/stderr && "
    "mount --move $d /dev && rmdir $d && "
    'test ! -e /dev/shm && exec "$@"'
)
NO_SHM = ["unshare", "--mount", "sh", "-c", _FRESH_DEV, "sh"]


def _probe(prefix: list[str]) -> str | None:
    """None when ``prefix`` runs a trivial command here; else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "needs root to make a private mount namespace"
    if shutil.which("unshare") is None:
        return "the unshare command is missing"
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {prefix[:2]}: {exc}"
    if probe.returncode != 0:
        return f"the machine refuses a private mount namespace: {probe.stderr.strip()[:300]}"
    return None


_PROBED: dict[str, str | None] = {}


def refuses(prefix: list[str]) -> str | None:
    """Why the machine refuses the environment ``prefix`` makes, or None (cached)."""
    key = json.dumps(prefix)
    if key not in _PROBED:
        _PROBED[key] = _probe(prefix)
    return _PROBED[key]


def seccomp_refused() -> str | None:
    """Why a seccomp filter of ours cannot be used here, or None."""
    if not sys.platform.startswith("linux"):
        return "seccomp is Linux-only"
    if platform.machine() != "x86_64":
        return f"the filter is written for x86_64 syscall numbers (this is {platform.machine()})"
    return None


class MemoryCgroup:
    """A child memory cgroup of ours with a limit; v2 (``memory.max``) where this machine
    has a unified memory controller, else v1 (``memory.limit_in_bytes``). Removed on exit
    (any process left in it is moved back to our own cgroup first)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.path: Path | None = None
        self.version = 0

    @staticmethod
    def refused() -> str | None:
        """Why no memory cgroup can be made here, or None."""
        if os.geteuid() != 0:
            return "needs root to create a memory cgroup"
        if _own_cgroup() is None:
            return "no writable cgroup memory controller (v1 or v2) found"
        return None

    def __enter__(self) -> MemoryCgroup:
        found = _own_cgroup()
        assert found is not None, self.refused()
        self.version, parent = found
        path = parent / f"shmloader-places-{os.getpid()}-{time.monotonic_ns()}"
        path.mkdir()
        self.path = path
        try:
            if self.version == 2:
                (path / "memory.max").write_text(str(self.limit))
                if (path / "memory.swap.max").exists():  # a limit that swap cannot stretch
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(self.limit))
        except BaseException:
            self._remove()
            raise
        return self

    def add(self, pid: int) -> None:
        """Move process ``pid`` into this cgroup."""
        assert self.path is not None
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        """The OOM killer's kills in this cgroup so far."""
        assert self.path is not None
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.path is None:
            return
        home = self.path.parent / "cgroup.procs"
        deadline = time.monotonic() + 10
        while True:
            try:
                for pid in (self.path / "cgroup.procs").read_text().split():
                    try:
                        home.write_text(pid)
                    except OSError:
                        pass  # it exited meanwhile
                self.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.path = None


def _own_cgroup() -> tuple[int, Path] | None:
    """(version, directory) of this process's memory cgroup, where we may make children."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = Path("/sys/fs/cgroup")
    for line in lines:
        hid, controllers, rel = line.split(":", 2)
        if hid == "0":
            for base in (unified, unified / "unified"):
                d = base / rel.lstrip("/")
                # A child of ours gets a memory controller only where our cgroup hands it
                # down (cgroup.subtree_control); enabling it is the machine owner's call.
                sub = d / "cgroup.subtree_control"
                if sub.exists() and "memory" in sub.read_text().split() and os.access(d, os.W_OK):
                    return 2, d
    for line in lines:
        hid, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            if (d / "memory.limit_in_bytes").exists() and os.access(d, os.W_OK):
                return 1, d
    return None


@dataclass
class Child:
    """What a child run left: returncode, output, its RESULT line, the time it took."""

    rc: int
    out: str
    err: str
    elapsed: float
    data: dict[str, Any] = field(default_factory=dict)

    def why(self) -> str:
        return f"rc={self.rc}\nstdout:\n{self.out[-3000:]}\nstderr:\n{self.err[-3000:]}"

    def worked(self) -> bool:
        """The child ran its epoch to the end, every batch equal to the dataset's (False:
        it raised, and ``data["error"]`` says what; anything else fails the test)."""
        d = self.data
        assert self.rc == 0 and d, self.why()
        if d["error"] is None:
            assert d["batches"] == d["expected_batches"], d
            assert d["mismatches"] == [], d
            return True
        return False

    def assert_inside(self, cg: MemoryCgroup) -> None:
        """The child ran its loader inside ``cg`` (its /proc/self/cgroup names it)."""
        assert cg.path is not None
        assert any(line.endswith("/" + cg.path.name) for line in self.data.get("cgroups", [])), self.why()


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


def command(args: dict[str, Any], prefix: list[str] | None = None) -> list[str]:
    return (prefix or []) + [sys.executable, "-c", CHILD_CODE, json.dumps(args)]


def run_child(
    args: dict[str, Any],
    *,
    prefix: list[str] | None = None,
    cgroup: MemoryCgroup | None = None,
    timeout: float = 30,
    env: dict[str, str] | None = None,
) -> Child:
    """Run :func:`main` with ``args`` in a child placed by ``prefix`` and ``cgroup``;
    kill it at ``timeout`` s (the result then says so)."""
    if cgroup is not None:
        args = dict(args, wait_stdin=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        command(args, prefix),
        cwd=ROOT,
        env=child_env(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if cgroup is not None:
            cgroup.add(proc.pid)  # before it imports anything but the standard library
        out, err = proc.communicate("go\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n[killed by the test: no result within {timeout} s]"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    child = Child(proc.returncode, out, err, time.monotonic() - t0)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            child.data = json.loads(line[len("RESULT ") :])
    return child


# --------------------------------------------------------------------------- seccomp

_AUDIT_ARCH_X86_64 = 0xC000003E
_NR = {"prctl": 157, "memfd_create": 319, "sched_setscheduler": 144}  # x86_64
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_EPERM = 1
_PR_SET_PDEATHSIG = 1


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def _ld(offset: int) -> bytes:
    return _insn(0x20, 0, 0, offset)  # BPF_LD | BPF_W | BPF_ABS: load seccomp_data[offset]


def _jeq(k: int, jf: int) -> bytes:
    return _insn(0x15, 0, jf, k)  # BPF_JMP | BPF_JEQ | BPF_K: next if == k, else skip jf


def _ret(k: int) -> bytes:
    return _insn(0x06, 0, 0, k)  # BPF_RET | BPF_K


def seccomp_program(refuse: str) -> bytes:
    """A BPF program for seccomp: ``refuse='pdeathsig'`` fails prctl(PR_SET_PDEATHSIG, ..)
    with EPERM, ``'memfd'`` fails memfd_create with EPERM, ``'sched'`` fails
    sched_setscheduler with EPERM; everything else is allowed.
    struct seccomp_data: nr at 0, arch at 4, args[0] at 16 (low word) and 20 (high)."""
    deny = _ret(_SECCOMP_RET_ERRNO | _EPERM)
    allow = _ret(_SECCOMP_RET_ALLOW)
    if refuse == "pdeathsig":
        body = [
            _ld(4),
            _jeq(_AUDIT_ARCH_X86_64, 7),
            _ld(0),
            _jeq(_NR["prctl"], 5),
            _ld(16),
            _jeq(_PR_SET_PDEATHSIG, 3),
            _ld(20),
            _jeq(0, 1),
            deny,
            allow,
        ]
    elif refuse in ("memfd", "sched"):
        nr = _NR["memfd_create" if refuse == "memfd" else "sched_setscheduler"]
        body = [_ld(4), _jeq(_AUDIT_ARCH_X86_64, 3), _ld(0), _jeq(nr, 1), deny, allow]
    else:
        raise ValueError(f"unknown seccomp refusal {refuse!r}: use 'pdeathsig', 'memfd' or 'sched'")
    return b"".join(body)


def install_seccomp(refuse: str) -> None:
    """Install :func:`seccomp_program` on this process; inherited by every child, across
    fork and exec (no_new_privs is set first, as an unprivileged filter needs)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prog = seccomp_program(refuse)
    buf = ctypes.create_string_buffer(prog, len(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


# --------------------------------------------------------------------------- child side

SHAPE = (3, 224, 224)
BATCH = 64
DISTINCT = 8  # distinct base images; each sample also carries its index


class Images:
    """``n`` images of shape (3, 224, 224) held in memory: sample ``i`` is base image
    ``i % 8`` with its first value set to ``i % 251``. Samples from ``sleep_from`` on
    take ``sleep_s`` each (a worker busy in user code). Loading sample ``hog_at`` first
    touches ``hog_mb`` MiB of private memory (a worker that outgrows a memory cgroup)."""

    def __init__(
        self,
        n: int,
        dtype: str,
        sleep_s: float = 0.0,
        sleep_from: int = 0,
        hog_at: int = -1,
        hog_mb: int = 0,
    ) -> None:
        import numpy as np

        self.n = n
        self.sleep_s = sleep_s
        self.sleep_from = sleep_from
        self.hog_at, self.hog_mb = hog_at, hog_mb
        rng = np.random.default_rng(14)
        self.base = rng.integers(0, 256, (DISTINCT, *SHAPE), dtype=np.uint8).astype(dtype)

    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> Any:
        sample = self.base[i % DISTINCT].copy()
        sample.flat[0] = i % 251
        return sample

    def __getitem__(self, i: int) -> Any:
        if self.sleep_s and i >= self.sleep_from:
            time.sleep(self.sleep_s)
        if i == self.hog_at:
            hog = b"\x01" * (self.hog_mb << 20)  # written, so every page is charged
            time.sleep(5)  # held: the OOM killer acts meanwhile
            del hog
        return self.sample(i)


def _describe(exc: BaseException) -> dict[str, Any]:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "msg": str(exc),
        "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames],
    }


def _shm_state() -> dict[str, Any]:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "size": st.f_blocks * st.f_frsize,
        "free": st.f_bavail * st.f_frsize,
        "readonly": bool(st.f_flag & os.ST_RDONLY),
    }


def _make_loader(args: dict[str, Any], ds: Any) -> tuple[Any, dict[str, Any]]:
    kwargs: dict[str, Any] = {
        "batch_size": args["batch_size"],
        "num_workers": 2,
        "multiprocessing_context": args["method"],
    }
    notes: dict[str, Any] = {}
    if args["loader"] == "torch":
        import torch.utils.data

        return torch.utils.data.DataLoader(ds, **kwargs), notes
    import inspect

    import shmloader

    backend = args.get("backend")
    if backend is not None:
        params = inspect.signature(shmloader.DataLoader.__init__).parameters
        notes["backend_arg"] = "shm_backend" in params
        if "shm_backend" in params:
            kwargs["shm_backend"] = backend
    kwargs["output"] = "numpy"
    kwargs.update(args.get("loader_kwargs", {}))
    return shmloader.DataLoader(ds, **kwargs), notes


def _ring_info(loader: Any) -> dict[str, Any] | None:
    """The current ring's slot count and bytes (None where there is none: torch's
    loader, or no ring yet)."""
    ring = getattr(loader, "ring", None)
    if ring is None:
        return None
    info = {"num_slots": ring.num_slots, "slot_bytes": ring.slot_bytes}
    for name in ("backend", "kind"):
        if hasattr(ring, name):
            info[name] = str(getattr(ring, name))
    return info


def _worker_pids(it: Any) -> list[int]:
    workers = getattr(it, "workers", [])
    return [getattr(w, "proc", w).pid for w in workers]


def run(args: dict[str, Any]) -> dict[str, Any]:
    """One epoch of a 2-worker loader in this process's environment; the facts."""
    import warnings

    import numpy as np

    res: dict[str, Any] = {"shm": _shm_state(), "batches": 0, "mismatches": [], "error": None}
    bs = args["batch_size"]
    ds = Images(
        args.get("samples", 6 * bs),
        args.get("dtype", "uint8"),
        args.get("sleep_s", 0.0),
        args.get("sleep_from", 0),
        args.get("hog_at", -1),
        args.get("hog_mb", 0),
    )
    stage = "construction"
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loader, notes = _make_loader(args, ds)
            res.update(notes)
            stage = "iteration"
            it = iter(loader)
            for b, batch in enumerate(it):
                batch = np.asarray(batch)
                if b == 0:
                    res["worker_pids"] = _worker_pids(it)
                    res["ring"] = _ring_info(loader)
                    if args.get("announce"):
                        print("READY " + json.dumps(res["worker_pids"]), flush=True)
                idx = range(b * bs, min((b + 1) * bs, len(ds)))
                # Row by row: a whole expected batch would double the memory a cgroup case sees.
                if len(batch) != len(idx) or any(
                    not np.array_equal(batch[j], ds.sample(i)) for j, i in enumerate(idx)
                ):
                    res["mismatches"].append(b)
                res["batches"] += 1
                del batch
            res["ring_end"] = _ring_info(loader)
            del it
        except BaseException as exc:  # report whatever happened, with the stage
            res["error"] = dict(_describe(exc), stage=stage)
    res["elapsed"] = time.monotonic() - t0
    res["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    res["expected_batches"] = -(-len(ds) // bs)
    return res


def main() -> None:
    """Child entry point: ``main()`` with argv[1] a JSON object (see module docstring):
    loader ('shmloader' | 'torch'), method, dtype, backend, nofile, seccomp, samples,
    sleep_s, sleep_from, hog_at, hog_mb, announce, wait_stdin."""
    args = json.loads(sys.argv[1])
    args.setdefault("loader", "shmloader")
    args.setdefault("method", "fork")
    args.setdefault("batch_size", BATCH)
    info: dict[str, Any] = {}
    if args.get("wait_stdin"):
        sys.stdin.readline()  # the parent moves us into a cgroup meanwhile
        info["cgroups"] = Path("/proc/self/cgroup").read_text().splitlines()
    if args.get("nofile"):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args["nofile"], hard))
        info["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        info["open_fds_at_start"] = len(os.listdir("/proc/self/fd"))
    if args.get("seccomp"):
        install_seccomp(args["seccomp"])
        info["seccomp"] = args["seccomp"]
    res = run(args)
    res.update(info)
    print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------------------- the table

# Kubernetes: a container's /dev/shm is the runtime's 64 MiB unless the pod mounts an
# emptyDir with medium: Memory there; that tmpfs is sized to the pod's memory limit and
# what it holds is charged to the container's memory cgroup. Reproduced as a 1 GiB tmpfs
# on /dev/shm inside a 1 GiB memory cgroup.
K8S_EMPTYDIR = [
    "unshare",
    "--mount",
    "sh",
    "-c",
    'mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$@"',
    "sh",
]

# (row, prefix, cgroup limit, child args): what `python -m tests.environments` measures.
TABLE_ROWS: list[tuple[str, list[str] | None, int | None, dict[str, Any]]] = [
    ("Docker default: 64 MiB /dev/shm, 9.6 MB batches", SMALL_SHM, None, {"dtype": "uint8"}),
    ("Docker default: 64 MiB /dev/shm, 38 MB batches", SMALL_SHM, None, {"dtype": "float32"}),
    (
        "Kubernetes emptyDir medium: Memory (1 GiB limit), 38 MB batches",
        K8S_EMPTYDIR,
        2**30,
        {"dtype": "float32"},
    ),
    ("no /dev/shm, fork", NO_SHM, None, {"method": "fork"}),
    ("no /dev/shm, spawn", NO_SHM, None, {"method": "spawn"}),
    ("no /dev/shm, forkserver", NO_SHM, None, {"method": "forkserver"}),
    ("read-only /dev/shm", READONLY_SHM, None, {}),
    ("ulimit -n 64, fork", None, None, {"method": "fork", "nofile": 64}),
    ("ulimit -n 64, spawn", None, None, {"method": "spawn", "nofile": 64}),
    ("ulimit -n 64, forkserver", None, None, {"method": "forkserver", "nofile": 64}),
    ("prctl(PR_SET_PDEATHSIG) refused, fork", None, None, {"method": "fork", "seccomp": "pdeathsig"}),
    ("memfd_create refused", None, None, {"seccomp": "memfd"}),
    ("sched_setscheduler refused, spawn", None, None, {"method": "spawn", "seccomp": "sched"}),
    ("cgroup memory limit 320 MiB, 38 MB batches, fork", None, 320 * 2**20, {"dtype": "float32"}),
    (
        "cgroup memory limit 320 MiB, 38 MB batches, spawn",
        None,
        320 * 2**20,
        {"dtype": "float32", "method": "spawn"},
    ),
    ("cgroup memory limit 448 MiB, 38 MB batches, fork", None, 448 * 2**20, {"dtype": "float32"}),
    ("cgroup memory limit 512 MiB, 38 MB batches, fork", None, 512 * 2**20, {"dtype": "float32"}),
    ("cgroup memory limit 640 MiB, 38 MB batches, fork", None, 640 * 2**20, {"dtype": "float32"}),
    ("cgroup memory limit 1 GiB, 38 MB batches, fork", None, 2**30, {"dtype": "float32"}),
]


def outcome(child: Child, kills: int | None) -> str:
    """One table cell: works (with the ring's backend and slots), the error, or the crash."""
    d = child.data
    if kills:
        return f"OOM-killed (rc {child.rc}, {kills} OOM kills in the cgroup)"
    if not d:
        return f"crash: rc {child.rc}, no result; {child.err.strip()[-200:]!r}"
    if d["error"] is None:
        ring = d.get("ring_end") or {}
        how = f" ({ring.get('backend', '?')}, {ring['num_slots']} slots)" if ring else ""
        warn = f"; warning: {d['warnings'][0][:160]}" if d["warnings"] else ""
        bad = f"; MISMATCHED batches {d['mismatches']}" if d["mismatches"] else ""
        return f"works{how}, {d['batches']}/{d['expected_batches']} batches{warn}{bad}"
    err = d["error"]
    last = err["msg"].strip().splitlines()[-1] if err["msg"].strip() else ""
    text = err["msg"] if len(err["msg"]) < 400 and "\n" not in err["msg"] else last
    return f"{err['type']} after {d['batches']} batches: {text[:400]}"


def table(loaders: list[tuple[str, dict[str, Any]]], timeout: float = 90) -> list[tuple[str, list[str]]]:
    """Run every row of :data:`TABLE_ROWS` for every loader; the cells. Rows whose
    mechanism the machine refuses say so."""
    rows = []
    for name, prefix, limit, args in TABLE_ROWS:
        cells = []
        for _, extra in loaders:
            why = refuses(prefix) if prefix else None
            if why is None and limit is not None:
                why = MemoryCgroup.refused()
            if why is None and args.get("seccomp"):
                why = seccomp_refused()
            if why:
                cells.append(f"skipped: {why}")
                continue
            if limit is None:
                child, kills = run_child(dict(args, **extra), prefix=prefix, timeout=timeout), None
            else:
                with MemoryCgroup(limit) as cg:
                    child = run_child(dict(args, **extra), prefix=prefix, cgroup=cg, timeout=timeout)
                    kills = cg.oom_kills()
            cells.append(outcome(child, kills))
        rows.append((name, cells))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return rows


if __name__ == "__main__":
    # python -m tests.environments [shmloader-posix] [torch]: one markdown row per line.
    which = sys.argv[1:] or ["shmloader", "shmloader-posix", "torch"]
    chosen = [
        (
            w,
            {
                "shmloader": {"backend": "auto"},
                "shmloader-posix": {"backend": "posix"},
                "torch": {"loader": "torch"},
            }[w],
        )
        for w in which
    ]
    print("| environment | " + " | ".join(w for w, _ in chosen) + " |")
    print("|---" * (len(chosen) + 1) + "|")
    table(chosen)
