"""One process of a Lightning Fabric job for tests/test_trainers.py: ``fabric_job.py job.json``.

Run under ``torchrun`` (Fabric's DDP strategy on CPU, gloo). Each process writes
``<phase>-rank<r>.json`` into the job's directory: the row ids of every batch it delivered.

- ``train``: ``k`` steps; ``fabric.save`` of model, optimizer and the loader (Fabric writes the
  file on process 0 only, so it holds process 0's data state) and one data-state file per
  process (docs/trainers.md); ``extra`` steps that the crash loses; SIGKILL of process 0.
- ``resume``: ``per_rank``: ``fabric.load`` of model and optimizer, the loader from this
  process's file; ``fabric_only``: the loader from ``fabric.load`` too, which must fail loudly
  on every process but 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _harness import make_loader
from lightning_fabric import Fabric

from torch_dataloader_utils import CheckpointMismatchError


def setup(fabric: Fabric, case: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """``(loader, Fabric's wrapper, the objects of the checkpoint)``."""
    loader, _ = make_loader(case)
    model = torch.nn.Linear(1, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-9))
    return loader, fabric.setup_dataloaders(loader), {"model": model, "optimizer": optimizer}


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"].tolist()]


def train(fabric: Fabric, job: dict[str, Any], out: Path) -> dict[str, Any]:
    loader, wrapped, state = setup(fabric, job["case"])
    it = iter(wrapped)
    first = [ids(next(it)) for _ in range(job["k"])]
    fabric.save(out / "checkpoint.pt", {**state, "data": loader})
    (out / f"data-rank{fabric.global_rank}.json").write_text(json.dumps(loader.state_dict()))
    lost = [ids(next(it)) for _ in range(job["extra"])]
    del it
    return {"kept": wrapped._dataloader is loader, "first": first, "lost": lost}


def resume(fabric: Fabric, job: dict[str, Any], out: Path) -> dict[str, Any]:
    loader, wrapped, state = setup(fabric, job["case"])
    fabric.load(out / "checkpoint.pt", state)  # model and optimizer; "data" is left over
    loader.load_state_dict(json.loads((out / f"data-rank{fabric.global_rank}.json").read_text()))
    report: dict[str, Any] = {"per_rank": [ids(b) for b in wrapped]}
    loader, wrapped, state = setup(fabric, job["case"])
    try:
        fabric.load(out / "checkpoint.pt", {**state, "data": loader})
    except CheckpointMismatchError as exc:
        report["fabric_only"] = {"error": type(exc).__name__, "field": exc.field}
        fabric.barrier()  # the one fabric.load ends with, which the error skipped
    else:
        report["fabric_only"] = {"batches": [ids(b) for b in wrapped]}
    return report


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp")
    fabric.launch()
    out = Path(job["dir"])
    report = (train if job["phase"] == "train" else resume)(fabric, job, out)
    report["world"] = [fabric.global_rank, fabric.world_size]
    Path(out, f"{job['phase']}-rank{fabric.global_rank}.json").write_text(json.dumps(report))
    if job.get("kill"):  # a crash, once every process has written its report
        fabric.barrier()
        if fabric.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # torchrun terminates the surviving processes
    torch.distributed.destroy_process_group()  # else gloo may abort the exit (pytorch#190489)


if __name__ == "__main__":
    main(sys.argv[1])
