"""Loops that read ahead: a state taken while a batch is held unread still matches the steps.

A trainer that reads one batch ahead (Lightning's fetcher when the loader has no ``len()``, a
hand-written loop that fetches the next batch before the step) holds a batch the loader has
handed out but no step has used. ``loader.state_dict()`` leaves out such batches (dict
batches tell the loader when they are first read: ``torch_dataloader_utils.api.handout``), so a
resume trains them: 0 lost, 0 repeated, the uninterrupted order, with 0 and 2 workers,
shuffled, and packed to the token.
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _harness
import pytest
import torch
from _data import write_token_documents

from torch_dataloader_utils import TokenPacking
from torch_dataloader_utils.api.handout import KEEP, UnreadBatch

WORKERS = (0, 2)


def _values(batch: Any) -> list[int]:
    """What a step trains on: row ids, or a packed batch's real tokens."""
    if "id" in batch:
        return [int(i) for i in batch["id"].tolist()]
    return [int(t) for t in batch["input_ids"].flatten()[: batch["num_tokens"]].tolist()]


def _steps_reading_ahead(loader: Any, k: int) -> tuple[list[list[int]], dict[str, Any]]:
    """``k`` steps of a loop that fetches the next batch before each step (as Lightning's
    fetcher does); the state taken after step ``k``, while batch ``k + 1`` is held unread."""
    it: Iterator[Any] = iter(loader)
    ahead = next(it)
    trained = []
    for _ in range(k):
        batch, ahead = ahead, next(it)
        trained.append(_values(batch))  # the step reads its batch
    state = loader.state_dict()
    del it, ahead
    return trained, state


def _rest(case: dict[str, Any], state: dict[str, Any]) -> list[list[int]]:
    loader, _ = _harness.make_loader(case)
    loader.load_state_dict(_harness.json_round_trip(state))
    return [_values(b) for b in loader]


def _assert_exact(case: dict[str, Any], k: int) -> None:
    loader, _ = _harness.make_loader(case)
    full = [_values(b) for b in loader]
    assert len(full) > k + 1
    loader, _ = _harness.make_loader(case)
    trained, state = _steps_reading_ahead(loader, k)
    assert trained == full[:k]
    assert _rest(case, state) == full[k:]  # batch k + 1 is not lost: 0 lost, 0 repeated


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_documents(tmp_path_factory.mktemp("tokens"))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_loop_reading_one_batch_ahead_resumes_exactly(
    parquet_dir: Path, small_split: int, workers: int
) -> None:
    case = {"path": str(parquet_dir), "split_bytes": small_split, "batch_size": 24}
    case |= {"num_workers": workers, "shuffle": True, "shuffle_seed": 7}
    for k in (1, 5):
        _assert_exact(case, k)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_packed_loop_reading_one_batch_ahead_resumes_at_the_token(
    tokens_dir: Path, workers: int
) -> None:
    packing = TokenPacking("tokens", seq_len=16, separator=-1)
    case = {"path": str(tokens_dir), "batch_size": 4, "split_bytes": 2_000, "packing": packing}
    _assert_exact({**case, "num_workers": workers, "shuffle": True}, 6)


def test_a_state_taken_before_the_step_reads_its_batch_leaves_it_out(
    parquet_dir: Path, small_split: int
) -> None:
    """``for batch in loader: save(); step(batch)``: the checkpoint precedes the step."""
    case = {"path": str(parquet_dir), "split_bytes": small_split, "batch_size": 24}
    full = [_values(b) for b in _harness.make_loader(case)[0]]
    loader, _ = _harness.make_loader(case)
    for step, batch in enumerate(loader):
        if step == 3:
            state = loader.state_dict()
            break
        _values(batch)
    assert _rest(case, state) == full[3:]


def test_batches_taken_unread_before_any_step_count_as_consumed(
    parquet_dir: Path, small_split: int
) -> None:
    """``list(loader)`` or ``next(it)`` without a look: nothing was read ahead of a step."""
    case = {"path": str(parquet_dir), "split_bytes": small_split, "batch_size": 24}
    full = [_values(b) for b in _harness.make_loader(case)[0]]
    loader, dataset = _harness.make_loader(case)
    it = iter(loader)
    taken = [next(it) for _ in range(3)]
    state = loader.state_dict()
    assert state == dataset.state_dict()
    del it
    assert [_values(b) for b in taken] == full[:3]
    assert _rest(case, state) == full[3:]


def test_the_left_out_batches_are_logged(
    parquet_dir: Path, small_split: int, caplog: pytest.LogCaptureFixture
) -> None:
    case = {"path": str(parquet_dir), "split_bytes": small_split, "batch_size": 24}
    loader, _ = _harness.make_loader(case)
    with caplog.at_level(logging.INFO, logger="torch_dataloader_utils"):
        _steps_reading_ahead(loader, 2)
    messages = [r.getMessage() for r in caplog.records if "not read yet" in r.getMessage()]
    assert messages and "1 batch(es)" in messages[0] and "reading ahead" in messages[0]


def test_an_unread_batch_is_a_dict_and_any_read_counts(parquet_dir: Path) -> None:
    loader, _ = _harness.make_loader({"path": str(parquet_dir), "batch_size": 10})
    reads = {
        "item": lambda b: b["id"],
        "unpack": lambda b: (lambda **kw: kw)(**b),
        "dict": dict,
        "items": lambda b: list(b.items()),
        "in": lambda b: "id" in b,
        "pickle": pickle.dumps,
        "copy": copy.copy,
        "send": lambda b: {k: v.to("cpu") for k, v in b.items() if isinstance(v, torch.Tensor)},
    }
    for name, read in reads.items():
        it = iter(loader)
        first = next(it)
        _values(first)  # a step has read batch 1
        held = next(it)
        assert isinstance(held, dict) and type(held) is UnreadBatch
        unread = loader.state_dict()
        read(held)
        assert loader.state_dict() != unread, f"{name} did not count as a read"
        del it
    plain = pickle.loads(pickle.dumps(held))
    assert type(plain) is dict and plain.keys() == held.keys()


def test_a_loop_holding_more_than_a_trainer_reads_ahead_is_warned(parquet_dir: Path) -> None:
    """Positions are kept for ``KEEP`` batches held unread; beyond, the state counts them as
    consumed and says so (no silent loss)."""
    loader, dataset = _harness.make_loader({"path": str(parquet_dir), "batch_size": 5})
    it = iter(loader)
    _values(next(it))
    held = [next(it) for _ in range(KEEP + 1)]
    with pytest.warns(UserWarning, match=f"holds {KEEP + 1} batches unread"):
        state = loader.state_dict()
    assert state == dataset.state_dict() and len(held) == KEEP + 1
    del it
