"""Reading one stream: its pieces, from a position, as exact-size Arrow batches with provenance.

A *position* ``(count, rows)`` means: the first ``count`` pieces of the stream are delivered,
and ``rows`` rows of the next one. Each batch carries the position just after its last row.
"""

from __future__ import annotations

import bisect
import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import pyarrow as pa

from ._errors import DataSourceError
from ._formats import FileFormat
from ._index import DatasetIndex
from ._plan import Pieces
from ._storage import Storage

__all__ = ["Position", "prefetch", "read_stream"]

Position = tuple[int, int]
T = TypeVar("T")

# Rows per decoded chunk: big enough to keep Python out of the loop, small enough to start fast.
_MIN_READ_ROWS = 16_384


def read_stream(
    index: DatasetIndex,
    storage: Storage,
    fmt: FileFormat,
    pieces: Pieces,
    start: Position,
    columns: Sequence[str] | None,
    batch_size: int,
    drop_last: bool,
) -> Iterator[tuple[pa.RecordBatch, Position]]:
    """Batches of exactly ``batch_size`` rows (the last may be short) from ``start`` on."""
    chunks = _read_chunks(
        index, storage, fmt, pieces, start, columns, max(batch_size, _MIN_READ_ROWS)
    )
    return _rebatch(chunks, batch_size, drop_last)


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
                f"cannot read split {index.describe(int(pieces.splits[number]))}: {exc}"
            ) from exc
        if done != piece_rows:
            raise DataSourceError(
                f"split {index.describe(int(pieces.splits[number]))} yielded "
                f"{done} of {piece_rows} rows: the file changed while reading"
            )


def _units_from(unit_rows: Sequence[int], units: range, row: int) -> tuple[range, int]:
    """The units of ``units`` from the one holding file row ``row``, and rows to skip in it."""
    bounds = list(itertools.accumulate(unit_rows, initial=0))
    unit = bisect.bisect_right(bounds, row) - 1
    unit = max(unit, units.start)
    return range(unit, units.stop), row - bounds[unit]


class _Mark(NamedTuple):
    """Piece ``number`` has ``done`` of its ``rows`` rows read at the end of a chunk."""

    number: int
    done: int
    rows: int

    def position(self, unread: int = 0) -> Position:
        """The stream position ``unread`` rows before this mark; a full piece rolls over."""
        done = self.done - unread
        return (self.number + 1, 0) if done == self.rows else (self.number, done)


def _rebatch(
    chunks: Iterator[tuple[pa.RecordBatch, _Mark]], batch_size: int, drop_last: bool
) -> Iterator[tuple[pa.RecordBatch, Position]]:
    pending: list[pa.RecordBatch] = []
    have = 0
    mark: _Mark | None = None
    for chunk, mark in chunks:
        offset = 0
        while offset < chunk.num_rows:
            take = min(batch_size - have, chunk.num_rows - offset)
            pending.append(chunk.slice(offset, take))
            have, offset = have + take, offset + take
            if have == batch_size:
                yield _concat(pending), mark.position(chunk.num_rows - offset)
                pending, have = [], 0
    if pending and not drop_last and mark is not None:
        yield _concat(pending), mark.position()


def _concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


_END = object()


def prefetch(items: Iterator[T], depth: int) -> Iterator[T]:
    """Run ``items`` in a background thread, ``depth`` ahead; errors re-raise in the consumer.

    Arrow decoding releases the GIL, so the next chunks decode while the consumer converts
    and trains on the current one.
    """
    buffer: queue.Queue[Any] = queue.Queue(depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        buffer.put((item, None), timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            buffer.put((_END, None))
        except BaseException as exc:  # re-raised in the consumer thread
            buffer.put((_END, exc))

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
