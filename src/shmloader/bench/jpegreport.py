"""W6's own table (:mod:`shmloader.bench.jpeg`): images/s, CPU per image and paired
ratios, for the long runs and the fresh loaders' passes."""

from __future__ import annotations

from typing import Any

from shmloader.bench.decodelimit import LIMIT, PARALLEL

OURS = "shmloader+ImageFolder"


def _section(title: str, part: dict[str, Any]) -> list[str]:
    lines = [title]
    lines.append(f"{'peer':<24}{'images/s':>10}{'spread':>9}{'consumer CPU/batch':>21}{'all CPU/image':>16}")
    for r in part["results"]:
        lines.append(
            f"{r['peer']:<24}{r['images_per_s']:>10.0f}{r['spread']:>8.0%} "
            f"{r['consumer_cpu_ms_per_batch']:>16.2f} ms{r['total_cpu_ms_per_image']:>13.2f} ms"
        )
    lines.append("")
    ranges = part.get("ratio_ranges", {})
    for name, value in part["ratios"].items():
        lo, hi = ranges.get(name, (value, value))
        lines.append(f"{name:<46} {value:5.2f}x  ({lo:.2f}-{hi:.2f})")
    cpu = {r["peer"]: r["total_cpu_ms_per_image"] for r in part["results"]}
    lines.append("CPU per image, consumer + workers (far less sensitive to other load than images/s):")
    for peer in ("torch+conventional", "torch+ImageFolder"):
        lines.append(f"  {peer} / shmloader+ImageFolder {'':<18} {cpu[peer] / cpu[OURS]:5.2f}x")
    if LIMIT in cpu:
        lines.append(f"  shmloader+ImageFolder / the decode's own {'':<12} {cpu[OURS] / cpu[LIMIT]:5.2f}x")
        lines.append(
            f"decode limit: the dataset's own __getitem__ in this process, one thread, times "
            f"{part['limit_cores']} cores (images/s); its CPU per image is the decode's own."
        )
    if PARALLEL in cpu:
        lines.append(
            f"{PARALLEL}: the same __getitem__ in {part['limit_cores']} forked processes at once, each "
            "over its share (on a busy machine the scheduler shares the CPU by session, not by "
            "process: there the decode limit overstates what any loader's workers can get)."
        )
    return lines


def w6_table(report: dict[str, Any]) -> str:
    """W6's own table: images/s, consumer CPU per batch, CPU per image of all processes,
    the paired ratios (median, min-max), for the long runs and the fresh passes, and a
    warning when other processes competed for the CPU."""
    lines = [report["workload"], f"(resample backend: {report['backend']}; median of repeats)", ""]
    lines += _section("Long runs (persistent workers, whole epochs):", report)
    if "fresh" in report:
        fresh = report["fresh"]
        lines += [""]
        lines += _section(
            f"Fresh loaders (a new loader per pass over {fresh['images']} images, start-up included):", fresh
        )
    lo, hi = report["load"]
    if lo is not None and hi is not None and max(lo, hi) > report["cores"]:
        lines.append(
            f"note: load average {lo:.1f} -> {hi:.1f} on {report['cores']} cores: other processes "
            "competed for the CPU, so images/s and its ratios are noisy; trust the CPU ratios more."
        )
    return "\n".join(lines)
