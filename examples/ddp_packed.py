"""Packed token sequences under DDP: every rank stops at a common step, checkpoints, resumes.

    torchrun --nproc_per_node=2 examples/ddp_packed.py [--workdir DIR]

With ``TokenPacking``, ``even_batches`` evens the rows each rank reads, not its tokens, so
ranks yield different numbers of packed batches. DDP needs the same number of steps on every
rank; the loop below stops every rank as soon as one runs out (one ``all_reduce`` a step)::

    batches = iter(loader)
    while True:
        batch = next(batches, None)               # None once this rank's stream ends
        finished = torch.tensor(int(batch is None))
        dist.all_reduce(finished)                 # SUM over ranks: has any rank finished?
        if finished:
            break
        train_step(batch)

What it checks, on 2 ranks (gloo): the uninterrupted run; a run that saves the ranks' states
on rank 0 (``save_state_global``) after ``CHECKPOINT_AT`` steps and "crashes" ``LOST`` steps
later; its resume (``restore_state_global(states, src_rank=0)``), which must continue every rank
exactly as the uninterrupted run; then the tokens the ranks did not reach before the common
stop, delivered by an elastic resume of the final states. Altogether every token of the data,
separators included, exactly once.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from _support import run_distributed, workdir

from torch_dataloader_utils import StructuredDataset, TokenPacking

EOS = -1
PACKING = TokenPacking("input_ids", seq_len=32, separator=EOS)
SEQUENCES = 4
CHECKPOINT_AT = 12  # steps
LOST = 4  # steps after the checkpoint, lost in the crash
SPAN = 1_000  # token ids are document * SPAN + position: each one unique


def write_documents(directory: Path, files: int = 3, docs: int = 80) -> Counter[int]:
    """Parquet files of documents of 0-120 tokens; returns every token (EOS included)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens: Counter[int] = Counter()
    for number in range(files):
        lengths = np.random.default_rng(number).integers(0, 120, docs)
        first = number * docs
        rows = [list(range((first + d) * SPAN, (first + d) * SPAN + n))
                for d, n in enumerate(lengths)]  # fmt: skip
        path = directory / f"docs-{number}.parquet"
        if not path.exists():
            table = pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))})
            pq.write_table(table, directory / f".{path.name}.tmp", row_group_size=20)
            (directory / f".{path.name}.tmp").replace(path)
        tokens.update(t for row in rows for t in [*row, EOS])
    return tokens


def tokens_of(batch: dict[str, Any]) -> list[int]:
    return [int(t) for t in batch["input_ids"].flatten()[: batch["num_tokens"]]]


def common_steps(batches: Iterator[Any], limit: int | None = None) -> Iterator[list[int]]:
    """Batches (as tokens) while every rank has one; at most ``limit`` of them."""
    for step in itertools.count():
        batch = None if step == limit else next(batches, None)
        finished = torch.tensor(int(batch is None))
        dist.all_reduce(finished)  # SUM over ranks: has any rank finished?
        if finished:
            return
        yield tokens_of(batch)


def make_loader(data: Path) -> tuple[Any, StructuredDataset]:
    return StructuredDataset.create_dataloader(
        str(data), batch_size=SEQUENCES, packing=PACKING, shuffle=True, num_workers=1,
        split_bytes=4096,
    )  # fmt: skip


def run(given: Path | None, rank: int, world_size: int) -> None:
    root = workdir(given, "ddp_packed")
    data = root / "data"
    if rank == 0:
        write_documents(data)
    dist.barrier()
    every_token = write_documents(data)  # the same files: only counts them

    loader, _ = make_loader(data)
    uninterrupted = list(common_steps(iter(loader)))

    loader, _ = make_loader(data)
    batches = iter(loader)
    before = list(common_steps(batches, CHECKPOINT_AT))
    states = loader.save_state_global(dst_rank=0)  # the list on rank 0, None elsewhere
    lost = list(common_steps(batches, LOST))  # trained on, then lost in the crash
    assert before + lost == uninterrupted[: CHECKPOINT_AT + LOST]
    del batches

    loader, dataset = make_loader(data)  # the restarted job
    loader.restore_state_global(states, src_rank=0)
    after = list(common_steps(iter(loader)))
    assert before + after == uninterrupted, f"rank {rank}: the resume differs"
    final = dataset.state_dict()

    # What the common stop left: an elastic resume of the final states delivers it.
    finals: list[Any] = [None] * world_size
    dist.all_gather_object(finals, final)
    loader, _ = make_loader(data)
    loader.restore_state_global(finals, src_rank=None, elastic=True)
    rest = [tokens_of(batch) for batch in loader]

    mine = [t for batch in before + after + rest for t in batch]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    delivered = Counter(t for tokens in everyone for t in tokens)
    # even_batches (on under DDP) leaves fewer than world_size whole documents out
    left_out = every_token - delivered
    assert not delivered - every_token, "a token delivered twice"
    documents_out = {t // SPAN for t in left_out if t != EOS}  # each with its separator
    assert left_out[EOS] < world_size and len(documents_out) <= left_out[EOS]
    if rank == 0:
        print(
            f"ddp_packed: {world_size} ranks x {len(uninterrupted)} common steps of "
            f"{SEQUENCES} x {PACKING.seq_len} tokens; saved at step {CHECKPOINT_AT}, {LOST} "
            f"lost; resumed identically; the rest after the common stop delivered elastically; "
            f"{delivered.total()} of {every_token.total()} tokens once "
            f"({left_out[EOS]} document(s) left out by even_batches)"
        )


if __name__ == "__main__":
    sys.exit(run_distributed(run, __doc__))
