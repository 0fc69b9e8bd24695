"""Shuffle quality on data sorted by file (a small ``benchmarks/bench_shuffle.py``).

64 files x 4,096 rows, one label per file, row groups of 1,024, batches of 1,024: unshuffled,
every batch holds one file; the sample-level shuffle of SPEC semantics 9 must mix ≥ 16.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from _shuffle_metrics import (
    adjacent_fraction,
    distinct_per_batch,
    spearman,
    write_sorted_by_file,
)

from torch_dataloader_utils import StructuredDataset

FILES, ROWS_PER_FILE, BATCH = 64, 4096, 1024  # batches never straddle a file in storage order


@pytest.fixture(scope="module")
def sorted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sorted_by_file")
    write_sorted_by_file(
        root, files=FILES, rows_per_file=ROWS_PER_FILE, row_group_rows=1024, features=1
    )
    return root


@functools.cache
def epoch(root: Path, shuffle: bool, num_workers: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """Labels per batch and ``row`` in delivery order (one run per setting in this module)."""
    loader, _ = StructuredDataset.create_dataloader(
        str(root),
        batch_size=BATCH,
        shuffle=shuffle,
        num_workers=num_workers,
        columns=["label", "row"],
    )
    labels, rows = [], []
    for batch in loader:
        labels.append(batch["label"].numpy())
        rows.append(batch["row"].numpy())
    return labels, np.concatenate(rows)


def test_metrics_on_hand_made_inputs() -> None:
    assert distinct_per_batch([[3, 3, 3], [1, 2, 2], [0, 1, 2, 3]]) == (1 + 2 + 4) / 3
    assert distinct_per_batch([np.array([5, 5])]) == 1.0
    assert distinct_per_batch([]) == 0.0
    assert spearman([0, 1, 2, 3], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([0, 1, 2, 3], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # ranks 3 0 4 1 2: squared rank differences 9 1 4 4 4, 1 - 6 * 22 / (5 * (25 - 1))
    assert spearman([0, 1, 2, 3, 4], [7, 1, 9, 3, 5]) == pytest.approx(-0.1)
    # Monotone but not linear: rank correlation 1, unlike Pearson's.
    assert spearman(np.arange(6), np.array([1, 2, 4, 8, 16, 1000])) == pytest.approx(1.0)
    assert spearman([0, 1, 2], [1, 0, 2]) == pytest.approx(0.5)  # 1 - 6*2 / (3*8)
    with pytest.raises(ValueError, match="equal length"):
        spearman([0, 1], [0, 1, 2])
    assert adjacent_fraction([0, 1, 2, 3]) == 1.0
    assert adjacent_fraction([3, 2, 1, 0]) == 0.0
    assert adjacent_fraction([0, 1, 5, 6, 2]) == 0.5
    assert adjacent_fraction([7]) == 0.0


def test_written_data_is_sorted_by_file(sorted_dir: Path) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(sorted_dir / "part-00002.parquet")
    assert table.column_names == ["label", "row", "f0"]
    assert set(table.column("label").to_pylist()) == {2}
    assert table.column("row").to_pylist() == list(range(2 * ROWS_PER_FILE, 3 * ROWS_PER_FILE))
    assert pq.ParquetFile(sorted_dir / "part-00002.parquet").metadata.num_row_groups == 4


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffled_epoch_delivers_every_row_once(sorted_dir: Path, num_workers: int) -> None:
    _, order = epoch(sorted_dir, shuffle=True, num_workers=num_workers)
    assert np.array_equal(np.sort(order), np.arange(FILES * ROWS_PER_FILE))


@pytest.mark.slow
def test_unshuffled_batches_hold_one_file(sorted_dir: Path) -> None:
    labels, order = epoch(sorted_dir, shuffle=False)
    assert np.array_equal(order, np.arange(FILES * ROWS_PER_FILE))
    assert distinct_per_batch(labels) == 1.0
    assert spearman(np.arange(len(order)), order) == pytest.approx(1.0)
    assert adjacent_fraction(order) > 0.99


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffled_batches_mix_files(sorted_dir: Path, num_workers: int) -> None:
    labels, order = epoch(sorted_dir, shuffle=True, num_workers=num_workers)
    assert distinct_per_batch(labels) >= 16
    assert abs(spearman(np.arange(len(order)), order)) < 0.1
    assert adjacent_fraction(order) < 0.1
