"""Shuffle quality on data sorted inside each file (a small ``benchmarks/bench_shuffle.py``).

Issue 15's layout, scaled down: 16 files x 65,536 rows sorted by ``pos``, ten label blocks per
file, row groups of 1,024, batches of 256 (``_shuffle_metrics``). The thresholds are the
benchmark's targets taken relative to a uniform random permutation measured here at this scale
(the full-scale targets are 9.5 / 0.27 / 1 % against the uniform 10 / 0.289 / 0.02 %). The
scale keeps what makes the full-size targets hard: the budget that binds is 1/16 of a stream's
data (2.5 MiB here), windows of about 21 row groups, dozens of batches each. One
large file (64 row groups) and files of one big row group hold half as many rows, for speed.
Public API only: whatever shuffle is on main is measured.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from _shuffle_metrics import (
    Quality,
    decoded_bytes,
    exactly_once,
    quality,
    spearman,
    uniform_batches,
    write_sorted_inside,
)

from torch_dataloader_utils import StructuredDataset

FILES, ROWS_PER_FILE, ROW_GROUP_ROWS, BATCH = 16, 65_536, 1_024, 256
TOTAL = FILES * ROWS_PER_FILE
COLUMNS = ["id", "pos", "label", "f0", "f1", "f2", "f3"]
# name -> (files, rows per file, row group rows); the last two at half the rows, for speed.
LAYOUTS = {
    "many_files": (FILES, ROWS_PER_FILE, ROW_GROUP_ROWS),
    "one_large_file": (1, TOTAL // 2, 8_192),  # one split by default, 64 row groups
    "one_row_group_per_file": (2, TOTAL // 4, TOTAL // 4),  # 256 Ki-row groups
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    roots = {}
    for name, (files, rows_per_file, row_group_rows) in LAYOUTS.items():
        roots[name] = tmp_path_factory.mktemp(name)
        write_sorted_inside(
            roots[name], files=files, rows_per_file=rows_per_file, row_group_rows=row_group_rows
        )
    return roots


@functools.cache
def epoch(root: Path, *, shuffle: bool = True, num_workers: int = 0, **knobs: Any) -> list:
    """Ids per batch in delivery order, one epoch (one run per setting in this module)."""
    loader, _ = StructuredDataset.create_dataloader(
        str(root),
        batch_size=BATCH,
        columns=COLUMNS,
        shuffle=shuffle,
        num_workers=num_workers,
        **knobs,
    )
    return [batch["id"].numpy().copy() for batch in loader]


@functools.cache
def uniform(total: int = TOTAL, rows_per_file: int = ROWS_PER_FILE) -> Quality:
    return quality(uniform_batches(total, BATCH), rows_per_file)


def meets(
    q: Quality, *, labels: float, spread: float, neighbours: float, layout: str = "many_files"
) -> None:
    """Assert the targets relative to the uniform permutation of the layout's rows (labels and
    neighbours as absolute margins, spread as a fraction), as the benchmark's full-scale ones."""
    files, rows_per_file, _ = LAYOUTS[layout]
    u = uniform(files * rows_per_file, rows_per_file)
    seen = f"measured {q}; uniform permutation {u}"
    assert q.labels >= u.labels - labels, f"labels per batch below {u.labels - labels:.2f}: {seen}"
    assert q.spread >= u.spread * spread, f"spread below {u.spread * spread:.3f}: {seen}"
    assert q.neighbours <= u.neighbours + neighbours, (
        f"neighbours above {u.neighbours + neighbours:.2%}: {seen}"
    )
    assert abs(q.spearman) < 0.05, f"|spearman| not below 0.05: {seen}"


def defaults_targets(q: Quality, layout: str = "many_files") -> None:
    meets(q, labels=0.5, spread=0.27 / 0.289, neighbours=0.01, layout=layout)


def binding_budget() -> int:
    """1/16 of a stream's decoded data with ``num_workers=0`` (one stream)."""
    parameters = inspect.signature(StructuredDataset).parameters
    if "shuffle_memory_bytes" not in parameters:
        pytest.skip("the installed StructuredDataset has no shuffle_memory_bytes")
    return TOTAL * (3 * 8 + 4 * 4) // 16


# ----------------------------------------------------------------------------- instruments


def test_metrics_on_hand_made_inputs() -> None:
    n = 100  # rows per file: labels are pos // 10
    q = quality([np.array([0, 1, 2]), np.array([10, 55, 99, 150])], n)
    assert q.labels == (1 + 3) / 2  # labels 0 | 1, 5, 9, 5 (150 is pos 50 of file 1)
    assert q.spread == pytest.approx((np.std([0, 0.01, 0.02]) + np.std([0.1, 0.55, 0.99, 0.5])) / 2)
    assert q.neighbours == pytest.approx((2 / 3 + 0 / 4) / 2)  # 1 and 2 follow 0 and 1
    assert q.spearman == pytest.approx(1.0)
    assert quality([np.array([3, 0]), np.array([2, 5])], n).neighbours == 0.0
    assert quality([np.array([1, 0])], n).neighbours == 0.5  # order inside the batch is free
    assert spearman([0, 1, 2, 3], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # ranks 3 0 4 1 2: squared rank differences 9 1 4 4 4, 1 - 6 * 22 / (5 * (25 - 1))
    assert spearman([0, 1, 2, 3, 4], [7, 1, 9, 3, 5]) == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="equal length"):
        spearman([0, 1], [0, 1, 2])


def test_exactly_once_names_what_is_wrong() -> None:
    assert exactly_once([np.array([2, 0]), np.array([1])], 3) is None
    assert exactly_once([np.array([2, 0]), np.array([0, 5])], 3) == (
        "4 ids delivered for 3 rows: 1 missing, 1 repeated, 1 out of range"
    )


def test_written_layout(layouts: dict[str, Path]) -> None:
    table = pq.read_table(layouts["many_files"] / "part-00002.parquet")
    assert table.column_names == COLUMNS
    pos = table.column("pos").to_numpy()
    assert np.array_equal(pos, np.arange(ROWS_PER_FILE))
    assert np.array_equal(table.column("id").to_numpy(), pos + 2 * ROWS_PER_FILE)
    assert np.array_equal(table.column("label").to_numpy(), pos * 10 // ROWS_PER_FILE)
    blocks = np.bincount(table.column("label").to_numpy())
    assert len(blocks) == 10
    assert blocks.max() - blocks.min() <= 1
    metadata = pq.ParquetFile(layouts["many_files"] / "part-00002.parquet").metadata
    assert metadata.num_row_groups == ROWS_PER_FILE // ROW_GROUP_ROWS
    one = pq.ParquetFile(layouts["one_row_group_per_file"] / "part-00001.parquet").metadata
    assert (one.num_row_groups, one.num_rows) == (1, TOTAL // 4)
    decoded = decoded_bytes([str(layouts["many_files"] / "part-00002.parquet")])
    assert decoded == pytest.approx(ROWS_PER_FILE * (3 * 8 + 4 * 4), rel=0.03)  # + padding


def test_uniform_permutation_meets_the_targets_it_anchors() -> None:
    u = uniform()
    assert u.labels == pytest.approx(10.0, abs=0.01)
    assert u.spread == pytest.approx(0.2887, abs=0.002)
    assert u.neighbours == pytest.approx((BATCH - 1) / TOTAL, rel=0.25)  # ~0.02 %
    assert abs(u.spearman) < 0.005


@pytest.mark.slow
def test_storage_order_misses_every_target(layouts: dict[str, Path]) -> None:
    """The instruments see storage order: unshuffled batches hold one label, one stretch."""
    batches = epoch(layouts["many_files"], shuffle=False)
    assert exactly_once(batches, TOTAL) is None
    q = quality(batches, ROWS_PER_FILE)
    assert q.labels < 1.1
    assert q.spread < 0.002
    assert q.neighbours > 0.99
    assert q.spearman == pytest.approx(1.0)


# ----------------------------------------------------------------------------- the shuffle


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shuffled_epoch_delivers_every_row_once(layouts: dict[str, Path], layout: str) -> None:
    files, rows_per_file, _ = LAYOUTS[layout]
    assert exactly_once(epoch(layouts[layout]), files * rows_per_file) is None


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shuffled_epoch_with_workers_delivers_every_row_once(
    layouts: dict[str, Path], layout: str
) -> None:
    files, rows_per_file, _ = LAYOUTS[layout]
    assert exactly_once(epoch(layouts[layout], num_workers=2), files * rows_per_file) is None


@pytest.mark.slow
def test_binding_budget_delivers_every_row_once(layouts: dict[str, Path]) -> None:
    batches = epoch(layouts["many_files"], shuffle_memory_bytes=binding_budget())
    assert exactly_once(batches, TOTAL) is None


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_defaults_meet_the_quality_targets(layouts: dict[str, Path], layout: str) -> None:
    defaults_targets(quality(epoch(layouts[layout]), LAYOUTS[layout][1]), layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_defaults_with_workers_meet_the_quality_targets(
    layouts: dict[str, Path], layout: str
) -> None:
    """Each worker's share is blocks from all over the data: with one large file, not each
    worker its half of it (which gave 6 labels a batch at full scale)."""
    batches = epoch(layouts[layout], num_workers=2)
    defaults_targets(quality(batches, LAYOUTS[layout][1]), layout)


@pytest.mark.slow
def test_binding_budget_degrades_gracefully(layouts: dict[str, Path]) -> None:
    """``shuffle_memory_bytes`` = 1/16 of the stream: ≥ 9 labels, ≥ 0.25, ≤ 2 % at full scale."""
    batches = epoch(layouts["many_files"], shuffle_memory_bytes=binding_budget())
    meets(quality(batches, ROWS_PER_FILE), labels=1.0, spread=0.25 / 0.289, neighbours=0.02)


@pytest.mark.slow
def test_one_large_file_differs_between_epochs(layouts: dict[str, Path]) -> None:
    """A new epoch is a new order, also when the data is one file (one split)."""
    loader, dataset = StructuredDataset.create_dataloader(
        str(layouts["one_large_file"]), batch_size=BATCH, columns=["id"], shuffle=True
    )
    orders = []
    for number in (0, 1):
        dataset.set_epoch(number)
        orders.append(np.concatenate([batch["id"].numpy() for batch in loader]))
    assert abs(spearman(orders[0], orders[1])) < 0.05
