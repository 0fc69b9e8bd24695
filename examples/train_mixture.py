"""Train a tiny language model on a packed 3-source mixture under DDP: crash, resume, reweight.

    torchrun --nproc_per_node=2 examples/train_mixture.py [--workdir DIR]

Three sources of tokenized documents (``web``, ``code``, ``math``) are mixed 5 : 3 : 2 by
packed sequences (weights count tokens: each source packs its own documents). The run:

1. trains epoch 0 uninterrupted, for reference;
2. trains it again, saves every rank's state on rank 0 (``save_state_global``) with the model
   after ``CHECKPOINT_AT`` steps, and "crashes" ``LOST`` steps later;
3. restarts: a new loader and model restore the checkpoint (``restore_state_global``) and must
   train exactly the reference's remaining batches;
4. at the end of epoch 0 changes the mixture — ``math`` up-weighted and a new source ``books``
   added — with ``load_state_dict(state, reweight=True)``, and trains epoch 1.

It checks that the resume is identical, that no token of any source is trained on twice (the
sources are larger than what two epochs read, so none wraps), that every source continued
where it stood and ``books`` started at a document's beginning, and that from the change on each
source's sequences stay within one per rank of the new weights after every step.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from _support import run_distributed, workdir
from torch import nn

from torch_dataloader_utils import StructuredDataset, TokenPacking

SEQ_LEN, SEQUENCES, EPOCH = 32, 4, 96  # EPOCH: packed sequences per epoch over the job
PACKING = TokenPacking("input_ids", seq_len=SEQ_LEN)
BEFORE = {"web": 5, "code": 3, "math": 2}
AFTER = {"web": 5, "code": 3, "math": 4, "books": 2}
CHECKPOINT_AT, LOST = 5, 3  # steps
SPAN = 10_000  # token = (source * 1,000 + document) * SPAN + place: each one names its origin
VOCAB = 256


def write_source(directory: Path, number: int, docs: int = 120) -> None:
    """Documents of 20-100 tokens; the files are written once, by one rank."""
    directory.mkdir(parents=True, exist_ok=True)
    lengths = np.random.default_rng(number).integers(20, 100, docs)
    rows = [list(range((number * 1_000 + d) * SPAN, (number * 1_000 + d) * SPAN + int(n)))
            for d, n in enumerate(lengths)]  # fmt: skip
    table = pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))})
    pq.write_table(table, directory / ".part-0.tmp", row_group_size=16)
    (directory / ".part-0.tmp").replace(directory / "part-0.parquet")


class TinyLM(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids % VOCAB))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> list[int]:
    """One optimizer step on ``batch``; the tokens it trained on."""
    ids = batch["input_ids"]
    logits = model(ids)[:, :-1]
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), (ids[:, 1:] % VOCAB).reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return ids.flatten().tolist()


def make(paths: dict[str, str], weights: dict[str, int]) -> tuple[Any, StructuredDataset]:
    return StructuredDataset.create_dataloader(
        paths, weights=weights, packing=PACKING, batch_size=SEQUENCES, epoch_size=EPOCH,
        shuffle=True, num_workers=1,
    )  # fmt: skip


def trainer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TinyLM())
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def run(given: Path | None, rank: int, world_size: int) -> None:
    root = workdir(given, "train_mixture")
    paths = {name: str(root / name) for name in AFTER}
    if rank == 0:
        for number, name in enumerate(AFTER):
            write_source(Path(paths[name]), number)
    dist.barrier()
    before = {name: paths[name] for name in BEFORE}

    loader, _ = make(before, BEFORE)  # 1. the reference
    model, optimizer = trainer()
    reference = [step(model, optimizer, batch) for batch in loader]

    loader, _ = make(before, BEFORE)  # 2. checkpoint, then crash
    model, optimizer = trainer()
    batches = iter(loader)
    trained = [step(model, optimizer, next(batches)) for _ in range(CHECKPOINT_AT)]
    states = loader.save_state_global(dst_rank=0)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(LOST):
        step(model, optimizer, next(batches))
    del batches

    loader, dataset = make(before, BEFORE)  # 3. the restarted job
    model, optimizer = trainer()
    model.load_state_dict(saved_model)
    loader.restore_state_global(states, src_rank=0)
    trained += [step(model, optimizer, batch) for batch in loader]
    assert trained == reference, f"rank {rank}: the resumed epoch differs from the reference"
    end_of_epoch = dataset.state_dict()

    loader, dataset = make(paths, AFTER)  # 4. a new mixture from the end of epoch 0
    loader.load_state_dict(end_of_epoch, reweight=True)
    dataset.set_epoch(1)
    after: list[list[int]] = []
    counts = np.zeros(len(AFTER), dtype=np.int64)
    for batch in loader:
        after.append(step(model, optimizer, batch))
        counts += np.bincount(batch["source"].numpy(), minlength=len(AFTER))
        share = counts.sum() * np.array(list(AFTER.values())) / sum(AFTER.values())
        assert (np.abs(counts - share) < 1).all(), f"rank {rank}: {counts} vs {share}"

    mine = [t for tokens in trained + after for t in tokens]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    delivered = Counter(t for tokens in everyone for t in tokens)
    assert max(delivered.values()) == 1, "a token trained on twice"
    book = list(AFTER).index("books")
    mine_books = [t for t in mine if t // SPAN // 1_000 == book]
    assert mine_books and mine_books[0] % SPAN == 0, "books did not start at a document start"
    if rank == 0:
        per_source = Counter(t // SPAN // 1_000 for t in delivered)
        print(
            f"train_mixture: {world_size} ranks, epoch 0 {BEFORE} resumed identically after "
            f"a crash at step {CHECKPOINT_AT + LOST} (checkpoint at {CHECKPOINT_AT}); epoch 1 "
            f"reweighted to {AFTER}; {delivered.total()} tokens each trained on once "
            f"(per source {[per_source[i] for i in range(len(AFTER))]})"
        )


if __name__ == "__main__":
    sys.exit(run_distributed(run, __doc__))
