"""Coming from Hugging Face ``datasets`` + torchdata's ``StatefulDataLoader``.

    python examples/from_hf_datasets.py [--workdir DIR]

A streaming ``datasets.IterableDataset`` under torchdata's ``StatefulDataLoader`` checkpoints
with ``loader.state_dict()``; under DDP each rank takes its part with ``split_dataset_by_node``
(or ``ds.shard``). ``StructuredDataset`` keeps that shape: it runs under the same
``StatefulDataLoader`` (with ``batch_size=None``: the dataset makes the batches), takes
``rank``/``world_size`` (default: the process group), and resumes exactly. Or use the loader
of ``create_dataloader``, the fast path with workers, whose ``state_dict()`` is the same call.

The idioms, Hugging Face's (``datasets`` is not a dependency here: comments only) and ours::

    # Hugging Face datasets + torchdata
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = load_dataset("parquet", data_files="data/*.parquet", split="train", streaming=True)
    ds = ds.shuffle(seed=0, buffer_size=1_000)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)  # DDP: this rank's part
    # (or ds = ds.shard(num_shards=world_size, index=rank): whole files per rank)
    loader = StatefulDataLoader(ds.with_format("torch"), batch_size=32, num_workers=2)
    ds.set_epoch(epoch)
    state = loader.state_dict()      # per rank; save it beside the model
    loader.load_state_dict(state)    # on a new loader, before iterating

    # torch_dataloader_utils, same loader
    dataset = StructuredDataset("data/", batch_size=32, shuffle=True, shuffle_seed=0,
                                rank=rank, world_size=world_size)  # default: the process group
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    dataset.set_epoch(epoch)
    state = loader.state_dict()
    loader.load_state_dict(state)

    # torch_dataloader_utils, its own loader
    loader, dataset = StructuredDataset.create_dataloader("data/", batch_size=32, shuffle=True,
                                                          shuffle_seed=0, num_workers=2)
    state = loader.state_dict()      # == dataset.state_dict(): plain builtin types
    loader.load_state_dict(state)

``split_dataset_by_node`` gives each rank whole files when their count divides by the world
size, and otherwise makes every rank read every row and keep one in ``world_size``. Here every
rank streams a share of the epoch's rows that differs from the others' by at most one row
(``even_batches``, on under DDP, makes the batch counts equal: ``docs/ddp.md``).

What it does: two ranks simulated in one process (``rank=r, world_size=2``), each through both
loaders: 7 batches, ``torch.save`` of the state, a new loader restored from it with
``torch.load(weights_only=True)``; checks that every continuation is the rest of that rank's
uninterrupted run and that the two ranks together deliver every row once.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _support import COLUMNS, TOTAL_ROWS, check_each_row_once, ids, workdir, write_sample
from torchdata.stateful_dataloader import StatefulDataLoader

from torch_dataloader_utils import StructuredDataset

WORLD_SIZE = 2
WORKERS = 2
BATCH = 32
CHECKPOINT_AFTER = 7  # batches (with workers, take it once every worker has handed one out)

Batches = list[list[int]]
MakeLoader = Callable[[Path, int], Any]


def stateful_loader(data: Path, rank: int) -> Any:
    """Our dataset under torchdata's ``StatefulDataLoader``."""
    # HF: load_dataset(..., streaming=True).shuffle(seed=0), then split_dataset_by_node(...)
    dataset = StructuredDataset(
        str(data), batch_size=BATCH, columns=COLUMNS, shuffle=True, shuffle_seed=0,
        rank=rank, world_size=WORLD_SIZE,
    )  # fmt: skip
    # HF: StatefulDataLoader(ds, batch_size=32, ...); here the dataset makes the batches
    return StatefulDataLoader(dataset, batch_size=None, num_workers=WORKERS)


def our_loader(data: Path, rank: int) -> Any:
    """The loader of ``create_dataloader``."""
    loader, _ = StructuredDataset.create_dataloader(
        str(data), batch_size=BATCH, columns=COLUMNS, shuffle=True, shuffle_seed=0,
        rank=rank, world_size=WORLD_SIZE, num_workers=WORKERS,
    )  # fmt: skip
    return loader


def checkpoint_and_resume(make: MakeLoader, data: Path, rank: int, ckpt: Path) -> Batches:
    """``CHECKPOINT_AFTER`` batches, save, then the rest from a new loader: the whole epoch."""
    loader = make(data, rank)
    before: Batches = []
    for batch in loader:
        before.append(ids(batch))
        if len(before) == CHECKPOINT_AFTER:
            torch.save({"data": loader.state_dict()}, ckpt)  # HF: the same call
            break
    resumed = make(data, rank)  # a new job: new loader, state from the file
    resumed.load_state_dict(torch.load(ckpt, weights_only=True)["data"])
    return before + [ids(batch) for batch in resumed]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to write data and checkpoints")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # torchdata 0.11 calls a torch function that torch 2.13 deprecates; nothing to act on.
    warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
    work = workdir(args.workdir, "from_hf")
    data = write_sample(work / "data")
    for name, make in (("StatefulDataLoader", stateful_loader), ("create_dataloader", our_loader)):
        every_rank: Batches = []
        for rank in range(WORLD_SIZE):
            full = [ids(batch) for batch in make(data, rank)]  # the uninterrupted run
            continued = checkpoint_and_resume(make, data, rank, work / f"{name}-{rank}.pt")
            assert continued == full, f"{name}, rank {rank}: the resumed batches differ"
            every_rank += continued
        rows = check_each_row_once(every_rank, TOTAL_ROWS)
        print(
            f"from_hf_datasets ({name}): {WORLD_SIZE} ranks x {WORKERS} workers, checkpoint "
            f"after {CHECKPOINT_AFTER} batches, resumed exactly; {rows} of {TOTAL_ROWS} rows, "
            f"each once"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
