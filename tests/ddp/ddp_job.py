"""One rank of a torchrun job for tests/test_ddp.py (gloo, 127.0.0.1): ``ddp_job.py job.json``.

The job file names a *phase*, the dataset case (``create_dataloader`` keyword arguments without
``rank``/``world_size``: those come from the process group, as in a user's job) and a directory.
Each rank writes ``<phase>-rank<r>.json`` there: the row ids of every batch it delivered, per
way of restoring, or the error a restore raised.

- ``train``: ``k`` batches, then save three ways -- ``plain.pt`` (``dist.all_gather_object`` of
  ``state_dict()``, written by rank 0), ``global.pt`` (``save_state_global``), ``rank<r>.pt``
  (each rank its own) -- then ``extra`` more batches that the crash loses; with ``kill`` rank 0
  dies by SIGKILL.
- ``resume``: same world size; continue from each file and each restore entry point (the
  dataset's, and Megatron-Energon's names on the loader); and the
  misuses that must raise ``CheckpointMismatchError`` on every rank (no rank left hanging).
- ``elastic``: another world size / ``num_workers``; continue from ``states`` with
  ``elastic=True`` (``restore_state_global`` and ``load_state_dict``); changed seed must raise.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _harness import make_loader

from torch_dataloader_utils import CheckpointMismatchError, StructuredDataset

Case = Mapping[str, Any]
Batches = list[list[int]]


def batch_ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"].tolist()]


def run_rest(case: Case, restore: Callable[[Any, StructuredDataset], None]) -> dict[str, Any]:
    """A fresh loader restored by ``restore(loader, dataset)``, then the rest of the epoch."""
    loader, dataset = make_loader(case)
    try:
        restore(loader, dataset)
    except CheckpointMismatchError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "field": exc.field}
    expected = len(dataset)  # what this rank yields in the rest of the epoch
    return {"batches": [batch_ids(b) for b in loader], "len": expected}


def load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


# ----------------------------------------------------------------------------- phases


def train(job: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    out = Path(job["dir"])
    loader, dataset = make_loader(job["case"])
    it = iter(loader)
    first = [batch_ids(next(it)) for _ in range(job["k"])]

    plain: list[Any] = [None] * world_size
    dist.all_gather_object(plain, dataset.state_dict())  # the pattern from docs/ddp.md
    helper = dataset.save_state_global(dst_rank=0)
    energon = loader.save_state_global(dst_rank=0)  # Megatron-Energon's name, on the loader
    torch.save(dataset.state_dict(), out / f"rank{rank}.pt")
    if rank == 0:
        torch.save(plain, out / "plain.pt")
        assert helper is not None
        torch.save(helper, out / "global.pt")
    # Work after the checkpoint that the crash loses: the resumed job delivers it again.
    lost = [batch_ids(b) for _, b in zip(range(job.get("extra", 0)), it, strict=False)]
    del it
    return {
        "first": first,
        "lost": lost,
        "helper_is_none": helper is None,
        "helper_equals_plain": helper == plain if rank == 0 else None,
        "energon_equals_plain": energon == plain if rank == 0 else energon is None,
        "state_rank": dataset.state_dict()["_rank"],
        "state_world_size": dataset.state_dict()["_world_size"],
        "len": len(dataset),
    }


def resume(job: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    out, case = Path(job["dir"]), job["case"]
    states = load(out / "plain.pt")
    held = load(out / "global.pt") if rank == 0 else None
    on_one = load(out / "global.pt") if rank == 1 else None
    wrong = states[(rank + 1) % world_size]
    return {
        "plain": run_rest(case, lambda _, ds: ds.load_state_dict(states[rank])),
        "per_rank": run_rest(case, lambda ld, _: ld.load_state_dict(load(out / f"rank{rank}.pt"))),
        "global": run_rest(case, lambda _, ds: ds.restore_state_global(held, src_rank=0)),
        "global_src1": run_rest(case, lambda _, ds: ds.restore_state_global(on_one, src_rank=1)),
        "global_all": run_rest(case, lambda _, ds: ds.restore_state_global(states, src_rank=None)),
        # Megatron-Energon's names, on the loader
        "energon_rank": run_rest(case, lambda ld, _: ld.restore_state_rank(states[rank])),
        "energon_global": run_rest(case, lambda ld, _: ld.restore_state_global(held, src_rank=0)),
        # misuses: every rank must raise, none may wait in a collective the others left
        "wrong_rank": run_rest(case, lambda _, ds: ds.load_state_dict(wrong)),
        "reversed": run_rest(
            case,
            lambda _, ds: ds.restore_state_global(states[::-1] if rank == 0 else None, src_rank=0),
        ),
        "duplicated": run_rest(
            case,
            lambda _, ds: ds.restore_state_global(
                [states[0]] * world_size if rank == 0 else None, src_rank=0
            ),
        ),
    }


def elastic(job: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    case = job["case"]
    states = load(Path(job["states"]))
    held = states if rank == 0 else None
    reseeded = {**case, "shuffle_seed": case["shuffle_seed"] + 1}

    def reseeded_restore(_: Any, ds: StructuredDataset) -> None:
        ds.restore_state_global(held, src_rank=0, elastic=True)

    return {
        "global": run_rest(case, lambda _, ds: ds.restore_state_global(held, elastic=True)),
        "plain": run_rest(case, lambda _, ds: ds.load_state_dict(states, elastic=True)),
        "reseeded": run_rest(reseeded, reseeded_restore),
    }


PHASES = {"train": train, "resume": resume, "elastic": elastic}


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    result = PHASES[job["phase"]](job, rank, world_size)
    result["world"] = [rank, world_size]
    Path(job["dir"], f"{job['phase']}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    if job.get("kill"):  # a crash: no teardown, no flush; torchrun reports the failure
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # torchrun terminates the surviving ranks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
