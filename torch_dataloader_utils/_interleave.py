"""Pure: the order in which a shuffle window mixes the rows of its pieces.

A window of ``K`` pieces with ``n[j]`` rows each is delivered as one sequence in which every
piece advances at the same relative rate: row ``r`` of piece ``j`` comes at the integer time
``key(j, r) = ((2r + 1) << 30) // n[j]`` (the middle of its share of the window, in 1/2^30
units); ties go to the lower piece. So any stretch of the window holds rows of every piece in
proportion to its size (a batch samples all ``K`` splits), each piece is read front to back
(rows of a piece delivered so far are always a prefix of it: a position is a few integers, and
re-entering a piece reads from its next row), and the whole order is integer arithmetic, the
same on every platform.

``counts_at(n, t)`` is how many rows of each piece the first ``t`` rows of the window hold;
``mixing_order(n, c0, c1)`` the delivery order of the rows between two such positions.
"""

from __future__ import annotations

import numpy as np

from ._plan import IntArray

__all__ = [
    "MAX_PIECE_ROWS",
    "counts_at",
    "mixing_order",
    "stream_counts",
    "stream_index",
    "stream_row",
    "window_start",
]

_SHIFT = 30
MAX_PIECE_ROWS = 1 << _SHIFT  # keeps every product below 2^62


def _count_upto(kappa: IntArray | np.int64, rows: IntArray) -> IntArray:
    """Rows of each piece whose key is ``<= kappa`` (broadcast over both)."""
    # key(r) <= kappa  <=>  (2r + 1) * 2^30 < (kappa + 1) * n  <=>  r < ceil((kappa+1) n / 2^30) / 2
    scaled = -((-(kappa + 1) * rows) >> _SHIFT)  # ceil division by 2^30
    counts: IntArray = np.clip(scaled // 2, 0, rows)
    return counts


def counts_at(rows: IntArray, t: int) -> IntArray:
    """Rows of each piece among the first ``t`` rows of the window (shape ``(K,)``)."""
    rows = np.asarray(rows, dtype=np.int64)
    total = int(rows.sum())
    if t >= total:
        return rows.copy()
    if int(rows.max()) > MAX_PIECE_ROWS:
        raise ValueError(f"a shuffled piece has more than {MAX_PIECE_ROWS} rows")
    # Every row keyed up to the time of row t holds t rows, give or take one per piece ...
    counts = _count_upto(np.int64((t << (_SHIFT + 1)) // total), rows)
    missing = t - int(counts.sum())
    if missing == 0:
        return counts
    # ... so the rest is the next (or last) few rows of each piece, in key order.
    steps = np.arange(abs(missing), dtype=np.int64)
    row = counts[:, None] + steps if missing > 0 else counts[:, None] - 1 - steps
    piece = np.broadcast_to(np.arange(len(rows), dtype=np.int64)[:, None], row.shape)
    valid = (row >= 0) & (row < rows[:, None])
    row, piece = row[valid], piece[valid]
    order = np.sort((((2 * row + 1) << _SHIFT) // rows[piece]) * len(rows) + piece)
    chosen = order[:missing] if missing > 0 else order[missing:]
    change = np.bincount(chosen % len(rows), minlength=len(rows))
    return counts + change if missing > 0 else counts - change


def mixing_order(rows: IntArray, start: IntArray, stop: IntArray) -> IntArray:
    """Delivery order of the rows between positions with counts ``start`` and ``stop``.

    Indexes the concatenation of each piece's rows ``[start[j], stop[j])`` in piece order.
    """
    taken = stop - start
    piece = np.repeat(np.arange(len(rows), dtype=np.int64), taken)
    index = np.arange(len(piece), dtype=np.int64)
    row = index + np.repeat(start - (np.cumsum(taken) - taken), taken)
    keys = ((2 * row + 1) << _SHIFT) // rows[piece]
    # Rows are concatenated piece by piece, so the index breaks ties by piece; each piece is
    # already in key order, which the stable sort (a merge of sorted runs) exploits.
    bits = max(1, len(index).bit_length())
    return np.sort((keys << bits) | index, kind="stable") & ((1 << bits) - 1)


def window_start(ends: IntArray, window: int, position: int) -> int:
    """The first piece of the window a stream is in after ``position`` rows (``ends``: the
    cumulative rows of its pieces); every piece before it is wholly delivered."""
    return int(np.searchsorted(ends, position, side="right")) // window * window


def stream_counts(rows: IntArray, window: int, position: int) -> IntArray:
    """Rows of each piece a stream of pieces ``rows``, mixed ``window`` at a time, has delivered
    after its first ``position`` rows."""
    out = np.zeros(len(rows), dtype=np.int64)
    ends = np.cumsum(rows)
    current = window_start(ends, window, position)
    out[:current] = rows[:current]
    if current < len(rows):
        part = rows[current : current + window]
        begin = int(ends[current] - rows[current])
        out[current : current + len(part)] = counts_at(part, position - begin)
    return out


def stream_row(rows: IntArray, ends: IntArray, window: int, position: int) -> tuple[int, int]:
    """The piece, and its row, that a stream of pieces ``rows`` (cumulative ``ends``) mixed
    ``window`` at a time delivers as its row ``position``."""
    first = window_start(ends, window, position)
    part = rows[first : first + window]
    begin = int(ends[first] - rows[first])
    before = counts_at(part, position - begin)
    piece = int(np.argmax(counts_at(part, position + 1 - begin) != before))
    return first + piece, int(before[piece])


def stream_index(rows: IntArray, ends: IntArray, window: int, piece: int, row: int) -> int:
    """Where a stream of pieces ``rows`` mixed ``window`` at a time delivers ``row`` of its
    piece ``piece`` (the inverse of ``stream_row``)."""
    first = piece // window * window
    part = np.asarray(rows[first : first + window], dtype=np.int64)
    j = piece - first
    key = ((2 * row + 1) << _SHIFT) // int(part[j])
    # Rows of lower pieces with a key up to ``key`` come first (ties: the lower piece), and
    # rows of the others with a smaller key; within piece ``j`` that is its ``row`` rows.
    earlier = (
        _count_upto(np.int64(key), part[:j]).sum() + _count_upto(np.int64(key - 1), part[j:]).sum()
    )
    return int(ends[first] - rows[first]) + int(earlier)
