"""The pure planner: cutting splits, ordering them per epoch, dealing their rows to streams.

No I/O. The dealing promise (SPEC semantics 0): the epoch's sequence of rows is cut into
``S = world_size * max(1, num_workers)`` contiguous shares that differ by at most one row (the
first ones one more). With ``even`` every rank gets ``N // world_size`` rows, spread over its
workers in the same pattern on every rank (so every rank yields the same number of batches), and
the last ``N % world_size`` rows, fewer than ``S``, are left out.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torch_dataloader_utils.base.world import World
from torch_dataloader_utils.checkpoint.schema import Generation
from torch_dataloader_utils.index.splits import Split, cut_splits
from torch_dataloader_utils.planning.bijection import permutation
from torch_dataloader_utils.planning.plan import EpochPlan, Pieces, deal

# One file: a list of (bytes, rows) per unit; rows may be 0 (empty row groups exist).
unit = st.tuples(st.integers(1, 500), st.integers(0, 50))
files = st.lists(st.lists(unit, max_size=12), min_size=1, max_size=6)


def _cut(layout: list[list[tuple[int, int]]], split_bytes: int) -> list[Split]:
    return cut_splits(
        [[b for b, _ in f] for f in layout], [[r for _, r in f] for f in layout], split_bytes
    )


def _ints(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _triples(pieces: Pieces) -> list[tuple[int, int, int]]:
    return list(zip(pieces.splits.tolist(), pieces.lo.tolist(), pieces.hi.tolist(), strict=True))


def _rows_of(pieces: Pieces) -> list[tuple[int, int]]:
    """``(split, row)`` of every row of ``pieces``, in order."""
    return [
        (s, r)
        for s, lo, hi in zip(
            pieces.splits.tolist(), pieces.lo.tolist(), pieces.hi.tolist(), strict=True
        )
        for r in range(lo, hi)
    ]


@st.composite
def epochs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """``(split_rows, order)`` of a random epoch."""
    split_rows = draw(st.lists(st.integers(1, 12), max_size=25))
    order = draw(st.permutations(range(len(split_rows))))
    return _ints(split_rows), _ints(order)


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


# ---------------------------------------------------------------------------- pieces


def test_rows_range_examples():
    # rows: split 7 [0, 4) | split 3 [5, 10) | split 9 [0, 3)  -> 12 rows
    pieces = Pieces(_ints([7, 3, 9]), _ints([0, 5, 0]), _ints([4, 10, 3]))
    assert pieces.rows.tolist() == [4, 5, 3]

    def cut(start: int, stop: int) -> list[tuple[int, int, int]]:
        return _triples(pieces.rows_range(start, stop))

    assert cut(0, 12) == [(7, 0, 4), (3, 5, 10), (9, 0, 3)]
    assert cut(2, 7) == [(7, 2, 4), (3, 5, 8)]
    assert cut(4, 9) == [(3, 5, 10)]  # exactly one piece, no empty neighbours
    assert cut(3, 5) == [(7, 3, 4), (3, 5, 6)]
    assert cut(11, 12) == [(9, 2, 3)]
    assert cut(6, 6) == []
    assert cut(12, 12) == []
    empty = Pieces(_ints([]), _ints([]), _ints([]))
    assert len(empty.rows_range(0, 0)) == 0


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5), st.integers(1, 6)), max_size=8),
       st.data())  # fmt: skip
def test_rows_range_cuts_the_concatenation(items, data):
    pieces = Pieces(
        _ints([s for s, _, _ in items]),
        _ints([lo for _, lo, _ in items]),
        _ints([lo + n for _, lo, n in items]),
    )
    rows = _rows_of(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(rows)), max_size=4)))
    bounds = [0, *cuts, len(rows)]
    parts = [pieces.rows_range(a, b) for a, b in itertools.pairwise(bounds)]
    for (a, b), part in zip(itertools.pairwise(bounds), parts, strict=True):
        assert _rows_of(part) == rows[a:b]
        assert (part.hi > part.lo).all()


# ---------------------------------------------------------------------------- dealing


def _streams(plan: EpochPlan, world_size: int, workers: int) -> list[Pieces]:
    return [
        plan.stream_share(rank * workers + worker)
        for rank in range(world_size)
        for worker in range(workers)
    ]


@given(epochs(), st.integers(1, 5), st.integers(0, 3), st.booleans())
def test_deal_is_balanced_and_lossless(epoch, world_size, num_workers, even):
    split_rows, order = epoch
    plan = EpochPlan.first(
        epoch=0, sequence=Pieces.whole(order, split_rows), world_size=world_size,
        num_workers=num_workers, even=even,
    )  # fmt: skip
    workers = max(1, num_workers)
    streams = world_size * workers
    sequence = [(int(s), r) for s in order for r in range(split_rows[s])]
    total = len(sequence)
    shares = _streams(plan, world_size, workers)
    sizes = [int(p.rows.sum()) for p in shares]
    left_out = _rows_of(plan.deal.left_out())

    # Shares differ by at most one row, the larger ones first (within each rank with even).
    def spread(rows: int, parts: int) -> list[int]:
        quota, extra = divmod(rows, parts)
        return [quota + 1] * extra + [quota] * (parts - extra)

    if even:
        # Every rank the same rows, spread alike over its workers: equal batch counts per rank.
        assert sizes == spread(total // world_size, workers) * world_size
        assert len(left_out) == total % world_size < streams
    else:
        assert sizes == spread(total, streams)
        assert left_out == []
    assert max(sizes) - min(sizes) <= 1
    assert plan.deal.shares.tolist() == sizes
    for rank in range(world_size):
        assert plan.rank_shares(rank).tolist() == sizes[rank * workers : (rank + 1) * workers]

    # Every remaining row exactly once: shares in stream order, then what is left out, are the
    # sequence itself (contiguous shares, each in the sequence's order).
    for pieces in shares:
        assert (pieces.hi > pieces.lo).all()
        assert (pieces.hi <= split_rows[pieces.splits]).all() and (pieces.lo >= 0).all()
    dealt = [row for pieces in shares for row in _rows_of(pieces)]
    assert dealt + left_out == sequence
    everything = {(s, r) for s in range(len(split_rows)) for r in range(split_rows[s])}
    assert len(set(dealt + left_out)) == len(dealt + left_out)
    assert set(dealt + left_out) == everything


def _rows_through(plan: EpochPlan, stream: int) -> list[tuple[int, int]]:
    """``(split, row)`` of every row stream ``stream`` of ``plan`` reads, in order (a later
    deal's stream reads rows of the previous deal's streams)."""
    pieces = plan.stream_share(stream)
    if plan.previous is None:
        return _rows_of(pieces)
    return [row for g, lo, hi in _triples(pieces) for row in _rows_through(plan.previous, g)[lo:hi]]


@given(epochs(), st.data())
def test_elastic_deals_are_exactly_the_rows_not_delivered(epoch, data):
    """A chain of deals (elastic resumes): each deals anew, once each, exactly the rows its
    predecessor's streams had not delivered, its left-out rows included."""
    split_rows, order = epoch
    world, workers, even = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 3)), True
    plan = EpochPlan.first(epoch=0, sequence=Pieces.whole(order, split_rows), world_size=world,
                           num_workers=workers, even=even)  # fmt: skip
    delivered: list[tuple[int, int]] = []
    for _ in range(data.draw(st.integers(1, 3))):
        shares = plan.deal.shares.tolist()
        positions = [data.draw(st.integers(0, n)) for n in shares]
        tokens = [data.draw(st.integers(0, 3)) if p < n else 0
                  for p, n in zip(positions, shares, strict=True)]  # fmt: skip
        for g, p in enumerate(positions):
            delivered += _rows_through(plan, g)[:p]
        generation = Generation(world, workers, even, _ints(positions), _ints(tokens))
        world, workers = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 3))
        even = data.draw(st.booleans())
        following = plan.then(generation, world_size=world, num_workers=workers, even=even)
        # The cut rows of the old streams are the rows the new deal skips tokens of.
        over = all(p >= n for p, n in zip(positions, shares, strict=True))
        streams = plan.deal.streams + (0 if over else 1)  # the left-out rows: stream S
        rest = [row for g in range(streams) for row in _rows_through(plan, g)[
            positions[g] if g < plan.deal.streams else 0:]]  # fmt: skip
        if over:
            delivered += _rows_through(plan, plan.deal.streams)  # left out for good
        sequence = [row for g in range(following.deal.streams + 1)
                    for row in _rows_through(following, g)]  # fmt: skip
        assert sequence == rest
        cut = {}
        for g, p in enumerate(positions):
            if tokens[g]:
                cut[_rows_through(plan, g)[p]] = tokens[g]
        assert {sequence[row]: n for row, n in following.skips.items()
                if sequence[row] in cut} == cut  # fmt: skip
        plan = following
    final = [row for g in range(plan.deal.streams + 1) for row in _rows_through(plan, g)]
    everything = [(int(s), r) for s in order for r in range(split_rows[s])]
    assert sorted(delivered + final) == sorted(everything)


def test_a_later_deal_keeps_the_cuts_its_streams_did_not_reach():
    """A row an elastic resume cut mid-document stays cut through the next one, until a stream
    passes it."""
    split_rows = _ints([10, 10])
    first = EpochPlan.first(epoch=0, sequence=Pieces.whole(_ints([0, 1]), split_rows), world_size=2,
                            num_workers=0, even=False)  # fmt: skip
    second = first.then(Generation(2, 0, False, _ints([4, 0]), _ints([3, 0])), world_size=1,
                        num_workers=0, even=False)  # fmt: skip
    assert dict(second.skips) == {0: 3}  # split 0 row 4 is the first row dealt anew
    third = second.then(Generation(1, 0, False, _ints([0]), _ints([0])), world_size=2,
                        num_workers=0, even=False)  # fmt: skip
    assert dict(third.skips) == {0: 3}
    passed = second.then(Generation(1, 0, False, _ints([1]), _ints([0])), world_size=1,
                         num_workers=0, even=False)  # fmt: skip
    assert dict(passed.skips) == {}


def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_one_rank_of_a_large_deal_costs_its_own_share():
    """4,096 ranks x 16 workers over 1,000,000 splits: a stream's share, a rank's shares and
    the left-out rows allocate for their own pieces, not for every split or every stream."""
    splits = 1_000_000
    rows = np.arange(splits, dtype=np.int64) % 7 + 100
    sequence = Pieces(np.arange(splits, dtype=np.int64), np.zeros(splits, np.int64), rows)
    _ = sequence.ends  # the cumulative rows: the one O(splits) array, computed once
    dealt = deal(sequence, world_size=4096, num_workers=16, even=True)
    stream = 2048 * 16 + 5  # worker 5 of rank 2048
    per_rank = int(rows.sum()) // 4096
    quota, extra = divmod(per_rank, 16)
    start = 2048 * per_rank + 5 * quota + min(5, extra)
    share = dealt.share(stream)
    assert share.total == quota + (extra > 5)
    expected = sequence.rows_range(start, start + share.total)
    assert all(
        np.array_equal(getattr(share, f), getattr(expected, f)) for f in ("splits", "lo", "hi")
    )
    assert dealt.shares_of(2048 * 16, 16).tolist() == dealt.shares[2048 * 16 : 2049 * 16].tolist()
    own = 64 * len(share) + 4096  # a few arrays of the share's pieces
    assert _peak_bytes(lambda: dealt.share(stream)) < own
    assert _peak_bytes(lambda: dealt.shares_of(2048 * 16, 16)) < 4096
    assert _peak_bytes(dealt.left_out) < 4096
    assert _peak_bytes(lambda: deal(sequence, world_size=4096, num_workers=16, even=False)) < 4096


def test_deal_examples():
    sequence = Pieces(_ints([4, 1]), _ints([0, 2]), _ints([5, 7]))  # 10 rows
    uneven = deal(sequence, world_size=2, num_workers=2, even=False)
    assert uneven.bounds.tolist() == [0, 3, 6, 8, 10]
    assert [_rows_of(uneven.share(g)) for g in range(4)] == [
        [(4, 0), (4, 1), (4, 2)], [(4, 3), (4, 4), (1, 2)], [(1, 3), (1, 4)], [(1, 5), (1, 6)],
    ]  # fmt: skip
    assert len(uneven.left_out()) == 0
    # 10 rows over 2 ranks: 5 each, 3 + 2 on both ranks' workers, nothing left out.
    evened = deal(sequence, world_size=2, num_workers=2, even=True)
    assert evened.shares.tolist() == [3, 2, 3, 2]
    assert len(evened.left_out()) == 0
    # 10 rows over 4 ranks: 2 each, the last 2 rows (fewer than 4) left out.
    evened = deal(sequence, world_size=4, num_workers=1, even=True)
    assert evened.shares.tolist() == [2, 2, 2, 2]
    assert _rows_of(evened.left_out()) == [(1, 5), (1, 6)]  # the sequence's last rows
    # More streams than rows: some shares are empty, never negative.
    assert deal(sequence, world_size=3, num_workers=4, even=False).shares.tolist() == (
        [1] * 10 + [0, 0]
    )
    assert deal(sequence, world_size=3, num_workers=4, even=True).shares.tolist() == (
        [1, 1, 1, 0] * 3
    )
    assert _rows_of(deal(sequence, world_size=12, num_workers=1, even=True).left_out()) == (
        _rows_of(sequence)
    )


def test_num_workers_zero_is_one_stream_per_rank():
    split_rows = _ints([5, 6, 7])
    build = {"epoch": 0, "sequence": Pieces.whole(_ints([0, 1, 2]), split_rows),
             "world_size": 2, "even": False}  # fmt: skip
    zero = EpochPlan.first(num_workers=0, **build)
    one = EpochPlan.first(num_workers=1, **build)
    assert zero.num_workers == 1
    assert zero.deal.bounds.tolist() == one.deal.bounds.tolist() == [0, 9, 18]


# ---------------------------------------------------------------------------- the issue's table


def _left_out(num_splits: int, ranks: int, workers: int, rows_per_split: int, epoch: int = 0):
    plan = EpochPlan.first(
        epoch=epoch,
        sequence=Pieces.whole(permutation(num_splits, epoch), np.full(num_splits, rows_per_split)),
        world_size=ranks, num_workers=workers, even=True,
    )  # fmt: skip
    return plan


ISSUE_CASES = [(127, 64, 1), (1_000, 256, 8), (5_000, 1_024, 8), (100_000, 1_024, 8)]


@pytest.mark.parametrize("rows_per_split", [1_000_000, 999_999])
def test_even_batches_leaves_out_fewer_than_s_rows_in_the_issues_cases(rows_per_split):
    """Issue 7's table (128 MiB splits of equal size, shuffle on), recomputed: was 49.6 % ..."""
    print(f"\nrows left out per epoch by even_batches, {rows_per_split:,} rows per split:")
    for num_splits, ranks, workers in ISSUE_CASES:
        plan = _left_out(num_splits, ranks, workers, rows_per_split)
        streams = ranks * workers
        left = int(plan.deal.left_out().rows.sum())
        total = num_splits * rows_per_split
        assert left == total % ranks < streams
        shares = plan.deal.shares.reshape(ranks, workers)
        assert (shares == shares[0]).all()  # every rank alike: as many batches
        assert int(shares.max() - shares.min()) <= 1
        print(
            f"  {num_splits:>7,} splits, {ranks:>5,} x {workers} streams (S = {streams:>5,}): "
            f"{left:>5,} of {total:,} rows left out ({left / total:.2e} of the epoch)"
        )


def test_five_equal_one_split_files_over_two_ranks_lose_less_than_two_rows():
    """Whole-split dropping lost a fifth of the data here, the same fifth every epoch."""
    for rows in (20, 21, 1_000_001):
        plans = [_left_out(5, 2, 1, rows, epoch) for epoch in range(4)]
        for plan in plans:
            assert int(plan.deal.left_out().rows.sum()) == (5 * rows) % 2 < 2
            assert plan.deal.shares.tolist() == [5 * rows // 2] * 2
    # The left-out row is the last row of the epoch's last split: it moves with the order.
    plans = [_left_out(5, 2, 1, 21, epoch) for epoch in range(4)]
    assert len({tuple(_rows_of(p.deal.left_out())) for p in plans}) > 1


def test_world_validates():
    with pytest.raises(ValueError, match="rank"):
        World(rank=2, world_size=2)
    with pytest.raises(ValueError, match="worker"):
        World(worker=1, num_workers=1)


def test_coalesced_joins_the_pieces_that_continue_each_other() -> None:
    pieces = Pieces.of([(0, 0, 4), (0, 4, 9), (0, 10, 12), (1, 12, 15), (1, 15, 16), (0, 16, 20)])
    assert _rows_of(pieces.coalesced()) == _rows_of(pieces)
    joined = pieces.coalesced()
    triples = zip(joined.splits.tolist(), joined.lo.tolist(), joined.hi.tolist(), strict=True)
    assert list(triples) == [(0, 0, 9), (0, 10, 12), (1, 12, 16), (0, 16, 20)]
    assert len(Pieces.empty().coalesced()) == 0
