"""One rank of a torchrun job for tests/test_ddp_malformed.py: ``malformed_job.py job.json``.

Each rank builds the job's datasets (``datasets``: a name -> ``create_dataloader`` keyword
arguments without ``rank``/``world_size``), takes the state after one batch on every rank
(``dist.all_gather_object``), and then, for each malformed list of ``CASES``, restores it every
way: ``restore_state_global`` from rank 0 (scattered), from rank 0 elastically (broadcast), and
``load_state_dict(states, elastic=True)`` with every rank holding the list. It writes
``malformed-rank<r>.json``: per dataset, case and way, the error raised (type and message) or
``"loaded"``, and the seconds it took. The process group's timeout is short (``timeout``
seconds): a rank left waiting in a collective fails with a ``RuntimeError`` quickly.
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _harness import make_loader

States = list[Any]


def _without(key: str, rank: int) -> Callable[[States], States]:
    def edit(states: States) -> States:
        del states[rank][key]
        return states

    return edit


def _set(key: str, value: object, rank: int) -> Callable[[States], States]:
    def edit(states: States) -> States:
        states[rank][key] = value
        return states

    return edit


def _files_digest(states: States) -> States:
    """Rank 1's state names other files: only rank 1's own load can tell."""
    state = states[1]
    files = state["sources"]["a"]["files"] if "sources" in state else state["files"]
    files["digest"] = "0" * len(files["digest"])
    return states


# name -> the malformed list made of the valid one (a deep copy, ranks 0 and 1)
CASES: dict[str, Callable[[States], States]] = {
    "no_epoch": _without("epoch", 1),
    "epoch_str": _set("epoch", "0", 1),
    "no_rank": _without("_rank", 0),
    "rank_str": _set("_rank", "1", 1),
    "streams_str": _set("streams", "x", 1),
    "cursor_7": _set("cursor", 7, 1),
    "duplicate": lambda s: [s[0], s[0]],
    "short": lambda s: s[:1],
    "long": lambda s: [*s, s[1]],
    "not_dict": lambda s: [s[0], [1, 2]],
    "none_entry": lambda s: [s[0], None],
    "files_of_rank_1": _files_digest,
}

WAYS: dict[str, Callable[[Any, States, int], None]] = {
    "scatter": lambda ds, s, rank: ds.restore_state_global(s if rank == 0 else None, src_rank=0),
    "broadcast": lambda ds, s, rank: ds.restore_state_global(
        s if rank == 0 else None, src_rank=0, elastic=True
    ),
    "held_elastic": lambda ds, s, rank: ds.load_state_dict(s, elastic=True),
}


def outcome(case: dict[str, Any], states: States, way: str, rank: int) -> dict[str, Any]:
    _, dataset = make_loader(case)
    fresh = dataset.state_dict()
    began = time.monotonic()
    try:
        WAYS[way](dataset, states, rank)
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - began,
            "unchanged": dataset.state_dict() == fresh,  # a refused load leaves no trace
        }
    return {"error": None, "seconds": time.monotonic() - began}


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    rank = dist.get_rank()
    result: dict[str, Any] = {}
    for name, case in job["datasets"].items():
        loader, dataset = make_loader(case)
        next(iter(loader))
        valid: States = [None] * dist.get_world_size()
        dist.all_gather_object(valid, dataset.state_dict())
        result[name] = {}
        for label, edit in CASES.items():
            result[name][label] = {}
            for way in WAYS:
                dist.barrier()  # each restore begins together
                result[name][label][way] = outcome(case, edit(copy.deepcopy(valid)), way, rank)
        dist.barrier()
        result[name]["valid"] = {"scatter": outcome(case, valid, "scatter", rank)}
    Path(job["dir"], f"malformed-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
