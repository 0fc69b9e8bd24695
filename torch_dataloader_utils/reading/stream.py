"""Reading one stream: its pieces, from a position, as exact-size batches with provenance.

A stream's *position* is how many rows of its share it has delivered. Unshuffled, the share's
pieces are read front to back; shuffled, window by window in the order of ``planning.order`` (a
window's blocks are read, then its rows handed out in a keyed random permutation); after an elastic
resume, as the rests of the old streams it was dealt, each in its old order. Each batch carries
the position just after its last row, so re-entering a stream at any batch reads at most the
window (unshuffled: the row group) that holds its next rows.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ..base.errors import DataSourceError
from ..formats import FileFormat
from ..index.index import DatasetIndex, IndexedFile
from ..planning.order import ShuffledShare, StreamOrder, permutation
from ..planning.plan import Pieces
from ..planning.tokens import TokenPacking
from ..storage.filesystem import Storage
from ..storage.remote import WINDOW, Group, Key, PieceReads, ReadAhead, RemoteObject, plan_groups
from .packing import pack_tokens
from .prefetch import prefetch
from .window import Rows, Window, owned

__all__ = [
    "Chunk",
    "ChunkSource",
    "Position",
    "Run",
    "SourceFiles",
    "StreamSource",
    "chunk_rows",
    "read_stream",
]

Position = int
# Rows of a stream: decoded, or gathered from a shuffle window and not yet cut into columns.
Chunk: TypeAlias = "pa.RecordBatch | Rows"

# Rows per decoded chunk, at least this many whatever the row width.
_MIN_CHUNK_ROWS = 256
# Decoded bytes per chunk read in order (at least a batch, at most _MAX_READ_ROWS rows): big
# enough to keep Python out of the loop, small enough that fresh allocations stay cheap (wide
# rows decoded 65,536 at a time, ~70 MB a chunk, ran up to 4x slower on page faults).
_READ_BYTES = 4 * 2**20
_MAX_READ_ROWS = 65_536
# Bytes a window's run of blocks fetches at a time, at least (one GET per group).
_MIN_LANE_BYTES = 2**20
# Rows gathered from a shuffle window at a time, at most (and at most a chunk read in order).
_GATHER_ROWS = 16_384
# Windows ahead whose parts of a unit a window's read carries (their rows: one window's).
_CARRY_WINDOWS = 8
# Threads that decode a window's runs in the main process (pyarrow decodes without the GIL)
# when the consumer waited for the window before (the first one, or a reader slower than the
# consumer): it waits half as long. Otherwise one: a thread more than the cores slows every
# thread (numeric columns, 0 workers, always two: 0.56 of unshuffled; one: 0.60).
_DECODE_THREADS = 2


@dataclass(frozen=True, kw_only=True)
class SourceFiles:
    """How to read one dataset's files: where they are, their format, the columns read, and
    the shuffle's memory budget per stream."""

    storage: Storage
    fmt: FileFormat
    columns: tuple[str, ...] | None
    memory_bytes: int

    def stream(self, order: StreamOrder) -> StreamSource:
        """The stream of ``order`` over these files."""
        return StreamSource(
            order=order,
            storage=self.storage,
            fmt=self.fmt,
            columns=self.columns,
            memory_bytes=self.memory_bytes,
        )


@dataclass(frozen=True, kw_only=True)
class StreamSource:
    """Everything one stream reads from: its order, the files and how to open them."""

    order: StreamOrder
    storage: Storage
    fmt: FileFormat
    columns: tuple[str, ...] | None
    memory_bytes: int

    @property
    def index(self) -> DatasetIndex:
        return self.order.index

    @property
    def total(self) -> int:
        return self.order.total

    @property
    def schema(self) -> pa.Schema:
        return self.index.schema

    @property
    def decodes_into_new_memory(self) -> bool:
        return self.fmt.decodes_into_new_memory

    def describe_at(self, position: Position) -> str:
        return self.order.describe_at(position)

    def chunks(
        self, start: Position, min_rows: int, read_ahead: int = 0, *, rows: bool = False
    ) -> Iterator[tuple[Chunk, int]]:
        """Decoded chunks of at least ``min_rows`` rows from ``start``, each with the position
        after its last row; with ``read_ahead`` > 0 decoded ahead in a thread (shuffled: the
        next window read while this one is handed out). Record batches; with ``rows``,
        shuffled rows as ``Rows``, for a caller that copies them anyway."""
        chunks = _chunks(self, start, self.read_rows(min_rows), read_ahead)
        if read_ahead and self.order.shuffled is None:
            chunks = prefetch(chunks, read_ahead)
        return chunks if rows else _batches(chunks)

    def packed(
        self,
        packing: TokenPacking,
        *,
        start: Position,
        batch_size: int,
        drop_last: bool,
        skips: Mapping[int, int],
        read_ahead: int = 0,
        position_ids: object = None,
    ) -> Iterator[tuple[dict[str, Any], Position]]:
        """Packed batches of the stream from ``start`` (``planning.tokens.pack_tokens``); ``skips``:
        tokens of rows of the share an earlier iteration delivered."""
        return pack_tokens(
            self.chunks(start, 1, read_ahead),
            packing=packing,
            batch_size=batch_size,
            drop_last=drop_last,
            skips=skips,
            end=self.total,
            describe=self.describe_at,
            position_ids=position_ids,
        )

    def older(self, stream: int) -> StreamSource:
        """Stream ``stream`` of the previous deal, whose rest this stream was dealt."""
        return replace(self, order=self.order.older(stream))

    def read_rows(self, batch_size: int) -> int:
        """Rows per decoded chunk of a piece read in order."""
        return chunk_rows(self.index.row_bytes(), batch_size)

    def lane_bytes(self) -> int:
        """Bytes a run of a shuffle window fetches at a time (twice that in flight)."""
        return int(np.clip(self.memory_bytes // 8, _MIN_LANE_BYTES, WINDOW))


class ChunkSource(Protocol):
    """What a stream reader reads: one dataset's stream, or a mixture's."""

    @property
    def schema(self) -> pa.Schema: ...

    @property
    def decodes_into_new_memory(self) -> bool: ...

    @property
    def total(self) -> int: ...

    def describe_at(self, position: Position) -> str: ...

    def read_rows(self, batch_size: int) -> int: ...

    def chunks(
        self, start: Position, min_rows: int, read_ahead: int = 0, *, rows: bool = False
    ) -> Iterator[tuple[Chunk, int]]: ...

    def packed(
        self,
        packing: TokenPacking,
        *,
        start: Position,
        batch_size: int,
        drop_last: bool,
        skips: Mapping[int, int],
        read_ahead: int = 0,
        position_ids: object = None,
    ) -> Iterator[tuple[dict[str, Any], Position]]: ...


def chunk_rows(row_bytes: int, batch_size: int) -> int:
    """Rows per chunk of rows of ``row_bytes`` (decoded) read in order: about ``_READ_BYTES``,
    at least a batch."""
    rows = int(np.clip(_READ_BYTES // max(1, row_bytes), _MIN_CHUNK_ROWS, _MAX_READ_ROWS))
    return max(batch_size, rows)


def read_stream(
    source: ChunkSource,
    *,
    start: Position,
    batch_size: int,
    drop_last: bool,
    run_sizes: Iterable[int] = itertools.repeat(1),
    read_ahead: int = 0,
    rows: bool = False,
) -> Iterator[Run]:
    """Runs of batches of exactly ``batch_size`` rows (the last may be short) from ``start``.

    Run ``i`` holds ``run_sizes[i]`` batches. With ``read_ahead`` > 0 a background thread
    decodes that many chunks ahead. With ``drop_last`` the last full batch stands for the end
    of the stream, so a checkpoint after it records the dropped rows as consumed. With
    ``rows``, shuffled rows come as ``Rows``, for a caller that copies them anyway.
    """
    chunks = source.chunks(start, batch_size, read_ahead, rows=rows)
    end = source.total
    last_full = start + (end - start) // batch_size * batch_size
    return _runs(
        chunks,
        batch_size=batch_size,
        drop_last=drop_last,
        sizes=iter(run_sizes),
        last_full=(last_full, end) if drop_last else None,
    )


def _batches(chunks: Iterator[tuple[Chunk, int]]) -> Iterator[tuple[pa.RecordBatch, int]]:
    """``chunks`` with ``Rows`` cut into record batches."""
    try:
        for chunk, position in chunks:
            yield (chunk.batch() if isinstance(chunk, Rows) else chunk), position
    finally:
        chunks.close()  # type: ignore[attr-defined]


def _chunks(
    source: StreamSource, start: Position, read_rows: int, read_ahead: int
) -> Iterator[tuple[Chunk, int]]:
    """Decoded chunks of the stream from ``start``, each with the position after its last row."""
    if source.order.plan.previous is not None:
        return _rest_chunks(source, start, read_rows, read_ahead)
    if source.order.shuffled is not None:
        gather_rows = min(read_rows, _GATHER_ROWS)
        return _shuffled_chunks(source, source.order.shuffled, start, gather_rows, read_ahead)
    return _ordered_chunks(source, start, read_rows)


def _ordered_chunks(
    source: StreamSource, start: Position, read_rows: int
) -> Iterator[tuple[Chunk, int]]:
    """The share's pieces front to back from ``start``."""
    pieces = source.order.pieces
    first = int(np.searchsorted(pieces.ends, start, side="right"))
    if first == len(pieces):
        return
    skip = start - int(pieces.ends[first - 1]) if first else start
    opener = _Opener(source, pieces, first, skip)
    try:
        for number in range(first, len(pieces)):
            begin = int(pieces.ends[number] - pieces.rows[number])
            read = _piece_read(source, pieces, number, skip if number == first else 0)
            for chunk, done in _piece_chunks(source, read, opener.open(read), read_rows):
                yield chunk, begin + done
    finally:
        opener.close()


def _rest_chunks(
    source: StreamSource, start: Position, read_rows: int, read_ahead: int
) -> Iterator[tuple[Chunk, int]]:
    """A later deal's share: the rests of old streams, each read in its old order."""
    pieces = source.order.pieces
    first = int(np.searchsorted(pieces.ends, start, side="right"))
    for number in range(first, len(pieces)):
        begin = int(pieces.ends[number] - pieces.rows[number])
        lo, hi = int(pieces.lo[number]), int(pieces.hi[number])
        older = source.older(int(pieces.splits[number]))
        chunks = _chunks(older, lo + max(0, start - begin), read_rows, read_ahead)
        try:
            for chunk, done in chunks:
                if done >= hi:
                    yield chunk.slice(0, chunk.num_rows - (done - hi)), begin + hi - lo
                    break
                yield chunk, begin + done - lo
        finally:
            chunks.close()  # type: ignore[attr-defined]


def _shuffled_chunks(
    source: StreamSource, order: ShuffledShare, start: Position, gather_rows: int, read_ahead: int
) -> Iterator[tuple[Chunk, int]]:
    """A shuffled share from ``start``: each window read whole, then handed out in its keyed
    permutation, ``gather_rows`` at a time; with ``read_ahead`` the next window is read in a
    thread meanwhile."""
    # Where the stream reads ahead (the main process), a window the consumer waited for makes
    # two threads decode the next; a DataLoader worker is one of several processes sharing
    # the cores already.
    waited = threading.Event()
    waited.set()  # for the first window
    threads = _DECODE_THREADS if read_ahead else 1
    windows: Iterator[tuple[Window, npt.NDArray[np.int64], int]] = _read_windows(
        source, order, order.window_at(start), threads, waited
    )
    if read_ahead:
        windows = prefetch(windows, 1, waited)
    try:
        for data, index, begin in windows:
            rows = data.num_rows
            for lo in range(max(0, start - begin), rows, gather_rows):
                hi = min(lo + gather_rows, rows)
                yield data.take(index[lo:hi]), begin + hi
            del data, index  # handed out: let go of it before the next one is read
    finally:
        windows.close()  # type: ignore[attr-defined]


# Parts of a window's units kept for the windows after it, by (split, first row): the reader
# decodes a unit once for the consecutive windows its parts were dealt to (``planning.order``).
_Carried: TypeAlias = dict[tuple[int, int], list[pa.RecordBatch]]


def _read_windows(
    source: StreamSource, order: ShuffledShare, first: int, threads: int, waited: threading.Event
) -> Iterator[tuple[Window, npt.NDArray[np.int64], int]]:
    """Windows ``first, first + 1, ...``: their rows in storage order, permutation and first
    stream row; ``threads`` decode a window's runs (independent reads) if the consumer
    ``waited`` for the window before (cleared here), else one."""
    carried: _Carried = {}
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        for number in range(first, len(order.ends)):
            blocks, begin, key = order.window(number)
            later = (order.window(n)[0] for n in range(number + 1, len(order.ends)))
            runs_map = (
                partial(_in_order, pool, threads) if pool is not None and waited.is_set() else map
            )
            waited.clear()
            window = _read_window(source, blocks, later, carried, runs_map)
            yield window, permutation(window.num_rows, key), begin
            del window  # the consumer is done with it: not held while the next one is read
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)  # after an error, the runs not begun are not read


def _in_order(
    pool: ThreadPoolExecutor,
    ahead: int,
    fn: Callable[[int], list[pa.RecordBatch]],
    runs: range,
) -> Iterator[list[pa.RecordBatch]]:
    """``fn(run)`` of each of ``runs`` in order, computed by ``pool``: at most ``ahead`` runs
    submitted beyond the one the consumer holds (``pool.map`` would submit them all, and runs
    decoded behind a slow one would pile up, the window's rows held twice)."""
    later = iter(runs)
    pending = deque(pool.submit(fn, run) for run in itertools.islice(later, ahead))
    try:
        while pending:
            done = pending.popleft().result()
            run = next(later, None)
            if run is not None:
                pending.append(pool.submit(fn, run))
            yield done
            del done  # taken: not held while the next run is awaited
    finally:
        for future in pending:
            future.cancel()


def _read_window(
    source: StreamSource,
    blocks: Pieces,
    later: Iterator[Pieces],
    carried: _Carried,
    runs_map: Callable[
        [Callable[[int], list[pa.RecordBatch]], range], Iterable[list[pa.RecordBatch]]
    ],
) -> Window:
    """The rows of a window's ``blocks`` in storage order; ``carried`` (updated): the parts
    of the windows after it read so far; ``runs_map``: ``map``, or ``_in_order`` on a pool.

    Its blocks not carried from the windows before are read, with the ``later`` windows'
    parts of the units they slice not carried yet (nearest window first, while all that is
    carried for later windows stays within the window's rows): blocks of one unit and
    adjacent blocks are read as one run, so a unit is decoded at most once for the
    consecutive windows its parts were dealt to; the rows between them are dropped. Each run
    is put into the window as it is decoded, and let go of.
    """
    unit_starts = source.index.unit_starts
    keys = list(zip(blocks.splits.tolist(), blocks.lo.tolist(), strict=True))
    rows = (blocks.hi - blocks.lo).tolist()
    first_row = dict(zip(keys, itertools.accumulate(rows, initial=0), strict=False))
    held = sum(p.num_rows for k, parts in carried.items() if k not in first_row for p in parts)
    wanted, later = _not_in(blocks, carried), (_not_in(w, carried) for w in later)
    reads = _with_later_parts(wanted, later, source.index, int(blocks.total) - held)
    runs, run_of = _runs_of(reads, unit_starts)
    splits = list(dict.fromkeys(blocks.splits.tolist()))
    where = ", ".join(source.index.describe(s) for s in splits[:3])
    window = Window(int(blocks.total), f"splits {where}{' ...' if len(splits) > 3 else ''}")

    def put(key: tuple[int, int], parts: list[pa.RecordBatch]) -> None:
        row = first_row[key]
        for part in parts:
            window.put(row, part)
            row += part.num_rows

    for key in [key for key in keys if key in carried]:
        put(key, carried.pop(key))
    opener = _Opener(source, runs, 0, 0)
    lane_bytes, read_rows = source.lane_bytes(), source.read_rows(1)

    def decoded(run: int) -> list[pa.RecordBatch]:
        read = _piece_read(source, runs, run, 0)
        handle = opener.open(read, lane_bytes)
        return [_conform(c) for c, _ in _piece_chunks(source, read, handle, read_rows)]

    for run, chunks in enumerate(runs_map(decoded, range(len(runs)))):
        start = int(runs.lo[run])
        for block in np.flatnonzero(run_of == run).tolist():
            key = int(reads.splits[block]), int(reads.lo[block])
            lo, hi = key[1] - start, int(reads.hi[block]) - start
            if key in first_row:
                put(key, _sliced(chunks, lo, hi))
            else:  # a later window's part
                carried[key] = _sliced(chunks, lo, hi, own=True)
        del chunks  # put or carried: the next run is decoded without them
    window.finish()
    return window


def _not_in(blocks: Pieces, carried: _Carried) -> Pieces:
    """``blocks`` but those ``carried`` holds."""
    keys = zip(blocks.splits.tolist(), blocks.lo.tolist(), strict=True)
    return blocks.take(np.flatnonzero([key not in carried for key in keys]))


def _with_later_parts(
    blocks: Pieces, later: Iterator[Pieces], index: DatasetIndex, most: int
) -> Pieces:
    """``blocks`` and the blocks of the ``later`` windows (nearest first, at most
    ``_CARRY_WINDOWS``) that are parts of the units ``blocks`` slice, up to ``most`` rows of
    them; in storage order."""
    sliced = {unit for unit, whole in _units_of(blocks, index) if not whole}
    chosen = [blocks]
    for window in itertools.islice(later, _CARRY_WINDOWS):
        if most <= 0 or not sliced:
            break
        mine = window.take(np.flatnonzero([u in sliced for u, _ in _units_of(window, index)]))
        if not len(mine):  # parts of a unit are in consecutive windows: none further on
            break
        keep = np.flatnonzero(np.cumsum(mine.rows) <= most)
        chosen.append(mine.take(keep))
        most -= int(mine.rows[keep].sum())
    every = Pieces.concat(chosen)
    return every.take(np.lexsort((every.lo, every.splits)))


def _units_of(blocks: Pieces, index: DatasetIndex) -> list[tuple[tuple[int, int], bool]]:
    """The ``(split, unit)`` of each block's first row, and whether the block starts at the
    unit's start and covers it (else it is a part of a sliced unit)."""
    out = []
    triples = zip(blocks.splits.tolist(), blocks.lo.tolist(), blocks.hi.tolist(), strict=True)
    for split, lo, hi in triples:
        starts = index.unit_starts(split)
        unit = int(np.searchsorted(starts, lo, side="right")) - 1
        end = int(starts[unit + 1]) if unit + 1 < len(starts) else int(index.split_rows[split])
        out.append(((split, unit), lo == int(starts[unit]) and hi >= end))
    return out


def _sliced(
    chunks: list[pa.RecordBatch], lo: int, hi: int, *, own: bool = False
) -> list[pa.RecordBatch]:
    """Rows ``[lo, hi)`` of ``chunks`` laid end to end, as slices of them (no copy); with
    ``own``, each column ``owned`` (a slice keeps its whole chunk in memory: a part carried
    for a later window keeps at most twice its bytes)."""
    out, first = [], 0
    for chunk in chunks:
        a, b = max(lo - first, 0), min(hi - first, chunk.num_rows)
        if a < b:
            part = chunk.slice(a, b - a)
            if own:
                columns = [owned(column) for column in part.columns]
                part = pa.RecordBatch.from_arrays(columns, schema=part.schema)
            out.append(part)
        first += chunk.num_rows
    return out


def _runs_of(
    blocks: Pieces, unit_starts: Callable[[int], npt.NDArray[np.int64]]
) -> tuple[Pieces, npt.NDArray[np.int64]]:
    """Reads that cover ``blocks`` (in storage order), and the read of each block: a block
    joins the read before it when it is of the same split and no unit starts between them
    (its rows would be decoded anyway to reach it)."""
    if not len(blocks):
        return blocks, np.zeros(0, dtype=np.int64)
    joins = np.zeros(len(blocks), dtype=bool)
    for i in range(1, len(blocks)):
        split = int(blocks.splits[i])
        if split == int(blocks.splits[i - 1]):
            gap = unit_starts(split)
            lo, hi = int(blocks.hi[i - 1]), int(blocks.lo[i])
            joins[i] = not ((gap > lo) & (gap <= hi)).any()
    run_of = np.cumsum(~joins) - 1
    first = np.flatnonzero(~joins)
    last = np.append(first[1:], len(blocks)) - 1
    return Pieces(blocks.splits[first], blocks.lo[first], blocks.hi[last]), run_of


@dataclass(frozen=True)
class _PieceRead:
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


def _piece_read(source: StreamSource, pieces: Pieces, number: int, skip: int) -> _PieceRead:
    """The read of piece ``number`` after its first ``skip`` rows."""
    split_id = int(pieces.splits[number])
    split = source.index.splits[split_id]
    file = source.index.files[split.file]
    lo, hi = int(pieces.lo[number]) + skip, int(pieces.hi[number])
    units, leading = _units_for(
        file.metadata.unit_rows, split.units, split.row_offset + lo, split.row_offset + hi
    )
    return _PieceRead(number, split_id, file, units, leading, skip, hi - lo + skip, lo)


class _Opener:
    """Opens one stream's pieces; on object stores, fetches the bytes they read ahead of them.

    Read in order, the stream has one read-ahead lane over all its pieces from where it starts,
    so the next piece's first bytes travel while this one decodes. Each run of a shuffle window
    has a lane of its own, sized to the memory budget. A lane fetches exactly the byte groups
    its pieces read (``FileFormat.unit_spans``), nothing more.
    """

    def __init__(self, source: StreamSource, pieces: Pieces, first: int, skip: int) -> None:
        self._source = source
        self._pieces = pieces
        self._remote = not source.storage.is_local
        self._lane = None
        self._planned_groups: dict[int, tuple[Group, ...]] = {}  # by piece, planned not opened
        if self._remote and source.order.shuffled is None:
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
        pieces = self._pieces
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
        raise DataSourceError(
            f"split {index.describe(read.split)} yielded {done - skip} of {want - skip} rows "
            f"from row {read.first_row}: the file changed while reading"
        )


def _conform(batch: pa.RecordBatch) -> pa.RecordBatch:
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

    chunks: list[Chunk] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    positions: list[Position] = field(default_factory=list)

    def batch(self) -> pa.RecordBatch:
        """All rows as one record batch (copies only when they span chunks, or are ``Rows``)."""
        batches = [c.batch() if isinstance(c, Rows) else c for c in self.chunks]
        return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


def _runs(
    chunks: Iterator[tuple[Chunk, int]],
    *,
    batch_size: int,
    drop_last: bool,
    sizes: Iterator[int],
    last_full: tuple[Position, Position] | None,
) -> Iterator[Run]:
    """Runs of ``next(sizes)`` batches each; rows are sliced, never copied.

    Invariant, at every step: the rows of ``run.chunks`` followed by ``chunk[taken:offset]``
    are the run's complete batches (``run.lengths``) and then the first ``have`` rows of the
    batch being filled; ``mark`` is the stream position after ``chunk``'s last row, so the
    batch that ends at ``chunk``'s row ``offset`` ends at ``mark - (chunk.num_rows - offset)``.
    A run is yielded as soon as its last batch is complete, and the rest of the chunk begins
    the next one.

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


def _head(chunks: list[Chunk], rows: int) -> list[Chunk]:
    kept = []
    for chunk in chunks:
        if rows <= 0:
            break
        kept.append(chunk.slice(0, rows))
        rows -= chunk.num_rows
    return kept
