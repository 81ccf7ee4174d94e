"""How much memory a process uses, as the kernel counts it: unique (USS), proportional
(PSS) and resident (RSS), and the unique memory outside shared mappings.

USS is the memory only that process maps: pages it made private, such as the pages a
forked worker copied from its parent by writing to them (reference counts included). PSS
shares every page among the processes mapping it, so the PSS of a parent and its workers
adds up to the memory they use together. ``private`` is USS less the pages of shared
mappings (the ring's slots a worker wrote and the consumer has not read yet, a shared
dataset's segment): what copy-on-read grows. Read from ``/proc/PID/smaps`` (Linux);
elsewhere nothing is known and :func:`process_memory` returns None. The totals alone
(:func:`memory_totals`, from ``/proc/PID/smaps_rollup``) cost less to read, and bound
``private`` from above (by ``uss``).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_EXCLUSIVE = 1 << 56  # /proc/PID/pagemap: the page is mapped by this process only
_PRESENT = 1 << 63


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory, in bytes: ``uss`` (unique), ``pss`` (proportional), ``rss``
    (resident) and ``private`` (unique, in private mappings only)."""

    uss: int
    pss: int
    rss: int
    private: int

    def as_dict(self) -> dict[str, int]:
        return {"uss": self.uss, "pss": self.pss, "rss": self.rss, "private": self.private}


def process_memory(pid: int) -> ProcessMemory | None:
    """The memory of process ``pid`` now, or None where it cannot be read (no such
    process, another user's, no /proc). Costs one read of ``/proc/PID/smaps``: the kernel
    walks the process's page tables (about a millisecond per GB mapped), and the text
    has a block per mapping."""
    try:
        with open(f"/proc/{pid}/smaps", "rb") as f:
            text = f.read()
    except OSError:
        return None
    if not text:
        return None  # a process exiting: its mappings are gone
    uss = pss = rss = private = 0
    block_private = 0
    for line in text.splitlines():
        head, _, rest = line.partition(b":")
        if head == b"Rss":
            rss += int(rest.split()[0])
        elif head == b"Pss":
            pss += int(rest.split()[0])
        elif head in (b"Private_Clean", b"Private_Dirty", b"Private_Hugetlb"):
            kb = int(rest.split()[0])
            uss += kb
            block_private += kb
        elif head == b"VmFlags":
            # The last line of a mapping's block: "sh" marks a shared mapping.
            if b" sh" not in rest:
                private += block_private
            block_private = 0
    return ProcessMemory(uss=uss * 1024, pss=pss * 1024, rss=rss * 1024, private=private * 1024)


@dataclass(frozen=True)
class MemoryTotals:
    """One process's memory as ``/proc/PID/smaps_rollup`` sums it, in bytes: ``uss``,
    ``pss`` and ``rss`` as in :class:`ProcessMemory`; not ``private``, which needs each
    mapping's flags (it is at most ``uss``)."""

    uss: int
    pss: int
    rss: int


def memory_totals(pid: int) -> MemoryTotals | None:
    """The memory totals of process ``pid`` now, from ``/proc/PID/smaps_rollup`` (Linux
    4.14+), or None where it cannot be read (no such process, no rollup file). The same
    walk of the page tables as :func:`process_memory`, without a block of text per
    mapping to write and parse: a third to a half of its cost for a process with torch
    imported (a thousand mappings)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:
        return None
    uss = pss = rss = 0
    seen = False
    for line in text.splitlines():
        head, _, rest = line.partition(b":")
        if head == b"Rss":
            rss, seen = int(rest.split()[0]), True
        elif head == b"Pss":
            pss = int(rest.split()[0])
        elif head in (b"Private_Clean", b"Private_Dirty", b"Private_Hugetlb"):
            uss += int(rest.split()[0])
    if not seen:
        return None  # a process exiting: its mappings are gone
    return MemoryTotals(uss=uss * 1024, pss=pss * 1024, rss=rss * 1024)


def exclusive_share(pid: int, pages: list[int]) -> float | None:
    """Of ``pages`` (page numbers: address // PAGE_SIZE) present in process ``pid``, the
    share mapped by that process alone (``/proc/PID/pagemap``, Linux): in a forked worker,
    the pages it copied from its parent (or kept when its parent copied them), which no
    longer count as shared. None where the map cannot be read or no page is present."""
    present = exclusive = 0
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            for page in pages:
                f.seek(page * 8)
                raw = f.read(8)
                if len(raw) != 8:
                    continue
                (entry,) = struct.unpack("<Q", raw)
                if entry & _PRESENT:
                    present += 1
                    exclusive += bool(entry & _EXCLUSIVE)
    except OSError:
        return None
    return exclusive / present if present else None
