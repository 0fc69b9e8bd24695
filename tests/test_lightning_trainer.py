"""The loader inside Lightning's ``Trainer``: exact by default, packing included.

Lightning saves ``loader.state_dict()`` in its checkpoints and loads it on ``fit(ckpt_path=...)``.
When the loader has no ``len()`` (token packing), Lightning's fetcher reads one batch ahead,
so the state was taken with a batch handed out and not trained: one batch lost per resume.
The loader now leaves out batches held unread (``api.handout``); these jobs prove it with the
code a user writes (``tests/trainers/lightning_job.py``): train, checkpoint every few steps,
crash after more steps; a new process resumes with ``fit(ckpt_path="last")`` or a path. What
every step trained on is compared with the uninterrupted epoch, computed here in-process:
0 rows or tokens lost, 0 repeated, the same batches in the same order.

Cases: 0 and 2 workers, shuffled, packed, ``accumulate_grad_batches=2``, ``val_check_interval``
mid-epoch, ``limit_train_batches``; and DDP on 2 CPU processes under ``torchrun``, SIGKILLed.
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
    trained_values,
    uninterrupted,
)

pytest.importorskip("lightning")

TESTS = Path(__file__).parent
JOB = TESTS / "trainers" / "lightning_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_documents(tmp_path_factory.mktemp("tokens"), docs=300)


def assert_exact(workdir: Path, case: dict[str, Any], rank: int = 0, world: int = 1) -> None:
    """The run, checkpointed at step ``save_every`` and resumed, is the uninterrupted epoch."""
    full = uninterrupted(case["kwargs"], rank, world)
    full = full[: case.get("trainer", {}).get("limit_train_batches", len(full))]
    acc = case.get("trainer", {}).get("accumulate_grad_batches", 1)
    saved, crashed = case["save_every"] * acc, case["crash_at"] * acc
    assert_continues(workdir / case["name"], full, saved=saved, crashed=crashed, rank=rank)


def test_lightning_resumes_exactly_in_one_process(
    parquet_dir: Path, small_split: int, tokens_dir: Path, tmp_path: Path
) -> None:
    cases = [
        {"name": "rows-w2", "kwargs": rows_case(parquet_dir, small_split, 2), "save_every": 5,
         "crash_at": 8},
        {"name": "packed-w0", "kwargs": packed_case(tokens_dir, 0), "save_every": 5, "crash_at": 8,
         "ckpt_path": "epoch=0-step=5.ckpt"},
        {"name": "packed-w2-acc2-val", "kwargs": packed_case(tokens_dir, 2), "save_every": 3,
         "crash_at": 5, "trainer": {"accumulate_grad_batches": 2, "val_check_interval": 4}},
        {"name": "packed-w2-limit", "kwargs": packed_case(tokens_dir, 2), "save_every": 4,
         "crash_at": 6, "trainer": {"limit_train_batches": 12}},
    ]  # fmt: skip
    train_and_resume(launch_job, [sys.executable, str(JOB)], cases, tmp_path)
    for case in cases:
        assert_exact(tmp_path, case)
    # where _compat.LIGHTNING_LOADER_STATES says Lightning keeps the loader's state
    import torch

    from torch_dataloader_utils.base.compat import LIGHTNING_LOADER_STATES

    found = torch.load(tmp_path / "packed-w0" / "ckpt" / "last.ckpt", weights_only=False)
    for key in LIGHTNING_LOADER_STATES:
        found = found[key]
    assert isinstance(found, list) and found[0]["_packing"] == ["tokens", -1]


def test_lightning_epochs_resume_exactly_at_every_moment(
    parquet_dir: Path, small_split: int, few_tokens: Path, tmp_path: Path
) -> None:
    """Three epochs, no ``set_epoch`` anywhere: the loader's ``sampler.set_epoch``, which
    Lightning calls before each epoch's first batch, moves it to Lightning's epoch. Resumed
    from a checkpoint mid-epoch, on an epoch's last step (``every_n_train_steps``), at the
    default epoch-end checkpoint, on the next epoch's first step, at a validation that
    ``val_check_interval`` puts across an epoch's end, with accumulation: every epoch's
    batches once, in the uninterrupted order. Before, with the recipe of docs/trainers.md in
    ``on_train_epoch_start``, an epoch-end step checkpoint trained 0 batches of the next
    epoch, and the epoch-end checkpoint without workers trained epoch 0's order again. A
    packed loader (no ``len()``) resumed from the epoch-end checkpoint: Lightning takes a
    batch of epoch 0 before ``set_epoch(1)``; the iteration restarts under it (``api.feed``),
    where it raised ``RuntimeError`` before."""
    kinds = case_kinds(parquet_dir, small_split, few_tokens)
    rows, packed = ({w: kinds[kind, w] for w in (0, 2)} for kind in ("rows", "packed"))
    epochs = {key: epochs_of(kwargs, epochs=3) for key, kwargs in kinds.items()}
    n, p0, p2 = len(epochs["rows", 0][0]), len(epochs["packed", 0][0]), len(epochs["packed", 2][0])
    end = {}  # Lightning's default ModelCheckpoint: at each epoch's end
    at_validation = {"save_on_train_epoch_end": False}
    across = {"val_check_interval": 7, "check_val_every_n_epoch": None}
    cases = [
        {"name": "rows-w0-mid", "kwargs": rows[0], "save_every": n + 10, "crash_at": n + 15},
        {"name": "rows-w0-last", "kwargs": rows[0], "save_every": n, "crash_at": n + 3},
        {"name": "rows-w2-last", "kwargs": rows[2], "save_every": n, "crash_at": n + 3},
        {"name": "rows-w0-end", "kwargs": rows[0], "checkpoint": end, "crash_at": n + 3},
        {"name": "rows-w2-end", "kwargs": rows[2], "checkpoint": end, "crash_at": 2 * n + 5},
        {"name": "rows-w2-first", "kwargs": rows[2], "save_every": n + 1, "crash_at": n + 4},
        {"name": "rows-w2-acc4-last", "kwargs": rows[2], "save_every": -(-n // 4),
         "crash_at": -(-n // 4) + 2, "trainer": {"accumulate_grad_batches": 4}},
        {"name": "rows-w0-acc3-val-across", "kwargs": rows[0], "checkpoint": at_validation,
         "crash_at": 12, "trainer": {"accumulate_grad_batches": 3, **across}},
        {"name": "packed-w0-last", "kwargs": packed[0], "save_every": p0, "crash_at": p0 + 3},
        {"name": "packed-w2-end", "kwargs": packed[2], "checkpoint": end, "crash_at": p2 + 4},
        {"name": "packed-w2-acc2-first", "kwargs": packed[2], "save_every": -(-p2 // 2) + 1,
         "crash_at": -(-p2 // 2) + 3, "trainer": {"accumulate_grad_batches": 2}},
        {"name": "packed-w0-val-across", "kwargs": packed[0], "checkpoint": at_validation,
         "crash_at": p0 + 8, "trainer": across},
        {"name": "packed-w2-mid", "kwargs": packed[2], "save_every": p2 + 10,
         "crash_at": p2 + 15},
        {"name": "packed-w2-last", "kwargs": packed[2], "save_every": p2, "crash_at": p2 + 3},
        {"name": "packed-w0-end", "kwargs": packed[0], "checkpoint": end, "crash_at": p0 + 4},
        {"name": "packed-w2-limit-last", "kwargs": packed[2], "save_every": 12, "crash_at": 15,
         "trainer": {"limit_train_batches": 12}},
    ]  # fmt: skip
    for case in cases:
        case["epochs"] = 3
    train_and_resume(launch_job, [sys.executable, str(JOB)], cases, tmp_path)
    for case in cases:
        limit = case.get("trainer", {}).get("limit_train_batches")
        expected = [epoch[:limit] for epoch in epochs[kind_of(case["name"])]]
        assert_epochs_continue(tmp_path / case["name"], expected)


@pytest.mark.ddp
def test_lightning_ddp_two_processes_resume_exactly(tokens_dir: Path, tmp_path: Path) -> None:
    """Packed ranks yield different numbers of batches (docs/tokens.md, "Under DDP"), so DDP
    runs a common number: ``limit_train_batches``."""
    case = {
        "name": "ddp-packed-w2-acc2-val", "kwargs": packed_case(tokens_dir, 2), "save_every": 2,
        "crash_at": 3, "trainer": {"accumulate_grad_batches": 2, "val_check_interval": 3,
                                   "limit_train_batches": 20},
    }  # fmt: skip
    train_and_resume(launch_job, torchrun(2, JOB), [case], tmp_path)
    for rank in range(2):
        assert_exact(tmp_path, case, rank, 2)


@pytest.mark.ddp
def test_lightning_ddp_epochs_resume_exactly(
    parquet_dir: Path, small_split: int, few_tokens: Path, tmp_path: Path
) -> None:
    """2 processes (gloo), ``LoaderStatesPerRank``, 3 epochs, no ``set_epoch``: a checkpoint on
    epoch 0's last step, and Lightning's default epoch-end one (whose loader states Lightning
    does not load: the sampler's ``set_epoch`` moves each process's loader), process 0
    SIGKILLed; each process trains every epoch of its share once, in its uninterrupted order;
    the epoch-end checkpoint with 0 workers too. Packed, the processes' epochs end at a common
    ``limit_train_batches`` (docs/tokens.md, "Under DDP"): a checkpoint on its last step,
    mid-epoch for the loader."""
    kwargs, no_workers = (rows_case(parquet_dir, small_split, w) for w in (2, 0))
    epochs = [epochs_of(kwargs, rank, 2, epochs=3) for rank in range(2)]
    epochs_w0 = [epochs_of(no_workers, rank, 2, epochs=3) for rank in range(2)]
    n, limit = len(epochs[0][0]), 8
    packed = packed_case(few_tokens, 2)
    packed_epochs = [epochs_of(packed, rank, 2, epochs=3) for rank in range(2)]
    assert min(len(epoch) for rank in packed_epochs for epoch in rank) > limit
    cases = [
        {"name": "ddp-rows-w2-last", "kwargs": kwargs, "save_every": n, "crash_at": n + 2,
         "epochs": 3},
        {"name": "ddp-rows-w2-end", "kwargs": kwargs, "checkpoint": {}, "crash_at": n + 2,
         "epochs": 3},
        {"name": "ddp-packed-w2-limit-last", "kwargs": packed, "save_every": limit,
         "crash_at": limit + 2, "epochs": 3, "trainer": {"limit_train_batches": limit}},
        {"name": "ddp-rows-w0-end", "kwargs": no_workers, "checkpoint": {}, "crash_at": n + 2,
         "epochs": 3},
    ]  # fmt: skip
    train_and_resume(launch_job, torchrun(2, JOB), cases, tmp_path)
    for rank in range(2):
        for case in cases[:2]:
            assert_epochs_continue(tmp_path / case["name"], epochs[rank], rank)
        assert_epochs_continue(tmp_path / cases[3]["name"], epochs_w0[rank], rank)
        limited = [epoch[:limit] for epoch in packed_epochs[rank]]
        assert_epochs_continue(tmp_path / cases[2]["name"], limited, rank)


def test_another_process_state_names_the_callback(parquet_dir: Path, small_split: int) -> None:
    """Without ``LoaderStatesPerRank`` every DDP process gets process 0's state: it refuses
    it loudly and names the callback."""
    from torch_dataloader_utils import CheckpointMismatchError

    kwargs = rows_case(parquet_dir, small_split, 0)
    first = loader_of({**kwargs, "rank": 0, "world_size": 2})
    trained_values(next(iter(first)))
    second = loader_of({**kwargs, "rank": 1, "world_size": 2})
    with pytest.raises(CheckpointMismatchError) as raised:
        second.load_state_dict(first.state_dict())
    assert any("LoaderStatesPerRank()" in note for note in raised.value.__notes__)
