"""One process of an Accelerate job for tests/test_trainers.py: ``accelerate_job.py job.json``.

Run under ``accelerate launch`` as a user's script would: the rank comes from the process group
Accelerate sets up (gloo on CPU). For each case of the job (``create_dataloader`` keyword
arguments without ``rank``/``world_size``) the loader goes through ``accelerator.prepare`` with
a model and an optimizer, and each process writes ``<phase>-rank<r>.json`` into the job's
directory: the row ids of every batch it delivered.

- ``train``: ``k`` steps, then the checkpoint of docs/trainers.md (``accelerator.save_state`` +
  this process's ``loader.state_dict()``), then ``extra`` steps that the crash loses; with
  ``kill`` process 0 dies by SIGKILL after every process has written its report.
- ``resume``: a new loader, ``prepare``, ``accelerator.load_state`` + ``loader.load_state_dict``,
  the rest of the epoch.
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
from accelerate import Accelerator


def step(accelerator: Accelerator, model: Any, optimizer: Any, batch: Any) -> list[int]:
    """One training step on the batch's ids; the ids, for the report."""
    ids = batch["id"]
    loss = model(ids.to(accelerator.device, torch.float32)[:, None]).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return [int(i) for i in ids.tolist()]


def run_case(accelerator: Accelerator, job: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    out = Path(job["dir"], case["name"])
    rank = accelerator.process_index
    loader, dataset = make_loader(case["kwargs"])
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    report: dict[str, Any] = {"prepared_is_loader": prepared is loader}
    if job["phase"] == "resume":
        accelerator.load_state(str(out))
        prepared.load_state_dict(json.loads((out / f"data-rank{rank}.json").read_text()))
        report["len"] = len(prepared)
        report["batches"] = [step(accelerator, model, optimizer, b) for b in prepared]
        return report
    it = iter(prepared)
    report["first"] = [step(accelerator, model, optimizer, next(it)) for _ in range(case["k"])]
    accelerator.save_state(str(out))  # creates the directory on every process
    (out / f"data-rank{rank}.json").write_text(json.dumps(prepared.state_dict()))
    report["lost"] = [step(accelerator, model, optimizer, next(it)) for _ in range(case["extra"])]
    report["state_rank"] = dataset.state_dict()["_rank"]
    del it
    return report


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    reports = {case["name"]: run_case(accelerator, job, case) for case in job["cases"]}
    reports["world"] = [rank, accelerator.num_processes]
    Path(job["dir"], f"{job['phase']}-rank{rank}.json").write_text(json.dumps(reports))
    accelerator.wait_for_everyone()
    if job.get("kill"):  # a crash: no teardown; the launcher reports the failure
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the launcher terminates the surviving processes
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
