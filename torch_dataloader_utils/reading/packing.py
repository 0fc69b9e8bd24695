"""Token packing at work: a stream's documents, concatenated, cut into batches of sequences.

A stream's documents, in delivery order (each followed by ``TokenPacking.separator`` if one is
given), form one token sequence, cut into batches of ``batch_size`` sequences of exactly
``seq_len`` tokens; a document may end in one batch and continue in the next. The stream's
position after a batch is a ``TokenPosition`` (``planning.tokens``), so resuming there skips exactly
the tokens delivered.

With companions (``TokenPacking.companions``) the tokens are ``Columns``: the token array and
each companion's, of one length, cut, skipped, joined and scattered alike (separators get each
companion's pad), so a batch holds each companion aligned with its tokens.

Everything runs on whole chunks with numpy; no Python per row or per token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from ..base.arrays import IntArray
from ..base.errors import DataSourceError, InvalidStateError
from ..planning.tokens import TokenPacking, TokenPosition

__all__ = [
    "Columns",
    "Pending",
    "column_pads",
    "documents",
    "named_companions",
    "pack_tokens",
    "packed_batch",
    "positions_from_bounds",
]


# Tokens (the first array) and their companions' values, aligned (``TokenPacking.companions``).
Columns = tuple[npt.NDArray[Any], ...]


@dataclass
class Pending:
    """Tokens read but not yet in a batch (the chunks' arrays, not joined: a batch is a view
    of one unless it spans two), with their companions, and the documents they come from (one
    entry per row, empty ones too): its stream row, its first token, the tokens skipped before.

    Invariant: ``starts`` is non-decreasing within ``[0, size]``; document ``i``'s pending
    tokens are ``[starts[i], starts[i + 1])`` (the last one's run to ``size``), and
    ``skipped[i]`` of its tokens were delivered (or skipped by a resume) before them. So the
    stream position after pending token ``t`` is row ``rows[i]`` with ``skipped[i] + t + 1 -
    starts[i]`` of its tokens delivered, or the next row once those are all of it
    (``position_after``); ``drop`` keeps the invariant for the tokens left.
    """

    parts: list[Columns]
    rows: IntArray
    starts: IntArray
    skipped: IntArray

    @property
    def size(self) -> int:
        return sum(len(part[0]) for part in self.parts)

    def extend(self, tokens: Columns, rows: IntArray, starts: IntArray, skipped: IntArray) -> None:
        self.starts = np.concatenate([self.starts, starts + self.size])
        self.parts.append(tokens)
        self.rows = np.concatenate([self.rows, rows])
        self.skipped = np.concatenate([self.skipped, skipped])

    def tokens(self, lo: int, size: int) -> Columns:
        """Pending tokens ``[lo, lo + size)`` and their companions: views, or copies where
        they span parts."""
        # what an empty range is: no tokens of their type
        pieces = [tuple(column[:0] for column in self.parts[0])]
        for part in self.parts:
            if lo < len(part[0]) and size > 0:
                pieces.append(tuple(column[lo : lo + size] for column in part))
                size -= len(pieces[-1][0])
            lo = max(0, lo - len(part[0]))
        if len(pieces) <= 2:
            return pieces[-1]
        return tuple(np.concatenate(column) for column in zip(*pieces, strict=True))

    def starts_within(self, lo: int, size: int) -> IntArray:
        """Where documents start among pending tokens ``[lo, lo + size)``, from ``lo``."""
        a, b = np.searchsorted(self.starts, [lo, lo + size], side="left")
        starts: IntArray = self.starts[a:b] - lo
        return starts

    def position_after(self, end: int) -> TokenPosition:
        """The stream position once the first ``end`` pending tokens are delivered."""
        doc = int(np.searchsorted(self.starts, end, side="left")) - 1
        last = int(self.starts[doc + 1]) if doc + 1 < len(self.starts) else self.size
        row = int(self.rows[doc])
        if last == end:
            return TokenPosition(row + 1)
        return TokenPosition(row, int(self.skipped[doc]) + end - int(self.starts[doc]))

    def drop(self, end: int) -> None:
        """Forget the first ``end`` tokens and the documents wholly within them."""
        doc = max(0, int(np.searchsorted(self.starts, end, side="right")) - 1)
        if doc < len(self.starts) and self.starts[doc] < end:
            self.skipped = self.skipped.copy()
            self.skipped[doc] += end - self.starts[doc]
        self.parts = [self.tokens(end, self.size - end)]
        self.rows, self.skipped = self.rows[doc:], self.skipped[doc:]
        self.starts = np.maximum(self.starts[doc:] - end, 0)


def pack_tokens(
    chunks: Iterator[tuple[pa.RecordBatch, int]],
    *,
    packing: TokenPacking,
    batch_size: int,
    drop_last: bool,
    skips: Mapping[int, int],
    end: int,
    describe: Callable[[int], str],
    describe_row: Callable[[int], str],
    position_ids: object = None,
) -> Iterator[tuple[dict[str, Any], TokenPosition]]:
    """Packed batches of numpy arrays from a stream's ``chunks``, each with the position after
    it; ``position_ids``, when given, stands in every batch for the array (which
    ``positions_from_bounds`` computes from the batch's ``cu_seqlens`` later).

    ``skips[row]`` tokens of stream row ``row`` were delivered before (a checkpoint's cut
    documents). The last full batch stands for the end of the stream (``end`` rows) when no
    token follows it or ``drop_last`` drops them; otherwise a last, padded batch follows.
    ``describe(position)`` names the split of a position, ``describe_row(row)`` the file and
    row of stream row ``row``, for errors.
    """
    need, seq_len = batch_size * packing.seq_len, packing.seq_len
    pending: Pending | None = None
    held: tuple[dict[str, Any], TokenPosition] | None = None
    for chunk, after in chunks:
        first = after - chunk.num_rows
        tokens, rows, starts, skipped = documents(
            chunk, packing, first, skips, describe, describe_row
        )
        if pending is None:
            pending = Pending([], rows[:0], starts[:0], skipped[:0])
        pending.extend(tokens, rows, starts, skipped)
        whole = pending.size // need * need
        for lo in range(0, whole, need):
            if held is not None:
                yield held
            columns = pending.tokens(lo, need)
            batch = packed_batch(
                columns[0], pending.starts_within(lo, need), seq_len, position_ids,
                companions=named_companions(packing, columns),
            )  # fmt: skip
            held = batch, pending.position_after(lo + need)
        if whole:
            pending.drop(whole)
    rest = 0 if pending is None else pending.size
    if held is not None:
        yield held[0], (TokenPosition(end) if rest == 0 or drop_last else held[1])
    if rest and not drop_last and pending is not None:
        size = -(-rest // seq_len) * seq_len
        padded = []
        pads = column_pads(packing, packing.pad_id)
        for real, pad in zip(pending.tokens(0, rest), pads, strict=True):
            padded.append(np.full(size, pad, real.dtype))
            padded[-1][:rest] = real
        starts = np.append(pending.starts_within(0, rest), rest)  # the padding: a part of its own
        companions = named_companions(packing, tuple(padded))
        batch = packed_batch(padded[0], starts, seq_len, position_ids, rest, companions)
        yield batch, TokenPosition(end)


def documents(
    chunk: pa.RecordBatch,
    packing: TokenPacking,
    first: int,
    skips: Mapping[int, int],
    describe: Callable[[int], str],
    describe_row: Callable[[int], str],
) -> tuple[Columns, IntArray, IntArray, IntArray]:
    """A chunk's tokens and their companions (separators and their pads inserted, skipped
    tokens removed), and per row: its stream row, its first token, the tokens skipped.
    ``describe(position)`` names the split of a position, ``describe_row(row)`` a stream
    row's file and row, for errors."""
    column = chunk.column(packing.column)
    offsets = column.offsets.to_numpy().astype(np.int64, copy=False)
    child = column.values.slice(offsets[0], offsets[-1] - offsets[0])
    if column.null_count or child.null_count:
        raise DataSourceError(
            f"split {describe(first + 1)}: column {packing.column!r} ({column.type}) holds null "
            f"documents or tokens; packing needs every row to be a list of token ids"
        )
    # writable: a read-only view of Arrow's buffer would reach the user without a separator
    writable = packing.separator is None
    columns = [child.to_numpy(zero_copy_only=False, writable=writable)]
    lengths = np.diff(offsets)
    if packing.companions:
        columns += _companion_values(chunk, packing, lengths, lambda i: describe_row(first + i))
    if packing.separator is not None:
        at = offsets[1:] - offsets[0]
        pads = column_pads(packing, packing.separator)
        columns = [np.insert(c, at, pad) for c, pad in zip(columns, pads, strict=True)]
        lengths = lengths + 1
    starts = np.cumsum(lengths) - lengths
    rows = np.arange(first, first + len(lengths), dtype=np.int64)
    skipped = np.zeros(len(lengths), dtype=np.int64)
    inside = [(row, count) for row, count in skips.items() if first <= row < first + len(rows)]
    if inside:
        keep = np.ones(len(columns[0]), dtype=bool)
        for row, count in inside:
            i = row - first
            if count > lengths[i]:
                raise InvalidStateError(
                    f"state key 'tokens': split {describe(row + 1)}: the checkpoint delivered "
                    f"{count} tokens of a document of {lengths[i]}: the state is corrupted (or "
                    f"the file changed without a change to its size or footer)"
                )
            keep[starts[i] : starts[i] + count] = False
            skipped[i] = count
        columns = [column[keep] for column in columns]
        lengths = lengths - skipped
        starts = np.cumsum(lengths) - lengths
    return tuple(columns), rows, starts, skipped


def _companion_values(
    chunk: pa.RecordBatch,
    packing: TokenPacking,
    lengths: IntArray,
    describe: Callable[[int], str],
) -> list[npt.NDArray[Any]]:
    """The chunk's companion values, each aligned with its rows' tokens (of ``lengths``); a
    companion row whose length differs, or a null, is an error naming the chunk's row
    (``describe``)."""
    out = []
    for name in packing.companions:
        column = chunk.column(name)
        offsets = column.offsets.to_numpy().astype(np.int64, copy=False)
        child = column.values.slice(offsets[0], offsets[-1] - offsets[0])
        differ = np.flatnonzero(np.diff(offsets) != lengths)
        if column.null_count or child.null_count or len(differ):
            raise _misaligned(column, offsets, lengths, differ, packing, name, describe)
        out.append(child.to_numpy(zero_copy_only=False, writable=packing.separator is None))
    return out


def _misaligned(
    column: pa.Array,
    offsets: IntArray,
    lengths: IntArray,
    differ: IntArray,
    packing: TokenPacking,
    name: str,
    describe: Callable[[int], str],
) -> DataSourceError:
    """The error of a companion column with a null, or with a row whose length differs from
    its tokens' (the first such row named). The error path only."""
    nulls = np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))
    inner = column.flatten().is_null().to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(column).to_numpy()[inner]  # rows with a null value
    null = min([*nulls[:1].tolist(), *parents[:1].tolist()], default=None)
    if null is not None and (not len(differ) or null <= differ[0]):
        return DataSourceError(
            f"{describe(null)}: companion column {name!r} holds a null; packing needs one "
            f"value per token of column {packing.column!r} in every row"
        )
    row = int(differ[0])
    return DataSourceError(
        f"{describe(row)}: companion column {name!r} holds {offsets[row + 1] - offsets[row]} "
        f"values where column {packing.column!r} holds {lengths[row]} tokens; packing needs "
        f"one value of each companion per token, in every row"
    )


def column_pads(packing: TokenPacking, token: int) -> tuple[int, ...]:
    """What stands at a separator's (``token``: ``separator``) or padding's (``pad_id``)
    place: the token, then each companion's pad."""
    return (token, *packing.companions.values())


def named_companions(packing: TokenPacking, columns: Columns) -> dict[str, npt.NDArray[Any]]:
    """The companions among ``columns`` (after the tokens), by name."""
    return dict(zip(packing.companions, columns[1:], strict=True))


def packed_batch(
    tokens: npt.NDArray[Any],
    starts: IntArray,
    seq_len: int,
    position_ids: object = None,
    real: int | None = None,
    companions: Mapping[str, npt.NDArray[Any]] | None = None,
) -> dict[str, Any]:
    """One batch of ``tokens`` (whole sequences; after the first ``real``, padding) whose
    documents start at ``starts``: its parts are the documents cut at sequence boundaries;
    then the ``companions`` (values aligned with ``tokens``), shaped alike.

    Every part holds a token: a start at ``size`` (the padding of a stream whose tokens fill
    its last batch exactly) would make a zero-length part, which varlen attention refuses.
    """
    size = len(tokens)
    parts = np.concatenate((starts[starts < size], np.arange(0, size, seq_len)))
    parts.sort()
    bounds = np.append(parts[np.append(True, parts[1:] != parts[:-1])], size)
    batch = {
        "input_ids": tokens.reshape(-1, seq_len),
        "position_ids": positions_from_bounds(bounds, seq_len)
        if position_ids is None
        else position_ids,
        "cu_seqlens": bounds.astype(np.int32),
        "num_tokens": size if real is None else real,
    }
    for name, values in (companions or {}).items():
        batch[name] = values.reshape(-1, seq_len)
    return batch


def positions_from_bounds(bounds: npt.NDArray[Any], seq_len: int) -> IntArray:
    """``position_ids`` (``int64``, rows x ``seq_len``) of a batch whose parts are bounded by
    ``bounds`` (its ``cu_seqlens``): each token's place in its part."""
    bounds = bounds.astype(np.int64, copy=False)
    size = int(bounds[-1])
    positions = np.repeat(bounds[:-1], bounds[1:] - bounds[:-1])
    np.subtract(_arange(size), positions, out=positions)
    return positions.reshape(-1, seq_len)


@functools.lru_cache(maxsize=4)
def _arange(size: int) -> IntArray:
    """``0 .. size - 1``, made once per batch size (read only)."""
    numbers = np.arange(size, dtype=np.int64)
    numbers.flags.writeable = False
    return numbers
