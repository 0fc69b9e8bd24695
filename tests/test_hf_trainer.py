"""The loader inside Hugging Face's ``transformers.Trainer``: ``StructuredTrainer`` resumes exactly.

The Trainer resumes mid-epoch by rebuilding its DataLoader with Accelerate's
``skip_first_batches``, which our dataset refuses (the first resumed batch raised: 0 batches
trained). ``StructuredTrainer`` (``integrations.hf``) trains on the loader itself, saves its
state in every checkpoint directory (a file per process) and loads it on
``train(resume_from_checkpoint=True or a path)``. The jobs (``tests/trainers/hf_job.py``)
train, checkpoint, crash; a new process resumes. What every step trained on is compared with
the uninterrupted run, computed here in-process: 0 rows or tokens lost, 0 repeated, the same
batches in the same order. Cases: 0 and 2 workers, shuffled, packed,
``gradient_accumulation_steps=2``, two epochs, and 2 CPU processes under ``torchrun`` (gloo),
SIGKILLed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from _data import write_token_documents
from _launch import launch_job, torchrun
from trainers._common import (
    assert_continues,
    assert_epochs_continue,
    case_kinds,
    epochs_of,
    kind_of,
    loader_of,
    packed_case,
    rows_case,
    train_and_resume,
    uninterrupted,
)

pytest.importorskip("transformers")

JOB = Path(__file__).parent / "trainers" / "hf_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_documents(tmp_path_factory.mktemp("tokens"), docs=300)


def assert_exact(workdir: Path, case: dict[str, Any], rank: int = 0, world: int = 1) -> None:
    """The run, checkpointed at step ``save_every`` and resumed, is the uninterrupted one."""
    args = case.get("args", {})
    full = uninterrupted(case["kwargs"], rank, world, epochs=args.get("num_train_epochs", 1))
    gas = args.get("gradient_accumulation_steps", 1)
    if "max_steps" in args:
        full = full[: args["max_steps"] * gas]
    saved, crashed = case["save_every"] * gas, case["crash_at"] * gas
    assert_continues(workdir / case["name"], full, saved=saved, crashed=crashed, rank=rank)


def test_hf_trainer_resumes_exactly_in_one_process(
    parquet_dir: Path, small_split: int, tokens_dir: Path, tmp_path: Path
) -> None:
    cases = [
        {"name": "rows-w0-2epochs", "kwargs": rows_case(parquet_dir, small_split, 0),
         "save_every": 40, "crash_at": 45, "args": {"num_train_epochs": 2}},
        {"name": "rows-w2-gas2", "kwargs": rows_case(parquet_dir, small_split, 2), "save_every": 5,
         "crash_at": 8, "args": {"gradient_accumulation_steps": 2}, "resume": "checkpoint-5"},
        {"name": "packed-w2-gas2", "kwargs": packed_case(tokens_dir, 2), "save_every": 4,
         "crash_at": 6, "args": {"gradient_accumulation_steps": 2, "max_steps": 15}},
    ]  # fmt: skip
    train_and_resume(launch_job, [sys.executable, str(JOB)], cases, tmp_path)
    for case in cases:
        assert_exact(tmp_path, case)
    state = tmp_path / "rows-w2-gas2" / "ckpt" / "checkpoint-5" / "loader_state_0.json"
    assert state.is_file()


def test_hf_trainer_epochs_resume_exactly_at_every_moment(
    parquet_dir: Path, small_split: int, few_tokens: Path, tmp_path: Path
) -> None:
    """Three epochs: resumed from a checkpoint mid-epoch, on an epoch's last step, at the
    epoch-end checkpoint (``save_strategy="epoch"``), on the next epoch's first step, with
    ``gradient_accumulation_steps`` whose last group of an epoch is short: every epoch's
    batches once, in the uninterrupted order. Packed (no ``len()``: the Trainer counts
    ``max_steps`` as its epoch), a resume on an epoch's last step stopped the training
    ("There seems not to be a single sample in your epoch_iterator")."""
    kinds = case_kinds(parquet_dir, small_split, few_tokens)
    rows, packed = ({w: kinds[kind, w] for w in (0, 2)} for kind in ("rows", "packed"))
    epochs = {key: epochs_of(kwargs, epochs=3) for key, kwargs in kinds.items()}
    n, p0, p2 = len(epochs["rows", 0][0]), len(epochs["packed", 0][0]), len(epochs["packed", 2][0])
    three = {"num_train_epochs": 3}
    steps = {w: {"max_steps": sum(len(e) for e in epochs["packed", w])} for w in (0, 2)}
    gas4 = {**three, "gradient_accumulation_steps": 4}
    cases = [
        {"name": "rows-w0-mid", "kwargs": rows[0], "save_every": n + 10, "crash_at": n + 15,
         "args": three},
        {"name": "rows-w0-last", "kwargs": rows[0], "save_every": n, "crash_at": n + 3,
         "args": three},
        {"name": "rows-w2-end", "kwargs": rows[2], "crash_at": n + 5,
         "args": {**three, "save_strategy": "epoch"}},
        {"name": "rows-w0-first", "kwargs": rows[0], "save_every": n + 1, "crash_at": n + 4,
         "args": three},
        {"name": "rows-w2-gas4-last", "kwargs": rows[2], "save_every": -(-n // 4),
         "crash_at": -(-n // 4) + 2, "args": gas4},
        {"name": "rows-w0-gas4-mid", "kwargs": rows[0], "save_every": -(-n // 4) + 2,
         "crash_at": -(-n // 4) + 5, "args": gas4, "resume": f"checkpoint-{-(-n // 4) + 2}"},
        {"name": "packed-w2-last", "kwargs": packed[2], "save_every": p2, "crash_at": p2 + 2,
         "args": steps[2]},
        {"name": "packed-w0-first", "kwargs": packed[0], "save_every": p0 + 1,
         "crash_at": p0 + 3, "args": steps[0]},
        {"name": "packed-w2-mid", "kwargs": packed[2], "save_every": p2 + 10,
         "crash_at": p2 + 15, "args": steps[2]},
    ]  # fmt: skip
    train_and_resume(launch_job, [sys.executable, str(JOB)], cases, tmp_path)
    for case in cases:
        assert_epochs_continue(tmp_path / case["name"], epochs[kind_of(case["name"])])


@pytest.mark.ddp
def test_hf_trainer_two_processes_resume_exactly(tokens_dir: Path, tmp_path: Path) -> None:
    """Packed ranks yield different numbers of batches (docs/tokens.md), so a common
    ``max_steps``; each process resumes from its own ``loader_state_<rank>.json``."""
    case = {
        "name": "ddp-packed-w2-gas2", "kwargs": packed_case(tokens_dir, 2), "save_every": 3,
        "crash_at": 5, "args": {"gradient_accumulation_steps": 2, "max_steps": 9},
    }  # fmt: skip
    train_and_resume(launch_job, torchrun(2, JOB), [case], tmp_path)
    for rank in range(2):
        assert_exact(tmp_path, case, rank, 2)
        assert tmp_path / case["name"] / "ckpt" / "checkpoint-3" / f"loader_state_{rank}.json"


@pytest.mark.ddp
def test_hf_trainer_ddp_epochs_resume_exactly(
    parquet_dir: Path, small_split: int, tmp_path: Path
) -> None:
    """2 processes (gloo), 3 epochs, no ``set_epoch``: a checkpoint on epoch 0's last step,
    ``save_strategy="epoch"``'s at the end of epoch 0 (2 workers) and one mid-epoch 1 (0
    workers), process 0 SIGKILLed; each process trains every epoch of its share once, in its
    uninterrupted order, from its own ``loader_state_<rank>.json``."""
    kwargs, no_workers = (rows_case(parquet_dir, small_split, w) for w in (2, 0))
    epochs = {
        w: [epochs_of(k, r, 2, epochs=3) for r in range(2)]
        for w, k in ((2, kwargs), (0, no_workers))
    }
    n = len(epochs[2][0][0])
    assert len(epochs[2][1][0]) == n
    cases = [
        {"name": "ddp-rows-w2-last", "kwargs": kwargs, "save_every": n, "crash_at": n + 2,
         "args": {"num_train_epochs": 3}},
        {"name": "ddp-rows-w2-end", "kwargs": kwargs, "crash_at": n + 2,
         "args": {"num_train_epochs": 3, "save_strategy": "epoch"}},
        {"name": "ddp-rows-w0-mid", "kwargs": no_workers, "save_every": n + 5, "crash_at": n + 8,
         "args": {"num_train_epochs": 3}},
    ]  # fmt: skip
    train_and_resume(launch_job, torchrun(2, JOB), cases, tmp_path)
    for case in cases:
        for rank in range(2):
            expected = epochs[kind_of(case["name"].removeprefix("ddp-"))[1]][rank]
            assert_epochs_continue(tmp_path / case["name"], expected, rank)


def test_a_checkpoint_without_loader_state_says_what_to_do(
    parquet_dir: Path, small_split: int, tmp_path: Path
) -> None:
    from transformers import TrainingArguments

    from torch_dataloader_utils.integrations.hf import StructuredTrainer

    (tmp_path / "checkpoint-7").mkdir()
    loader = loader_of(rows_case(parquet_dir, small_split, 0))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = StructuredTrainer(model=_Loss(), args=args, train_dataloader=loader)
    assert trainer.get_train_dataloader() is loader and trainer.args.ignore_data_skip
    with pytest.raises(
        FileNotFoundError, match=r"loader_state_0.json not found.*StructuredTrainer"
    ):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(TypeError, match="StructuredDataLoader"):
        StructuredTrainer(model=_Loss(), args=args, train_dataloader=[])  # type: ignore[arg-type]


def _Loss() -> Any:
    import torch

    return torch.nn.Linear(1, 1)


def test_the_trainers_default_resume_names_the_fix(parquet_dir: Path, small_split: int) -> None:
    """What ``Trainer.train(resume_from_checkpoint=...)`` does to a loader returned by
    ``get_train_dataloader`` (Accelerate's ``skip_first_batches``) raises, naming the fix."""
    from accelerate.data_loader import skip_first_batches

    loader = loader_of(rows_case(parquet_dir, small_split, 0))
    with pytest.raises(RuntimeError, match=r"transformers.Trainer.*integrations\.hf\.Structured"):
        next(iter(skip_first_batches(loader, 2)))
