"""Evening out ranks: every rank yields the same number of batches (DDP would hang otherwise).

Rows are dealt row by row (SPEC semantics 0): with ``even_batches`` fewer than
``S = world_size * max(1, num_workers)`` rows of an epoch are left out (recorded as consumed,
logged); without it every row is delivered once, in stream shares that differ by at most one row.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import pytest
from _data import write_dataset
from _harness import assert_resume_exact, ids, make_loader, run_epoch
from hypothesis import given
from hypothesis import strategies as st

TOTAL = 134


def _case(root: Path, rank: int, world_size: int, **extra: object) -> dict[str, object]:
    return {
        "path": str(root), "batch_size": 10, "split_bytes": 1, "shuffle": True,
        "rank": rank, "world_size": world_size, **extra,
    }  # fmt: skip


def _spread(rows: int, parts: int) -> list[int]:
    """``rows`` in ``parts`` shares that differ by at most one row, the larger ones first."""
    quota, extra = divmod(rows, parts)
    return [quota + 1] * extra + [quota] * (parts - extra)


@pytest.fixture
def uneven(tmp_path: Path) -> Path:
    write_dataset(tmp_path, [37, 23, 51, 9, 14], row_group_size=8)  # 134 rows, 19 splits
    return tmp_path


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_yield_equal_batch_counts_and_leave_out_fewer_than_s_rows(
    uneven: Path, num_workers: int
) -> None:
    world_size = 3
    streams = world_size * max(1, num_workers)
    epochs = [run_epoch(_case(uneven, r, world_size, num_workers=num_workers)) for r in range(3)]
    counts = {len(batches) for batches in epochs}
    assert len(counts) == 1, f"ranks yield different batch counts: {counts}"
    rows = [len(ids(batches)) for batches in epochs]
    assert rows == [TOTAL // world_size] * world_size  # 44 rows on every rank
    delivered = [i for batches in epochs for i in ids(batches)]
    assert len(delivered) == len(set(delivered)), "a row delivered twice"
    assert set(delivered) <= set(range(TOTAL))
    left_out = TOTAL - len(delivered)
    assert left_out < streams
    assert left_out == TOTAL % world_size == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_even_batches_off_delivers_every_row_in_balanced_shares(
    uneven: Path, num_workers: int
) -> None:
    world_size, workers = 3, max(1, num_workers)
    epochs = [
        run_epoch(_case(uneven, r, world_size, num_workers=num_workers, even_batches=False))
        for r in range(world_size)
    ]
    assert sorted(i for batches in epochs for i in ids(batches)) == list(range(TOTAL))
    # Stream g = rank * workers + worker reads the g-th share; shares differ by at most one
    # row, the larger first: 23 23 22 22 22 22 with 2 workers, 45 45 44 without.
    shares = _spread(TOTAL, world_size * workers)
    assert max(shares) - min(shares) <= 1
    for rank, batches in enumerate(epochs):
        assert len(ids(batches)) == sum(shares[rank * workers : (rank + 1) * workers])


@pytest.mark.parametrize(("even_batches", "drop_last"), [(True, False), (True, True),
                                                          (False, False)])  # fmt: skip
def test_len_is_exact(uneven: Path, even_batches: bool, drop_last: bool) -> None:
    lengths = []
    for rank in range(3):
        case = _case(uneven, rank, 3, num_workers=2, even_batches=even_batches,
                     drop_last=drop_last)  # fmt: skip
        loader, dataset = make_loader(case)
        batches = list(loader)
        assert len(loader) == len(dataset) == len(batches)
        if drop_last:
            assert all(len(b["id"]) == 10 for b in batches)
        lengths.append(len(batches))
    if even_batches:
        assert len(set(lengths)) == 1


@given(
    files=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    world_size=st.integers(1, 5),
    batch_size=st.integers(1, 12),
    shuffle=st.booleans(),
    even_batches=st.booleans(),
    drop_last=st.booleans(),
)
def test_dealing_properties_on_random_files(files, world_size, batch_size, shuffle,
                                            even_batches, drop_last):  # fmt: skip
    """One stream per rank: equal batch counts (even), every row once (not even), len exact."""
    root = Path(tempfile.mkdtemp(prefix="tdu-even-"))
    try:
        write_dataset(root, files, row_group_size=6)
        total = sum(files)
        case = {
            "path": str(root),
            "batch_size": batch_size,
            "split_bytes": 1,
            "shuffle": shuffle,
            "even_batches": even_batches,
            "drop_last": drop_last,
        }
        epochs = []
        for rank in range(world_size):
            loader, _ = make_loader({**case, "rank": rank, "world_size": world_size})
            batches = [b["id"].tolist() for b in loader]
            assert len(loader) == len(batches)
            epochs.append(batches)
        delivered = [i for batches in epochs for b in batches for i in b]
        assert len(delivered) == len(set(delivered)), "a row delivered twice"
        shares = (
            [total // world_size] * world_size if even_batches else (_spread(total, world_size))
        )
        # Each rank reads its share (less a last partial batch with drop_last) ...
        for share, batches in zip(shares, epochs, strict=True):
            assert sum(len(b) for b in batches) == (
                share - share % batch_size if drop_last else share
            )
            assert len(batches) == (share // batch_size if drop_last else -(-share // batch_size))
        # ... so with even_batches every rank yields as many batches, fewer than S rows lost.
        if even_batches:
            assert len({len(batches) for batches in epochs}) == 1
            assert total - sum(shares) < world_size
        else:
            assert sum(shares) == total
        if not drop_last:
            assert len(delivered) == sum(shares)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("k", [1, 3])
def test_resume_exact_with_evened_batches(uneven: Path, k: int) -> None:
    state = assert_resume_exact(_case(uneven, 1, 3, num_workers=2), k)
    assert state["_even_batches"] is True


def test_five_one_split_files_over_two_ranks_lose_less_than_two_rows(tmp_path: Path) -> None:
    """Dropping whole splits lost a fifth of this data, and the same fifth every epoch."""
    write_dataset(tmp_path, [21] * 5, row_group_size=7)  # 105 rows, one split per file
    left_out = []
    for epoch in (0, 1):
        per_rank = [run_epoch(_case(tmp_path, r, 2, batch_size=8), epoch) for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1])
        delivered = [i for batches in per_rank for i in ids(batches)]
        assert len(delivered) == len(set(delivered))
        missing = set(range(105)) - set(delivered)
        assert len(missing) < 2
        assert len(missing) == 1  # 105 rows over 2 ranks: 52 each
        left_out.append(missing)
    assert left_out[0] != left_out[1], "shuffle leaves out a different row each epoch"


def test_evened_epoch_end_leaves_nothing_for_an_elastic_resume(uneven: Path) -> None:
    states = []
    for rank in range(3):
        loader, _ = make_loader(_case(uneven, rank, 3, num_workers=2))
        assert list(loader)
        states.append(json.loads(json.dumps(loader.state_dict())))
    loader, dataset = make_loader(_case(uneven, 0, 1, num_workers=2, even_batches=True))
    dataset.load_state_dict(states, elastic=True)
    assert len(dataset) == 0
    assert list(loader) == [], "rows an evened epoch left out count as consumed for that epoch"


def test_left_out_rows_are_logged_with_their_count(
    uneven: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="torch_dataloader_utils")
    loader, _ = make_loader(_case(uneven, 2, 3, num_workers=2))
    assert list(loader)
    lines = [r for r in caplog.records if r.name == "torch_dataloader_utils"
             and "even_batches" in r.getMessage()]  # fmt: skip
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].levelno == logging.INFO
    message = lines[0].getMessage()
    assert "2 row(s) of epoch 0 left out" in message, message
    caplog.clear()
    loader, _ = make_loader(_case(uneven, 2, 3, num_workers=2, even_batches=False))
    assert list(loader)
    assert not [r for r in caplog.records if "left out" in r.getMessage()]
