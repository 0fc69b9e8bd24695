"""Whole-document packing: a stream's documents, window by window, packed best-fit decreasing.

No document is cut. The stream's rows are taken in windows of ``TokenPacking.window`` rows from
where the iteration starts (always a window's start: positions only name window starts); a
window's documents go, longest first, each to the open sequence whose free space it fills
best (a new sequence when none has room), and the window's sequences are handed out in the
order they were opened, each padded to ``seq_len`` with ``pad_id``. The assignment is a pure
function of the window's lengths, so the same window start always gives the same sequences,
and a stream's position is a ``TokenPosition``: the window's start, and ``tokens`` = the
window's sequences already delivered.

After an elastic resume a stream reads the rests of old streams (a mixture's source: of each
source epoch's old streams; its windows end with each source epoch); an old stream that stood
inside a window (``Generation.tokens[g]`` sequences of the window at ``positions[g]``
delivered) had some of that window's documents delivered: the window is read and packed
again (as the old stream packed it) to find them, and they are left out here.

Companions (``TokenPacking.companions``) go where their tokens go: every column is cut, placed
and padded (with its own pad) as the tokens are; positions depend on the tokens alone.

Per document only integer work (the assignment) and one slice copy per column; never Python per
token.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from ..base.arrays import IntArray
from ..base.errors import DataSourceError, InvalidStateError
from ..planning.order import StreamOrder
from ..planning.plan import Position
from ..planning.tokens import TokenPacking, TokenPosition
from .packing import Columns, column_pads, documents, named_companions, packed_batch
from .runs import Chunk

__all__ = [
    "DocumentSource",
    "Documents",
    "WholeDocuments",
    "Window",
    "best_fit",
    "chunk_documents",
    "delivered_before",
    "left_out",
    "whole_batches",
]

_log = logging.getLogger("torch_dataloader_utils")

# A stream's documents as read: tokens and companions (separators and their pads in, earlier
# deals' documents out), each row's length (0: empty or delivered by an earlier deal), and the
# first row's stream row.
Documents = tuple[Columns, IntArray, int]


class DocumentSource(Protocol):
    """What whole-document packing reads: a stream (``reading.stream.StreamSource``)."""

    @property
    def order(self) -> StreamOrder: ...

    @property
    def total(self) -> int: ...

    def chunks(
        self, start: Position, min_rows: int, read_ahead: int = 0, *, rows: bool = False
    ) -> Iterator[tuple[Chunk, int]]: ...

    def describe_at(self, position: Position) -> str: ...

    def older(self, stream: int) -> DocumentSource: ...


def best_fit(lengths: IntArray, seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of ``lengths`` (each at most ``seq_len``; zeros left
    out) in sequences, in the order the sequences were opened, each sequence's in index
    order. Longest first (ties: lower index first), each to the sequence with the least free
    space that holds it (ties: the one that reached that space last)."""
    free: list[int] = []  # free space of the sequences with any, ascending
    owner: list[int] = []  # the sequence of each entry of ``free``
    sequences: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[i])
        if length == 0:
            break  # sorted: only empty documents follow
        at = bisect.bisect_left(free, length)
        if at == len(free):
            number, left = len(sequences), seq_len - length
            sequences.append([i])
        else:
            number, left = owner.pop(at), free.pop(at) - length
            sequences[number].append(i)
        if left:
            at = bisect.bisect_left(free, left)
            free.insert(at, left)
            owner.insert(at, number)
    return [sorted(members) for members in sequences]


@dataclass(frozen=True)
class Window:
    """One window's sequences: ``columns`` (the tokens, then each companion: ``len(fill)``
    sequences of ``seq_len``, flat), ``starts`` (ascending: where each document and each
    sequence's padding begin), ``fill`` (real tokens of each sequence), and the window's rows
    (from its first) sequence by sequence: ``members[firsts[i]:firsts[i + 1]]`` are sequence
    ``i``'s."""

    columns: Columns
    starts: IntArray
    fill: IntArray
    members: IntArray
    firsts: IntArray

    @classmethod
    def pack(
        cls,
        values: Columns,
        lengths: IntArray,
        *,
        placed: IntArray,
        seq_len: int,
        pads: tuple[int, ...],
    ) -> Window:
        """The window of the documents of ``lengths`` tokens, one after the other in each of
        ``values`` (the tokens, then each companion), of which the first ``placed`` (each at
        most ``seq_len``) go into sequences; ``pads[c]`` fills the rest of column ``c``."""
        sequences = best_fit(placed, seq_len)
        sizes = np.array([len(s) for s in sequences], dtype=np.int64)
        members = np.array([i for s in sequences for i in s], dtype=np.int64)
        firsts = np.concatenate(([0], np.cumsum(sizes)))
        used = placed[members]
        before = np.cumsum(used) - used  # each placed document's first token, all in a row
        fill = np.add.reduceat(used, firsts[:-1]) if len(sizes) else sizes
        sources = np.cumsum(lengths) - lengths  # each document's first token in ``values``
        # where each document goes: its sequence's start + the documents before it there
        places = np.repeat(np.arange(len(sizes)) * seq_len - before[firsts[:-1]], sizes) + before
        copies = list(zip(places.tolist(), sources[members].tolist(), used.tolist(), strict=True))
        columns = []
        for column, pad in zip(values, pads, strict=True):
            out = np.full(len(sizes) * seq_len, pad, dtype=column.dtype)
            # a copy per document (hundreds of tokens each): 20x faster than gathering by index
            for place, source, count in copies:
                out[place : place + count] = column[source : source + count]
            columns.append(out)
        ends = np.arange(len(sizes), dtype=np.int64) * seq_len + fill
        starts = np.sort(np.concatenate((places, ends[fill < seq_len])))
        return cls(tuple(columns), starts, fill, members, firsts)

    def __len__(self) -> int:
        return len(self.fill)

    def rows_of(self, sequences: int) -> IntArray:
        """The rows (from the window's first) in its first ``sequences`` sequences."""
        return self.members[: self.firsts[sequences]]


class WholeDocuments:
    """A stream's documents as best-fit sequences on demand, from ``start`` (a window's first
    row, and the sequences of that window already delivered). With ``run_end`` (a mixture's
    source, whose rows run on over its epochs) no window crosses the end of a run."""

    def __init__(
        self,
        docs: Iterator[Documents],
        packing: TokenPacking,
        start: TokenPosition | int,
        describe: Callable[[int], str],
        run_end: Callable[[int], int] | None = None,
    ) -> None:
        self._docs, self._packing, self._describe = docs, packing, describe
        self._run_end = run_end  # where the run (a mixture's source epoch) of a row ends
        self._parts: list[Columns] = []  # the pending tokens and companions, chunk by chunk
        self._lengths: IntArray = np.empty(0, dtype=np.int64)
        self._first = int(start)  # the stream row of the first pending document
        self._window: Window | None = None
        self._start = self._end = int(start)  # the current window's rows
        self._next = start.tokens if isinstance(start, TokenPosition) else 0
        self._skip = self._next  # sequences of the first window delivered before
        self.overlong = 0  # documents truncated or dropped so far

    @property
    def position(self) -> TokenPosition:
        """The stream position after the sequences taken."""
        window = self._window
        if window is None:
            return TokenPosition(self._start, self._next)
        if self._next < len(window):
            return TokenPosition(self._start, self._next)
        return TokenPosition(self._end)

    def take(self, sequences: int) -> tuple[Columns, IntArray, int, int]:
        """Up to ``sequences`` next sequences (fewer at the stream's end): their tokens and
        companions (flat), where documents and paddings start in them, the real tokens and the
        sequences."""
        seq_len = self._packing.seq_len
        parts: list[tuple[Columns, IntArray, int]] = []
        taken = 0
        while taken < sequences:
            window = self._window
            if window is None or self._next == len(window):
                if not self._advance():
                    break
                continue
            hi = min(len(window), self._next + sequences - taken)
            lo_token, hi_token = self._next * seq_len, hi * seq_len
            a, b = np.searchsorted(window.starts, [lo_token, hi_token])
            starts = window.starts[a:b] - lo_token + taken * seq_len
            real = int(window.fill[self._next : hi].sum())
            columns = tuple(column[lo_token:hi_token] for column in window.columns)
            parts.append((columns, starts, real))
            taken += hi - self._next
            self._next = hi
        if not parts:
            return self._none(), np.empty(0, dtype=np.int64), 0, 0
        columns = parts[0][0] if len(parts) == 1 else _joined([p[0] for p in parts])
        starts = np.concatenate([p[1] for p in parts])
        return columns, starts, sum(p[2] for p in parts), taken

    def first_window(self) -> Window | None:
        """The window at ``start`` (``None``: the stream ends there)."""
        if self._window is None and not self._advance():
            return None
        return self._window

    def _advance(self) -> bool:
        """Pack the next window; ``False`` at the stream's end."""
        rows = self._packing.window
        if self._run_end is not None:
            rows = min(rows, self._run_end(self._first) - self._first)
        while len(self._lengths) < rows:
            got = next(self._docs, None)
            if got is None:
                break
            values, lengths, first = got
            assert first == self._first + len(self._lengths), "documents out of order"
            self._parts.append(values)
            self._lengths = np.concatenate((self._lengths, lengths))
        count = min(rows, len(self._lengths))
        if count == 0:
            return False
        lengths, self._lengths = self._lengths[:count], self._lengths[count:]
        values = self._take_values(int(lengths.sum()))
        window_start = self._first
        self._first += count
        window = Window.pack(
            values,
            lengths,
            placed=self._capped(lengths, window_start),
            seq_len=self._packing.seq_len,
            pads=column_pads(self._packing, self._packing.pad_id),
        )
        first_window = self._window is None
        self._window, self._start, self._end = window, window_start, window_start + count
        self._next = 0
        if first_window and self._skip:
            if self._skip > len(window):
                raise InvalidStateError(
                    f"state key 'streams': {self._describe(window_start + 1)}: the checkpoint "
                    f"delivered {self._skip} sequences of a window that makes {len(window)}: "
                    f"the state is corrupted (or the file changed without a change to its size "
                    f"or footer)"
                )
            self._next = self._skip
        return True

    def _take_values(self, count: int) -> Columns:
        """The next ``count`` pending tokens and their companions: views of a chunk's, or
        copies where they span chunks (a window's worth at most)."""
        if not count:
            return self._none()  # a window without a token makes no sequence
        pieces: list[Columns] = []
        while count:
            head = self._parts[0]
            if len(head[0]) <= count:
                pieces.append(self._parts.pop(0))
                count -= len(head[0])
            else:
                pieces.append(tuple(column[:count] for column in head))
                self._parts[0], count = tuple(column[count:] for column in head), 0
        return pieces[0] if len(pieces) == 1 else _joined(pieces)

    def _none(self) -> Columns:
        """No tokens, and no values of each companion."""
        return (np.empty(0, dtype=np.int64),) * (1 + len(self._packing.companions))

    def _capped(self, lengths: IntArray, first: int) -> IntArray:
        """``lengths`` with the documents longer than ``seq_len`` truncated or dropped (and
        counted), or refused, as ``TokenPacking.overlong`` says."""
        packing = self._packing
        over = np.flatnonzero(lengths > packing.seq_len)
        if not len(over):
            return lengths
        where = self._describe(first + int(over[0]) + 1)
        if packing.overlong == "error":
            raise DataSourceError(
                f"{where}: stream row {first + int(over[0])} is a document of "
                f"{int(lengths[over[0]])} tokens, longer than seq_len={packing.seq_len}; "
                f"whole-document packing with overlong='error' refuses it: pass "
                f"overlong='truncate' or 'drop', or a larger seq_len"
            )
        logged, self.overlong = self.overlong, self.overlong + len(over)
        if self.overlong >= 2 * logged:  # the first, then each time the count doubles
            _log.warning(
                "whole-document packing: %s %d document(s) longer than seq_len=%d in the "
                "window of stream rows %d..%d (the first: %s); %d in this stream so far (logged "
                "again when that doubles)",
                "truncated" if packing.overlong == "truncate" else "dropped", len(over),
                packing.seq_len, first, first + len(lengths) - 1, where, self.overlong,
            )  # fmt: skip
        capped = lengths.copy()
        capped[over] = packing.seq_len if packing.overlong == "truncate" else 0
        return capped


def whole_batches(
    source: DocumentSource,
    packing: TokenPacking,
    *,
    start: Position,
    batch_size: int,
    drop_last: bool,
    read_ahead: int = 0,
    position_ids: object = None,
) -> Iterator[tuple[dict[str, Any], TokenPosition]]:
    """Batches of ``batch_size`` whole-document sequences of ``source`` from ``start``, each
    with the position after it; the last one shorter (dropped with ``drop_last``, the last
    full one then standing for the stream's end). ``position_ids`` as in ``pack_tokens``."""
    docs = stream_documents(source, packing, int(start), read_ahead)
    packer = WholeDocuments(docs, packing, start, source.describe_at)
    end = TokenPosition(source.total)
    held: tuple[dict[str, Any], TokenPosition] | None = None
    try:
        while True:
            columns, starts, real, taken = packer.take(batch_size)
            if taken < batch_size and (drop_last or not taken):
                break
            if held is not None:
                yield held
            batch = packed_batch(
                columns[0], starts, packing.seq_len, position_ids, real=real,
                companions=named_companions(packing, columns),
            )  # fmt: skip
            held = batch, (packer.position if taken == batch_size else end)
        if held is not None:
            yield held[0], end
    finally:
        docs.close()


def stream_documents(
    source: DocumentSource,
    packing: TokenPacking,
    start: int,
    read_ahead: int = 0,
    delivered: IntArray | None = None,
) -> Generator[Documents, None, None]:
    """The documents of ``source`` from row ``start``, chunk by chunk, without those an
    earlier deal delivered (their rows' lengths 0; ``delivered``: ``delivered_before``'s)."""
    if delivered is None:
        delivered = delivered_before(source, packing)
    chunks = source.chunks(start, 1, read_ahead)
    try:
        for chunk, after in chunks:
            first = after - chunk.num_rows
            columns, lengths = chunk_documents(chunk, packing, first, source.describe_at)
            yield (*left_out(columns, lengths, first, delivered), first)
    finally:
        chunks.close()  # type: ignore[attr-defined]


def chunk_documents(
    chunk: pa.RecordBatch, packing: TokenPacking, first: int, describe: Callable[[int], str]
) -> tuple[Columns, IntArray]:
    """A chunk's tokens and companions (separators and their pads in) and each row's length;
    ``first``: its first row."""
    columns, _, starts, _ = documents(
        chunk, packing, first, {}, describe, lambda row: describe(row + 1)
    )
    return columns, np.diff(np.append(starts, len(columns[0])))


def left_out(
    columns: Columns, lengths: IntArray, first: int, delivered: IntArray
) -> tuple[Columns, IntArray]:
    """Documents (from row ``first``: their tokens and companions) without the rows in
    ``delivered`` (their lengths 0)."""
    gone = delivered[(delivered >= first) & (delivered < first + len(lengths))] - first
    if not len(gone):
        return columns, lengths
    kept = np.ones(len(lengths), dtype=bool)
    kept[gone] = False
    keep = np.repeat(kept, lengths)
    return tuple(column[keep] for column in columns), np.where(kept, lengths, 0)


def delivered_before(source: DocumentSource, packing: TokenPacking) -> IntArray:
    """The rows of ``source``'s share (ascending) whose documents an earlier deal delivered:
    of each old stream it reads the rest of, those the old stream's own earlier deals
    delivered, and, when it stood inside a window, that window's first sequences' rows."""
    plan, order = source.order.plan, source.order
    generation = plan.generation
    none = np.empty(0, dtype=np.int64)
    if generation is None:
        return none
    pieces = order.pieces
    begins = (pieces.ends - pieces.rows).tolist()
    found = [none]
    for number, g in enumerate(pieces.splits.tolist()):
        lo, hi = int(pieces.lo[number]), int(pieces.hi[number])
        old = source.older(g)
        rows = delivered_before(old, packing)
        count = int(generation.tokens[g]) if g < len(generation.tokens) else 0
        at = int(generation.positions[g]) if count else 0
        if count and lo < at + packing.window:
            rows = np.concatenate((rows, _window_delivered(old, packing, at, count, rows)))
        rows = rows[(rows >= lo) & (rows < hi)]
        found.append(begins[number] + rows - lo)
    return np.sort(np.concatenate(found))


def _window_delivered(
    old: DocumentSource, packing: TokenPacking, at: int, count: int, delivered: IntArray
) -> IntArray:
    """The rows of stream ``old`` (whose rows ``delivered`` earlier deals delivered) in the
    first ``count`` sequences of its window at ``at``."""
    docs = stream_documents(old, packing, at, delivered=delivered)
    try:
        packer = WholeDocuments(docs, packing, TokenPosition(at, count), old.describe_at)
        window = packer.first_window()
    finally:
        docs.close()
    if window is None:
        raise InvalidStateError(
            f"state key 'generations': an old stream stood at row {at} with {count} sequences "
            f"of its window delivered, but it ends there: the state is corrupted"
        )
    return at + window.rows_of(count)


def _joined(pieces: list[Columns]) -> Columns:
    """Pieces of columns, each column's joined."""
    return tuple(np.concatenate(column) for column in zip(*pieces, strict=True))
