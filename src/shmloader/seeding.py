"""How a worker seeds the random number generators at the start of each epoch: Python's
``random``, numpy's global RNG and torch's (as torch's own workers do), and what it needs
to know about the torch build to do it quickly."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np


def seed_all(seed: int, cpu_only: bool | None = None) -> None:
    """Seed Python's ``random``, numpy's global RNG and torch (when imported), and give
    torch one intra-op thread, as torch's own workers do: N workers each running a
    core-count OpenMP pool oversubscribe the machine, and an OpenMP pool inherited
    through fork can hang on first use. ``cpu_only``: :func:`torch_cpu_only` where already
    known (None: asked here)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None:
        if cpu_only is None:
            cpu_only = torch_cpu_only()
        if cpu_only:
            # What torch.manual_seed does on a build with no accelerator: the devices it
            # also seeds (lazily, recording traceback.format_stack() for each: 3-15 ms
            # of a worker's start, reading source files) can never be used here.
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        torch.set_num_threads(1)


_cpu_only_answer: list[bool] = []  # torch_cpu_only()'s, once torch is imported


def torch_cpu_only() -> bool | None:
    """:func:`_cpu_only` for the torch this process imported (asked once), or None when it
    has not imported torch."""
    if _cpu_only_answer:
        return _cpu_only_answer[0]
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    _cpu_only_answer.append(_cpu_only(torch))
    return _cpu_only_answer[0]


def _cpu_only(torch: Any) -> bool:
    """Whether this torch build has no device that ``torch.manual_seed`` seeds besides the
    CPU (no CUDA/ROCm, XPU, MTIA or MPS compiled in, no custom backend registered). Any
    doubt (a torch whose private names moved) answers False: the full seeding then runs."""
    try:
        return not (
            torch.cuda._is_compiled()
            or torch.xpu._is_compiled()
            or torch.mtia._is_compiled()
            or torch.backends.mps.is_built()
            or torch._C._get_privateuse1_backend_name() != "privateuseone"
        )
    except Exception:
        return False
