"""The shuffle window's knobs, its memory bound, and exact resume inside a window."""

from __future__ import annotations

from pathlib import Path

import _harness
import numpy as np
import pytest
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils._stream import StreamSource


@pytest.fixture(scope="module")
def twelve(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 files of 40 rows, one split each (split_bytes large): 480 rows."""
    root = tmp_path_factory.mktemp("twelve")
    write_dataset(root, [40] * 12, row_group_size=8)
    return root


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"shuffle": True, "shuffle_window": 0}, ValueError, "shuffle_window must be a positive"),
        ({"shuffle": True, "shuffle_window": -3}, ValueError, "shuffle_window must be a positive"),
        ({"shuffle": True, "shuffle_window": 2.5}, TypeError, r"shuffle_window must be an int, "
                                                               r"got 2\.5 \(float\)"),
        ({"shuffle": True, "shuffle_window": 13}, ValueError, "larger than the data: these files "
                                                               "make 12 split"),
        ({"shuffle_window": 4}, ValueError, "only with shuffle=True"),
        ({"shuffle": True, "shuffle_memory_bytes": 0}, ValueError, "shuffle_memory_bytes must"),
        ({"shuffle": True, "shuffle_memory_bytes": 1000}, ValueError, "below the minimum"),
    ],
)  # fmt: skip
def test_knobs_are_validated(twelve: Path, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        StructuredDataset(str(twelve), **kwargs)


def test_a_window_as_wide_as_the_data_is_accepted(twelve: Path) -> None:
    loader, _ = StructuredDataset.create_dataloader(
        str(twelve), shuffle=True, shuffle_window=12, batch_size=48
    )
    batches = _harness.take(loader)
    assert sorted(_harness.ids(batches)) == list(range(480))
    # One window of 12 equal splits: every batch holds 4 rows of each file.
    for batch in batches:
        files = np.bincount(np.array(batch["id"][1]) // 40, minlength=12)
        assert files.tolist() == [4] * 12


@pytest.mark.parametrize("window", [1, 3, 5])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_inside_a_window_is_exact(twelve: Path, window: int, num_workers: int) -> None:
    case = {"path": str(twelve), "shuffle": True, "shuffle_window": window, "batch_size": 7,
            "num_workers": num_workers, "shuffle_seed": 4}  # fmt: skip
    full = _harness.run_epoch(case)
    for k in (1, 9, len(full) // 2, len(full) - 2):
        _harness.assert_resume_exact(case, k, full=full)


def test_memory_budget_bounds_rows_decoded_per_split(twelve: Path) -> None:
    dataset = StructuredDataset(str(twelve), shuffle=True, shuffle_memory_bytes=2**20)
    index = dataset._index
    pieces = dataset._epochs.plan(dataset._next_start, 0).stream(
        dataset._epochs.settings(0).world()
    )
    source = StreamSource(
        index=index, storage=dataset._storage, fmt=dataset._format, pieces=pieces, window=12,
        columns=None, memory_bytes=2**20,
    )  # fmt: skip
    rows = source.mix_rows()
    assert rows * index.row_bytes() * (12 + 2) <= 2**20 or rows == 256
    generous = StreamSource(
        index=index, storage=dataset._storage, fmt=dataset._format, pieces=pieces, window=12,
        columns=None, memory_bytes=2**30,
    )  # fmt: skip
    assert generous.mix_rows() == 16_384


def test_resume_inside_a_window_rereads_at_most_one_row_group_per_split(
    twelve: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O(1) resume with shuffle: each split of the window is re-entered at the row group that
    holds its next row, so the rows decoded exceed the rows left by less than one row group
    (8 rows) per split of the window."""
    case = {"path": str(twelve), "shuffle": True, "batch_size": 10, "split_bytes": 10**9}
    full = _harness.run_epoch(case)
    state, _ = _harness.checkpoint_after(case, 25)  # 250 of 480 rows, mid-window
    assert len(state["partial"]) == 12  # every split of the window is in progress
    read = _harness.count_decoded_rows(monkeypatch, "parquet")
    assert _harness.resume(case, state) == full[25:]
    assert 0 <= sum(rows for _, rows in read) - (480 - 250) < 12 * 8
