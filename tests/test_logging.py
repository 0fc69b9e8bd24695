"""What the library logs (logger ``torch_dataloader_utils``), and that it prints nothing itself."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.index.build import _local_rank
from torch_dataloader_utils.storage.retry import RetryPolicy, retry_call

LOGGER = "torch_dataloader_utils"


def test_retries_are_logged_with_what_and_the_attempt(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("peer reset")
        return "ok"

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = retry_call(flaky, RetryPolicy(attempts=4, base_delay=0), what="reading s3://b/k")
    assert got == "ok"
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2
    assert messages[0].startswith("reading s3://b/k failed (ConnectionResetError: peer reset)")
    assert "attempt 2 of 4" in messages[0] and "attempt 3 of 4" in messages[1]


def test_index_cache_hits_and_misses_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "cache"))
    write_dataset(tmp_path / "data", [20, 30], row_group_size=10)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        StructuredDataset(str(tmp_path / "data"))
        StructuredDataset(str(tmp_path / "data"))
    lines = [r.getMessage() for r in caplog.records if "footer(s) cached" in r.getMessage()]
    assert len(lines) == 2
    assert "0 of 2 footer(s) cached, 2 read from storage" in lines[0]
    assert "2 of 2 footer(s) cached, 0 read from storage" in lines[1]


def test_resume_position_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_dataset(tmp_path, [50], row_group_size=10)
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=10)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=10)
    loader.load_state_dict(state)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert len(list(loader)) == 4
    assert any("resumes epoch 0 at rows [10]" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("value", "rank"), [(None, 0), ("0", 0), ("3", 3), ("x", 0)])
def test_progress_bars_only_on_local_rank_zero(
    monkeypatch: pytest.MonkeyPatch, value: str | None, rank: int
) -> None:
    if value is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", value)
    assert _local_rank() == rank


def test_the_library_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    write_dataset(tmp_path, [30, 30], row_group_size=10)
    loader, _ = StructuredDataset.create_dataloader(
        str(tmp_path), batch_size=7, shuffle=True, world_size=4, rank=1, num_workers=2
    )
    assert sum(len(b["id"]) for b in loader) == 15  # 60 rows over 4 ranks, evened out
    out, err = capfd.readouterr()
    assert out == "" and err == ""


_UNCONFIGURED = """
import logging, sys
import torch_dataloader_utils
from torch_dataloader_utils.storage.retry import RetryPolicy, retry_call

def flaky():
    flaky.calls += 1
    if flaky.calls % 2:
        raise ConnectionResetError("peer reset")
    return "ok"

flaky.calls = 0
policy = RetryPolicy(attempts=2, base_delay=0)
print(retry_call(flaky, policy, what="reading s3://b/k"))
print("-- logging configured --", file=sys.stderr, flush=True)
logging.basicConfig(level=logging.WARNING)
print(retry_call(flaky, policy, what="reading s3://b/k"))
"""


def test_records_reach_stderr_only_once_logging_is_configured() -> None:
    # A fresh interpreter: Python's last-resort handler prints WARNINGs of a logger without
    # handlers to stderr when nothing configured logging.
    done = subprocess.run(
        [sys.executable, "-c", _UNCONFIGURED],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\nok\n"
    before, _, after = done.stderr.partition("-- logging configured --\n")
    assert before == ""
    assert after.startswith(f"WARNING:{LOGGER}:reading s3://b/k failed (ConnectionResetError")
    assert after.count("\n") == 1, after
