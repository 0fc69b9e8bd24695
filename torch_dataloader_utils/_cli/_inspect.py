"""``inspect CHECKPOINT``: epoch, settings and progress per rank/worker of a saved state.

Without the files it reports what the state itself says: epoch, settings, splits done (bits of
the ``done`` bitmap), splits in progress with their delivered rows, an elastic ``base``. With
``--data PATH`` it plans the epoch over the files now, with the checkpoint's own settings, and
reports the rows of each worker stream's share delivered.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._epoch import Epochs
from .._errors import CheckpointMismatchError
from .._state import _unpack_bits
from ._files import BadInput
from ._output import EXIT_MISMATCH, EXIT_OK, Report, emit, percent
from ._resume import SETTINGS, epochs_for, load_states, resume

__all__ = ["add_inspect", "inspect"]

# Splits in progress listed per rank in text (a shuffled stream has a window of them).
_PARTIAL_LINES = 8


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
    """epoch, settings and progress per rank/worker of a saved state"""
    found = load_states(args)
    states, first = found.states, found.states[0]
    report: Report = {
        "checkpoint": args.checkpoint,
        "key": found.key,
        "epoch": first["epoch"],
        "settings": {key[1:]: first[key] for key in SETTINGS} | _packing(first),
        "files": first["files"].get("count"),
        "num_splits": first["num_splits"],
        "ranks": [_rank(state) for state in states],
        "splits_done": int(
            np.logical_or.reduce([_done(s["done"], s, "done") for s in states]).sum()
        ),
    }
    code = EXIT_OK
    if args.data:
        try:
            _add_streams(report, states, epochs_for(first, args, args.data))
        except CheckpointMismatchError as exc:
            report["mismatch"] = str(exc)
            code = EXIT_MISMATCH
    emit(report, args.json, _render)
    return code


def _packing(state: Mapping[str, Any]) -> Report:
    """A packed state's packing setting ([column, separator]); nothing when not packed."""
    return {} if state["_packing"] is None else {"packing": state["_packing"]}


def _done(bits: str, state: Mapping[str, Any], key: str) -> np.ndarray:
    return _unpack_bits(bits, state["num_splits"], key)


def _rank(state: Mapping[str, Any]) -> Report:
    base = state["base"]
    return {
        "rank": state["_rank"],
        "splits_done": int(_done(state["done"], state, "done").sum()),
        "partial": _partials(state["partial"], "partial"),
        "base": None
        if base is None
        else {
            "splits_done": int(_done(base["done"], state, "base.done").sum()),
            "partial": _partials(base["partial"], "base.partial"),
        },
        "cursor": state["cursor"],
    }


def _partials(entries: Sequence[Any], key: str) -> list[Report]:
    """Each split in progress: ``path rows [a, b)``, its rows and the rows of it delivered."""
    out = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[4], list)):
            raise BadInput(
                f"state key {key!r}: entry {str(entry)[:80]} is not "
                f"[path, row_offset, row_length, fingerprint, [lo, hi, ...]]"
            )
        path, offset, length, _, bounds = entry
        delivered = sum(hi - lo for lo, hi in zip(bounds[::2], bounds[1::2], strict=False))
        split = f"{path} rows [{offset}, {offset + length})"
        out.append({"split": split, "rows": length, "delivered": delivered})
    return out


def _add_streams(report: Report, states: Sequence[Mapping[str, Any]], epochs: Epochs) -> None:
    """Rows of each worker stream's share delivered, from the plan of the files now."""
    for rank, state in zip(report["ranks"], states, strict=True):
        progress = resume(epochs, state, None)
        shares = progress.plan.rank_shares(state["_rank"])
        rank["streams"] = [
            {"worker": w, "rows": progress.positions[w], "share": int(shares[w])}
            for w in sorted(progress.positions)
        ]
        rank["left_out"] = progress.left_out()


def _render(report: Report) -> list[str]:
    key = f", key {report['key']!r}" if report["key"] else ""
    ranks, splits, done = report["ranks"], report["num_splits"], report["splits_done"]
    lines = [
        f"checkpoint {report['checkpoint']}{key}: {len(ranks)} rank state(s), "
        f"epoch {report['epoch']}",
        "settings: " + " ".join(f"{k}={v}" for k, v in report["settings"].items()),
        f"files: {report['files']}, splits: {splits}",
    ]
    for rank in ranks:
        lines.extend(_render_rank(rank, splits))
    lines.append(
        f"all ranks: {done} of {splits} splits done ({percent(done, splits)})" + _rows(ranks)
    )
    if "mismatch" in report:
        lines.append(f"MISMATCH with the files now: {report['mismatch']}")
    return lines


def _render_rank(rank: Report, splits: int) -> list[str]:
    done = rank["splits_done"]
    lines = [
        f"rank {rank['rank']}: {done} of {splits} splits done ({percent(done, splits)}), "
        f"{len(rank['partial'])} partial, cursor {rank['cursor']}"
    ]
    partial = [
        f"  partial {p['split']}: {p['delivered']} of {p['rows']} rows delivered"
        for p in rank["partial"]
    ]
    lines += partial[:_PARTIAL_LINES]
    if len(partial) > _PARTIAL_LINES:
        lines.append(f"  ... {len(partial) - _PARTIAL_LINES} more partial (--json lists all)")
    if rank["base"] is not None:
        base = rank["base"]
        lines.append(
            f"  base (elastic resume): {base['splits_done']} splits done, "
            f"{len(base['partial'])} partial"
        )
    for s in rank.get("streams", []):
        rows, share = s["rows"], s["share"]
        lines.append(f"  worker {s['worker']}: {rows} of {share} rows ({percent(rows, share)})")
    if rank.get("left_out"):
        lines.append(f"  left out by even_batches (epoch): {rank['left_out']} rows")
    return lines


def _rows(ranks: Sequence[Report]) -> str:
    streams = [s for rank in ranks for s in rank.get("streams", [])]
    if not streams:
        return ""
    rows, share = sum(s["rows"] for s in streams), sum(s["share"] for s in streams)
    return f"; {rows} of {share} rows of their shares ({percent(rows, share)})"
