"""A Lightning ``Trainer`` job for tests/test_lightning_trainer.py: ``lightning_job.py job.json``.

As a user writes it (docs/trainers.md): ``train_dataloader()`` returns the loader of
``create_dataloader``, ``ModelCheckpoint(every_n_train_steps=...)``, nothing else; with more
than one process, ``LoaderStatesPerRank()``. Run with ``python`` (one process) or ``torchrun``
(DDP on CPU, gloo). For each case of the job:

- ``train``: ``fit`` until optimizer step ``crash_at``, where the step raises (a crash: no
  checkpoint then, the batches after the last checkpoint are lost). After the last case,
  with ``kill``, process 0 dies by SIGKILL.
- ``resume``: a new ``Trainer``, ``fit(ckpt_path=...)`` (``"last"``, or a checkpoint's file
  name), to the end of ``epochs`` (default 1).

Checkpoints: ``ModelCheckpoint(every_n_train_steps=save_every)``, or ``checkpoint``'s keyword
arguments (``{}``: Lightning's default, at each epoch's end). Each step records what it
trained on (``_common.record``); each checkpoint holds how many batches the run had trained
(``TRAINED``), which the resumed run notes (``note_resumed_from``): where it must continue.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import loader_of, note_resumed_from, record, run_job, trained_values
from lightning.pytorch.callbacks import ModelCheckpoint

from torch_dataloader_utils.integrations.lightning import LoaderStatesPerRank

# The checkpoint's key for the batches the run had trained when it was saved.
TRAINED = "test_batches_trained"


class Crash(Exception):
    """The step at which the job dies."""


class Tiny(L.LightningModule):
    def __init__(self, case: dict[str, Any], log: Path, crash_at: int | None) -> None:
        super().__init__()
        self.case, self.record_to, self.crash_at = case, log, crash_at
        self.layer = torch.nn.Linear(1, 1)
        self.trained = 0

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[TRAINED] = self.trained

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if TRAINED in checkpoint:
            note_resumed_from(self.record_to, checkpoint[TRAINED])

    def train_dataloader(self) -> Any:
        return loader_of(self.case["kwargs"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.crash_at is not None and self.global_step == self.crash_at:
            raise Crash(f"crash at step {self.global_step}")
        values = trained_values(batch)
        record(self.record_to, values)
        self.trained += 1
        x = torch.tensor([[float(len(values))]])
        return self.layer(x).pow(2).mean() * 1e-6

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", self.layer(batch).sum())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def trainer(case: dict[str, Any], ckpt_dir: Path) -> L.Trainer:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    checkpoint = case.get("checkpoint")
    if checkpoint is None:
        checkpoint = {"every_n_train_steps": case["save_every"], "save_top_k": -1}
    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_epochs=case.get("epochs", 1),
        callbacks=[
            ModelCheckpoint(dirpath=ckpt_dir, save_last=True, **checkpoint),
            *([LoaderStatesPerRank()] if world > 1 else []),  # DDP: every process's state
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **case.get("trainer", {}),
    )  # fmt: skip


def run_case(job: dict[str, Any], case: dict[str, Any], rank: int) -> None:
    out = Path(job["dir"], case["name"])
    log = out / f"{job['phase']}-rank{rank}.jsonl"
    if job["phase"] == "train":
        try:
            trainer(case, out / "ckpt").fit(Tiny(case, log, case["crash_at"]))
        except Crash:
            return
        raise AssertionError(f"{case['name']}: training ended before step {case['crash_at']}")
    ckpt = case.get("ckpt_path", "last")
    if ckpt != "last":
        ckpt = str(out / "ckpt" / ckpt)
    trainer(case, out / "ckpt").fit(Tiny(case, log, None), ckpt_path=ckpt)


if __name__ == "__main__":
    run_job(run_case)
