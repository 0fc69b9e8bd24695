"""The shuffle window: its knobs, its memory bound, and exact resume inside a window."""

from __future__ import annotations

from pathlib import Path

import _harness
import numpy as np
import pytest
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset

# About 23 rows a window on this data (three windows' worth fill the budget).
SMALL_BUDGET = 4096


@pytest.fixture(scope="module")
def twelve(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 files of 40 rows, one split each (split_bytes large): 480 rows."""
    root = tmp_path_factory.mktemp("twelve")
    write_dataset(root, [40] * 12, row_group_size=8)
    return root


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"shuffle": True, "shuffle_memory_bytes": 0}, ValueError, "shuffle_memory_bytes must"),
        ({"shuffle": True, "shuffle_memory_bytes": 2.5}, TypeError, "must be an int"),
        ({"shuffle": True, "shuffle_memory_bytes": 1000}, ValueError, "below the minimum"),
    ],
)  # fmt: skip
def test_knobs_are_validated(twelve: Path, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        StructuredDataset(str(twelve), **kwargs)


def test_the_removed_shuffle_window_says_what_replaces_it(twelve: Path) -> None:
    with pytest.raises(TypeError, match=r"shuffle_window was removed.*shuffle_memory_bytes"):
        StructuredDataset.create_dataloader(str(twelve), shuffle=True, shuffle_window=4)


def _window_rows(root: Path, budget: int) -> int:
    dataset = StructuredDataset(str(root), shuffle=True, shuffle_memory_bytes=budget)
    return dataset._epochs.window_rows


def test_the_budget_sizes_the_window(twelve: Path) -> None:
    """Three windows' worth (one handed out, the next while it is read and assembled) fill
    the budget."""
    dataset = StructuredDataset(str(twelve), shuffle=True, shuffle_memory_bytes=2**20)
    row_bytes = dataset._index.row_bytes()
    assert dataset._epochs.window_rows == 2**20 // (3 * row_bytes)
    assert _window_rows(twelve, SMALL_BUDGET) == SMALL_BUDGET // (3 * row_bytes) < 480


def test_windows_hold_at_most_their_rows_and_blocks_from_many_splits(twelve: Path) -> None:
    dataset = StructuredDataset(str(twelve), shuffle=True, shuffle_memory_bytes=SMALL_BUDGET)
    epochs = dataset._epochs
    plan = epochs.plan(dataset._next_start, 0)
    shuffled = epochs.order(plan, 0).shuffled
    assert shuffled is not None
    sizes = np.diff(np.concatenate(([0], shuffled.ends)))
    assert sizes.sum() == 480 and len(sizes) == -(-480 // epochs.window_rows)
    assert sizes.max() <= epochs.window_rows + 8  # at most a block (a row group: 8 rows) over
    files = [len(set(shuffled.window(w)[0].splits.tolist())) for w in range(len(sizes))]
    # blocks from anywhere in the share (some windows draw two blocks of one file)
    assert min(files) >= 2 and np.mean(files) > 2.5


@pytest.mark.parametrize("budget", [SMALL_BUDGET, 3 * SMALL_BUDGET, 2**20])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_inside_a_window_is_exact(twelve: Path, budget: int, num_workers: int) -> None:
    case = {"path": str(twelve), "shuffle": True, "shuffle_memory_bytes": budget,
            "batch_size": 7, "num_workers": num_workers, "shuffle_seed": 4}  # fmt: skip
    full = _harness.run_epoch(case)
    assert sorted(_harness.ids(full)) == list(range(480))
    for k in (1, 9, len(full) // 2, len(full) - 2):
        _harness.assert_resume_exact(case, k, full=full)


def test_resume_rereads_at_most_one_window(twelve: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O(1) resume with shuffle: only the window holding the next row is read again, so the
    rows decoded exceed the rows left by less than a window."""
    case = {"path": str(twelve), "shuffle": True, "batch_size": 10, "split_bytes": 10**9,
            "shuffle_memory_bytes": SMALL_BUDGET}  # fmt: skip
    window = _window_rows(twelve, SMALL_BUDGET)
    full = _harness.run_epoch(case)
    state, _ = _harness.checkpoint_after(case, 25)  # 250 of 480 rows
    _harness.join_read_ahead()  # the first loader's thread may still read its next window
    read = _harness.count_decoded_rows(monkeypatch, "parquet")
    assert _harness.resume(case, state) == full[25:]
    assert 0 <= sum(rows for _, rows in read) - (480 - 250) < window + 8
