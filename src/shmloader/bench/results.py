"""What a run measures: one :class:`Row` per peer and one :class:`ConfigResult` per
configuration (the JSON output is these, as dicts)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shmloader.bench.workloads import Config


@dataclass
class Row:
    """One peer's figures in one configuration."""

    loader: str  # "shmloader", "torch", "shmloader w0", "copy ceiling", W6's three peers
    status: str = "ok"  # or "n/a (...)", "skipped: ...", "failed: ..."
    runs: list[float] = field(default_factory=list)  # batches/s of each repeat
    cpu_ms_runs: list[float] = field(default_factory=list)  # consumer CPU ms per batch
    batches_runs: list[int] = field(default_factory=list)
    batches_per_s: float | None = None  # median
    spread: float | None = None  # (max - min) / median
    gb_per_s: float | None = None
    consumer_cpu_ms: float | None = None  # median consumer CPU ms per batch
    ratio_to_torch: float | None = None  # median of per-repeat ratios
    ratio_range: tuple[float, float] | None = None
    pct_of_ceiling: float | None = None  # median of per-repeat ratios, in %


@dataclass
class ConfigResult:
    """Everything measured in one configuration."""

    config: Config
    description: str
    batch_size: int
    batch_bytes: int
    num_slots: int
    rows: list[Row] = field(default_factory=list)
    first_batch_s: dict[str, dict[str, Any]] = field(default_factory=dict)
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    ring: dict[str, int] | None = None  # the shmloader ring this configuration used
    # Fresh loaders' short epochs: {"batches": n, "shmloader"/"torch": {"median_s", "spread",
    # "runs_s"}, "ratio": median of torch/shmloader paired per round, "ratio_range": [lo, hi]}
    cold: dict[str, Any] = field(default_factory=dict)
    load_average: list[float] | None = None  # 1-minute load at the start and the end
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # W6's report, W7's padding waste

    def row(self, loader: str) -> Row | None:
        """The row of ``loader``, or None when it was not measured."""
        return next((r for r in self.rows if r.loader == loader), None)


def median_spread(values: Sequence[float]) -> tuple[float, float]:
    """The median of ``values`` and their spread, (max - min) / median."""
    med = statistics.median(values)
    return med, ((max(values) - min(values)) / med if med else 0.0)


def timing_summary(runs: list[float]) -> dict[str, Any]:
    """Seconds of repeated runs: ``{"median_s", "spread", "runs_s"}``."""
    med, spread = median_spread(runs)
    return {"median_s": med, "spread": spread, "runs_s": runs}
