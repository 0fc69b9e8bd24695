"""Reading one stream: its pieces, from a position, as exact-size batches with provenance.

A stream's *position* is how many rows of its share it has delivered. The share is read in
*windows* of ``window`` consecutive pieces: a window of one piece is read front to back; a wider
one mixes the rows of its pieces in the order of ``_interleave`` (every stretch of it samples all
its pieces, each piece read front to back). Each batch carries the position just after its last
row, so re-entering a stream at any batch reads only the row groups that hold its next rows.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.types as pat

from ._errors import DataSourceError
from ._formats import FileFormat
from ._index import DatasetIndex, IndexedFile
from ._interleave import counts_at, mixing_order
from ._plan import Pieces
from ._prefetch import prefetch
from ._remote import WINDOW, Group, Key, PieceReads, ReadAhead, RemoteObject, plan_groups
from ._storage import Storage

__all__ = ["Position", "Run", "StreamSource", "read_stream", "stream_chunks"]

Position = int

# Rows per decoded chunk, at least this many whatever the row width.
_MIN_CHUNK_ROWS = 256
# Decoded bytes per chunk read in order (at least a batch, at most _MAX_READ_ROWS rows): big
# enough to keep Python out of the loop, small enough that fresh allocations stay cheap (wide
# rows decoded 65,536 at a time, ~70 MB a chunk, ran up to 4x slower on page faults).
_READ_BYTES = 4 * 2**20
_MAX_READ_ROWS = 65_536
# Rows a mixed window's piece decodes at a time, and the window delivers at a time: bounded by
# the memory budget. Small enough that the window's decoded chunks stay hot in memory: 32
# pieces decoding 65,536 rows each ran 3x slower than one piece (page faults).
_MAX_MIX_ROWS = 16_384
# Bytes a mixed window's piece fetches at a time, at least (one GET per group).
_MIN_LANE_BYTES = 2**20


@dataclass(frozen=True, kw_only=True)
class StreamSource:
    """Everything one stream reads from: the files, how to open them, its pieces."""

    index: DatasetIndex
    storage: Storage
    fmt: FileFormat
    pieces: Pieces
    window: int
    columns: tuple[str, ...] | None
    memory_bytes: int

    @property
    def total(self) -> int:
        return int(self.pieces.rows.sum())

    def describe_at(self, position: Position) -> str:
        """The split(s) the rows just before ``position`` come from (a mixed window: all)."""
        ends = np.cumsum(self.pieces.rows)
        number = int(np.searchsorted(ends, max(0, position - 1), side="right"))
        first = min(number, len(self.pieces) - 1) // self.window * self.window
        names = [self.index.describe(int(s)) for s in self.pieces.splits[first:][: self.window]]
        if len(names) == 1:
            return names[0]
        return f"one of {len(names)} mixed: " + ", ".join(names[:3]) + (" ..." * (len(names) > 3))

    def read_rows(self, batch_size: int) -> int:
        """Rows per decoded chunk of a piece read in order."""
        rows = int(np.clip(_READ_BYTES // self.index.row_bytes(), _MIN_CHUNK_ROWS, _MAX_READ_ROWS))
        return max(batch_size, rows)

    def lane_bytes(self) -> int:
        """Bytes each piece of a mixed window fetches at a time (twice that in flight), so
        the window's read-ahead stays within the memory budget."""
        return int(np.clip(self.memory_bytes // (2 * self.window), _MIN_LANE_BYTES, WINDOW))

    def mix_rows(self) -> int:
        """Rows per decoded chunk of a mixed window, so ``window`` of them fit the budget."""
        budget = self.memory_bytes // self.index.row_bytes()
        return int(np.clip(budget // (self.window + 2), _MIN_CHUNK_ROWS, _MAX_MIX_ROWS))


def read_stream(
    source: StreamSource,
    *,
    start: Position,
    batch_size: int,
    drop_last: bool,
    run_sizes: Iterable[int] = itertools.repeat(1),
    read_ahead: int = 0,
) -> Iterator[Run]:
    """Runs of batches of exactly ``batch_size`` rows (the last may be short) from ``start``.

    Run ``i`` holds ``run_sizes[i]`` batches. With ``read_ahead`` > 0 a background thread
    decodes that many chunks ahead. With ``drop_last`` the last full batch stands for the end
    of the stream, so a checkpoint after it records the dropped rows as consumed.
    """
    chunks = stream_chunks(source, start=start, min_rows=batch_size, read_ahead=read_ahead)
    end = source.total
    last_full = start + (end - start) // batch_size * batch_size
    return _runs(
        chunks,
        batch_size=batch_size,
        drop_last=drop_last,
        sizes=iter(run_sizes),
        last_full=(last_full, end) if drop_last else None,
    )


def stream_chunks(
    source: StreamSource, *, start: Position, min_rows: int, read_ahead: int = 0
) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Decoded chunks of at least ``min_rows`` rows from ``start``, each with the position
    after its last row; with ``read_ahead`` > 0 decoded that many ahead in a thread."""
    chunks = _chunks(source, start, source.read_rows(min_rows))
    return prefetch(chunks, read_ahead) if read_ahead else chunks


def _chunks(
    source: StreamSource, start: Position, read_rows: int
) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Decoded chunks of the stream from ``start``, each with the position after its last row."""
    pieces, window = source.pieces, source.window
    first_piece = int(np.searchsorted(pieces.ends, start, side="right"))
    skip = start - int(pieces.ends[first_piece - 1]) if first_piece else start
    opener = _Opener(source, first_piece, skip)
    begin = 0
    try:
        for first in range(0, len(pieces), window):
            part = pieces.take(slice(first, first + window))
            rows = int(part.rows.sum())
            if start < begin + rows:
                offset = max(0, start - begin)
                if len(part) == 1:
                    read = _piece_read(source, pieces, first, offset)
                    chunks = _piece_chunks(source, read, opener.open(read), read_rows)
                else:
                    chunks = _mixed_chunks(source, opener, first, part, offset)
                for chunk, done in chunks:
                    yield chunk, begin + done
            begin += rows
    finally:
        opener.close()


@dataclass(frozen=True)
class _PieceRead:
    """What piece ``number`` of the stream reads: ``units`` of ``file``, of whose rows it skips
    ``leading`` and then yields rows ``[done, want)`` of the piece (``done``: rows skipped)."""

    number: int
    split: int
    file: IndexedFile
    units: range
    leading: int
    done: int
    want: int


def _piece_read(source: StreamSource, pieces: Pieces, number: int, skip: int) -> _PieceRead:
    """The read of piece ``number`` after its first ``skip`` rows."""
    split_id = int(pieces.splits[number])
    split = source.index.splits[split_id]
    file = source.index.files[split.file]
    lo, hi = int(pieces.lo[number]) + skip, int(pieces.hi[number])
    units, leading = _units_for(
        file.metadata.unit_rows, split.units, split.row_offset + lo, split.row_offset + hi
    )
    return _PieceRead(number, split_id, file, units, leading, skip, hi - lo + skip)


class _Opener:
    """Opens one stream's pieces; on object stores, fetches the bytes they read ahead of them.

    Read one piece at a time, the stream has one read-ahead lane over all its pieces from where
    it starts, so the next piece's first bytes travel while this one decodes. Each piece of a
    mixed window has a lane of its own, sized so the window's lanes fit the memory budget. A lane
    fetches exactly the byte groups its pieces read (``FileFormat.unit_spans``), nothing more.
    """

    def __init__(self, source: StreamSource, first: int, skip: int) -> None:
        self._source = source
        self._remote = not source.storage.is_local
        self._lane = None
        self._planned_groups: dict[int, tuple[Group, ...]] = {}  # by piece, planned not opened
        if self._remote and source.window == 1:
            self._lane = ReadAhead(self._planned(first, skip))

    def open(self, read: _PieceRead, lane_bytes: int | None = None) -> Any:
        """A handle on ``read``'s file whose planned bytes come from a lane; with
        ``lane_bytes``, from a lane of its own of that many bytes."""
        storage, file = self._source.storage, read.file
        if not self._remote:
            return storage.open(file.path)
        if self._lane is not None and lane_bytes is None:
            for number in [n for n in self._planned_groups if n < read.number]:
                del self._planned_groups[number]  # planned after their piece was opened
            groups = self._planned_groups.pop(read.number, None)
            if groups is None:
                groups = self._groups(read, None)
            reads = PieceReads(self._lane, read.number, groups)
        else:
            groups = self._groups(read, lane_bytes)
            obj = storage.remote(file.path)
            lane = ReadAhead((((0, g), obj, group) for g, group in enumerate(groups)), lane_bytes)
            reads = PieceReads(lane, 0, groups, owned=True)
        known = self._source.fmt.known_bytes(file.metadata)
        return storage.open(file.path, reads=reads, known=known)

    def close(self) -> None:
        """Cancel every fetch of the stream's lane not yet read."""
        if self._lane is not None:
            self._lane.close()

    def _planned(self, first: int, skip: int) -> Iterator[tuple[Key, RemoteObject, Group]]:
        """The groups of pieces ``first, first + 1, ...`` in reading order (a lazy plan)."""
        pieces = self._source.pieces
        for number in range(first, len(pieces)):
            read = _piece_read(self._source, pieces, number, skip if number == first else 0)
            groups = self._planned_groups[number] = self._groups(read, None)
            if groups:
                obj = self._source.storage.remote(read.file.path)
                yield from (((number, g), obj, group) for g, group in enumerate(groups))

    def _groups(self, read: _PieceRead, window: int | None) -> tuple[Group, ...]:
        source = self._source
        spans = source.fmt.unit_spans(read.file.metadata, read.units, source.columns)
        return () if spans is None else tuple(plan_groups(spans, window))


def _piece_chunks(
    source: StreamSource, read: _PieceRead, handle: Any, read_rows: int
) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Rows of ``read`` from ``handle``, with the piece's rows read so far (closes ``handle``)."""
    index, file = source.index, read.file
    leading, done, want = read.leading, read.done, read.want
    try:
        with handle:
            reads = source.fmt.read_units(
                handle, file.metadata, read.units, source.columns, read_rows
            )
            for chunk in reads:
                if leading:
                    cut = min(leading, chunk.num_rows)
                    chunk, leading = chunk.slice(cut), leading - cut
                chunk = chunk.slice(0, want - done)
                if chunk.num_rows:
                    done += chunk.num_rows
                    yield chunk, done
                if done == want:
                    break
    except (OSError, pa.ArrowException) as exc:
        raise DataSourceError(
            f"cannot read split {index.describe(read.split)} (fingerprint {file.fingerprint}): "
            f"{exc}. If the file changed since the dataset was built, build it again; a "
            f"checkpoint of the old content will not load."
        ) from exc
    if done != want:
        skip = read.done
        lo = int(source.pieces.lo[read.number]) + skip
        raise DataSourceError(
            f"split {index.describe(read.split)} yielded {done - skip} of {want - skip} rows "
            f"from row {lo}: the file changed while reading"
        )


class _PieceReader:
    """One piece of a mixed window, read front to back and handed out ``take(n)`` rows at a time."""

    def __init__(self, chunks: Iterator[tuple[pa.RecordBatch, int]]) -> None:
        self._chunks = chunks
        self._held: pa.RecordBatch | None = None

    def take(self, rows: int) -> list[pa.RecordBatch]:
        out: list[pa.RecordBatch] = []
        while rows > 0:
            if self._held is None or self._held.num_rows == 0:
                self._held = next(self._chunks)[0]
            part = self._held.slice(0, rows)
            self._held = self._held.slice(part.num_rows)
            out.append(part)
            rows -= part.num_rows
        return out

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]


def _mixed_chunks(
    source: StreamSource, opener: _Opener, first: int, pieces: Pieces, start: int
) -> Iterator[tuple[pa.RecordBatch, int]]:
    """The window's rows in mixing order from its row ``start``, with the rows done after each.

    ``pieces`` are the stream's pieces ``first, first + 1, ...``."""
    rows = pieces.rows
    total = int(rows.sum())
    step = source.mix_rows()
    counts = counts_at(rows, start)
    schema = source.index.schema
    with ExitStack() as stack:
        readers = []
        lane_bytes = source.lane_bytes()
        for number in range(len(pieces)):
            if counts[number] == rows[number]:  # delivered: nothing to open (or fetch)
                readers.append(_PieceReader(iter(())))
                continue
            read = _piece_read(source, source.pieces, first + number, int(counts[number]))
            handle = opener.open(read, lane_bytes)
            reader = _PieceReader(_piece_chunks(source, read, handle, step))
            stack.callback(reader.close)
            readers.append(reader)
        done = start
        while done < total:
            after = min(done + step, total)
            following = counts_at(rows, after)
            parts = [
                part
                for reader, a, b in zip(readers, counts.tolist(), following.tolist(), strict=True)
                for part in reader.take(b - a)
            ]
            joined = pa.concat_batches([_conform(part, schema) for part in parts])
            yield _gather(joined, mixing_order(rows, counts, following)), after
            done, counts = after, following


def _gather(batch: pa.RecordBatch, index: npt.NDArray[np.int64]) -> pa.RecordBatch:
    """``batch.take(index)``; numpy's gather for plain numeric columns, twice as fast."""
    columns = []
    for column in batch.columns:
        if column.null_count == 0 and (pat.is_integer(column.type) or pat.is_floating(column.type)):
            columns.append(pa.array(column.to_numpy()[index], type=column.type))
        else:
            columns.append(column.take(index))
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with the dataset's schema (files may differ in schema metadata only)."""
    return batch if batch.schema.metadata is None else batch.replace_schema_metadata(None)


def _units_for(unit_rows: tuple[int, ...], units: range, first: int, end: int) -> tuple[range, int]:
    """The units of ``units`` holding file rows ``[first, end)``, and rows to skip in the first;
    no unit for no rows (after the last row of a split there may be no unit in the file)."""
    if first >= end:
        return range(units.stop, units.stop), 0
    bounds = list(itertools.accumulate(unit_rows, initial=0))
    unit = max(bisect.bisect_right(bounds, first) - 1, units.start)
    stop = min(bisect.bisect_left(bounds, end), units.stop)
    return range(unit, stop), first - bounds[unit]


@dataclass
class Run:
    """Consecutive rows of a stream in ``chunks``, cut into batches of ``lengths`` rows.

    ``positions[i]`` is the stream position after batch ``i``.
    """

    chunks: list[pa.RecordBatch] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    positions: list[Position] = field(default_factory=list)

    def batch(self) -> pa.RecordBatch:
        """All rows as one record batch (copies only when they span chunks)."""
        return self.chunks[0] if len(self.chunks) == 1 else pa.concat_batches(self.chunks)


def _runs(
    chunks: Iterator[tuple[pa.RecordBatch, int]],
    *,
    batch_size: int,
    drop_last: bool,
    sizes: Iterator[int],
    last_full: tuple[Position, Position] | None,
) -> Iterator[Run]:
    """Runs of ``next(sizes)`` batches each; rows are sliced, never copied.

    ``last_full = (p, end)``: the batch ending at position ``p`` stands for ``end`` (the rows
    after it are dropped).
    """
    want, run, have = next(sizes), Run(), 0
    mark = 0
    for chunk, mark in chunks:
        offset = taken = 0  # rows of this chunk read / already placed in a run
        while offset < chunk.num_rows:
            step = min(batch_size - have, chunk.num_rows - offset)
            have, offset = have + step, offset + step
            if have < batch_size:
                continue
            run.lengths.append(batch_size)
            position = mark - (chunk.num_rows - offset)
            if last_full is not None and position == last_full[0]:
                position = last_full[1]
            run.positions.append(position)
            have = 0
            if len(run.lengths) == want:
                run.chunks.append(chunk.slice(taken, offset - taken))
                taken = offset
                yield run
                want, run = next(sizes), Run()
        if taken < chunk.num_rows:
            run.chunks.append(chunk.slice(taken))
    if have and not drop_last:
        run.lengths.append(have)
        run.positions.append(mark)
    elif have:
        run.chunks = _head(run.chunks, sum(run.lengths))
    if run.lengths:
        yield run


def _head(chunks: list[pa.RecordBatch], rows: int) -> list[pa.RecordBatch]:
    kept = []
    for chunk in chunks:
        if rows <= 0:
            break
        kept.append(chunk.slice(0, rows))
        rows -= chunk.num_rows
    return kept
