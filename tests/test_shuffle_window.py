"""The shuffle window: its knobs, its memory bound, and exact resume inside a window."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import _harness
import numpy as np
import pytest
from _data import write_dataset
from _orders import stream_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.reading import shuffled as _shuffled

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
    # blocks from anywhere in the dataset, at random (a window may draw two of one file)
    assert np.mean(files) > 2.4


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


def test_a_worker_lets_go_of_a_window_before_it_reads_the_next(
    twelve: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that does not read ahead (a DataLoader worker) holds the window it reads, not
    also the one it has handed out (which cost a window of memory more: docs/shuffle.md)."""
    read, held = _shuffled._read_window, []

    def checked(*args: Any, **kwargs: Any) -> Any:
        assert all(window() is None for window in held), "a handed-out window is still held"
        window = read(*args, **kwargs)
        held.append(weakref.ref(window))
        return window

    monkeypatch.setattr(_shuffled, "_read_window", checked)  # forked workers inherit it
    case = {"path": str(twelve), "shuffle": True, "batch_size": 10, "num_workers": 1,
            "shuffle_memory_bytes": SMALL_BUDGET}  # fmt: skip
    assert -(-480 // _window_rows(twelve, SMALL_BUDGET)) >= 3
    assert sorted(_harness.ids(_harness.run_epoch(case))) == list(range(480))


def test_two_threads_decode_a_window_only_after_the_consumer_waited(
    twelve: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without workers, a second decode thread is worth it only when the consumer is the
    faster side (it waited for the window before); otherwise it slows every thread."""
    read, pooled = _shuffled._read_window, []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        pooled.append(args[-1] is not map)
        return read(*args, **kwargs)

    monkeypatch.setattr(_shuffled, "_read_window", recorded)
    dataset = StructuredDataset(str(twelve), shuffle=True, shuffle_memory_bytes=SMALL_BUDGET)
    progress = dataset._epochs.begin(dataset._start, 0)
    source = dataset._reader(progress, 0).source
    order = source.order.shuffled
    waited = threading.Event()
    waited.set()
    windows = _shuffled._read_windows(source, order, 0, 2, waited)
    next(windows)  # the first window: the consumer waits for it
    next(windows)  # nobody said the consumer waited for the first
    waited.set()
    next(windows)
    windows.close()
    assert pooled == [True, False, True]
    assert not waited.is_set()


@pytest.fixture(scope="module")
def long_groups(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 files of 5 row groups of 600 rows (24,000 rows): with windows of under 14,400 rows
    (24 row groups) row groups are sliced into parts that go to consecutive windows."""
    root = tmp_path_factory.mktemp("long_groups")
    write_dataset(root, [3000] * 8, row_group_size=600)
    return root


def _budget(root: Path, window_rows: int) -> int:
    """A budget whose window holds about ``window_rows`` rows."""
    return 3 * window_rows * StructuredDataset(str(root))._index.row_bytes()


@pytest.mark.parametrize("window", [1500, 4000, 8000])
def test_sliced_row_groups_are_decoded_about_once(
    long_groups: Path, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of a row group go to consecutive windows and the reader carries the next
    windows' parts of what it decodes (a window's rows at most): an epoch decodes its rows
    1.0-1.4 times here (the order of state version 4 decoded each group once per window
    holding a part of it: 2.0-2.1 times), and delivers them in the order's permutation."""
    case = {"path": str(long_groups), "shuffle": True, "batch_size": 100, "split_bytes": 10**9,
            "shuffle_memory_bytes": _budget(long_groups, window)}  # fmt: skip
    loader, dataset = _harness.make_loader(case)
    order = dataset._epochs.order(dataset._epochs.plan(dataset._next_start, 0), 0)
    assert order.shuffled is not None and len(order.shuffled.ends) >= 3
    assert (order.shuffled.blocks.rows < 600).all()  # every row group is sliced
    read = _harness.count_decoded_rows(monkeypatch, "parquet")
    delivered = _harness.ids(_harness.take(loader))
    splits = dataset._index.splits
    first = [split.row_offset + 3000 * split.file for split in splits]
    assert delivered == [first[s] + row for s, row in stream_rows(order)]
    assert sorted(delivered) == list(range(24_000))
    assert sum(rows for _, rows in read) <= 1.4 * 24_000


@pytest.mark.parametrize("window", [1500, 4000])
def test_parts_carried_for_later_windows_keep_at_most_twice_their_bytes(
    long_groups: Path, window: int
) -> None:
    """A part carried for a later window is a slice of a decoded chunk; kept as a slice it
    would keep the whole chunk in memory until its window is read (docs/shuffle.md)."""
    budget = _budget(long_groups, window)
    dataset = StructuredDataset(
        str(long_groups), shuffle=True, split_bytes=10**9, shuffle_memory_bytes=budget
    )
    progress = dataset._epochs.begin(dataset._start, 0)
    source = dataset._reader(progress, 0).source
    order = source.order.shuffled
    carried: dict = {}
    later = (order.window(n)[0] for n in range(1, len(order.ends)))
    first = _shuffled._read_window(source, order.window(0)[0], later, carried, map)
    assert first.num_rows == order.window(0)[0].total
    columns = [column for parts in carried.values() for part in parts for column in part.columns]
    assert columns  # row groups are sliced: parts of them wait for later windows
    assert all(column.get_total_buffer_size() <= 2 * column.nbytes for column in columns)


@settings(max_examples=12, deadline=None)
@given(
    window=st.integers(500, 12_000),
    num_workers=st.sampled_from([0, 2]),
    seed=st.integers(0, 2**31),
    at=st.floats(0, 1),
)
def test_resume_is_exact_where_parts_are_carried(
    long_groups: Path, window: int, num_workers: int, seed: int, at: float
) -> None:
    """With row groups sliced over consecutive windows (a resume re-reads the parts a window
    would have carried), the batches after any checkpoint are the uninterrupted run's."""
    budget = _budget(long_groups, window)
    case = {"path": str(long_groups), "shuffle": True, "batch_size": 97, "shuffle_seed": seed,
            "num_workers": num_workers, "shuffle_memory_bytes": budget}  # fmt: skip
    full = _harness.run_epoch(case)
    assert sorted(_harness.ids(full)) == list(range(24_000))
    _harness.assert_resume_exact(case, min(len(full) - 1, int(at * len(full))), full=full)
