"""``profile PATH [options]``: read for N seconds with a consumer of a given step time and print
where the time went, the verdict and what to change; ``--plot`` draws it (matplotlib).

Sizes workers before a job: the same options as ``create_dataloader``, and ``--step-ms`` the
time the training step will take (the consumer sleeps it, as a step on an accelerator leaves
the CPU to the loader).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..api.dataset import StructuredDataset
from ..api.loader import StructuredDataLoader
from ..api.stats import LoaderStats, summary
from ..base.stages import COUNTS, STAGES
from .args import add_settings, add_sources, pairs, planned_settings, weight
from .files import BadInput
from .output import EXIT_OK, Report, emit, table
from .resume import paths

__all__ = ["add_profile", "profile"]

# Seconds between the samples of the loop's figures that --plot draws.
_SAMPLE_SECONDS = 0.5


def add_profile(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="*", metavar="PATH", help="directory, prefix, glob, file")
    add_settings(parser, plan=True)
    parser.add_argument("--columns", help="comma-separated projection, e.g. id,x")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per batch")
    parser.add_argument("--prefetch-factor", type=int, metavar="N", help="batches per worker")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to read (10)")
    parser.add_argument("--step-ms", type=float, default=0.0, help="the step's time (0: none)")
    parser.add_argument("--plot", metavar="PNG", help="draw the figures (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    add_sources(parser)
    parser.set_defaults(run=profile)


def profile(args: argparse.Namespace) -> int:
    """read for --seconds (or an epoch) with a --step-ms consumer: where the time went"""
    if args.seconds <= 0 or args.step_ms < 0:
        raise BadInput("--seconds must be > 0 and --step-ms >= 0")
    if args.plot:
        _pyplot()  # before reading: a missing matplotlib is said at once
    loader = _loader(args)
    samples: list[tuple[float, float, float]] = []  # seconds, wait share, rows/s
    step, began = args.step_ms / 1e3, time.perf_counter()
    sampled, ended = began, True
    for _ in loader:
        if step:
            time.sleep(step)
        now = time.perf_counter()
        if now - sampled >= _SAMPLE_SECONDS:
            recent = loader.stats(_SAMPLE_SECONDS).recent
            samples.append((now - began, recent.wait_fraction, recent.rows / recent.seconds))
            sampled = now
        if now - began >= args.seconds:
            ended = False
            break
    stats = loader.stats(args.seconds)
    report = _report(args, loader, stats)
    report["settings"]["epoch_ended"] = ended
    if args.plot:
        _plot(args.plot, samples, stats)
        report["plot"] = args.plot
    emit(report, args.json, _render)
    return EXIT_OK


def _loader(args: argparse.Namespace) -> StructuredDataLoader:
    settings = planned_settings(args)  # rank 0's share with --world-size
    workers = args.num_workers or 0
    options: dict[str, Any] = {"num_workers": workers}
    if args.prefetch_factor is not None:
        if not workers:
            raise BadInput("--prefetch-factor needs --num-workers >= 1")
        options["prefetch_factor"] = args.prefetch_factor
    if args.source:
        if args.path:
            raise BadInput("give PATH for one dataset, or --source/--weight for a mixture")
        weights = {name: weight(n) for name, n in pairs(args.weight, "--weight", "N")}
        source = dict(pairs(args.source, "--source", "PATH"))
        loader, _ = StructuredDataset.create_dataloader(
            source, weights=weights, **settings, **options
        )
    elif args.path:
        loader, _ = StructuredDataset.create_dataloader(paths(args.path), **settings, **options)
    else:
        raise BadInput("give PATH (one dataset) or --source NAME=PATH --weight NAME=N (a mixture)")
    return loader


def _report(args: argparse.Namespace, loader: StructuredDataLoader, stats: LoaderStats) -> Report:
    figures = stats.as_dict()
    return {
        "path": " ".join(args.path or args.source),
        "settings": {
            "batch_size": args.batch_size,
            "num_workers": loader.num_workers,
            "prefetch_factor": loader.prefetch_factor,
            "step_ms": args.step_ms,
            "seconds": args.seconds,
        },
        "summary": summary(stats),
        **figures,
    }


def _render(report: Report) -> list[str]:
    settings, loop = report["settings"], report["since_start"]
    seconds = loop["seconds"] or 1.0
    ended = " (the epoch ended)" if settings["epoch_ended"] else ""
    lines = [
        f"profile of {report['path']} for {loop['seconds']:.1f} s{ended}: batch_size "
        f"{settings['batch_size']}, num_workers {settings['num_workers']}, step "
        f"{settings['step_ms']:g} ms",
        f"loop: {loop['batches']:,} batches, {loop['rows']:,} rows ({loop['rows'] / seconds:,.0f} "
        f"rows/s), waited {loop['wait_fraction']:.0%} of its time (p50 "
        f"{loop['wait_p50'] * 1e3:.2f} ms, p95 {loop['wait_p95'] * 1e3:.2f} ms, p99 "
        f"{loop['wait_p99'] * 1e3:.2f} ms per batch); start-up {report['startup_seconds']:.2f} s",
        "seconds per stage, by process:",
        *table(
            ["process", *STAGES, "MiB", "requests", "retries", "batches", "rows"],
            [_row(p["process"], p["since_start"]) for p in report["processes"]],
            name=True,
        ),
    ]
    if report["mixture"]:
        lines.append("mixture, rows per source against the schedule:")
        lines += table(
            ["source", "weight", "share", "rows", "delivered", "epoch"],
            [
                [
                    s["name"],
                    s["weight"],
                    f"{s['share']:.1%}",
                    f"{s['rows']:,}",
                    f"{s['delivered_share']:.1%}",
                    s["epoch"],
                ]
                for s in report["mixture"]
            ],
            name=True,
        )
    lines.append(f"bottleneck: {report['bottleneck']}: {report['advice']}")
    if "plot" in report:
        lines.append(f"plot: {report['plot']}")
    return lines


def _row(name: str, figures: dict[str, Any]) -> list[str]:
    fetched, requests, retries = (figures[c] for c in COUNTS)
    return [
        name,
        *(f"{figures[s]:.3f}" for s in STAGES),
        f"{fetched / 2**20:.1f}",
        str(requests),
        str(retries),
        f"{figures['batches']:,}",
        f"{figures['rows']:,}",
    ]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or leave "
            "out --plot: the figures print without it)"
        ) from None
    return plt


def _plot(path: str, samples: list[tuple[float, float, float]], stats: LoaderStats) -> None:
    """The loop's wait share and rows/s over time; each process's seconds per stage."""
    plt = _pyplot()
    figure, (wait, rate, stages) = plt.subplots(3, 1, figsize=(9, 10))
    times = [t for t, _, _ in samples]
    wait.plot(times, [100 * w for _, w, _ in samples])
    wait.set(ylabel="data wait, % of the loop's time", ylim=(0, 100))
    rate.plot(times, [r for _, _, r in samples])
    rate.set(xlabel="seconds", ylabel="rows/s")
    names = [p.process for p in stats.processes]
    bottom = [0.0] * len(names)
    for stage in STAGES:
        values = [getattr(p.since_start, stage) for p in stats.processes]
        stages.bar(names, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    stages.set(ylabel="seconds", title=f"bottleneck: {stats.bottleneck}")
    stages.legend(fontsize="small", ncol=3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
