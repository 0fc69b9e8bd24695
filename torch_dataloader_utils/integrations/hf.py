"""Hugging Face ``transformers.Trainer`` on a ``StructuredDataLoader``, resuming exactly.

``transformers.Trainer`` builds its own DataLoader from ``train_dataset`` and, when resuming
mid-epoch, skips the trained batches by rebuilding it with Accelerate's
``skip_first_batches`` (which reads and discards them; our dataset refuses it). This module
gives the Trainer the loader itself, saves the loader's state in every checkpoint directory
(one file per process), and loads it on ``train(resume_from_checkpoint=...)``, so the loader
starts where the checkpoint left off and nothing is skipped by reading:

    trainer = StructuredTrainer(model=model, args=args, train_dataloader=loader)
    trainer.train(resume_from_checkpoint=True)  # or a checkpoint directory

A Trainer subclass of your own (e.g. ``trl``'s) takes the mixin first:
``class MyTrainer(StructuredTrainerMixin, SFTTrainer)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint

from ..api.loader import StructuredDataLoader

__all__ = ["LOADER_STATE_FILE", "DataStatsCallback", "StructuredTrainer", "StructuredTrainerMixin"]

# The loader's state of process ``{process}`` in a checkpoint directory.
LOADER_STATE_FILE = "loader_state_{process}.json"

if TYPE_CHECKING:  # the mixin is type-checked as the Trainer it is mixed into
    _Base = Trainer
else:
    _Base = object


class StructuredTrainerMixin(_Base):
    """Train a ``transformers.Trainer`` (subclass) on ``train_dataloader``, resuming exactly.

    Takes the Trainer's arguments plus ``train_dataloader`` (the loader of
    ``StructuredDataset.create_dataloader``; ``train_dataset`` is not used). Every checkpoint
    directory gets ``loader_state_<process>.json``; ``train(resume_from_checkpoint=path or
    True)`` loads it before training, and the Trainer's own fast-forward is off
    (``args.ignore_data_skip = True``): the loader starts at the checkpoint by itself. Each
    epoch after the first starts the loader's next epoch (``set_epoch``). With
    ``data_stats=True`` every log also holds the loader's ``data/...`` figures
    (``DataStatsCallback``).

    The ``TrainingArguments`` ``dataloader_*`` settings do not apply: pass ``num_workers``,
    ``pin_memory``, ... to ``create_dataloader``.
    """

    def __init__(
        self,
        *args: Any,
        train_dataloader: StructuredDataLoader,
        data_stats: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(train_dataloader, StructuredDataLoader):
            raise TypeError(
                f"train_dataloader must be the StructuredDataLoader of "
                f"StructuredDataset.create_dataloader, got {type(train_dataloader).__name__}"
            )
        super().__init__(*args, **kwargs)
        self.structured_loader = train_dataloader
        train_dataloader.dataset._trainer_moves_epochs()  # epoch-end states say "finished"
        self.args.ignore_data_skip = True  # the loader resumes from its state, not by skipping
        self.add_callback(_LoaderCheckpoints(train_dataloader))
        if data_stats:  # first: the reporters (wandb, ...) then see the figures
            self.callback_handler.callbacks.insert(0, DataStatsCallback(train_dataloader))

    def get_train_dataloader(self) -> Any:
        """The loader itself: not rebuilt, not prepared by Accelerate (it shards by rank)."""
        return self.structured_loader

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """``Trainer.train``, the loader first restored from the checkpoint's state."""
        checkpoint = _checkpoint_dir(resume_from_checkpoint, str(self.args.output_dir))
        if checkpoint is not None:
            state = _read_state(Path(checkpoint), self.args.process_index)
            self.structured_loader.load_state_dict(state)
            resume_from_checkpoint = checkpoint
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)


class StructuredTrainer(StructuredTrainerMixin, Trainer):
    """``transformers.Trainer`` with ``StructuredTrainerMixin``:
    ``StructuredTrainer(model=..., args=..., train_dataloader=loader)``."""


class _LoaderCheckpoints(TrainerCallback):
    """Writes the loader's state into each checkpoint directory; moves it to the next epoch."""

    def __init__(self, loader: StructuredDataLoader) -> None:
        self.loader = loader
        self._epochs_begun = 0

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        self._epochs_begun = 0

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        dataset = self.loader.dataset
        self._epochs_begun += 1
        # The Trainer's epoch number cannot say where the loader stands: without a len()
        # (packing) it counts max_steps as an epoch. Each of its epochs iterates the loader to
        # its end, so the loader's next epoch follows each one; the first of a run continues
        # the loader (a state saved "finished" continues with the next epoch by itself; one
        # saved at an epoch's end before that key existed is moved on here).
        if self._epochs_begun > 1 or dataset._ended():
            dataset.set_epoch(dataset.epoch + 1)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        directory = Path(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOADER_STATE_FILE.format(process=args.process_index)
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.loader.state_dict()))
        os.replace(partial, path)


class DataStatsCallback(TrainerCallback):
    """Adds ``loader.stats()``'s key figures (``data/wait_fraction``, ``data/rows_per_second``,
    ..., ``LoaderStats.metrics()``) to every log of the Trainer:
    ``Trainer(..., callbacks=[DataStatsCallback(loader)])``.

    The Trainer calls its reporting callbacks (wandb, TensorBoard, ...) before the ones it is
    given, so this one also puts the figures into the log just recorded in
    ``state.log_history``; for the reporters to see them, put it first:
    ``trainer.callback_handler.callbacks.insert(0, DataStatsCallback(loader))``.
    ``StructuredTrainer(..., data_stats=True)`` does that.
    """

    def __init__(self, loader: StructuredDataLoader, recent_seconds: float = 10.0) -> None:
        self.loader = loader
        self.recent_seconds = recent_seconds

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        metrics = self.loader.stats(self.recent_seconds).metrics()
        if logs is not None:
            logs.update(metrics)
        if state.log_history:
            state.log_history[-1].update(metrics)


def _checkpoint_dir(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint directory ``Trainer.train`` will resume from (``True``: the latest in
    ``output_dir``, as the Trainer picks it); ``None`` when not resuming or none is there
    (the Trainer then says so itself)."""
    if resume_from_checkpoint is True:
        if not os.path.isdir(output_dir):
            return None
        last: str | None = get_last_checkpoint(output_dir)  # type: ignore[no-untyped-call]
        return last
    if not resume_from_checkpoint:
        return None
    return str(resume_from_checkpoint)


def _read_state(checkpoint: Path, process: int) -> dict[str, Any]:
    path = checkpoint / LOADER_STATE_FILE.format(process=process)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: checkpoint {checkpoint} holds no loader state for process "
            f"{process}, so the loader cannot continue where it stopped. It was saved without "
            f"StructuredTrainer (or by fewer processes). Resume from a checkpoint that "
            f"StructuredTrainer wrote, or start the epoch afresh with "
            f"train(resume_from_checkpoint=None)"
        )
    state: dict[str, Any] = json.loads(path.read_text())
    return state
