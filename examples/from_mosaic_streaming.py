"""Coming from MosaicML Streaming: ``StreamingDataLoader.state_dict()`` / ``load_state_dict()``.

    python examples/from_mosaic_streaming.py [--workdir DIR]

MosaicML Streaming reads its own MDS shards (you convert Parquet to them with ``MDSWriter``),
and ``StreamingDataLoader.state_dict()`` records how many samples the job has seen; a resume
skips that many samples of the epoch's order. This library reads the Parquet files as they
are, and its state records *which rows* were handed out (by file content), so a resume is
refused with ``CheckpointMismatchError`` if the data changed underneath.

The idiom, Streaming's (not installed here: comments only), then ours::

    # MosaicML Streaming
    dataset = StreamingDataset(remote="s3://b/mds/", local="/tmp/cache",
                               shuffle=True, shuffle_seed=0, batch_size=32)
    loader = StreamingDataLoader(dataset, batch_size=32, num_workers=2)
    ckpt = {"model": model.state_dict(), "loader": loader.state_dict()}   # torch.save(ckpt)
    loader.load_state_dict(ckpt["loader"])          # on a new loader, before iterating
    for epoch in range(epochs):                     # the dataset advances its epoch itself
        for batch in loader: ...

    # torch_dataloader_utils
    loader, dataset = StructuredDataset.create_dataloader(
        "s3://b/parquet/", batch_size=32, shuffle=True, shuffle_seed=0, num_workers=2)
    ckpt = {"model": model.state_dict(), "data": dataset.state_dict()}    # or loader's: same
    dataset.load_state_dict(ckpt["data"])           # on a new loader, before iterating
    for epoch in range(dataset.epoch, epochs):      # starts at the checkpoint's epoch
        if epoch != dataset.epoch:
            dataset.set_epoch(epoch)                # never for the epoch just resumed
        for batch in loader: ...

Under DDP, Streaming's ``StreamingDataLoader.state_dict()`` counts the samples of every rank
(one state, saved by rank 0); here each rank has its own state: gather them
(``examples/ddp_gather.py``) or save one file per rank.

What it does: trains a linear model for 2 epochs on a generated Parquet dataset, saves model,
optimizer and ``dataset.state_dict()`` together with ``torch.save`` in the middle of epoch 0,
trains 5 more steps and "crashes" (drops everything), then builds a new model, optimizer and
loader, loads the checkpoint and finishes. Checks that the resumed run's batches and final
weights equal an uninterrupted run's, and that each epoch delivered every row once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from _support import (
    COLUMNS,
    TOTAL_ROWS,
    check_each_row_once,
    ids,
    make_model,
    same_weights,
    train_step,
    workdir,
    write_sample,
)

from torch_dataloader_utils import StructuredDataset

EPOCHS = 2
BATCH = 32
CHECKPOINT_AT = 25  # steps: in epoch 0 (76 batches: each of 2 workers ends short)
CRASH_AT = 30  # the 5 steps after the checkpoint are lost with the process


def train(data: Path, ckpt: Path, *, resume: bool, crash_at: int | None) -> dict[str, Any]:
    """One run: fresh model, optimizer and loader (restored from ``ckpt`` if ``resume``)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader, dataset = StructuredDataset.create_dataloader(
        str(data), batch_size=BATCH, columns=COLUMNS, shuffle=True, shuffle_seed=0, num_workers=2
    )
    step = 0
    if resume:
        saved = torch.load(ckpt, weights_only=True)  # the data state is plain builtin types
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        dataset.load_state_dict(saved["data"])  # Streaming: loader.load_state_dict(...)
        step = saved["step"]
    batches: list[tuple[int, list[int]]] = []  # (epoch, row ids) of every step of this run
    for epoch in range(dataset.epoch, EPOCHS):
        if epoch != dataset.epoch:
            dataset.set_epoch(epoch)  # never for the epoch just resumed
        for batch in loader:
            train_step(model, optimizer, batch)
            step += 1
            batches.append((epoch, ids(batch)))
            if step == CHECKPOINT_AT and not resume:
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "data": dataset.state_dict(), "step": step},
                    ckpt,
                )  # fmt: skip
            if step == crash_at:
                return {"batches": batches, "model": model}
    return {"batches": batches, "model": model}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to write data and checkpoints")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # DataLoader workers use the other cores
    work = workdir(args.workdir, "from_mosaic")
    data = write_sample(work / "data")
    ckpt = work / "checkpoint.pt"

    full = train(data, ckpt, resume=False, crash_at=None)  # the uninterrupted run
    crashed = train(data, ckpt, resume=False, crash_at=CRASH_AT)
    resumed = train(data, ckpt, resume=True, crash_at=None)

    continued = crashed["batches"][:CHECKPOINT_AT] + resumed["batches"]
    assert continued == full["batches"], "the resumed run's batches differ from the uninterrupted"
    assert same_weights(resumed["model"], full["model"]), "the final weights differ"
    for epoch in range(EPOCHS):
        check_each_row_once((b for e, b in continued if e == epoch), TOTAL_ROWS)
    print(
        f"from_mosaic_streaming: {EPOCHS} epochs x {TOTAL_ROWS} rows in {len(full['batches'])} "
        f"batches; checkpoint at step {CHECKPOINT_AT}, crash at step {CRASH_AT}, resumed: "
        f"{len(resumed['batches'])} batches and the final weights identical to the "
        f"uninterrupted run, every row once per epoch"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
