"""Reading one stream: its pieces, from a position, as exact-size batches with provenance.

A *position* ``(count, rows)`` means: the first ``count`` pieces of the stream are delivered,
and ``rows`` rows of the next one. Each batch carries the position just after its last row.
"""

from __future__ import annotations

import bisect
import itertools
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import pyarrow as pa

from ._errors import DataSourceError
from ._formats import FileFormat
from ._index import DatasetIndex
from ._plan import Pieces
from ._storage import Storage

__all__ = ["Position", "Run", "prefetch", "read_stream"]

Position = tuple[int, int]
T = TypeVar("T")

# Rows per decoded chunk: big enough to keep Python out of the loop, small enough to start fast.
_MIN_READ_ROWS = 65_536


def read_stream(
    index: DatasetIndex,
    storage: Storage,
    fmt: FileFormat,
    pieces: Pieces,
    start: Position,
    columns: Sequence[str] | None,
    batch_size: int,
    drop_last: bool,
    *,
    run_sizes: Iterable[int] = itertools.repeat(1),
    read_ahead: int = 0,
    row_budget: int | None = None,
) -> Iterator[Run]:
    """Runs of batches of exactly ``batch_size`` rows (the last may be short) from ``start``.

    Run ``i`` holds ``run_sizes[i]`` batches. With ``read_ahead`` > 0 a background thread
    decodes that many chunks ahead. ``row_budget`` caps the rows the whole stream delivers in
    the epoch, counting those delivered before ``start``.
    """
    read_rows = max(batch_size, _MIN_READ_ROWS)
    chunks = _read_chunks(index, storage, fmt, pieces, start, columns, read_rows)
    if row_budget is not None:
        remaining = row_budget - _rows_before(index, pieces, start)
        chunks = _within(chunks, remaining, (len(pieces), 0))
    if read_ahead:
        chunks = prefetch(chunks, read_ahead)
    return _runs(chunks, batch_size, drop_last, iter(run_sizes))


def _read_chunks(
    index: DatasetIndex,
    storage: Storage,
    fmt: FileFormat,
    pieces: Pieces,
    start: Position,
    columns: Sequence[str] | None,
    read_rows: int,
) -> Iterator[tuple[pa.RecordBatch, _Mark]]:
    """Decoded chunks, each marked with its piece and the piece's rows read after it."""
    first, skip_rows = start
    for number in range(first, len(pieces)):
        split = index.splits[int(pieces.splits[number])]
        file = index.files[split.file]
        skip = int(pieces.starts[number]) + (skip_rows if number == first else 0)
        piece_rows = split.row_length - int(pieces.starts[number])
        units, leading = _units_from(file.metadata.unit_rows, split.units, split.row_offset + skip)
        done = skip - int(pieces.starts[number])
        if number + 1 < len(pieces):  # object stores: fetch the next split meanwhile
            storage.prefetch(*_first_unit(index, pieces, number + 1))
        try:
            with storage.open(file.path) as source:
                for chunk in fmt.read_units(source, file.metadata, units, columns, read_rows):
                    if leading:
                        cut = min(leading, chunk.num_rows)
                        chunk, leading = chunk.slice(cut), leading - cut
                    if chunk.num_rows:
                        done += chunk.num_rows
                        yield chunk, _Mark(number, done, piece_rows)
        except (OSError, pa.ArrowException) as exc:
            raise DataSourceError(
                f"cannot read split {index.describe(int(pieces.splits[number]))} (fingerprint "
                f"{file.fingerprint}): {exc}. If the file changed since the dataset was built, "
                f"build it again; a checkpoint of the old content will not load."
            ) from exc
        if done != piece_rows:
            raise DataSourceError(
                f"split {index.describe(int(pieces.splits[number]))} yielded "
                f"{done} of {piece_rows} rows: the file changed while reading"
            )


def _first_unit(index: DatasetIndex, pieces: Pieces, number: int) -> tuple[str, int]:
    """The file and first unit piece ``number`` reads."""
    split = index.splits[int(pieces.splits[number])]
    file = index.files[split.file]
    row = split.row_offset + int(pieces.starts[number])
    return file.path, _units_from(file.metadata.unit_rows, split.units, row)[0].start


def _rows_before(index: DatasetIndex, pieces: Pieces, start: Position) -> int:
    count, rows = start
    lengths = [index.splits[int(s)].row_length for s in pieces.splits[:count]]
    return sum(lengths) - int(pieces.starts[:count].sum()) + rows


def _within(
    chunks: Iterator[tuple[pa.RecordBatch, _Mark]], budget: int, end: Position
) -> Iterator[tuple[pa.RecordBatch, _Mark]]:
    """The first ``budget`` rows of ``chunks``; the last one delivered stands for ``end``.

    So a checkpoint after it records the skipped rest of the stream as consumed for the epoch.
    """
    held: tuple[pa.RecordBatch, _Mark] | None = None
    for chunk, mark in chunks:
        if held is not None:  # rows follow the budget: they are skipped
            yield held[0], held[1]._replace(end=end)
            return
        if budget <= 0:
            return
        if chunk.num_rows > budget:
            cut = chunk.num_rows - budget
            yield chunk.slice(0, budget), _Mark(mark.number, mark.done - cut, mark.rows, end)
            return
        budget -= chunk.num_rows
        if budget == 0:
            held = chunk, mark  # is anything left to skip? the next chunk tells
            continue
        yield chunk, mark
    if held is not None:
        yield held


def _units_from(unit_rows: Sequence[int], units: range, row: int) -> tuple[range, int]:
    """The units of ``units`` from the one holding file row ``row``, and rows to skip in it."""
    bounds = list(itertools.accumulate(unit_rows, initial=0))
    unit = bisect.bisect_right(bounds, row) - 1
    unit = max(unit, units.start)
    return range(unit, units.stop), row - bounds[unit]


class _Mark(NamedTuple):
    """Piece ``number`` has ``done`` of its ``rows`` rows read at the end of a chunk.

    ``end``, when set, is the position the chunk's last row stands for instead: the end of the
    stream, when an evened-out epoch skips the stream's remaining rows.
    """

    number: int
    done: int
    rows: int
    end: Position | None = None

    def position(self, unread: int = 0) -> Position:
        """The stream position ``unread`` rows before this mark; a full piece rolls over."""
        if unread == 0 and self.end is not None:
            return self.end
        done = self.done - unread
        return (self.number + 1, 0) if done == self.rows else (self.number, done)


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
    chunks: Iterator[tuple[pa.RecordBatch, _Mark]],
    batch_size: int,
    drop_last: bool,
    sizes: Iterator[int],
) -> Iterator[Run]:
    """Runs of ``next(sizes)`` batches each; rows are sliced, never copied."""
    want, run, have = next(sizes), Run(), 0
    mark: _Mark | None = None
    for chunk, mark in chunks:
        offset = taken = 0  # rows of this chunk read / already placed in a run
        while offset < chunk.num_rows:
            step = min(batch_size - have, chunk.num_rows - offset)
            have, offset = have + step, offset + step
            if have < batch_size:
                continue
            run.lengths.append(batch_size)
            run.positions.append(mark.position(chunk.num_rows - offset))
            have = 0
            if len(run.lengths) == want:
                run.chunks.append(chunk.slice(taken, offset - taken))
                taken = offset
                yield run
                want, run = next(sizes), Run()
        if taken < chunk.num_rows:
            run.chunks.append(chunk.slice(taken))
    if have and not drop_last and mark is not None:
        run.lengths.append(have)
        run.positions.append(mark.position())
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


_END = object()


def prefetch(items: Iterator[T], depth: int) -> Iterator[T]:
    """Run ``items`` in a background thread, ``depth`` ahead; errors re-raise in the consumer.

    Arrow decoding releases the GIL, so the next chunks decode while the consumer converts
    and trains on the current one.
    """
    buffer: queue.Queue[Any] = queue.Queue(depth)
    stop = threading.Event()

    def put(entry: tuple[Any, BaseException | None]) -> bool:
        """Hand ``entry`` over unless the consumer has gone; never block past that."""
        while not stop.is_set():
            try:
                buffer.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_END, None))
        except BaseException as exc:  # re-raised in the consumer thread
            put((_END, exc))

    thread = threading.Thread(target=produce, name="tdu-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = buffer.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()
