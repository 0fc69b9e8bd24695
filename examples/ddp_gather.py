"""A plain DDP training loop: gather every rank's data state onto rank 0, save one file beside
the model, resume; and when the data changed, catch ``CheckpointMismatchError`` and restart
the epoch.

    torchrun --nproc_per_node=2 examples/ddp_gather.py [--workdir DIR]

The pattern (``docs/ddp.md``, "Saving and restoring: three ways")::

    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, dataset.state_dict())    # or dataset.save_state_global(0)
    if dist.get_rank() == 0:
        torch.save({"model": ..., "optimizer": ..., "data": states, "epoch": epoch}, path)

    ckpt = torch.load(path, weights_only=True)              # every rank reads the one file
    ok = torch.ones(1)
    try:
        dataset.load_state_dict(ckpt["data"][dist.get_rank()])
    except CheckpointMismatchError as exc:                  # files/seed/settings changed
        print(exc)                                          # ends with "Likely cause: ..."
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)               # every rank takes the same branch
    if not ok.item():
        dataset.set_epoch(ckpt["epoch"])                    # the whole epoch again

What it does, on each of the 2 ranks, with a ``DistributedDataParallel`` linear model and the
DDP default ``even_batches`` (every rank yields as many batches, so no rank waits forever in
the gradient all-reduce):

1. an uninterrupted epoch, for reference;
2. 20 steps, gather and save (and check that ``save_state_global`` gathers the same list),
   5 more steps, "crash";
3. resume from the file: the rest of the epoch and the final weights must equal the
   uninterrupted run's, and the ranks together must deliver every row once;
4. a fifth file lands in the data directory; resuming from the same file raises
   ``CheckpointMismatchError`` on every rank ("Likely cause: files changed"), so every rank
   restarts the epoch, which delivers every row of the new data once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _support import (
    COLUMNS,
    FILES,
    ROWS_PER_FILE,
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
from torch.nn.parallel import DistributedDataParallel

from torch_dataloader_utils import CheckpointMismatchError, StructuredDataset

BATCH = 16
CHECKPOINT_AT = 20  # steps
LOST = 5  # steps after the checkpoint, lost in the crash

Batches = list[list[int]]


class Job:
    """A new process's training job: DDP model, optimizer, loader."""

    def __init__(self, data: Path) -> None:
        self.model = DistributedDataParallel(make_model())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.loader, self.dataset = StructuredDataset.create_dataloader(
            str(data), batch_size=BATCH, columns=COLUMNS, shuffle=True, shuffle_seed=0,
            num_workers=0,
        )  # fmt: skip
        self.step = 0
        self.batches: Batches = []

    def train(self, *, ckpt: Path | None = None, crash_at: int | None = None) -> None:
        """Train to the end of the epoch (or ``crash_at``), saving at ``CHECKPOINT_AT``."""
        for batch in self.loader:
            train_step(self.model, self.optimizer, batch)
            self.step += 1
            self.batches.append(ids(batch))
            if ckpt is not None and self.step == CHECKPOINT_AT:
                self.save(ckpt)
            if self.step == crash_at:
                return

    def save(self, path: Path) -> None:
        """Every rank's data state, gathered: one file, written by rank 0."""
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, self.dataset.state_dict())
        gathered = self.dataset.save_state_global(dst_rank=0)  # the same list, on rank 0 only
        if dist.get_rank() == 0:
            assert gathered == states, "save_state_global and all_gather_object differ"
            torch.save(
                {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "data": states, "epoch": self.dataset.epoch, "step": self.step},
                path,
            )  # fmt: skip
        dist.barrier()  # the file is complete before any rank may read it

    def resume(self, path: Path) -> bool:
        """Restore from ``path``; ``False`` (on every rank) if the data state does not fit."""
        ckpt = torch.load(path, weights_only=True)
        self.model.module.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.step = ckpt["step"]
        ok = torch.ones(1)
        try:
            self.dataset.load_state_dict(ckpt["data"][dist.get_rank()])
        except CheckpointMismatchError as exc:
            if dist.get_rank() == 0:
                print(f"  rank 0: {type(exc).__name__}: {str(exc).splitlines()[-1]}")
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # one rank's stale file fails them all
        if not ok.item():
            self.dataset.set_epoch(ckpt["epoch"])  # restart that epoch, on every rank
        return bool(ok.item())


def run(given_workdir: Path | None, rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    work = workdir(given_workdir, "ddp_gather")
    data, ckpt = work / "data", work / "checkpoint.pt"
    extra = data / f"part-{FILES:04d}.parquet"  # the file step 4 adds
    if rank == 0:
        extra.unlink(missing_ok=True)  # from an earlier run
        write_sample(data)
    dist.barrier()

    full = Job(data)  # 1.
    full.train()
    crashed = Job(data)  # 2.
    crashed.train(ckpt=ckpt, crash_at=CHECKPOINT_AT + LOST)
    resumed = Job(data)  # 3.
    assert resumed.resume(ckpt), "the checkpoint should fit the unchanged data"
    resumed.train()
    continued = crashed.batches[:CHECKPOINT_AT] + resumed.batches
    assert continued == full.batches, f"rank {rank}: the resumed batches differ"
    assert same_weights(resumed.model, full.model), f"rank {rank}: the final weights differ"

    if rank == 0:  # 4.
        write_sample(data, first_file=FILES, files=1)
    dist.barrier()
    restarted = Job(data)
    assert not restarted.resume(ckpt), "a changed directory should not match the checkpoint"
    restarted.train()

    counts = [len(full.batches), len(restarted.batches)]
    everything: list[Any] = [None] * world_size
    dist.all_gather_object(everything, (counts, continued, restarted.batches))
    if rank == 0:
        assert all(c == everything[0][0] for c, _, _ in everything), "unequal batch counts"
        rows = check_each_row_once(
            (b for _, batches, _ in everything for b in batches), TOTAL_ROWS,
            left_out=TOTAL_ROWS % world_size,
        )  # fmt: skip
        new_total = TOTAL_ROWS + ROWS_PER_FILE
        new_rows = check_each_row_once(
            (b for _, _, batches in everything for b in batches), new_total,
            left_out=new_total % world_size,
        )  # fmt: skip
        print(
            f"ddp_gather: {world_size} ranks x {counts[0]} steps; saved at step "
            f"{CHECKPOINT_AT}, {LOST} steps lost; resumed: batches and final weights identical "
            f"to the uninterrupted run, {rows} of {TOTAL_ROWS} rows each once; data changed: "
            f"CheckpointMismatchError on every rank, epoch restarted, {new_rows} of {new_total} "
            f"rows each once"
        )


if __name__ == "__main__":
    sys.exit(run_distributed(run, __doc__))
