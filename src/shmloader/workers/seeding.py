"""How a worker seeds the random number generators: Python's ``random``, numpy's global
RNG and torch's, as torch's own workers do (``torch/utils/data/_utils/worker.py``), and
what it needs to know about the torch build to do it quickly."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np


def seed_all(seed: int, worker_id: int = 0, cpu_only: bool | None = None) -> None:
    """Seed worker ``worker_id`` whose seed is ``seed`` (its loader's base seed plus its
    id) as torch seeds its workers: Python's ``random`` and torch (when imported) with
    ``seed``, numpy's global RNG with :func:`generate_state` of the base seed and the id;
    and give torch one intra-op thread, as torch's workers do: N workers each running a
    core-count OpenMP pool oversubscribe the machine, and an OpenMP pool inherited
    through fork can hang on first use. ``cpu_only``: :func:`torch_cpu_only` where already
    known (None: asked here)."""
    random.seed(seed)
    np.random.seed(generate_state(seed - worker_id, worker_id))
    torch = sys.modules.get("torch")
    if torch is not None:
        if cpu_only is None:
            cpu_only = torch_cpu_only()
        if cpu_only:
            # What torch.manual_seed does on a build with no accelerator: the devices it
            # also seeds (lazily, recording traceback.format_stack() for each, which reads
            # source files: a noticeable share of a worker's start) can never be used here.
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


_MASK32 = 0xFFFFFFFF


def generate_state(base_seed: int, worker_id: int) -> list[int]:
    """The four uint32 torch's workers seed numpy's global RNG with (torch's
    ``_generate_state``, after ``numpy.random.SeedSequence``): two workers, or a worker's
    numpy and ``random``, never share a stream."""
    mult_a, mult_b = 0x931E8875, 0x58F38DED
    mix_l, mix_r = 0xCA01F9DD, 0x4973F715
    entropy = [worker_id, base_seed & _MASK32, base_seed >> 32, 0]
    hash_a = 0x43B0D7E5

    def hashed(value: int) -> int:
        nonlocal hash_a
        value = (value ^ hash_a) & _MASK32
        hash_a = (hash_a * mult_a) & _MASK32
        value = (value * hash_a) & _MASK32
        return (value ^ (value >> 16)) & _MASK32

    def mix(x: int, y: int) -> int:
        result = ((mix_l * x) - (mix_r * y)) & _MASK32
        return (result ^ (result >> 16)) & _MASK32

    pool = [hashed(e) for e in entropy]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashed(pool[src]))
    hash_b = 0x8B51F9DD
    state = []
    for value in pool:
        value = (value ^ hash_b) & _MASK32
        hash_b = (hash_b * mult_b) & _MASK32
        value = (value * hash_b) & _MASK32
        state.append((value ^ (value >> 16)) & _MASK32)
    return state
