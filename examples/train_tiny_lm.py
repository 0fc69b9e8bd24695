"""Train a tiny causal language model on packed token sequences, crash, resume to the token.

The data: Parquet files of tokenized documents (an ``input_ids`` column of ``list<int32>``,
generated here). ``TokenPacking`` concatenates them, an EOS id after each, into sequences of
``SEQ_LEN`` tokens; a batch's ``position_ids`` restart at every document, so attention is
limited to each document (here a block-diagonal causal mask; with flash attention, pass
``cu_seqlens`` to its variable-length kernel instead).

The run saves a checkpoint (model, optimizer, ``dataset.state_dict()``) every ``--every``
steps, is "killed" after ``--crash-at`` steps, and resumes from its last checkpoint in a fresh
loader. It checks that the resumed run sees exactly the batches the uninterrupted run saw from
there, ends with the same weights, and that every token of the epoch was trained on once.

    python examples/train_tiny_lm.py [--workdir DIR] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn

from torch_dataloader_utils import StructuredDataset, TokenPacking

VOCAB, EOS, SEQ_LEN, SEQUENCES = 256, 255, 64, 4
PACKING = TokenPacking("input_ids", seq_len=SEQ_LEN, separator=EOS)


def write_documents(directory: Path, files: int = 3, docs: int = 50) -> int:
    """Parquet files of random documents (0-200 tokens); returns the tokens with EOS."""
    directory.mkdir(parents=True, exist_ok=True)
    total = 0
    for number in range(files):
        rng = np.random.default_rng(number)
        lengths = rng.integers(0, 200, docs)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = rng.integers(0, EOS, int(offsets[-1]), dtype=np.int32)
        ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        pq.write_table(pa.table({"input_ids": ids}), directory / f"docs-{number}.parquet",
                       row_group_size=40)  # fmt: skip
        total += int(offsets[-1]) + docs
    return total


class TinyLM(nn.Module):
    """Embedding, one causal self-attention block limited to each document, a head."""

    def __init__(self, vocab: int = VOCAB, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(1024, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids.long()) + self.position(position_ids.clamp(max=1023))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # a new document part begins where position_ids is 0
        parts = torch.cumsum(position_ids == 0, dim=1)
        same = parts[:, :, None] == parts[:, None, :]
        size = input_ids.shape[1]
        causal = torch.ones(size, size, dtype=torch.bool).tril()
        x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=same & causal)
        return self.head(x)


def loss_of(model: TinyLM, batch: dict[str, Any]) -> torch.Tensor:
    """Next-token cross-entropy; with ``labels`` (fine-tuning) over the tokens whose label is
    not -100 (the assistant's; padding is -100), a document's first token never predicted."""
    ids, positions = batch["input_ids"], batch["position_ids"]
    logits = model(ids, positions)[:, :-1]
    if "labels" in batch:  # shifted as usual: position i predicts label i + 1
        labels = batch["labels"][:, 1:].masked_fill(positions[:, 1:] == 0, -100)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    targets = ids[:, 1:].long()
    # predict within a document part only, and never a padding token
    real = torch.arange(ids.numel()).view_as(ids)[:, 1:] < batch["num_tokens"]
    keep = (positions[:, 1:] != 0) & real
    return F.cross_entropy(logits[keep], targets[keep])


def real_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """The tokens of a batch packed by concatenation (its padding is at its end)."""
    return batch["input_ids"].flatten()[: batch["num_tokens"]].clone()


def train(
    make_loader: Callable[[], tuple[Any, StructuredDataset]], workdir: Path, *, vocab: int = VOCAB,
    steps: int | None, every: int, resume: bool,
    record: Callable[[dict[str, Any]], torch.Tensor] = real_tokens,
) -> tuple[nn.Module, list[torch.Tensor]]:  # fmt: skip
    """Train from scratch or from the last checkpoint for ``steps`` (None: to the epoch's end)
    on a loader ``make_loader()`` builds; returns the model and ``record(batch)`` of every
    batch trained on."""
    torch.manual_seed(0)
    model = TinyLM(vocab=vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader, dataset = make_loader()
    checkpoint = workdir / "checkpoint.pt"
    step = 0
    if resume:
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        dataset.load_state_dict(saved["data"])  # continues at the exact token
        step = saved["step"]
    seen = []
    for batch in loader:
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
        seen.append(record(batch))
        step += 1
        if step % every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "data": dataset.state_dict(), "step": step}  # fmt: skip
            torch.save(state, workdir / "checkpoint.tmp")
            (workdir / "checkpoint.tmp").replace(checkpoint)
        if steps is not None and step >= steps:
            break  # the "crash": everything after the last checkpoint is lost
    return model, seen


def crash_and_resume(
    make_loader: Callable[[], tuple[Any, StructuredDataset]], workdir: Path, *, every: int,
    crash_at: int, **options: Any,
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:  # fmt: skip
    """Train uninterrupted, then again "killed" after ``crash_at`` steps, then resumed from its
    last checkpoint (``train(..., **options)`` each). Asserts that the resumed run trains on
    the uninterrupted run's batches from the checkpoint and ends with its weights; returns the
    uninterrupted run's records, the crashed then resumed run's, and the checkpoint's step."""
    reference, uninterrupted = train(make_loader, workdir, steps=None, resume=False,
                                     every=every, **options)  # fmt: skip
    _, before = train(make_loader, workdir, steps=crash_at, resume=False, every=every, **options)
    resumed, after = train(make_loader, workdir, steps=None, resume=True, every=every, **options)
    saved = crash_at // every * every
    assert len(saved_part := uninterrupted[saved:]) == len(after)
    assert all(torch.equal(a, b) for a, b in zip(saved_part, after, strict=True))
    weights = zip(reference.state_dict().values(), resumed.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in weights)
    return uninterrupted, before[:saved] + after, saved


def run_args(doc: str | None, *, every: int, crash_at: int) -> argparse.Namespace:
    """The examples' options: where, how many workers, checkpoint and crash steps."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.mkdtemp()))
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--every", type=int, default=every, help="checkpoint every N steps")
    parser.add_argument("--crash-at", type=int, default=crash_at)
    return parser.parse_args()


def packed_loader(data: Path, num_workers: int) -> tuple[Any, StructuredDataset]:
    """The tokenized documents of ``data``, shuffled and packed."""
    return StructuredDataset.create_dataloader(
        str(data), batch_size=SEQUENCES, num_workers=num_workers, packing=PACKING,
        shuffle=True, split_bytes=16 * 2**10,
    )  # fmt: skip


def main() -> None:
    args = run_args(__doc__, every=10, crash_at=23)
    data = args.workdir / "data"
    total = write_documents(data)

    def make_loader() -> tuple[Any, StructuredDataset]:
        return packed_loader(data, args.num_workers)

    uninterrupted, trained, saved = crash_and_resume(
        make_loader, args.workdir, every=args.every, crash_at=args.crash_at
    )
    tokens = torch.cat(trained)
    assert len(tokens) == total == len(torch.cat(uninterrupted)), (len(tokens), total)
    print(
        f"train_tiny_lm: {len(uninterrupted)} steps of {SEQUENCES} x {SEQ_LEN} tokens; crashed "
        f"at step {args.crash_at}, resumed from step {saved}: the same "
        f"{len(uninterrupted) - saved} batches, the same weights, {total} tokens each trained "
        f"on once"
    )


if __name__ == "__main__":
    main()
