"""Footers are held serialized and parsed when read from; a process keeps a bounded number of
them parsed (issue 32: a mixture's first windows touched every file, and every parsed footer
stayed in memory)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.index import parsed
from torch_dataloader_utils.index.parsed import SerializedMetadata, hold_parsed_footers

FILES = 40
ROWS = [25] * FILES


@pytest.fixture
def data(tmp_path: Path) -> Path:
    write_dataset(tmp_path / "data", ROWS, row_group_size=5)
    return tmp_path / "data"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> parsed._ParsedFooters:
    """This process's parsed footers, empty and with no bound set (a test's own)."""
    footers = parsed._ParsedFooters()
    monkeypatch.setattr(parsed, "_PARSED", footers)
    return footers


@pytest.mark.parametrize("cached", [True, False])
def test_an_index_holds_footers_as_bytes_and_parses_none(
    data: Path, fresh: parsed._ParsedFooters, monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    monkeypatch.setenv("TDU_INDEX_CACHE", "1" if cached else "0")
    StructuredDataset(str(data))  # fills the cache, if on
    dataset = StructuredDataset(str(data))
    metas = [f.metadata for f in dataset._index.files]
    assert all(isinstance(m, SerializedMetadata) and m.footer_bytes for m in metas)
    assert len(fresh._held) == 0  # building parsed (or kept) none
    assert metas[0].footer.num_row_groups == 5


@pytest.mark.parametrize("budget", [4096, 256 * 2**10])
def test_an_epoch_keeps_parsed_footers_within_an_eighth_of_the_budget(
    data: Path, fresh: parsed._ParsedFooters, budget: int
) -> None:
    dataset = StructuredDataset(str(data), batch_size=7, shuffle=True, shuffle_memory_bytes=budget)
    ids = sorted(int(i) for batch in dataset for i in batch["id"])
    assert ids == list(range(sum(ROWS)))
    footer_bytes = len(dataset._index.files[0].metadata.footer_bytes)
    assert fresh.limit == budget // 8
    held = len(fresh._held)
    assert held == min(FILES, budget // 8 // (parsed._PARSED_PER_BYTE * footer_bytes))
    assert held < FILES  # before: every footer the epoch read stayed parsed
    assert fresh._bytes == sum(cost for _, _, cost in fresh._held.values()) <= budget // 8
    assert sorted(fresh._keys) == sorted(fresh._held)


def test_the_bound_only_grows(fresh: parsed._ParsedFooters) -> None:
    hold_parsed_footers(10_000)
    hold_parsed_footers(5_000)
    assert fresh.limit == 10_000


def _held_in_child(queue: multiprocessing.Queue[int]) -> None:
    queue.put(len(parsed._PARSED._held))


def test_a_forked_child_starts_without_its_parents_footers(data: Path) -> None:
    dataset = StructuredDataset(str(data), batch_size=50)
    hold_parsed_footers(2**20)
    assert dataset._index.files[0].metadata.footer is not None
    assert len(parsed._PARSED._held) >= 1
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[int] = context.Queue()
    child = context.Process(target=_held_in_child, args=(queue,))
    child.start()
    assert queue.get(timeout=30) == 0
    child.join(30)
    assert child.exitcode == 0
