"""``plan --source NAME=PATH --weight NAME=N ...``: a mixture's plan, and what a step reads.

Per source: its rows, weight and share of the positions, the rows an epoch reads of it and how
many of its epochs that is. Per (rank, worker) stream: its positions in the epoch, the rows of
each source it reads, and the positions where a source's epoch ends and the next (reshuffled)
begins. With ``--step K`` (and ``--rank R``): the source, file and row of every row of that
batch. All of it is the schedule's integer arithmetic; no file is read beyond its footer.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace
from typing import Any

from ..api.dataset import StructuredDataset
from ..mixing.epochs import MixedEpochs, MixedProgress
from ..planning.epochs import Start
from .args import pairs, planned_settings, weight
from .files import BadInput
from .output import EXIT_OK, Report, emit, table

__all__ = ["mixture_plan"]

# Rows of a step listed in text (--json lists all).
_STEP_ROWS = 16


def mixture_plan(args: argparse.Namespace) -> int:
    """A mixture's plan: sources, streams, where each source wraps, what a step reads."""
    mix = _mixture(args)
    workers = args.num_workers or 0
    mix.begin(Start.fresh(args.epoch), workers)  # checks the sources against the streams
    report: Report = {
        "settings": {
            "epoch": args.epoch,
            "epoch_size": mix.timeline.epoch_size,
            "batch_size": args.batch_size,
            "world_size": mix.world_size,
            "num_workers": workers,
            "shuffle": mix.config.shuffle,
            "period": mix.timeline.schedule.period_length,
        },
        "sources": _sources(mix),
        "streams": [_stream(mix, rank, workers, args.epoch) for rank in range(mix.world_size)],
    }
    if args.step is not None:
        report["step"] = _step(mix, args, workers)
    emit(report, args.json, _render)
    return EXIT_OK


def _mixture(args: argparse.Namespace) -> MixedEpochs:
    paths = dict(pairs(args.source, "--source", "PATH"))
    weights = {name: weight(value) for name, value in pairs(args.weight, "--weight", "N")}
    dataset = StructuredDataset(
        paths, weights=weights, epoch_size=args.epoch_size, **planned_settings(args)
    )
    mix = dataset._epochs
    assert isinstance(mix, MixedEpochs)
    return mix


def _sources(mix: MixedEpochs) -> list[dict[str, Any]]:
    total = sum(mix.timeline.schedule.weights)
    out = []
    for s, name in enumerate(mix.names):
        rows = int(mix.sources[s].index.split_rows.sum())
        weight = mix.timeline.schedule.weights[s]
        per_epoch = mix.timeline.epoch_size * weight / total
        out.append({
            "name": name, "files": len(mix.sources[s].index.files), "rows": rows,
            "weight": weight, "share": weight / total, "rows_per_epoch": round(per_epoch),
            "source_epochs_per_epoch": per_epoch / rows,
        })  # fmt: skip
    return out


def _stream(mix: MixedEpochs, rank: int, workers: int, epoch: int) -> list[dict[str, Any]]:
    """Each worker stream of ``rank``: positions, rows per source, where sources wrap."""
    progress = MixedProgress(_of_rank(mix, rank), epoch, workers)
    out = []
    for worker in range(max(1, workers)):
        total = progress.total(worker)
        first, last = progress.counts(worker, 0), progress.counts(worker, total)
        shares = progress.shares(worker)
        wraps: list[dict[str, Any]] = []
        for s, name in enumerate(mix.names):
            for n in range(first[s] // shares[s] + 1, last[s] // shares[s] + 1):
                at = _position_of(progress, worker, s, n * shares[s], total)
                wraps.append({"source": name, "source_epoch": n, "position": at})
        out.append({
            "rank": rank, "worker": worker, "positions": total,
            "rows": {name: int(last[s] - first[s]) for s, name in enumerate(mix.names)},
            "wraps": sorted(wraps, key=lambda w: int(w["position"])),
        })  # fmt: skip
    return out


def _of_rank(mix: MixedEpochs, rank: int) -> MixedEpochs:
    """The same mixture as rank ``rank`` plans it."""
    return replace(mix, rank=rank, _orders={}, _shares={}, _settings_states={})


def _position_of(progress: MixedProgress, worker: int, source: int, count: int, end: int) -> int:
    """The first position of the epoch after which ``source`` has been read ``count`` times."""
    lo, hi = 0, end
    while lo < hi:
        mid = (lo + hi) // 2
        if progress.counts(worker, mid)[source] >= count:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _step(mix: MixedEpochs, args: argparse.Namespace, workers: int) -> dict[str, Any]:
    """The source, file and row of each row of batch ``args.step`` of rank ``args.rank``."""
    streams = max(1, workers)
    rank = args.rank or 0
    worker, batch = args.step % streams, args.step // streams
    ranked = _of_rank(mix, rank)
    progress = MixedProgress(ranked, args.epoch, workers)
    lo = batch * args.batch_size
    hi = min(lo + args.batch_size, progress.total(worker))
    if lo >= hi:
        raise BadInput(f"step {args.step} is past the end of epoch {args.epoch} of rank {rank}")
    ids = progress.sources(worker, lo, hi)
    rows = []
    counts = progress.counts(worker, lo).copy()
    for source in ids.tolist():
        place = ranked.place(source, progress.stream(worker), int(counts[source]), workers)
        split, row = place.order.row_at(place.offset) or (0, 0)
        index = ranked.sources[source].index
        rows.append({
            "source": mix.names[source], "source_epoch": place.epoch,
            "file": index.files[index.splits[split].file].display,
            "row": index.splits[split].row_offset + row,
        })  # fmt: skip
        counts[source] += 1
    return {"rank": rank, "worker": worker, "batch_of_worker": batch, "rows": rows}


def _render(report: Report) -> list[str]:
    s = report["settings"]
    lines = [
        f"mixture of {len(report['sources'])} sources, epoch {s['epoch']}: {s['epoch_size']} "
        f"rows over {s['world_size']} rank(s) x {max(1, s['num_workers'])} worker stream(s) "
        f"(schedule period {s['period']}, shuffle {'on' if s['shuffle'] else 'off'})",
        *table(
            ["source", "files", "rows", "weight", "share", "rows/epoch", "its epochs/epoch"],
            [
                [
                    x["name"],
                    x["files"],
                    x["rows"],
                    x["weight"],
                    f"{x['share']:.3f}",
                    x["rows_per_epoch"],
                    f"{x['source_epochs_per_epoch']:.2f}",
                ]
                for x in report["sources"]
            ],
            name=True,
        ),
    ]
    streams = [x for rank in report["streams"] for x in rank]
    names = [x["name"] for x in report["sources"]]
    lines += table(
        ["rank", "worker", "positions", *names, "sources wrap at (position)"],
        [[x["rank"], x["worker"], x["positions"], *(x["rows"][n] for n in names),
          ", ".join(f"{w['source']}@{w['position']}" for w in x["wraps"]) or "-"]
         for x in streams],
        name=False,
    )  # fmt: skip
    if "step" in report:
        step = report["step"]
        mix = Counter(r["source"] for r in step["rows"])
        lines.append(
            f"step: rank {step['rank']} worker {step['worker']} batch {step['batch_of_worker']}"
            f": {len(step['rows'])} rows, {dict(mix)}"
        )
        lines += table(
            ["source", "source epoch", "file", "row"],
            [[r["source"], r["source_epoch"], r["file"], r["row"]]
             for r in step["rows"][:_STEP_ROWS]],
            name=True,
        )  # fmt: skip
        if len(step["rows"]) > _STEP_ROWS:
            lines.append(f"  ... {len(step['rows']) - _STEP_ROWS} more rows (--json lists all)")
    return lines
