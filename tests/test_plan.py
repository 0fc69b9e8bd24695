"""The pure planner: cutting splits, ordering them per epoch, dealing them to streams. No I/O."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torch_dataloader_utils._plan import (
    Consumed,
    EpochPlan,
    Pieces,
    Split,
    cut_splits,
    epoch_order,
    remaining_pieces,
    stream_pieces,
)
from torch_dataloader_utils._world import World

# One file: a list of (bytes, rows) per unit; rows may be 0 (empty row groups exist).
unit = st.tuples(st.integers(1, 500), st.integers(0, 50))
files = st.lists(st.lists(unit, max_size=12), min_size=1, max_size=6)


def _cut(layout: list[list[tuple[int, int]]], split_bytes: int) -> list[Split]:
    return cut_splits(
        [[b for b, _ in f] for f in layout], [[r for _, r in f] for f in layout], split_bytes
    )


# ---------------------------------------------------------------------------- cut_splits


@given(files, st.integers(1, 1500))
def test_splits_stay_within_split_bytes_unless_one_unit(layout, split_bytes):
    for split in _cut(layout, split_bytes):
        size = sum(layout[split.file][u][0] for u in split.units)
        assert size <= split_bytes or len(split.units) == 1


@given(files, st.integers(1, 1500))
def test_splits_cover_every_row_of_every_file_once_in_order(layout, split_bytes):
    splits = _cut(layout, split_bytes)
    assert [s.file for s in splits] == sorted(s.file for s in splits)
    for file, units in enumerate(layout):
        mine = [s for s in splits if s.file == file]
        rows = [r for _, r in units]
        covered = 0
        for split in mine:
            assert split.row_offset == sum(rows[: split.units.start])
            assert split.row_offset == covered
            assert split.row_length == sum(rows[split.units.start : split.units.stop])
            assert split.row_length > 0
            covered += split.row_length
        assert covered == sum(rows)


@given(files, st.integers(1, 1500))
def test_splits_are_greedy(layout, split_bytes):
    """A split ends only where the next unit would break the bound."""
    splits = _cut(layout, split_bytes)
    for a, b in itertools.pairwise(splits):
        if a.file == b.file and a.units.stop == b.units.start:
            size = sum(layout[a.file][u][0] for u in a.units)
            assert size + layout[b.file][b.units.start][0] > split_bytes


def test_cut_splits_examples():
    splits = cut_splits([[10, 10, 10, 50, 5], [7]], [[1, 2, 3, 4, 5], [6]], 25)
    assert splits == [
        Split(0, range(0, 2), 0, 3),
        Split(0, range(2, 3), 3, 3),
        Split(0, range(3, 4), 6, 4),  # larger than the bound: its own split
        Split(0, range(4, 5), 10, 5),
        Split(1, range(0, 1), 0, 6),
    ]
    # An empty file and a file of empty row groups make no splits.
    assert cut_splits([[], [3, 3]], [[], [0, 0]], 100) == []


def test_cut_splits_rejects_non_positive_bound():
    with pytest.raises(ValueError, match="split_bytes"):
        cut_splits([[1]], [[1]], 0)


# ---------------------------------------------------------------------------- epoch_order


@given(st.integers(0, 300), st.integers(0, 2**40), st.integers(0, 1000))
def test_epoch_order_is_a_deterministic_permutation(n, seed, epoch):
    order = epoch_order(n, seed, epoch, True)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(n))
    assert np.array_equal(order, epoch_order(n, seed, epoch, True))


@given(st.integers(12, 300), st.integers(0, 2**40), st.integers(0, 1000))
def test_epoch_order_changes_with_epoch_and_seed(n, seed, epoch):
    order = epoch_order(n, seed, epoch, True)
    assert not np.array_equal(order, epoch_order(n, seed, epoch + 1, True))
    assert not np.array_equal(order, epoch_order(n, seed + 1, epoch, True))
    assert not np.array_equal(order, np.arange(n))


@given(st.integers(0, 300), st.integers(0, 100), st.integers(0, 100))
def test_epoch_order_without_shuffle_is_identity(n, seed, epoch):
    assert epoch_order(n, seed, epoch, False).tolist() == list(range(n))


def test_epoch_order_is_pinned():
    """Platform- and version-stable: a checkpoint's order must not change under an upgrade."""
    assert epoch_order(10, 0, 0, True).tolist() == [5, 1, 4, 9, 3, 8, 6, 7, 0, 2]
    assert epoch_order(10, 7, 3, True).tolist() == [3, 5, 7, 2, 0, 6, 9, 8, 4, 1]


# ---------------------------------------------------------------------------- dealing


def _pieces(n: int, seed: int) -> Pieces:
    order = epoch_order(n, seed, 0, True)
    return Pieces(order, np.arange(n, dtype=np.int64) % 3)


@given(st.integers(0, 200), st.integers(1, 5), st.integers(1, 5), st.integers(0, 50))
def test_stream_pieces_partition_round_robin_ranks_then_workers(n, world_size, workers, seed):
    pieces = _pieces(n, seed)
    owner: dict[int, tuple[int, int]] = {}
    for rank in range(world_size):
        for worker in range(workers):
            mine = stream_pieces(pieces, World(rank, world_size, worker, workers))
            assert len(mine.splits) == len(mine.starts)
            for split, start in zip(mine.splits.tolist(), mine.starts.tolist(), strict=True):
                assert split not in owner, "a piece dealt twice"
                owner[split] = (rank, worker)
                i = pieces.splits.tolist().index(split)
                assert start == pieces.starts[i]
    assert sorted(owner) == sorted(pieces.splits.tolist())
    # Piece i goes to rank i % world_size, then worker (i // world_size) % workers.
    for i, split in enumerate(pieces.splits.tolist()):
        assert owner[split] == (i % world_size, (i // world_size) % workers)


def test_stream_pieces_example():
    pieces = Pieces(np.arange(10, dtype=np.int64), np.zeros(10, dtype=np.int64))
    got = stream_pieces(pieces, World(rank=1, world_size=2, worker=1, num_workers=2))
    assert got.splits.tolist() == [3, 7]  # stream 1 + 2 * 1 = 3 of 4


@given(st.integers(1, 100), st.integers(0, 50), st.data())
def test_remaining_pieces_skips_done_and_starts_partial(n, seed, data):
    order = epoch_order(n, seed, 0, True)
    done = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    open_ = [i for i in range(n) if not done[i]]
    partial = {s: data.draw(st.integers(1, 9)) for s in open_[: data.draw(st.integers(0, 3))]}
    pieces = remaining_pieces(order, Consumed(done, partial))
    assert pieces.splits.tolist() == [s for s in order.tolist() if not done[s]]
    assert pieces.starts.tolist() == [partial.get(s, 0) for s in pieces.splits.tolist()]


def test_epoch_plan_deals_only_what_base_left():
    done = np.zeros(8, dtype=bool)
    done[[0, 5]] = True
    plan = EpochPlan(2, np.arange(8, dtype=np.int64), Consumed(done, {3: 4}))
    first = plan.stream(World(0, 1, 0, 2))
    second = plan.stream(World(0, 1, 1, 2))
    assert first.splits.tolist() == [1, 3, 6]
    assert first.starts.tolist() == [0, 4, 0]
    assert second.splits.tolist() == [2, 4, 7]
    assert Consumed.nothing(4).done.tolist() == [False] * 4


def test_world_validates():
    with pytest.raises(ValueError, match="rank"):
        World(rank=2, world_size=2)
    with pytest.raises(ValueError, match="worker"):
        World(worker=1, num_workers=1)
