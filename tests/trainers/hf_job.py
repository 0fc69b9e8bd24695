"""A Hugging Face ``Trainer`` job for tests/test_hf_trainer.py: ``hf_job.py job.json``.

As a user writes it (docs/trainers.md): ``StructuredTrainer(model=..., args=...,
train_dataloader=loader)``, checkpoints every ``save_every`` steps. Run with ``python`` (one
process) or ``torchrun`` (DDP on CPU, gloo). For each case of the job:

- ``train``: ``train()`` until optimizer step ``crash_at``, where a callback raises (a crash:
  the batches after the last checkpoint are lost). After the last case, with ``kill``,
  process 0 dies by SIGKILL.
- ``resume``: a new trainer, ``train(resume_from_checkpoint=True)`` or the checkpoint
  directory of step ``save_every``, to the end.

The model records what each forward trained on (``_common.record``); each checkpoint
directory gets ``TRAINED``: how many batches the run had trained, which the resumed run notes
(``note_resumed_from``): where it must continue.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from _common import loader_of, note_resumed_from, record, recorded, run_job, trained_values
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from torch_dataloader_utils.integrations.hf import StructuredTrainer

# In each checkpoint directory, per process: the batches it had trained when it was saved.
TRAINED = "test_batches_trained_{process}.json"


class Crash(Exception):
    """The step at which the job dies."""


class CrashAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise Crash(f"crash at step {state.global_step}")


class CountTrained(TrainerCallback):
    def __init__(self, log: Path) -> None:
        self.log = log

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        directory = Path(args.output_dir, f"checkpoint-{state.global_step}")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TRAINED.format(process=args.process_index)
        path.write_text(json.dumps(len(recorded(self.log))))


class Tiny(torch.nn.Module):
    """A model that takes any batch, records it, and returns a loss."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log
        self.layer = torch.nn.Linear(1, 1)

    def forward(self, **batch: Any) -> dict[str, torch.Tensor]:
        values = trained_values(batch)
        record(self.log, values)
        x = torch.tensor([[float(len(values))]])
        return {"loss": self.layer(x).pow(2).mean() * 1e-6}


def trainer(case: dict[str, Any], out: Path, log: Path, crash_at: int | None) -> Any:
    args = TrainingArguments(
        output_dir=str(out / "ckpt"), use_cpu=True, report_to=[], disable_tqdm=True,
        logging_strategy="no", learning_rate=1e-3, seed=3, **{
            "num_train_epochs": 1, "save_strategy": "steps",
            "save_steps": case.get("save_every", 500), **case.get("args", {}),
        },
    )  # fmt: skip
    return StructuredTrainer(
        model=Tiny(log),
        args=args,
        train_dataloader=loader_of(case["kwargs"]),
        callbacks=[CountTrained(log), *([CrashAt(crash_at)] if crash_at is not None else [])],
    )


def run_case(job: dict[str, Any], case: dict[str, Any], rank: int) -> None:
    out = Path(job["dir"], case["name"])
    log = out / f"{job['phase']}-rank{rank}.jsonl"
    if job["phase"] == "train":
        try:
            trainer(case, out, log, case["crash_at"]).train()
        except Crash:
            return
        raise AssertionError(f"{case['name']}: training ended before step {case['crash_at']}")
    resume = case.get("resume", True)
    if resume is not True:
        resume = str(out / "ckpt" / resume)
    directory = Path(get_last_checkpoint(str(out / "ckpt")) if resume is True else resume)
    note_resumed_from(log, json.loads((directory / TRAINED.format(process=rank)).read_text()))
    trainer(case, out, log, None).train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    run_job(run_case)
