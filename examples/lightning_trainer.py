"""Lightning's ``Trainer`` on packed token sequences: crash, ``fit(ckpt_path="last")``, exact.

``train_dataloader()`` returns the loader of ``create_dataloader``; nothing else is needed.
Lightning saves ``loader.state_dict()`` in its checkpoints and loads it on resume. A packed
loader has no ``len()``, so Lightning's fetcher reads one batch ahead; the loader leaves that
batch out of the state (it has not been read yet), so the resume trains it.

The run checkpoints every ``EVERY`` steps, crashes at step ``CRASH_AT``, and a new Trainer,
model and loader resume from the last checkpoint. It checks that every token of the epoch was
trained on exactly once, in the uninterrupted order. (With more than one process add
``LoaderStatesPerRank()`` to the callbacks: docs/trainers.md.) More epochs need nothing
either: Lightning's ``sampler.set_epoch`` moves the loader to each epoch, and a checkpoint
saved on an epoch's last step continues with the next (docs/trainers.md, "Epochs").

    python examples/lightning_trainer.py [--workdir DIR] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from train_tiny_lm import PACKING, SEQUENCES, TinyLM, loss_of, write_documents

from torch_dataloader_utils import StructuredDataset

EVERY, CRASH_AT = 5, 8


class Crash(Exception):
    pass


class PackedLM(L.LightningModule):
    def __init__(self, data: Path, num_workers: int, crash_at: int | None = None) -> None:
        super().__init__()
        self.data, self.num_workers, self.crash_at = data, num_workers, crash_at
        self.model = TinyLM()
        self.trained: list[torch.Tensor] = []  # the tokens of each step, to check the run

    def train_dataloader(self) -> Any:
        loader, _ = StructuredDataset.create_dataloader(
            str(self.data), batch_size=SEQUENCES, packing=PACKING, shuffle=True,
            num_workers=self.num_workers,
        )  # fmt: skip
        return loader

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.crash_at:
            raise Crash  # the job dies; what was trained after the checkpoint is lost
        self.trained.append(batch["input_ids"].flatten()[: batch["num_tokens"]].clone())
        return loss_of(self.model, batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(checkpoints: Path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=EVERY,
                                   save_top_k=-1, save_last=True)],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.mkdtemp()))
    parser.add_argument("--num-workers", type=int, default=2)
    args = parser.parse_args()
    data, checkpoints = args.workdir / "docs", args.workdir / "lightning-checkpoints"
    write_documents(data, files=2, docs=20)

    uninterrupted = PackedLM(data, args.num_workers)
    trainer(args.workdir / "uninterrupted").fit(uninterrupted)

    crashed = PackedLM(data, args.num_workers, crash_at=CRASH_AT)
    with contextlib.suppress(Crash):
        trainer(checkpoints).fit(crashed)
    resumed = PackedLM(data, args.num_workers)
    trainer(checkpoints).fit(resumed, ckpt_path="last")  # a new process would do the same

    full = torch.cat(uninterrupted.trained)
    done = torch.cat(crashed.trained[:EVERY] + resumed.trained)
    assert torch.equal(done, full), "the resumed run did not continue the uninterrupted one"
    print(
        f"lightning_trainer: {len(full)} tokens in {len(uninterrupted.trained)} steps; "
        f"crashed at step {CRASH_AT}, resumed from step {EVERY}: "
        f"{len(resumed.trained)} steps, every token once in the uninterrupted order"
    )


if __name__ == "__main__":
    main()
