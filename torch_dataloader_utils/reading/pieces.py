"""Reading one piece of a stream: the units of its file (row groups, record batches) that hold
its rows, opened (on object stores, the byte groups they read fetched ahead in a lane) and
decoded into exactly its rows; a file that cannot be read, or changed, raises an error naming
the split."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from ..base.errors import DataSourceError
from ..base.stages import DECODE, timed
from ..formats import FileFormat
from ..index.index import DatasetIndex, IndexedFile
from ..planning.order import StreamOrder
from ..planning.plan import Pieces
from ..storage.filesystem import Storage
from ..storage.remote import Group, Key, PieceReads, ReadAhead, RemoteObject, plan_groups

__all__ = ["Opener", "PieceRead", "PieceSource", "piece_chunks", "piece_read"]


class PieceSource(Protocol):
    """What a stream's pieces are read from (``reading.stream.StreamSource``)."""

    @property
    def order(self) -> StreamOrder: ...

    @property
    def storage(self) -> Storage: ...

    @property
    def fmt(self) -> FileFormat: ...

    @property
    def columns(self) -> tuple[str, ...] | None: ...

    @property
    def index(self) -> DatasetIndex: ...


@dataclass(frozen=True)
class PieceRead:
    """What piece ``number`` of the stream reads: ``units`` of ``file``, of whose rows it skips
    ``leading`` and then yields rows ``[done, want)`` of the piece (``done``: rows skipped),
    from row ``first_row`` of its split."""

    number: int
    split: int
    file: IndexedFile
    units: range
    leading: int
    done: int
    want: int
    first_row: int


def piece_read(source: PieceSource, pieces: Pieces, number: int, skip: int) -> PieceRead:
    """The read of piece ``number`` after its first ``skip`` rows."""
    split_id = int(pieces.splits[number])
    split = source.index.splits[split_id]
    file = source.index.files[split.file]
    lo, hi = int(pieces.lo[number]) + skip, int(pieces.hi[number])
    units, leading = _units_for(
        file.metadata.unit_rows, split.units, split.row_offset + lo, split.row_offset + hi
    )
    return PieceRead(number, split_id, file, units, leading, skip, hi - lo + skip, lo)


class Opener:
    """Opens one stream's pieces; on object stores, fetches the bytes they read ahead of them.

    Read in order, the stream has one read-ahead lane over all its pieces from where it starts,
    so the next piece's first bytes travel while this one decodes. Each run of a shuffle window
    has a lane of its own, sized to the memory budget. A lane fetches exactly the byte groups
    its pieces read (``FileFormat.unit_spans``), nothing more.
    """

    def __init__(self, source: PieceSource, pieces: Pieces, first: int, skip: int) -> None:
        self._source = source
        self._pieces = pieces
        self._remote = not source.storage.is_local
        self._lane = None
        self._planned_groups: dict[int, tuple[Group, ...]] = {}  # by piece, planned not opened
        if self._remote and source.order.shuffled is None:
            self._lane = ReadAhead(self._planned(first, skip))

    def open(self, read: PieceRead, lane_bytes: int | None = None) -> Any:
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
        pieces = self._pieces
        for number in range(first, len(pieces)):
            read = piece_read(self._source, pieces, number, skip if number == first else 0)
            groups = self._planned_groups[number] = self._groups(read, None)
            if groups:
                obj = self._source.storage.remote(read.file.path)
                yield from (((number, g), obj, group) for g, group in enumerate(groups))

    def _groups(self, read: PieceRead, window: int | None) -> tuple[Group, ...]:
        source = self._source
        spans = source.fmt.unit_spans(read.file.metadata, read.units, source.columns)
        return () if spans is None else tuple(plan_groups(spans, window))


def piece_chunks(
    source: PieceSource, read: PieceRead, handle: Any, read_rows: int
) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Rows of ``read`` from ``handle``, with the piece's rows read so far (closes ``handle``)."""
    index, file = source.index, read.file
    leading, done, want = read.leading, read.done, read.want
    try:
        with handle:
            reads = timed(
                source.fmt.read_units(handle, file.metadata, read.units, source.columns, read_rows),
                DECODE,
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
        raise DataSourceError(
            f"split {index.describe(read.split)} yielded {done - skip} of {want - skip} rows "
            f"from row {read.first_row}: the file changed while reading"
        )


def _units_for(unit_rows: tuple[int, ...], units: range, first: int, end: int) -> tuple[range, int]:
    """The units of ``units`` holding file rows ``[first, end)``, and rows to skip in the first;
    no unit for no rows (after the last row of a split there may be no unit in the file)."""
    if first >= end:
        return range(units.stop, units.stop), 0
    bounds = list(itertools.accumulate(unit_rows, initial=0))
    unit = max(bisect.bisect_right(bounds, first) - 1, units.start)
    stop = min(bisect.bisect_left(bounds, end), units.stop)
    return range(unit, stop), first - bounds[unit]
