"""The migration examples in ``examples/`` run as a user runs them, and verify themselves.

Each example generates its small dataset, checkpoints, "crashes", resumes, asserts that the
continuation is exact and every row is delivered once, and prints a one-line summary. The
single-process ones run with ``python``; the others under ``python -m torch.distributed.run``
with 2 ranks (gloo on 127.0.0.1, a free port, ``GLOO_SOCKET_IFNAME=lo``), as ``test_ddp.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _launch import run_logged, torchrun

EXAMPLES = Path(__file__).parent.parent / "examples"
TIMEOUT = 180

pytestmark = pytest.mark.slow


def run_example(
    name: str, workdir: Path, *, ranks: int = 0, args: tuple[str, ...] | list[str] = ()
) -> str:
    """Run ``examples/<name>`` (under torchrun when ``ranks``); its output, after exit 0."""
    script = EXAMPLES / name
    launcher = torchrun(ranks, script) if ranks else [sys.executable, str(script)]
    code, out = run_logged(
        [*launcher, "--workdir", str(workdir), *args],
        log_file=workdir / f"{name}.log",
        cwd=workdir,
        pythonpath=[str(EXAMPLES.parent)],
        timeout=TIMEOUT,
    )
    assert code == 0, f"{name} failed ({code}):\n{out[-4000:]}"
    return out


def summary(out: str, name: str) -> str:
    """The example's one summary line (each prints exactly one per loader it shows)."""
    lines = [line for line in out.splitlines() if line.startswith(name)]
    assert lines, f"no summary line from {name}:\n{out[-2000:]}"
    return "\n".join(lines)


def test_from_mosaic_streaming(tmp_path: Path) -> None:
    line = summary(run_example("from_mosaic_streaming.py", tmp_path), "from_mosaic_streaming")
    assert "2 epochs x 2400 rows in 152 batches" in line
    assert "resumed: 127 batches and the final weights identical" in line
    assert "every row once per epoch" in line
    assert (tmp_path / "checkpoint.pt").is_file()


def test_from_hf_datasets(tmp_path: Path) -> None:
    lines = summary(run_example("from_hf_datasets.py", tmp_path), "from_hf_datasets").splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "from_hf_datasets (StatefulDataLoader)",
        "from_hf_datasets (create_dataloader)",
    ]
    for line in lines:
        assert "2 ranks x 2 workers, checkpoint after 7 batches, resumed exactly" in line
        assert "2400 of 2400 rows, each once" in line


@pytest.mark.ddp
def test_from_energon(tmp_path: Path) -> None:
    line = summary(run_example("from_energon.py", tmp_path, ranks=2), "from_energon")
    assert (
        "resumed exactly through restore_state_rank, restore_state_global(src_rank=0), "
        "restore_state_global(src_rank=None)"
    ) in line
    assert "2400 of 2400 rows, each once" in line
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["global.pt", "rank0.pt", "rank1.pt"]


@pytest.mark.ddp
def test_ddp_gather(tmp_path: Path) -> None:
    out = run_example("ddp_gather.py", tmp_path, ranks=2)
    line = summary(out, "ddp_gather")
    assert "2 ranks x 75 steps; saved at step 20, 5 steps lost" in line
    assert "identical to the uninterrupted run, 2400 of 2400 rows each once" in line
    assert "CheckpointMismatchError on every rank, epoch restarted, 3000 of 3000 rows" in line
    assert "Likely cause: files changed" in out  # what the job printed when it caught it


@pytest.mark.ddp
def test_dcp_stateful(tmp_path: Path) -> None:
    line = summary(run_example("dcp_stateful.py", tmp_path, ranks=2), "dcp_stateful")
    assert "2 ranks x 75 steps; dcp.save at step 20" in line
    assert "dcp.load: batches and final weights identical to the uninterrupted run" in line
    assert "2400 of 2400 rows each once" in line
    assert (tmp_path / "checkpoint" / ".metadata").is_file()


def test_train_tiny_lm_on_packed_tokens(tmp_path: Path) -> None:
    out = run_example("train_tiny_lm.py", tmp_path, args=["--num-workers", "2"])
    line = summary(out, "train_tiny_lm")
    assert "59 steps of 4 x 64 tokens; crashed at step 23, resumed from step 20" in line
    assert "the same 39 batches, the same weights, 14858 tokens each trained on once" in line


def test_train_from_text(tmp_path: Path) -> None:
    """Text Parquet tokenized in 2 workers, packed, crashed, resumed, checked token for token."""
    out = run_example("train_from_text.py", tmp_path, args=["--num-workers", "2"])
    line = summary(out, "train_from_text")
    assert "400 texts, 32 steps of 4 x 64 tokens; crashed at step 17, resumed from step 10" in line
    assert "the same 22 batches, the same weights, 8014 tokens each trained on once" in line
    assert "another tokenizer refused" in line


def test_sft_chat(tmp_path: Path) -> None:
    """Chat Parquet rendered and tokenized in 2 workers, whole conversations packed with their
    labels, the loss on the assistant's tokens; crashed, resumed, checked token for token."""
    out = run_example("sft_chat.py", tmp_path, args=["--num-workers", "2"])
    line = summary(out, "sft_chat")
    assert "300 conversations, 22 steps of 4 x 256 tokens, 20372 tokens (876 padding)" in line
    assert "5820 of them the assistant's (the loss's)" in line
    assert "crashed at step 13, resumed from step 8: the same 14 batches (input_ids and " in line
    assert "the same weights, every conversation once and whole" in line
    assert "another template refused" in line


@pytest.mark.ddp
def test_ddp_packed(tmp_path: Path) -> None:
    line = summary(run_example("ddp_packed.py", tmp_path, ranks=2), "ddp_packed")
    assert "saved at step 12, 4 lost; resumed identically" in line
    assert "the rest after the common stop delivered elastically" in line


@pytest.mark.ddp
def test_train_mixture(tmp_path: Path) -> None:
    """A packed 3-source mixture under DDP: crash, resume, reweight with a source added."""
    line = summary(run_example("train_mixture.py", tmp_path, ranks=2), "train_mixture")
    assert "resumed identically after a crash at step 8 (checkpoint at 5)" in line
    assert "reweighted to {'web': 5, 'code': 3, 'math': 4, 'books': 2}" in line
    assert "tokens each trained on once" in line


def test_hf_trainer(tmp_path: Path) -> None:
    """StructuredTrainer: crash at step 6, train(resume_from_checkpoint=True), packed (workers:
    tests/test_hf_trainer.py)."""
    out = run_example("hf_trainer.py", tmp_path, args=["--num-workers", "0"])
    line = summary(out, "hf_trainer")
    assert "resumed from checkpoint-4" in line and "every token once" in line
    assert (tmp_path / "hf-checkpoints" / "checkpoint-4" / "loader_state_0.json").is_file()


def test_lightning_trainer(tmp_path: Path) -> None:
    """Lightning's Trainer with nothing added: crash, fit(ckpt_path="last"), packed (workers:
    tests/test_lightning_trainer.py)."""
    out = run_example("lightning_trainer.py", tmp_path, args=["--num-workers", "0"])
    line = summary(out, "lightning_trainer")
    assert "resumed from step 5" in line and "every token once" in line
