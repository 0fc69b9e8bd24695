"""The loader inside Lightning's ``Trainer``: exact by default, packing included.

Lightning saves ``loader.state_dict()`` in its checkpoints and loads it on ``fit(ckpt_path=...)``.
When the loader has no ``len()`` (token packing), Lightning's fetcher reads one batch ahead,
so the state was taken with a batch handed out and not trained: one batch lost per resume.
The loader now leaves out batches held unread (``_handout``); these jobs prove it with the
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

    from torch_dataloader_utils._compat import LIGHTNING_LOADER_STATES

    found = torch.load(tmp_path / "packed-w0" / "ckpt" / "last.ckpt", weights_only=False)
    for key in LIGHTNING_LOADER_STATES:
        found = found[key]
    assert isinstance(found, list) and found[0]["_packing"] == ["tokens", -1]


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
