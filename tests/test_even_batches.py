"""Evening out ranks: every rank yields the same number of batches (DDP would hang otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _data import write_dataset
from _harness import assert_resume_exact, ids, run_epoch

from torch_dataloader_utils._plan import Pieces, even_row_budgets, stream_rows


def _case(root: Path, rank: int, world_size: int, **extra: object) -> dict[str, object]:
    return {
        "path": str(root), "batch_size": 10, "split_bytes": 1, "shuffle": True,
        "rank": rank, "world_size": world_size, **extra,
    }  # fmt: skip


@pytest.fixture
def uneven(tmp_path: Path) -> Path:
    write_dataset(tmp_path, [37, 23, 51, 9, 14], row_group_size=8)  # 134 rows, 19 splits
    return tmp_path


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_yield_equal_batch_counts_and_disjoint_rows(uneven: Path, num_workers: int) -> None:
    epochs = [run_epoch(_case(uneven, r, 3, num_workers=num_workers)) for r in range(3)]
    counts = {len(batches) for batches in epochs}
    assert len(counts) == 1, f"ranks yield different batch counts: {counts}"
    delivered = [i for batches in epochs for i in ids(batches)]
    assert len(delivered) == len(set(delivered))
    assert set(delivered) <= set(range(134))


def test_even_batches_off_delivers_every_row(uneven: Path) -> None:
    epochs = [run_epoch(_case(uneven, r, 3, even_batches=False)) for r in range(3)]
    assert sorted(i for batches in epochs for i in ids(batches)) == list(range(134))


def test_len_matches_evened_batches(uneven: Path) -> None:
    from _harness import make_loader

    for rank in range(3):
        loader, dataset = make_loader(_case(uneven, rank, 3, num_workers=2))
        assert len(loader) == len(dataset) == len(list(loader))


@pytest.mark.parametrize("k", [1, 3])
def test_resume_exact_with_evened_batches(uneven: Path, k: int) -> None:
    assert_resume_exact(_case(uneven, 1, 3, num_workers=2), k)


def test_budget_keeps_first_batches_in_round_robin_order() -> None:
    # rank 0: workers with 25 and 5 rows -> 3 + 1 batches of 10; rank 1: 10 + 10 -> 1 + 1
    rows = np.array([[25, 5], [10, 10]])
    budgets = even_row_budgets(rows, batch_size=10, drop_last=False)
    assert budgets.tolist() == [[10, 5], [10, 10]]
    # drop_last: 2 + 0 and 1 + 1 batches -> both ranks keep 2
    assert even_row_budgets(rows, batch_size=10, drop_last=True).tolist() == [[20, 0], [10, 10]]


def test_stream_rows_follow_round_robin_dealing() -> None:
    pieces = Pieces(np.arange(5), np.array([0, 0, 3, 0, 0]))
    rows = stream_rows(pieces, np.array([10, 20, 30, 40, 50]), world_size=2, num_workers=2)
    # streams g = rank + 2 * worker take pieces g::4 -> g0: 0,4  g1: 1  g2: 2  g3: 3
    assert rows.tolist() == [[10 + 50, 27], [20, 40]]


def test_evened_epoch_end_leaves_nothing_for_an_elastic_resume(uneven: Path) -> None:
    from _harness import make_loader

    states = []
    for rank in range(3):
        loader, dataset = make_loader(_case(uneven, rank, 3, num_workers=2))
        assert list(loader)
        states.append(json.loads(json.dumps(loader.state_dict())))
    loader, dataset = make_loader(_case(uneven, 0, 1, num_workers=2, even_batches=True))
    dataset.load_state_dict(states, elastic=True)
    assert list(loader) == [], "rows an evened epoch skipped count as consumed for that epoch"
