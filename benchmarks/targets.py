"""The project's targets (issues 4, 14, 15, 17), judged on a run's JSON (2-worker configs).

The library measures (``shmloader bench``); what counts as good enough is this project's
call, so it lives here. ``python benchmarks/run.py`` judges its run with :func:`evaluate`
and prints :func:`text` (and appends :func:`markdown` to RESULTS.md). To judge a stored run
again::

    python benchmarks/targets.py benchmarks/results.json
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from shmloader.bench.report import md_table, text_table

RATIO_TARGETS = {"W1": 8.0, "W2": 6.0, "W3": 15.0, "W4": 30.0}  # steady, vs torch
W4_CONSUMER_US = 15.0  # the consumer's CPU per batch (issue 15)
COLD_TARGET = 4.0  # a fresh loader's short epoch vs torch's, W1-W4 (issue 14)
W5_RANGE = (0.95, 1.05)  # the loader should not matter when samples cost ~1 ms
W6_TARGETS = {"torch+conventional": 2.5, "torch+ImageFolder": 1.5}  # long runs and fresh passes (issue 17)
W6_LIMIT_SHARE = 0.9  # a fresh pass's images/s over its decode limit (issue 44)
W7_TARGET = 5.0
CEILING_PCT = 50.0  # W1, W2: % of the copy ceiling
W1_CPU_RATIO = 0.1  # consumer CPU per batch vs torch's
W1_FIRST_BATCH_RATIO = 1.0  # time to first batch vs torch's
TITLE = "Targets (2 workers)"
HEADER = ["target", "figure", "goal", "status"]


def _row(config: dict[str, Any], loader: str) -> dict[str, Any] | None:
    return next((r for r in config["rows"] if r["loader"] == loader), None)


def evaluate(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target that the configs (a run's JSON ``configs``) can judge:
    ``{"target", "value", "goal", "met"}``, ``met`` None where the figure is missing."""
    by = {(c["config"]["name"], c["config"]["workers"]): c for c in configs}
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, met: Any) -> None:
        judged = None if value is None else met(value)
        out.append({"target": name, "value": value, "goal": goal, "met": judged})

    def ratio(wl: str) -> float | None:
        row = _row(by[(wl, 2)], "shmloader")
        return row["ratio_to_torch"] if row else None

    for wl, goal in RATIO_TARGETS.items():
        if (wl, 2) in by:
            add(f"{wl} w2 vs torch", ratio(wl), f">= {goal:g}x", lambda v, g=goal: v >= g)
    for wl in RATIO_TARGETS:
        cold = by[(wl, 2)].get("cold") if (wl, 2) in by else None
        if cold:
            add(
                f"{wl} w2 cold vs torch",
                cold.get("ratio"),
                f">= {COLD_TARGET:g}x",
                lambda v: v >= COLD_TARGET,
            )
    if ("W5", 2) in by:
        lo, hi = W5_RANGE
        add("W5 w2 vs torch", ratio("W5"), f"{lo:g}x - {hi:g}x", lambda v: lo <= v <= hi)
    if ("W6", 2) in by:
        ours = _row(by[("W6", 2)], "shmloader+ImageFolder")
        for peer, goal in W6_TARGETS.items():
            theirs = _row(by[("W6", 2)], peer)
            val = None
            if ours and theirs and ours["runs"] and theirs["runs"]:
                val = statistics.median(a / b for a, b in zip(ours["runs"], theirs["runs"], strict=True))
            add(f"W6 w2 shmloader+ImageFolder vs {peer}", val, f">= {goal:g}x", lambda v, g=goal: v >= g)
        fresh = by[("W6", 2)].get("extra", {}).get("w6", {}).get("fresh")
        if fresh:
            for peer, goal in W6_TARGETS.items():
                val = fresh["ratios"].get(f"shmloader+ImageFolder / {peer}")
                add(f"W6 w2 fresh pass vs {peer}", val, f">= {goal:g}x", lambda v, g=goal: v >= g)
            limit = fresh["ratios"].get("shmloader+ImageFolder / decode limit")
            add(
                "W6 w2 fresh pass vs decode limit",
                limit,
                f">= {W6_LIMIT_SHARE:g}x",
                lambda v: v >= W6_LIMIT_SHARE,
            )
    if ("W7", 2) in by:
        add("W7 w2 vs torch", ratio("W7"), f">= {W7_TARGET:g}x", lambda v: v >= W7_TARGET)
    for wl in ("W1", "W2"):
        if (wl, 2) in by:
            row = _row(by[(wl, 2)], "shmloader")
            add(
                f"{wl} w2 % of copy ceiling",
                row and row["pct_of_ceiling"],
                f">= {CEILING_PCT:g}%",
                lambda v: v >= CEILING_PCT,
            )
    if ("W1", 2) in by:
        res = by[("W1", 2)]
        s, t = _row(res, "shmloader"), _row(res, "torch")
        val = None
        if s and t and t["consumer_cpu_ms"] and s["consumer_cpu_ms"] is not None:
            val = s["consumer_cpu_ms"] / t["consumer_cpu_ms"]
        add("W1 w2 consumer CPU/batch vs torch", val, f"<= {W1_CPU_RATIO:g}x", lambda v: v <= W1_CPU_RATIO)
        fb = res["first_batch_s"]
        val = None
        if "torch" in fb and "shmloader" in fb:
            val = fb["shmloader"]["median_s"] / fb["torch"]["median_s"]
        add(
            "W1 w2 time to first batch vs torch",
            val,
            f"<= {W1_FIRST_BATCH_RATIO:g}x",
            lambda v: v <= W1_FIRST_BATCH_RATIO,
        )
    if ("W4", 2) in by:
        row = _row(by[("W4", 2)], "shmloader")
        val = row["consumer_cpu_ms"] * 1e3 if row and row["consumer_cpu_ms"] is not None else None
        add("W4 w2 consumer CPU/batch", val, f"<= {W4_CONSUMER_US:g} us", lambda v: v <= W4_CONSUMER_US)
    return out


def rows(targets: list[dict[str, Any]]) -> list[list[str]]:
    """The targets table's cells."""
    cells = []
    for t in targets:
        v = t["value"]
        goal = t["goal"]
        if v is None:
            shown = "-"
        elif goal.endswith("%"):
            shown = f"{v:.1f}%"
        elif goal.endswith(" us"):
            shown = f"{v:.1f} us"
        else:
            shown = f"{v:.3g}x"
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")
        cells.append([t["target"], shown, t["goal"], met])
    return cells


def text(targets: list[dict[str, Any]]) -> str:
    """The targets table, as text."""
    return f"{TITLE}:\n" + text_table(HEADER, rows(targets))


def markdown(targets: list[dict[str, Any]]) -> str:
    """The targets table, as a markdown section."""
    return f"## {TITLE}\n\n" + md_table(HEADER, rows(targets)) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(text(evaluate(json.load(f)["configs"])))
