"""Whether other processes use the CPUs this loader runs on.

A side out of work may yield its CPU before it sleeps (transport/yielding.py): alone with
its siblings that saves the wake-ups, beside other CPU-bound processes it costs them
time slices, and not only in the yield itself: a process that stays runnable uses up its
share of the CPU, and the scheduler then wakes it late behind the others. So yielding
is allowed only while the machine is quiet, as :class:`OthersLoad` measures it: the CPU
time of the CPUs in this process's affinity mask (``/proc/stat``) less the time of the
loader's own processes (the consumer and its workers), over :data:`INTERVAL_NS`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from shmloader.system.cores import affinity_cpus

PROC_STAT = "/proc/stat"
PROC_LOADAVG = "/proc/loadavg"
INTERVAL_NS = 500_000_000  # how often the load is measured (the ticks below are 10 ms)
FIRST_INTERVAL_NS = 250_000_000  # the first verdict, sooner
# Busy: others used at least this many CPUs' worth of time while fewer than IDLE_CORES
# were idle (others on a machine with idle CPUs do not take a yielding side's CPU).
OTHERS_CORES = 0.25
IDLE_CORES = 0.5
_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def cpu_seconds(cpus: set[int], path: str = PROC_STAT) -> tuple[float, float] | None:
    """The (busy, idle) seconds of ``cpus`` since boot (every CPU where ``cpus`` is
    empty), from ``path``; None where it cannot be read (not Linux). Busy counts user,
    nice, system, irq and softirq time; idle counts idle and iowait; a hypervisor's
    steal is neither (no process here ran then)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = idle = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        fields = line.split()
        try:
            cpu = int(fields[0][3:])
            ticks = [int(v) for v in fields[1:8]]
        except ValueError:
            continue
        if cpus and cpu not in cpus:
            continue
        user, nice, system, idle_t, iowait, irq, softirq = (ticks + [0] * 7)[:7]
        busy += user + nice + system + irq + softirq
        idle += idle_t + iowait
    return busy * _TICK_S, idle * _TICK_S


def process_seconds(pid: int) -> float:
    """The CPU seconds (user and system, all threads) of process ``pid``; 0.0 when it is
    gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0.0
    fields = text[text.rfind(")") + 2 :].split()  # (the name may hold spaces and parentheses)
    try:
        return (int(fields[11]) + int(fields[12])) * _TICK_S
    except (IndexError, ValueError):
        return 0.0


def others_runnable(cpus: int, path: str = PROC_LOADAVG) -> bool | None:
    """Whether, at this instant, other tasks are runnable and together with this one fill
    ``cpus`` CPUs (``path``'s count of runnable tasks, this one included); None where it
    cannot be read. One look, for the verdict before the first measure: a CPU-bound
    process is always runnable, so this seldom misses one."""
    try:
        with open(path) as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None
    return running - 1 >= 1 and running >= cpus


class OthersLoad:
    """Measures, every INTERVAL_NS at most, whether processes other than the loader's
    keep this process's CPUs busy (:meth:`measure`); :attr:`busy` holds the verdict.

    Until the first verdict (FIRST_INTERVAL_NS after the first sample) the machine counts
    as busy when other tasks are runnable now and fill the CPUs (:func:`others_runnable`),
    or when that cannot be read but ``/proc/stat`` can (the safe side: nothing yields);
    where neither can be read (other systems) it counts as quiet, and the adapted yield
    window alone decides."""

    __slots__ = ("_cpus", "_last", "_next_ns", "_path", "busy")

    def __init__(self, path: str = PROC_STAT, loadavg: str = PROC_LOADAVG) -> None:
        self._path = path
        self._cpus = affinity_cpus()
        self._last: tuple[int, float, float, float] | None = None  # ns, busy s, idle s, ours s
        self._next_ns = 0
        instant = others_runnable(len(self._cpus) or os.cpu_count() or 1, loadavg)
        self.busy = os.path.exists(path) if instant is None else instant

    def due(self, now_ns: int) -> bool:
        """Whether a measure is due at ``now_ns`` (``time.perf_counter_ns``)."""
        return now_ns >= self._next_ns

    def measure(self, now_ns: int, worker_pids: Iterable[int]) -> bool:
        """Take a sample now (the consumer's CPU and its workers', ``worker_pids``) and,
        from the last one, the verdict; returns :attr:`busy`."""
        machine = cpu_seconds(self._cpus, self._path)
        if machine is None:
            self.busy = False
            self._next_ns = now_ns + INTERVAL_NS
            return self.busy
        ours = time.process_time() + sum(process_seconds(pid) for pid in worker_pids)
        last = self._last
        self._last = (now_ns, machine[0], machine[1], ours)
        if last is None:
            self._next_ns = now_ns + FIRST_INTERVAL_NS
            return self.busy
        self._next_ns = now_ns + INTERVAL_NS
        elapsed = (now_ns - last[0]) / 1e9
        others = (machine[0] - last[1]) - (ours - last[3])
        idle = machine[1] - last[2]
        self.busy = others >= OTHERS_CORES * elapsed and idle < IDLE_CORES * elapsed
        return self.busy
