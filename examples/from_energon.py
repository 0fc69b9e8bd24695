"""Coming from Megatron-Energon: ``save_state_rank`` / ``restore_state_rank``,
``save_state_global(dst_rank)`` / ``restore_state_global(state, src_rank)``, on the loader.

    torchrun --nproc_per_node=2 examples/from_energon.py [--workdir DIR]

Energon's savable loader offers three ways to checkpoint (its "Save and Restore" page); the
loader of ``create_dataloader`` has the same four calls with the same meaning, so the code
around them stays as it was. Energon's idiom (not installed here: comments only)::

    loader = get_savable_loader(get_train_dataset(
        "dataset.yaml", batch_size=16, shuffle_buffer_size=100, worker_config=worker_config))

and ours, from where on the calls are the same::

    loader, _ = StructuredDataset.create_dataloader("data/", batch_size=16, shuffle=True,
                                                    num_workers=1)
    # 1. every rank its own file
    state = loader.save_state_rank()
    loader.restore_state_rank(state)                    # a new loader, before iterating
    # 2. gathered on rank 0, scattered back from it (collectives: every rank calls them)
    states = loader.save_state_global(dst_rank=0)       # the list on rank 0, None elsewhere
    loader.restore_state_global(states, src_rank=0)     # states=None on the other ranks
    # 3. gathered on rank 0, every rank reads the file
    loader.restore_state_global(states, src_rank=None)  # no communication

Each state here is plain builtin types (``torch.load(weights_only=True)``, JSON) and names the
rows handed out by file content: restoring onto other files, another seed, or another rank's
state raises ``CheckpointMismatchError`` on every rank instead of silently reading other data.
``restore_state_global(states, src_rank=..., elastic=True)`` also resumes on another number of
ranks or workers (``docs/ddp.md``).

What it does, on each of the 2 ranks: 6 batches, save the three ways, 3 more batches that the
"crash" loses; then three new loaders, one per way of restoring, each of which must continue
exactly as that rank's uninterrupted run; and the ranks together must deliver every row once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _support import (
    COLUMNS,
    TOTAL_ROWS,
    check_each_row_once,
    ids,
    run_distributed,
    workdir,
    write_sample,
)

from torch_dataloader_utils import StructuredDataLoader, StructuredDataset

BATCH = 16
CHECKPOINT_AFTER = 6  # batches
LOST = 3  # batches after the checkpoint, lost in the crash

Batches = list[list[int]]


def make_loader(data: Path) -> StructuredDataLoader:
    loader, _ = StructuredDataset.create_dataloader(
        str(data), batch_size=BATCH, columns=COLUMNS, shuffle=True, shuffle_seed=0, num_workers=1
    )
    return loader


def first_run(data: Path, work: Path, rank: int) -> Batches:
    """Batches up to the checkpoint; saves it the three ways, then reads on and "crashes"."""
    loader = make_loader(data)
    batches = iter(loader)
    seen = [ids(next(batches)) for _ in range(CHECKPOINT_AFTER)]
    torch.save(loader.save_state_rank(), work / f"rank{rank}.pt")  # 1.
    states = loader.save_state_global(dst_rank=0)  # 2. and 3.: a collective
    if rank == 0:
        assert states is not None
        torch.save(states, work / "global.pt")
    else:
        assert states is None
    for _ in range(LOST):
        next(batches)
    return seen


def restored(data: Path, restore: Callable[[StructuredDataLoader], None]) -> Batches:
    """A new loader restored by ``restore``, read to the end of the epoch."""
    loader = make_loader(data)
    restore(loader)
    return [ids(batch) for batch in loader]


def run(given_workdir: Path | None, rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    work = workdir(given_workdir, "from_energon")
    data = work / "data"
    if rank == 0:
        write_sample(data)
    dist.barrier()  # the data is there before any rank lists it

    full = [ids(batch) for batch in make_loader(data)]  # this rank's uninterrupted run
    seen = first_run(data, work, rank)
    dist.barrier()  # every file is written before any rank reads one

    def load(path: Path) -> Any:
        return torch.load(path, weights_only=True)

    ways: dict[str, Callable[[StructuredDataLoader], None]] = {
        "restore_state_rank": lambda ld: ld.restore_state_rank(load(work / f"rank{rank}.pt")),
        "restore_state_global(src_rank=0)": lambda ld: ld.restore_state_global(
            load(work / "global.pt") if rank == 0 else None, src_rank=0
        ),
        "restore_state_global(src_rank=None)": lambda ld: ld.restore_state_global(
            load(work / "global.pt"), src_rank=None
        ),
    }
    for name, restore in ways.items():
        rest = restored(data, restore)
        assert seen + rest == full, f"rank {rank}, {name}: the resumed batches differ"

    everything: list[Any] = [None] * world_size
    dist.all_gather_object(everything, full)
    if rank == 0:
        rows = check_each_row_once(
            (b for batches in everything for b in batches), TOTAL_ROWS,
            left_out=TOTAL_ROWS % world_size,
        )  # fmt: skip
        print(
            f"from_energon: {world_size} ranks, checkpoint after {CHECKPOINT_AFTER} batches, "
            f"{LOST} lost in the crash; resumed exactly through {', '.join(ways)}; "
            f"{rows} of {TOTAL_ROWS} rows, each once"
        )


if __name__ == "__main__":
    sys.exit(run_distributed(run, __doc__))
