"""The report of a run: text tables for the terminal, markdown for RESULTS.md, and the
JSON form. One list of sections feeds both the text and the markdown.

Where torch did not run, its columns are left out (``shmloader bench`` says once how to get
them), rather than filled with "not installed".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from shmloader.bench.results import ConfigResult

COLUMNS = ["workload", "loader", "batches/s", "spread", "GB/s", "vs torch", "% ceiling", "CPU ms/batch"]
_FB_TITLE = "Time to first batch (fresh loader, fork)"
_FB_HEADER = ["workload", "shmloader", "torch", "ratio"]
_COLD_TITLE = (
    "Cold vs steady (cold: a fresh loader, fork, constructor to the last batch of a short "
    "epoch, median ± spread; ratios: median of paired rounds (min-max))"
)
_COLD_HEADER = ["workload", "batches", "shmloader", "torch", "cold vs torch", "steady vs torch"]
_MEM_TITLE = "Memory (fresh process per loader, every page of every batch read)"
_MEM_HEADER = [
    "workload",
    "loader",
    "peak RSS MB",
    "over baseline",
    "of it shm MB",
    "sys Shmem +MB",
    "/dev/shm +MB",
]
_WASTE_TITLE = "W7 padding waste (padded / all elements of one epoch's batches, from the sampler and lengths)"
_WASTE_HEADER = ["workload", "bucketed waste", "unbucketed waste", "elements/batch bucketed", "unbucketed"]
_W8_MEM_TITLE = (
    "W8 workers' memory (fork, one shuffled epoch per fresh process; USS: each worker's peak, "
    "read every 0.25 s and at the last batch; PSS: the consumer and its workers at the last batch; "
    "times from iter(); next epoch: the same loader's second epoch, its workers started again)"
)
_W8_MEM_HEADER = [
    "workload",
    "loader",
    "USS/worker MB",
    "workers' USS MB",
    "total PSS MB",
    "epoch s",
    "first batch s",
    "next epoch s",
]
_W8_SPAWN_TITLE = (
    "W8 time to first batch (spawn, from iter(); share_dataset: share() inside that iter(); "
    "pre-shared: the dataset shared before, share() timed apart)"
)
_W8_SPAWN_HEADER = ["workload", "loader", "first batch s", "vs torch", "share() s"]
_TORCH_COLUMNS = {"vs torch", "torch", "ratio", "cold vs torch", "steady vs torch"}

CONSUMER_NOTE = (
    "Every consumer reads every page of every batch it is given (a byte per 4 KiB page of "
    "every leaf, shmloader.bench.consume), as a host-to-device copy would, for every peer "
    "alike; the copy ceiling's processes read each batch they write."
)
_LEGEND = [
    f"- consumer: {CONSUMER_NOTE}",
    "- shmloader / torch: the same dataset object, batch size, num_workers, prefetch_factor 2, "
    "default collate, numpy samples; persistent_workers=True and timed from the first batch of "
    "each epoch (steady state), except W1-fresh (persistent_workers=False, timed from iter(), "
    "so each epoch's worker start-up counts). W1-unordered, W7-unordered: in_order=False (both "
    "loaders then give no task to a worker that already has its share in flight).",
    "- shmloader w0: this loader with num_workers=0 (fetch and collate in the consumer).",
    "- cold: each round a fresh loader of each kind (fork, persistent_workers=False, the same "
    "settings) over the first --cold-batches batches of the same dataset, timed from its "
    "constructor to the last batch in hand (worker start-up and shmloader's first ring "
    "included, the workers' shutdown after it not); the first round is a warm-up, the peers "
    "alternate. Time to first batch comes from the same runs.",
    "- copy ceiling: as many processes as workers, each doing one np.copyto per leaf per batch "
    "of the same bytes from the same cached samples, rotating over as many batch-sized "
    "buffers as the ring has slots (private memory: numpy's allocator, huge pages where the "
    "kernel gives them). copy ceiling shm: the same into shared memory (4 KiB shmem pages, "
    "like the ring's).",
    "- CPU ms/batch: the consumer process's CPU time (user + system) per batch.",
    "- W6 (shmloader.bench.jpeg): torch+conventional is torch's DataLoader over the "
    "dataset people write (Pillow open, convert, torchvision's RandomResizedCrop algorithm, "
    "flip, np.array); torch+ImageFolder is torch's DataLoader over shmloader.vision.ImageFolder; "
    "shmloader+ImageFolder is this loader over the same ImageFolder. Shuffled, persistent "
    "workers, one warm-up epoch, then whole epochs timed; 'vs torch' is vs torch+conventional.",
    "- W8 (shmloader.bench.metadata): a dataset holding its metadata as one Python dict per "
    "record in a list (path, label, annotation dict with a box); __getitem__ reads one record's "
    "fields. Every measurement in a fresh process; torch empty / shmloader empty: the same "
    "samples computed from the index, no containers (the floor); shmloader gc.freeze: gc.freeze() "
    "in the consumer before iter(). Batches/s in the main table: the fork epoch after its first batch.",
    "- W7: both loaders (and w0) get the same BucketBatchSampler(lengths, 64, num_buckets=16, "
    "seed=0); shmloader pads with collate='pad', torch with a numpy collate_fn "
    "(shmloader.bench.datasets.pad_collate) returning (padded, lengths). No copy ceiling: batch sizes vary.",
]


def _fmt(v: float | None, spec: str, missing: str = "-") -> str:
    return missing if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _timing_text(timing: dict[str, float] | None, missing: str = "-") -> str:
    """``median ms ±spread`` of one loader's timings, or ``missing`` where it did not run."""
    return f"{timing['median_s'] * 1e3:.0f} ms ±{timing['spread']:.0%}" if timing else missing


def _ratio_text(ratio: float | None, span: Sequence[float] | None) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.2f}x" + (f" ({span[0]:.2f}-{span[1]:.2f})" if span else "")


def _nonneg(v: float | None) -> float | None:
    """A peak-over-baseline figure: below zero only when other processes freed memory."""
    return None if v is None else max(0.0, v)


def _loads(v: Any) -> str:
    return "unknown" if not v else " / ".join(f"{x:.1f}" for x in v)


def table_rows(results: list[ConfigResult]) -> list[list[str]]:
    """The main table's cells (:data:`COLUMNS`), one list per peer."""
    rows = []
    for res in results:
        for r in res.rows:
            if r.status != "ok":
                rows.append([res.config.label, r.loader, r.status, "", "", "", "", ""])
                continue
            rows.append(
                [
                    res.config.label,
                    r.loader,
                    _fmt(r.batches_per_s, ",.0f"),
                    _fmt(r.spread, ".0%"),
                    _fmt(r.gb_per_s, ".2f"),
                    _fmt(r.ratio_to_torch, ".2f", "n/a") + ("x" if r.ratio_to_torch is not None else ""),
                    _fmt(r.pct_of_ceiling, ".0f") + ("%" if r.pct_of_ceiling is not None else ""),
                    _fmt(r.consumer_cpu_ms, ".3f"),
                ]
            )
    return rows


def _first_batch_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results:
        fb = res.first_batch_s
        if not fb:
            continue  # W6: not measured
        s, t = fb.get("shmloader"), fb.get("torch")
        ratio = f"{s['median_s'] / t['median_s']:.2f}x" if s and t else "n/a"
        rows.append([res.config.label, _timing_text(s), _timing_text(t), ratio])
    return rows


def _cold_rows(results: list[ConfigResult]) -> list[list[str]]:
    """Cold (a fresh loader's short epoch) beside steady (persistent workers), per config."""
    rows = []
    for res in results:
        cold = res.cold
        if not cold:
            continue  # W6: not measured
        steady = res.row("shmloader")
        rows.append(
            [
                res.config.label,
                str(cold["batches"]),
                _timing_text(cold.get("shmloader")),
                _timing_text(cold.get("torch")),
                _ratio_text(cold.get("ratio"), cold.get("ratio_range")),
                _ratio_text(steady.ratio_to_torch, steady.ratio_range) if steady else "n/a",
            ]
        )
    return rows


def _memory_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results:
        for name, m in res.memory.items():
            if "error" in m:
                rows.append([res.config.label, name, m["error"], "", "", "", ""])
                continue
            rows.append(
                [
                    res.config.label,
                    name,
                    f"{m['peak_rss_mb']:.0f}",
                    f"{m['peak_rss_mb'] - m['baseline_rss_mb']:.0f}",
                    f"{m['peak_rss_shmem_mb']:.0f}",
                    _fmt(_nonneg(m["shmem_delta_mb"]), ".0f"),
                    _fmt(_nonneg(m["dev_shm_delta_mb"]), ".0f"),
                ]
            )
    return rows


def _waste_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results:
        pad = res.extra.get("padding")
        if pad:
            b, u = pad["bucketed"], pad["unbucketed"]
            rows.append(
                [
                    res.config.label,
                    f"{b['waste']:.1%}",
                    f"{u['waste']:.1%}",
                    f"{b['elements_per_batch']:,.0f}",
                    f"{u['elements_per_batch']:,.0f}",
                ]
            )
    return rows


def _figure(fig: dict[str, Any] | None, scale: float = 1.0, spec: str = ".0f") -> str:
    """A W8 figure: its median (divided by ``scale``), and its spread over rounds."""
    if not fig:
        return "-"
    text = format(fig["median"] / scale, spec)
    return text + (f" ±{fig['spread']:.0%}" if len(fig["runs"]) > 1 else "")


def _w8_memory_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results:
        w8 = res.extra.get("w8")
        for name, fig in (w8 or {}).get("fork", {}).items():
            if "error" in fig:
                rows.append([res.config.label, name, fig["error"], "", "", "", "", ""])
                continue
            mb = 2**20
            rows.append(
                [
                    res.config.label,
                    name,
                    _figure(fig["worker_peak_uss"], mb),
                    _figure(fig["workers_peak_uss_sum"], mb),
                    _figure(fig["total_pss"], mb),
                    _figure(fig["epoch_s"], spec=".2f"),
                    _figure(fig["first_batch_s"], spec=".2f"),
                    _figure(fig.get("next_epoch_s"), spec=".2f"),
                ]
            )
    return rows


def _w8_spawn_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results:
        spawn = (res.extra.get("w8") or {}).get("spawn", {})
        base = spawn.get("torch", {}).get("first_batch_s")
        for name, fig in spawn.items():
            if "error" in fig:
                rows.append([res.config.label, name, fig["error"], "", ""])
                continue
            first = fig["first_batch_s"]
            ratio = f"{first['median'] / base['median']:.2f}x" if base else "n/a"
            rows.append(
                [
                    res.config.label,
                    name,
                    _figure(first, spec=".2f"),
                    ratio,
                    _figure(fig.get("share_s"), spec=".2f"),
                ]
            )
    return rows


def _torch_ran(results: list[ConfigResult]) -> bool:
    """Whether any configuration has a figure relative to torch."""
    return any(r.ratio_to_torch is not None for res in results for r in res.rows) or any(
        "torch" in res.first_batch_s or "torch" in res.cold for res in results
    )


def _without_torch(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    keep = [i for i, h in enumerate(header) if h not in _TORCH_COLUMNS]
    return [header[i] for i in keep], [[r[i] for i in keep] for r in rows]


def _tables(results: list[ConfigResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The tables after the main one and its notes: (title, header, rows), in order; the
    first-batch table always, the others where they have rows."""
    tables = [
        (_WASTE_TITLE, _WASTE_HEADER, _waste_rows(results)),
        (_COLD_TITLE, _COLD_HEADER, _cold_rows(results)),
        (_FB_TITLE, _FB_HEADER, _first_batch_rows(results)),
        (_MEM_TITLE, _MEM_HEADER, _memory_rows(results)),
        (_W8_MEM_TITLE, _W8_MEM_HEADER, _w8_memory_rows(results)),
        (_W8_SPAWN_TITLE, _W8_SPAWN_HEADER, _w8_spawn_rows(results)),
    ]
    return [t for t in tables if t[2] or t[0] == _FB_TITLE]


def _sections(results: list[ConfigResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    compared = _torch_ran(results)
    out = []
    for title, header, rows in [("", COLUMNS, table_rows(results)), *_tables(results)]:
        if not compared:
            header, rows = _without_torch(header, rows)
        out.append((title, header, rows))
    return out


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """An aligned text table: the first two columns to the left, the others to the right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _notes(results: list[ConfigResult]) -> list[str]:
    return sorted({n for r in results for n in r.notes})


def format_report(results: list[ConfigResult]) -> str:
    """Every table of a run, as text."""
    (_, header, rows), *tables = _sections(results)
    parts = [text_table(header, rows), CONSUMER_NOTE]
    notes = _notes(results)
    if notes:
        parts.append("\n".join(notes))
    for res in results:
        if "w6_table" in res.extra:
            parts.append(f"{res.config.label} in detail:\n" + res.extra["w6_table"])
    parts += [f"{title}:\n" + text_table(header, rows) for title, header, rows in tables]
    return "\n\n".join(parts)


def format_markdown(results: list[ConfigResult], info: dict[str, Any], command: str) -> str:
    """A RESULTS.md: machine, command, and every table."""
    (_, header, rows), *tables = _sections(results)
    lines = [
        "# shmloader vs torch DataLoader",
        "",
        f"Reproduce with: `{command}`",
        "",
        f"shmloader {info.get('shmloader_commit') or info['shmloader']}. "
        f"Machine: {info['cpu_model']}, {info['usable_cores']} usable cores of {info['cores']}, "
        f"{_fmt(info['memory_gb'], '.0f')} GB; python {info['python']}, numpy {info['numpy']}, "
        f"torch {info['torch'] or 'not installed'}, start method {info['start_method']}; "
        f"{info['date']}; "
        f"load average (1, 5, 15 min) at start {_loads(info.get('load_average'))}, at end "
        f"{_loads(info.get('load_average_end'))}: other work on the machine skews every "
        "figure, which is why each ratio pairs two loaders measured back to back.",
        "",
        "batches/s and consumer CPU are medians of the repeats; spread = (max - min) / median; "
        "'vs torch' and '% ceiling' are medians of ratios paired within a repeat.",
        "",
        *_LEGEND,
        "",
        md_table(header, rows),
        "",
    ]
    notes = _notes(results)
    lines += [*notes, ""] if notes else []
    for res in results:
        if "w6_table" in res.extra:
            lines += [f"## {res.config.label} in detail", "", "```", res.extra["w6_table"], "```", ""]
    for title, header, rows in tables:
        lines += [f"## {title}", "", md_table(header, rows), ""]
    return "\n".join(lines)


def results_json(
    results: list[ConfigResult], info: dict[str, Any], settings: dict[str, Any]
) -> dict[str, Any]:
    """The machine-readable form of a run: ``{"machine", "settings", "configs"}``, one
    config per :class:`~shmloader.bench.results.ConfigResult` (as a dict, plus its label)."""
    configs = []
    for res in results:
        d = asdict(res)
        d["label"] = res.config.label
        configs.append(d)
    return {"machine": info, "settings": settings, "configs": configs}
