"""``shmloader bench``: the options, the run over every configuration, the outputs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from shmloader.bench.busy import Burners
from shmloader.bench.jpeg import W6_IMAGE_SIZE, measure_w6, w6_steps
from shmloader.bench.machine import machine_info
from shmloader.bench.measure import COLD_BATCHES, config_steps, measure_config
from shmloader.bench.metadata import W8_BATCH, W8_RECORDS, measure_w8, w8_steps
from shmloader.bench.peers import torch_dataloader
from shmloader.bench.plot import write_plot
from shmloader.bench.progress import Progress
from shmloader.bench.report import format_markdown, format_report, results_json
from shmloader.bench.results import ConfigResult
from shmloader.bench.torchvision_pipeline import measure_w9, w9_steps
from shmloader.bench.workloads import ALL_NAMES, DEFAULT_NAMES, OPT_IN_NAMES, WORKLOADS, Config, make_configs

TORCH_HINT = "torch is not installed: `pip install torch` adds the side-by-side torch columns."


def _parse_list(text: str, allowed: Sequence[str] | None = None, opt_in: Sequence[str] = ()) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if allowed is not None:
        if items == ["all"]:
            return list(allowed)
        lookup = {a.lower(): a for a in [*allowed, *opt_in]}
        bad = [i for i in items if i.lower() not in lookup]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown workload(s) {bad}; choose from {', '.join(lookup.values())} or 'all'"
            )
        items = [lookup[i.lower()] for i in items]
    return items


def _image_size(text: str) -> tuple[int, int]:
    from shmloader.vision.synth import parse_size

    try:
        return parse_size(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"--image-size wants WIDTHxHEIGHT in pixels (at least 8x8), e.g. 500x375, got {text!r}."
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The options of ``shmloader bench``."""
    parser = argparse.ArgumentParser(
        prog="shmloader bench",
        description="Compare shmloader with torch.utils.data.DataLoader (and with its own "
        "num_workers=0 path and the memory-copy ceiling) on synthetic workloads, in one run.",
        epilog="Workloads: "
        + "; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values())
        + "; W1-unordered, W7-unordered: W1, W7 with in_order=False; W1-fresh: W1 with "
        "persistent_workers=False. "
        "W6 needs Pillow and simplejpeg, and writes its images once under $SHMLOADER_CACHE "
        "(default ~/.cache/shmloader; a few minutes). "
        "W8 runs only when named (--workloads W8 --workers 2,4; 'all' leaves it out): a fresh "
        "process per measurement, about 4 minutes per worker count and round at 1,000,000 "
        "records on 2 cores. "
        "With no options: W1 and W4 with 2 workers, about a minute.",
    )
    parser.add_argument(
        "--workloads",
        type=lambda s: _parse_list(s, ALL_NAMES, OPT_IN_NAMES),
        default=DEFAULT_NAMES,
        help=f"comma-separated, or 'all' (all but {','.join(OPT_IN_NAMES)}; "
        f"default: {','.join(DEFAULT_NAMES)})",
    )
    parser.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in _parse_list(s)],
        default=[2],
        help="comma-separated worker counts, e.g. 2,1 (default: 2)",
    )
    parser.add_argument(
        "--batches", type=int, default=None, help="batches per timed repeat (default: per workload)"
    )
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="time box of one timed repeat (default: 2)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed repeats; the median is reported (default: 3)"
    )
    parser.add_argument(
        "--cold-batches",
        type=int,
        default=COLD_BATCHES,
        help=f"batches of the fresh loaders' short epoch, the cold figure (default: {COLD_BATCHES})",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the memory probes (a subprocess per loader)"
    )
    parser.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as markdown here")
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG bar chart of the ratios (needs matplotlib)"
    )
    _add_workload_options(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The options of single workloads (W6's images, W8's records) and of the machine the
    loaders run on (--busy)."""
    parser.add_argument(
        "--image-size",
        type=_image_size,
        default=W6_IMAGE_SIZE,
        metavar="WxH",
        help="W6's JPEGs: every image this size (default: 500x375, ImageNet's median; "
        "e.g. 1200x800 for camera photos scaled down)",
    )
    parser.add_argument(
        "--w8-records",
        type=int,
        default=W8_RECORDS,
        metavar="N",
        help=f"W8's metadata records (default: {W8_RECORDS:,})",
    )
    parser.add_argument(
        "--w8-rounds", type=int, default=1, metavar="N", help="W8's rounds of every peer (default: 1)"
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run N CPU-bound processes beside the loaders while they are measured (a busy "
        "machine: e.g. one per core), ended by the bench (default: 0)",
    )


def _steps(cfg: Config, repeat: int, memory: bool, have_torch: bool, w8_rounds: int = 1) -> int:
    if cfg.workload == "W8":
        return w8_steps(w8_rounds, have_torch)
    if cfg.workload == "W9":
        return w9_steps(repeat)
    if WORKLOADS[cfg.workload].make is None:
        return w6_steps(repeat)
    return config_steps(cfg, repeat, memory, have_torch)


def run(
    configs: list[Config],
    *,
    batches: int | None = None,
    seconds: float = 2.0,
    repeat: int = 3,
    memory: bool = True,
    out: Callable[[str], None] = print,
    quiet: bool = False,
    cold_batches: int = COLD_BATCHES,
    image_size: tuple[int, int] = W6_IMAGE_SIZE,
    w8_records: int = W8_RECORDS,
    w8_rounds: int = 1,
) -> list[ConfigResult]:
    """Measure ``configs`` one after the other (W6 by :func:`~shmloader.bench.jpeg.measure_w6`,
    W8 by :func:`~shmloader.bench.metadata.measure_w8`, the others by
    :func:`~shmloader.bench.measure.measure_config`); without torch, its peers are left out."""
    torch_dl = torch_dataloader()
    total = sum(_steps(cfg, repeat, memory, torch_dl is not None, w8_rounds) for cfg in configs)
    progress = Progress(total, out, enabled=not quiet)
    results = []
    try:
        for cfg in configs:
            if cfg.workload == "W8":
                results.append(
                    measure_w8(
                        cfg, records=w8_records, rounds=w8_rounds, torch_dl=torch_dl, progress=progress
                    )
                )
                continue
            if cfg.workload == "W9":
                results.append(measure_w9(cfg, repeat=repeat, torch_dl=torch_dl, progress=progress))
                continue
            if WORKLOADS[cfg.workload].make is None:
                results.append(
                    measure_w6(
                        cfg, repeat=repeat, torch_dl=torch_dl, progress=progress, image_size=image_size
                    )
                )
                continue
            results.append(
                measure_config(
                    cfg,
                    batches=batches,
                    seconds=seconds,
                    repeat=repeat,
                    memory=memory,
                    torch_dl=torch_dl,
                    progress=progress,
                    cold_batches=cold_batches,
                )
            )
    finally:
        progress.close()
    return results


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the options no run can use (argparse's error: usage, message, status 2)."""
    if (
        args.repeat < 1
        or (args.batches is not None and args.batches < 1)
        or args.seconds <= 0
        or args.cold_batches < 1
    ):
        parser.error("--repeat, --batches and --cold-batches must be positive, and --seconds above zero")
    if args.w8_records < W8_BATCH or args.w8_rounds < 1:
        parser.error(f"--w8-rounds must be positive, and --w8-records at least one batch ({W8_BATCH})")
    if args.busy < 0:
        parser.error("--busy must be 0 or more (CPU-bound processes beside the loaders)")
    if any(w < 1 for w in args.workers):
        parser.error("--workers must be positive: the num_workers=0 path is measured in every configuration")


def _settings(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The run's settings as the JSON records them."""
    return {
        "workloads": args.workloads,
        "workers": args.workers,
        "batches": args.batches,
        "seconds": args.seconds,
        "repeat": args.repeat,
        "cold_batches": args.cold_batches,
        "image_size": list(args.image_size),
        "w8_records": args.w8_records,
        "w8_rounds": args.w8_rounds,
        "memory": not args.no_memory,
        "busy": args.busy,
        "command": command,
    }


def main(argv: list[str] | None = None) -> int:
    """``shmloader bench``: run the benchmark and print the tables."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)

    def out(s: str) -> None:
        print(s, flush=True)

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            out(
                "note: --plot needs matplotlib, which is not installed: the run goes on "
                "without a chart (pip install matplotlib)."
            )
    configs = make_configs(args.workloads, args.workers)
    info = machine_info()
    versions = f"python {info['python']}, numpy {info['numpy']}" + (
        f", torch {info['torch']}" if info["torch"] else ""
    )
    out(
        f"shmloader bench: {', '.join(c.label for c in configs)}; up to "
        f"{args.batches or 'default'} batches or {args.seconds:g} s per repeat, "
        f"{args.repeat} repeats; {info['cpu_model']}, {info['usable_cores']} cores, {versions}"
    )
    if args.busy:
        out(f"busy: {args.busy} CPU-bound process(es) run beside the loaders throughout")
    t0 = time.perf_counter()
    with Burners(args.busy):  # (ended and reaped however the run ends)
        results = run(
            configs,
            batches=args.batches,
            seconds=args.seconds,
            repeat=args.repeat,
            memory=not args.no_memory,
            out=out,
            quiet=args.quiet,
            cold_batches=args.cold_batches,
            image_size=args.image_size,
            w8_records=args.w8_records,
            w8_rounds=args.w8_rounds,
        )
    out("")
    out(format_report(results))
    if info["torch"] is None:
        out("\n" + TORCH_HINT)
    out(f"\n{len(configs)} configuration(s) in {time.perf_counter() - t0:.0f} s.")
    command = ("shmloader bench " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
    settings = _settings(args, command)
    info["load_average_end"] = machine_info()["load_average"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results_json(results, info, settings), f, indent=1, default=str)
        out(f"results written to {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(results, info, command))
        out(f"markdown written to {args.markdown}")
    if args.plot:
        out(write_plot(args.plot, results))
    return 0
