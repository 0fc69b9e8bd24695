"""Hugging Face's ``Trainer`` on packed token sequences: crash, resume from the checkpoint, exact.

``StructuredTrainer`` (``torch_dataloader_utils.integrations.hf``) is ``transformers.Trainer``
trained on the loader of ``create_dataloader``: it saves the loader's state in every
checkpoint directory (``loader_state_<process>.json``) and loads it when training resumes, so
the loader continues where the checkpoint left off (the Trainer's own fast-forward, which
rebuilds the loader and skips batches by reading them, is off).

The run checkpoints every ``EVERY`` steps with ``gradient_accumulation_steps=2``, crashes at
step ``CRASH_AT``, and a new trainer, model and loader resume from the last checkpoint. It
checks that every token was trained on exactly once, in the uninterrupted order.

    python examples/hf_trainer.py [--workdir DIR] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path
from typing import Any

import torch
from train_tiny_lm import PACKING, SEQUENCES, TinyLM, loss_of, write_documents
from transformers import TrainerCallback, TrainingArguments

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.integrations.hf import StructuredTrainer

EVERY, CRASH_AT, MAX_STEPS = 4, 6, 12


class Crash(Exception):
    pass


class CrashAt(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == CRASH_AT:
            raise Crash  # the job dies; what was trained after the checkpoint is lost


class PackedLM(torch.nn.Module):
    """The Trainer calls ``model(**batch)`` and takes ``loss`` from what it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()
        self.trained: list[torch.Tensor] = []  # the tokens of each batch, to check the run

    def forward(self, **batch: Any) -> dict[str, torch.Tensor]:
        self.trained.append(batch["input_ids"].flatten()[: batch["num_tokens"]].clone())
        return {"loss": loss_of(self.model, batch)}


def run(data: Path, output: Path, workers: int, **train: Any) -> PackedLM:
    loader, _ = StructuredDataset.create_dataloader(
        str(data), batch_size=SEQUENCES, packing=PACKING, shuffle=True, num_workers=workers
    )
    args = TrainingArguments(
        output_dir=str(output), max_steps=MAX_STEPS, gradient_accumulation_steps=2,
        save_steps=EVERY, learning_rate=1e-3, use_cpu=True, report_to=[], disable_tqdm=True,
        logging_strategy="no",
    )  # fmt: skip
    model = PackedLM()
    crash = [CrashAt()] if not train else []
    trainer = StructuredTrainer(model=model, args=args, train_dataloader=loader, callbacks=crash)
    with contextlib.suppress(Crash):
        trainer.train(**train)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.mkdtemp()))
    parser.add_argument("--num-workers", type=int, default=2)
    args = parser.parse_args()
    data, output = args.workdir / "docs", args.workdir / "hf-checkpoints"
    write_documents(data, files=2, docs=40)

    full = torch.cat(run(data, args.workdir / "uninterrupted", args.num_workers,
                         resume_from_checkpoint=None).trained)  # fmt: skip
    crashed = run(data, output, args.num_workers)
    resumed = run(data, output, args.num_workers, resume_from_checkpoint=True)  # latest

    done = torch.cat(crashed.trained[: EVERY * 2] + resumed.trained)  # 2 batches a step
    assert torch.equal(done, full), "the resumed run did not continue the uninterrupted one"
    print(
        f"hf_trainer: {len(full)} tokens in {MAX_STEPS} steps of 2 batches; crashed at step "
        f"{CRASH_AT}, resumed from checkpoint-{EVERY}: {len(resumed.trained)} batches, every "
        f"token once in the uninterrupted order"
    )


if __name__ == "__main__":
    main()
