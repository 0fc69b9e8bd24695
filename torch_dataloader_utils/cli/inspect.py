"""``inspect CHECKPOINT``: epoch, settings and progress per rank/worker of a saved state.

A mixture's state is reported by ``mix_inspect``.

Without the files it reports what the state itself says: epoch, settings, for each worker
stream the rows of its share handed out and the split it is in, and the deals of the epoch
before an elastic resume. With ``--data PATH`` it also plans the epoch over the files now, with
the checkpoint's own settings, and checks that every position still fits.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from ..base.errors import CheckpointMismatchError
from ..planning.epochs import Epochs
from .files import BadInput, stream_entry
from .mix_inspect import mixture_report, render_mixture
from .output import EXIT_MISMATCH, EXIT_OK, Report, emit, percent, share_progress
from .resume import SETTINGS, epochs_for, is_mixture, load_states, resume

__all__ = ["add_inspect", "inspect"]


def add_inspect(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="JSON or torch.save file")
    parser.add_argument("--key", help="dotted key of the state(s) in the checkpoint, e.g. a.b")
    parser.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        help="the files: report rows per worker stream and percent of its share",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=inspect)


def inspect(args: argparse.Namespace) -> int:
    """epoch, settings and progress per rank/worker (and per source) of a saved state"""
    found = load_states(args)
    states, first = found.states, found.states[0]
    if is_mixture(first):
        if args.data:
            raise BadInput(
                "--data checks one dataset's checkpoint; check a mixture's against its files "
                "with: verify CHECKPOINT [--source NAME=PATH ...]"
            )
        emit(mixture_report(args.checkpoint, found), args.json, render_mixture)
        return EXIT_OK
    report: Report = {
        "checkpoint": args.checkpoint,
        "key": found.key,
        "epoch": first["epoch"],
        "settings": {key[1:]: first[key] for key in SETTINGS} | _packing(first),
        "files": first["files"].get("count"),
        "num_splits": first["num_splits"],
        "ranks": [_rank(state) for state in states],
    }
    code = EXIT_OK
    if args.data:
        try:
            _checked(report, states, epochs_for(first, args, args.data))
        except CheckpointMismatchError as exc:
            report["mismatch"] = str(exc)
            code = EXIT_MISMATCH
    emit(report, args.json, _render)
    return code


def _packing(state: Mapping[str, Any]) -> Report:
    """A packed state's packing setting ([column, separator]) and, packed whole, its
    ``whole_documents`` choices; nothing when not packed."""
    whole = state.get("_whole_documents")
    return ({} if state["_packing"] is None else {"packing": state["_packing"]}) | (
        {} if whole is None else {"whole_documents": whole}
    )


def _rank(state: Mapping[str, Any]) -> Report:
    return {
        "rank": state["_rank"],
        "streams": [
            stream_entry(w, entry) for w, entry in enumerate(state["streams"]) if entry is not None
        ],
        "generations": [
            {"world_size": g[0], "num_workers": g[1], "even_batches": g[2]}
            for g in state["generations"]
            if isinstance(g, list) and len(g) == 5
        ],
        "cursor": state["cursor"],
    }


def _checked(report: Report, states: Sequence[Mapping[str, Any]], epochs: Epochs) -> None:
    """Every stream's position against the plan of the files now (raises on a mismatch)."""
    for rank, state in zip(report["ranks"], states, strict=True):
        rank["left_out"] = resume(epochs, state, None).left_out()


def _render(report: Report) -> list[str]:
    key = f", key {report['key']!r}" if report["key"] else ""
    ranks = report["ranks"]
    lines = [
        f"checkpoint {report['checkpoint']}{key}: {len(ranks)} rank state(s), "
        f"epoch {report['epoch']}",
        "settings: " + " ".join(f"{k}={v}" for k, v in report["settings"].items()),
        f"files: {report['files']}, splits: {report['num_splits']}",
    ]
    for rank in ranks:
        lines.extend(_render_rank(rank))
    streams = [s for rank in ranks for s in rank["streams"]]
    rows, share = sum(s["rows"] for s in streams), sum(s["share"] for s in streams)
    lines.append(f"all ranks: {rows} of {share} rows of their shares ({percent(rows, share)})")
    if "mismatch" in report:
        lines.append(f"MISMATCH with the files now: {report['mismatch']}")
    return lines


def _render_rank(rank: Report) -> list[str]:
    lines = [f"rank {rank['rank']}: {len(rank['streams'])} stream(s), cursor {rank['cursor']}"]
    for g in rank["generations"]:
        lines.append(
            f"  after a deal to world_size {g['world_size']} x num_workers {g['num_workers']} "
            f"(elastic resume)"
        )
    for s in rank["streams"]:
        lines.append(f"  worker {s['worker']}: {share_progress(s)}")
    if rank.get("left_out"):
        lines.append(f"  left out by even_batches (epoch): {rank['left_out']} rows")
    return lines
