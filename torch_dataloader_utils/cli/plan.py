"""``plan PATH``: files, splits, rows and bytes per rank/worker stream for given settings.

The planner is pure: the dataset is built once (as rank 0; the plan deals every rank's share)
and ``Epochs.plan`` deals the epoch to all ``world_size x max(1, num_workers)`` streams. A
share's stored bytes are estimated from its splits' bytes, in proportion to its rows of them.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ..api.dataset import StructuredDataset
from ..planning.epochs import Epochs, Start
from ..planning.plan import EpochPlan
from .args import add_settings, add_sources, planned_settings
from .files import BadInput
from .mix_plan import mixture_plan
from .output import EXIT_OK, Report, emit, size, table
from .resume import epochs_of, paths

__all__ = ["add_plan", "plan"]


def add_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="*", metavar="PATH", help="directory, prefix, glob, file")
    add_settings(parser, plan=True)
    parser.add_argument("--columns", help="comma-separated projection, e.g. id,x")
    parser.add_argument("--epoch", type=int, default=0, help="the epoch to plan (default 0)")
    parser.add_argument("--batch-size", type=int, default=1024, help="for batches per stream")
    parser.add_argument("--json", action="store_true", help="print JSON")
    mixture = add_sources(parser)
    mixture.add_argument("--epoch-size", type=int, metavar="N", help="rows of a mixture epoch")
    mixture.add_argument("--step", type=int, metavar="K",
                         help="list what batch K of the epoch (of --rank) reads")  # fmt: skip
    mixture.add_argument("--rank", type=int, metavar="R", help="the rank of --step (default 0)")
    parser.set_defaults(run=plan)


def plan(args: argparse.Namespace) -> int:
    """files, splits, rows and bytes per rank/worker stream for given settings"""
    if args.source:
        if args.path:
            raise BadInput("give PATH for one dataset, or --source/--weight for a mixture")
        return mixture_plan(args)
    if not args.path:
        raise BadInput("give PATH (one dataset) or --source NAME=PATH --weight NAME=N (a mixture)")
    dataset = StructuredDataset(paths(args.path), **planned_settings(args))
    epochs = epochs_of(dataset)
    workers = args.num_workers or 0
    dealt = epochs.plan(Start.fresh(args.epoch), workers)
    report = {
        "path": args.path,
        "settings": _settings(epochs, workers, args.epoch),
        **_files(epochs),
        **_streams(epochs, dealt, args.batch_size),
    }
    emit(report, args.json, _render)
    return EXIT_OK


def _settings(epochs: Epochs, workers: int, epoch: int) -> Report:
    settings = epochs.settings(workers)
    config = epochs.config
    return {
        "format": settings.format,
        "split_bytes": settings.split_bytes,
        "shuffle": settings.shuffle,
        "shuffle_seed": settings.shuffle_seed,
        "shuffle_memory_bytes": settings.memory_bytes,
        "shuffle_window_rows": settings.window_rows,
        "even_batches": settings.even_batches,
        "world_size": settings.world_size,
        "num_workers": workers,
        "epoch": epoch,
        "batch_size": config.batch_size,
        "columns": config.columns and list(config.columns),
    }


def _files(epochs: Epochs) -> Report:
    """Per file: path, splits, rows, stored bytes; and the totals."""
    index = epochs.index
    counts = np.bincount([s.file for s in index.splits], minlength=len(index.files))
    files: list[dict[str, Any]] = [
        {
            "path": f.display,
            "splits": int(n),
            "rows": f.metadata.num_rows,
            "bytes": sum(f.metadata.unit_bytes),
        }
        for f, n in zip(index.files, counts, strict=True)
    ]
    totals = {key: sum(f[key] for f in files) for key in ("splits", "rows", "bytes")}
    return {"files": files, "totals": {"files": len(files), **totals}}


def _split_bytes(epochs: Epochs) -> np.ndarray:
    """Stored bytes of every split (its units' bytes in the file footer)."""
    files = epochs.index.files
    return np.array(
        [sum(files[s.file].metadata.unit_bytes[u] for u in s.units) for s in epochs.index.splits],
        dtype=np.int64,
    )


def _streams(epochs: Epochs, dealt: EpochPlan, batch_size: int) -> Report:
    """Rows, estimated stored bytes and batches of every (rank, worker) stream."""
    deal = dealt.deal
    sequence = deal.sequence
    rows = epochs.index.split_rows[sequence.splits]
    piece_bytes = _split_bytes(epochs)[sequence.splits] * sequence.rows / np.maximum(rows, 1)
    at_row = np.concatenate([[0], np.cumsum(sequence.rows)])
    at_byte = np.concatenate([[0.0], np.cumsum(piece_bytes)])
    stream_bytes = np.diff(np.interp(deal.bounds, at_row, at_byte))
    streams = [
        {
            "rank": g // dealt.num_workers,
            "worker": g % dealt.num_workers,
            "rows": int(n),
            "bytes": round(float(b)),
            "batches": -(-int(n) // batch_size),
        }
        for g, (n, b) in enumerate(zip(deal.shares, stream_bytes, strict=True))
    ]
    left_out = int(deal.left_out().rows.sum())
    return {"streams": streams, "rows_dealt": int(deal.shares.sum()), "left_out": left_out}


def _render(report: Report) -> list[str]:
    s, totals = report["settings"], report["totals"]
    shuffle = f"on, seed {s['shuffle_seed']}, window {s['shuffle_window_rows']:,} rows"
    files = [[f["path"], f["splits"], f["rows"], size(f["bytes"])] for f in report["files"]]
    streams = [
        [x["rank"], x["worker"], x["rows"], size(x["bytes"]), x["batches"]]
        for x in report["streams"]
    ]
    return [
        f"{totals['files']} files, {totals['splits']} splits, {totals['rows']} rows, "
        f"{size(totals['bytes'])} stored ({s['format']}, split_bytes {s['split_bytes']})",
        *table(["file", "splits", "rows", "bytes"], files, name=True),
        f"epoch {s['epoch']}: {report['rows_dealt']} rows dealt to {s['world_size']} rank(s) x "
        f"{max(1, s['num_workers'])} worker stream(s) (shuffle {shuffle if s['shuffle'] else 'off'}"
        f"; even_batches {'on' if s['even_batches'] else 'off'}; batch_size {s['batch_size']})",
        *table(["rank", "worker", "rows", "~bytes", "batches"], streams, name=False),
        f"left out by even_batches: {report['left_out']} rows",
    ]
