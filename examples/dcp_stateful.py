"""The torchtitan / ``torch.distributed.checkpoint`` pattern: the dataloader's per-rank state in
a ``Stateful``, saved and loaded with the model by ``dcp.save`` / ``dcp.load``.

    torchrun --nproc_per_node=2 examples/dcp_stateful.py [--workdir DIR]

torchtitan's dataloader (``ParallelAwareDataloader``, a torchdata ``StatefulDataLoader``) is
itself ``Stateful`` and keys its state by data-parallel rank, because DCP saves a key that
every rank holds only once (it deduplicates replicated entries), and each rank must get its
own state back::

    # torchtitan (components/dataloader.py), in outline
    def state_dict(self):
        return {f"dp_rank_{dp_rank}": pickle.dumps(super().state_dict()),
                "world_size": dp_world_size}
    def load_state_dict(self, state_dict):
        super().load_state_dict(pickle.loads(state_dict[f"dp_rank_{dp_rank}"]))

    # its CheckpointManager
    dcp.save({"model": ..., "optimizer": ..., "dataloader": dataloader, ...}, checkpoint_id=d)
    dcp.load(states, checkpoint_id=d)      # calls each Stateful's load_state_dict

Ours: a small ``Stateful`` around the loader of ``create_dataloader`` (``LoaderState`` below).
Its entry is one JSON string per rank: the state is plain builtin types, JSON needs no pickle
on load, and DCP matches the keys of the state dict it is given on load against the saved ones,
so one leaf per rank keeps that match independent of what the state holds.

With the same world size every rank finds its own key. To resume on another number of ranks,
read every old rank's entry (the keys ``dataloader.rank_*`` of
``dcp.FileSystemReader(d).read_metadata().state_dict_metadata``) into a template and pass the
list to ``loader.load_state_dict(states, elastic=True)`` (``docs/ddp.md``).

What it does, on each of the 2 ranks: an uninterrupted epoch for reference; 20 steps, ``dcp.save``
of model, optimizer and loader, 5 more steps, "crash"; a new job restored by ``dcp.load`` must
continue exactly (batches and final weights), and the ranks together deliver every row once.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _support import (
    COLUMNS,
    TOTAL_ROWS,
    check_each_row_once,
    ids,
    make_model,
    run_distributed,
    same_weights,
    train_step,
    workdir,
    write_sample,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

from torch_dataloader_utils import StructuredDataLoader, StructuredDataset

BATCH = 16
CHECKPOINT_AT = 20  # steps
LOST = 5  # steps after the checkpoint, lost in the crash

Batches = list[list[int]]


class LoaderState(Stateful):
    """The loader's state for DCP, keyed by rank (torchtitan's ``dp_rank_{rank}`` keys)."""

    def __init__(self, loader: StructuredDataLoader, rank: int, world_size: int) -> None:
        self.loader, self.key, self.world_size = loader, f"rank_{rank}", world_size

    def state_dict(self) -> dict[str, Any]:
        return {self.key: json.dumps(self.loader.state_dict()), "world_size": self.world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["world_size"] != self.world_size:
            raise ValueError(
                f"the checkpoint holds the dataloader states of {state_dict['world_size']} ranks, "
                f"this job has {self.world_size}: load every old rank's entry and pass the list "
                f"to loader.load_state_dict(states, elastic=True)"
            )
        self.loader.load_state_dict(json.loads(state_dict[self.key]))


class Job:
    """A new process's training job: DDP model, optimizer, loader."""

    def __init__(self, data: Path) -> None:
        self.model = DistributedDataParallel(make_model())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.loader, _ = StructuredDataset.create_dataloader(
            str(data), batch_size=BATCH, columns=COLUMNS, shuffle=True, shuffle_seed=0,
            num_workers=0,
        )  # fmt: skip
        self.step = 0
        self.batches: Batches = []

    def states(self) -> dict[str, Any]:
        """What DCP saves and loads in place (tensors), or through ``Stateful`` (the loader)."""
        return {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "dataloader": LoaderState(self.loader, dist.get_rank(), dist.get_world_size()),
            "step": self.step,
        }

    def train(self, *, ckpt: Path | None = None, crash_at: int | None = None) -> None:
        for batch in self.loader:
            train_step(self.model, self.optimizer, batch)
            self.step += 1
            self.batches.append(ids(batch))
            if ckpt is not None and self.step == CHECKPOINT_AT:
                dcp.save(self.states(), checkpoint_id=ckpt)  # a collective
            if self.step == crash_at:
                return

    def resume(self, ckpt: Path) -> None:
        states = self.states()
        dcp.load(states, checkpoint_id=ckpt)  # tensors in place; LoaderState.load_state_dict
        self.model.module.load_state_dict(states["model"])
        self.optimizer.load_state_dict(states["optimizer"])
        self.step = states["step"]


def run(given_workdir: Path | None, rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    work = workdir(given_workdir, "dcp_stateful")
    data, ckpt = work / "data", work / "checkpoint"
    if rank == 0:
        write_sample(data)
        shutil.rmtree(ckpt, ignore_errors=True)  # from an earlier run
    dist.barrier()

    full = Job(data)
    full.train()
    crashed = Job(data)
    crashed.train(ckpt=ckpt, crash_at=CHECKPOINT_AT + LOST)
    resumed = Job(data)
    resumed.resume(ckpt)
    assert resumed.step == CHECKPOINT_AT, f"rank {rank}: resumed at step {resumed.step}"
    resumed.train()
    continued = crashed.batches[:CHECKPOINT_AT] + resumed.batches
    assert continued == full.batches, f"rank {rank}: the resumed batches differ"
    assert same_weights(resumed.model, full.model), f"rank {rank}: the final weights differ"

    everything: list[Any] = [None] * world_size
    dist.all_gather_object(everything, continued)
    if rank == 0:
        rows = check_each_row_once(
            (b for batches in everything for b in batches), TOTAL_ROWS,
            left_out=TOTAL_ROWS % world_size,
        )  # fmt: skip
        files = sorted(p.name for p in ckpt.iterdir())
        print(
            f"dcp_stateful: {world_size} ranks x {len(full.batches)} steps; dcp.save at step "
            f"{CHECKPOINT_AT} ({', '.join(files)}), {LOST} steps lost; dcp.load: batches and "
            f"final weights identical to the uninterrupted run, {rows} of {TOTAL_ROWS} rows "
            f"each once"
        )


if __name__ == "__main__":
    sys.exit(run_distributed(run, __doc__))
