"""The shuffle window's mixing order, against a brute-force sort of every row's key.

Row ``r`` of piece ``j`` (of ``rows[j]`` rows) comes at the integer key
``((2r + 1) << 30) // rows[j]``; ties go to the lower piece. A stream's pieces are mixed
``window`` at a time, in consecutive groups of ``window`` pieces. No I/O.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torch_dataloader_utils._interleave import (
    MAX_PIECE_ROWS,
    counts_at,
    mixing_order,
    stream_counts,
)

# Windows of 1 to 8 pieces, at least one row each; sizes from equal to wildly unequal.
small_rows = st.lists(st.integers(1, 40), min_size=1, max_size=8)
unequal_rows = st.lists(
    st.one_of(st.integers(1, 3), st.integers(1, 400), st.integers(2_000, 5_000)),
    min_size=1, max_size=8,
)  # fmt: skip


def _order(rows: list[int]) -> list[tuple[int, int]]:
    """``(piece, row)`` of the whole window in delivery order: every key sorted, ties by piece."""
    items = [((((2 * r + 1) << 30) // n), j, r) for j, n in enumerate(rows) for r in range(n)]
    return [(j, r) for _, j, r in sorted(items)]


def _counts(order: list[tuple[int, int]], k: int, t: int) -> list[int]:
    counts = [0] * k
    for j, _ in order[:t]:
        counts[j] += 1
    return counts


def _ints(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# ---------------------------------------------------------------------------- counts_at


@given(small_rows)
def test_counts_at_equals_brute_force_at_every_position(rows):
    order = _order(rows)
    n = _ints(rows)
    previous = np.zeros(len(rows), dtype=np.int64)
    for t in range(len(order) + 1):
        got = counts_at(n, t)
        assert got.tolist() == _counts(order, len(rows), t), t
        assert int(got.sum()) == t
        assert (got >= previous).all() and (got <= n).all()  # monotone, within each piece
        previous = got
    assert counts_at(n, len(order) + 5).tolist() == rows  # past the end: everything


@given(unequal_rows, st.data())
def test_counts_at_equals_brute_force_for_unequal_pieces(rows, data):
    order = _order(rows)
    n = _ints(rows)
    ts = data.draw(st.lists(st.integers(0, len(order)), min_size=1, max_size=30))
    for t in sorted(ts):
        got = counts_at(n, t)
        assert got.tolist() == _counts(order, len(rows), t), t
        assert int(got.sum()) == t


@given(st.integers(1, 10_000), st.data())
def test_counts_at_one_piece_is_the_position(n, data):
    t = data.draw(st.integers(0, n))
    assert counts_at(_ints([n]), t).tolist() == [t]


def test_counts_at_examples():
    # Equal pieces go round by round, lower piece first.
    assert [counts_at(_ints([3, 3]), t).tolist() for t in range(7)] == [
        [0, 0], [1, 0], [1, 1], [2, 1], [2, 2], [3, 2], [3, 3],
    ]  # fmt: skip
    # One row of a piece sits in the middle of the window.
    assert counts_at(_ints([1, 4]), 2).tolist() == [0, 2]
    assert counts_at(_ints([1, 4]), 3).tolist() == [1, 2]


def test_counts_at_large_pieces_against_a_vectorised_brute_force():
    """Pieces of a million rows next to pieces of one: the keys, sorted by numpy."""
    rows = _ints([1, 3, 1_000_003, 7, 250_000])
    piece = np.repeat(np.arange(len(rows)), rows)
    row = np.arange(len(piece)) - np.repeat(np.cumsum(rows) - rows, rows)
    keys = ((2 * row + 1) << 30) // rows[piece]
    order = piece[np.lexsort((piece, keys))]
    for t in (0, 1, 2, 5, 1000, 654_321, 1_000_000, 1_250_000, len(order) - 1, len(order)):
        expected = np.bincount(order[:t], minlength=len(rows))
        assert counts_at(rows, t).tolist() == expected.tolist(), t


def test_counts_at_refuses_pieces_beyond_the_key_range():
    with pytest.raises(ValueError, match="rows"):
        counts_at(_ints([MAX_PIECE_ROWS + 1, 1]), 5)


# ---------------------------------------------------------------------------- mixing_order


@given(unequal_rows, st.data())
def test_mixing_order_equals_brute_force_between_positions(rows, data):
    order = _order(rows)
    n = _ints(rows)
    t0 = data.draw(st.integers(0, len(order)))
    t1 = data.draw(st.integers(t0, min(len(order), t0 + 3_000)))
    start, stop = counts_at(n, t0), counts_at(n, t1)
    got = mixing_order(n, start, stop)
    # It indexes the concatenation of each piece's rows [start[j], stop[j]), in piece order.
    offset = np.cumsum(stop - start) - (stop - start)
    expected = [int(offset[j]) + r - int(start[j]) for j, r in order[t0:t1]]
    assert got.tolist() == expected


def test_mixing_order_of_a_whole_window():
    rows = _ints([2, 4, 1])
    got = mixing_order(rows, np.zeros(3, dtype=np.int64), rows)
    # concatenation: a0 a1 | b0 b1 b2 b3 | c0  -> indexes 0 1 | 2 3 4 5 | 6
    assert got.tolist() == [2, 0, 3, 6, 4, 1, 5]  # b0 a0 b1 c0 b2 a1 b3
    assert [(j, r) for j, r in _order([2, 4, 1])] == [
        (1, 0), (0, 0), (1, 1), (2, 0), (1, 2), (0, 1), (1, 3),
    ]  # fmt: skip


# ---------------------------------------------------------------------------- stream_counts


def _stream_counts(rows: list[int], window: int, position: int) -> list[int]:
    """Brute force: windows of ``window`` consecutive pieces, each mixed, one after another."""
    out: list[int] = []
    left = position
    for first in range(0, len(rows), window):
        part = rows[first : first + window]
        take = min(left, sum(part))
        out += _counts(_order(part), len(part), take)
        left -= take
    return out


@given(st.lists(st.integers(1, 30), max_size=14), st.integers(1, 5), st.data())
def test_stream_counts_equals_brute_force_over_windows(rows, window, data):
    n = _ints(rows)
    positions = data.draw(st.lists(st.integers(0, sum(rows)), max_size=10))
    for position in [0, sum(rows), *positions]:
        got = stream_counts(n, window, position)
        assert got.tolist() == _stream_counts(rows, window, position), position
        assert int(got.sum()) == position


def test_stream_counts_at_window_boundaries():
    rows = _ints([2, 3, 4, 5, 6])  # windows of 2: [2, 3] [4, 5] [6]
    assert stream_counts(rows, 2, 5).tolist() == [2, 3, 0, 0, 0]
    assert stream_counts(rows, 2, 14).tolist() == [2, 3, 4, 5, 0]
    assert stream_counts(rows, 2, 15).tolist() == [2, 3, 4, 5, 1]
    assert stream_counts(rows, 2, 20).tolist() == [2, 3, 4, 5, 6]
    # window 1: pieces in order, one after another (shuffle off)
    assert stream_counts(rows, 1, 6).tolist() == [2, 3, 1, 0, 0]


# ---------------------------------------------------------------------------- mixing quality


@pytest.mark.parametrize("n", [32, 1_000, 10_000, 100_000])
def test_a_batch_from_a_window_of_32_equal_pieces_holds_all_32(n):
    rows = np.full(32, n, dtype=np.int64)
    total = 32 * n
    for t in range(0, total - 1024 + 1, max(1024, total // 400 // 1024 * 1024)):
        batch = counts_at(rows, t + 1024) - counts_at(rows, t)
        assert (batch > 0).all(), t
        assert int(batch.sum()) == 1024


def test_a_batch_from_a_window_of_32_unequal_pieces_holds_all_32():
    """Pieces within a factor of two: a batch holds at least 16 - 3 rows of each."""
    rows = np.random.default_rng(7).integers(5_000, 10_001, 32).astype(np.int64)
    total = int(rows.sum())
    for t in range(0, total - 1024 + 1, 997):
        batch = counts_at(rows, t + 1024) - counts_at(rows, t)
        assert (batch >= 13).all(), t
