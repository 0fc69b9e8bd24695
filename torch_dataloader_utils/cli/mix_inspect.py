"""``inspect CHECKPOINT`` of a mixture's state: the mixture, and where each source stands.

From the state alone: the mixture's epoch, weights, ``epoch_size``, schedule and job settings;
per rank the positions of the epoch each worker stream has handed out (and where the mixture
changed, after a reweight or an elastic resume); per source its weight, settings and files,
and for every worker stream the source epoch it is in, the rows of its share of that epoch it
has handed out and the split it reads next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .files import Found, stream_entry
from .output import Report, percent, share_progress

__all__ = ["mixture_report", "render_mixture"]

# Files a text report names one by one before it names the first and last.
_NAMED_FILES = 4


def mixture_report(checkpoint: str, found: Found) -> Report:
    """The report of a mixture's states (checked by ``load_states``)."""
    first = found.states[0]
    mixture = first["_mixture"]
    subs = first["sources"]
    packing = next(iter(subs.values()))["_packing"]
    return {
        "checkpoint": checkpoint,
        "key": found.key,
        "mixture": True,
        "epoch": first["epoch"],
        "settings": {
            "weights": mixture["weights"],
            "epoch_size": mixture["epoch_size"],
            "schedule_block": mixture.get("schedule_block", 0),
            "shuffle_seed": mixture.get("schedule_seed", 0),
            "policies": mixture.get("policies", {}),
            "shuffle": next(iter(subs.values()))["_shuffle"],
            "even_batches": first["_even_batches"],
            "world_size": first["_world_size"],
            "num_workers": first["_num_workers"],
        }
        | ({} if packing is None else {"packing": packing}),
        "ranks": [_rank(state) for state in found.states],
        "sources": [_source(name, found.states) for name in subs],
    }


def _rank(state: Mapping[str, Any]) -> Report:
    epoch, positions, counts, lengths = state["_mixture"]["segment"]
    changed = None
    if positions or lengths:
        changed = {"epoch": epoch, "positions": positions, "rows": counts, "lengths": lengths}
    return {
        "rank": state["_rank"],
        "cursor": state["cursor"],
        "positions": state["streams"],
        "changed": changed,
    }


def _source(name: str, states: Sequence[Mapping[str, Any]]) -> Report:
    """Source ``name``: its weight, settings and files, and each worker stream's place in it."""
    sub = states[0]["sources"][name]
    files = sub["files"]
    return {
        "name": name,
        "weight": states[0]["_mixture"]["weights"][name],
        "format": sub["_format"],
        "split_bytes": sub["_split_bytes"],
        "shuffle_memory_bytes": sub["_shuffle_memory_bytes"],
        "files": {
            "count": files.get("count"),
            "root": files.get("root"),
            "groups": [
                {"first": g[0], "last": g[1], "count": g[2]}
                for g in files.get("groups", [])
                if isinstance(g, list) and len(g) == 4
            ],
        },
        "num_splits": sub["num_splits"],
        "streams": [
            {"rank": state["_rank"], "source_epoch": state["sources"][name]["epochs"][worker]}
            | stream_entry(worker, entry)
            for state in states
            for worker, entry in enumerate(state["sources"][name]["streams"])
            if entry is not None
        ],
    }


def render_mixture(report: Report) -> list[str]:
    key = f", key {report['key']!r}" if report["key"] else ""
    s = report["settings"]
    ranks, sources = report["ranks"], report["sources"]
    lines = [
        f"checkpoint {report['checkpoint']}{key}: mixture of {len(sources)} sources, "
        f"{len(ranks)} rank state(s), epoch {report['epoch']}",
        "settings: " + " ".join(f"{k}={v}" for k, v in s.items()),
    ]
    for rank in ranks:
        lines.extend(_render_rank(rank))
    for source in sources:
        lines.extend(_render_source(source))
    handed = sum(p for rank in ranks for p in rank["positions"] if p is not None)
    lines.append(
        f"all ranks given: {handed} positions of the epoch's {s['epoch_size']} handed out "
        f"({percent(handed, s['epoch_size'])})"
    )
    return lines


def _render_rank(rank: Report) -> list[str]:
    positions = ", ".join("-" if p is None else str(p) for p in rank["positions"])
    lines = [
        f"rank {rank['rank']}: positions [{positions}] of the epoch handed out per worker "
        f"stream, cursor {rank['cursor']}"
    ]
    changed = rank["changed"]
    if changed and changed["positions"]:
        lines.append(
            f"  the mixture changed (reweight) at epoch {changed['epoch']} positions "
            f"{changed['positions']}"
        )
    if changed and changed["lengths"] and changed["positions"]:  # a reweight kept its end
        lines.append(
            f"  epoch {changed['epoch']} runs to {changed['lengths']} positions per worker "
            f"stream after the change"
        )
    elif changed and changed["lengths"]:
        lines.append(
            f"  epoch {changed['epoch']} dealt anew by an elastic resume: "
            f"{changed['lengths']} positions per worker stream"
        )
    return lines


def _render_source(source: Report) -> list[str]:
    files = source["files"]
    groups = files["groups"]
    names = [g["first"] if g["count"] == 1 else f"{g['first']} .. {g['last']}" for g in groups]
    if len(names) > _NAMED_FILES:
        names = [groups[0]["first"], "..", groups[-1]["last"]]
    lines = [
        f"source {source['name']}: weight {source['weight']}, {files['count']} file(s) in "
        f"{files['root'] or '(no common directory)'} ({' '.join(names)}), "
        f"{source['num_splits']} splits; format={source['format']} "
        f"split_bytes={source['split_bytes']} "
        f"shuffle_memory_bytes={source['shuffle_memory_bytes']}"
    ]
    for s in source["streams"]:
        lines.append(
            f"  rank {s['rank']} worker {s['worker']}: source epoch {s['source_epoch']}, "
            f"{share_progress(s)}"
        )
    return lines
