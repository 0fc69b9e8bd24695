"""Reading one stream: its pieces, from a position, as exact-size batches with provenance.

A stream's *position* is how many rows of its share it has delivered. Unshuffled, the share's
pieces are read front to back; shuffled, window by window in the order of ``planning.order`` (a
window's blocks are read, then its rows handed out in a keyed random permutation); after an elastic
resume, as the rests of the old streams it was dealt, each in its old order. Each batch carries
the position just after its last row, so re-entering a stream at any batch reads at most the
window (unshuffled: the row group) that holds its next rows.

Here: what a stream reads from (``StreamSource``) and the read from a position, unshuffled or
as rests; a piece is opened and decoded by ``reading.pieces``, a shuffled share read by
``reading.shuffled``, the chunks cut into runs of batches by ``reading.runs``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from ..base.stages import TRANSFORM, timed
from ..base.world import detect_worker
from ..formats import FileFormat
from ..index.index import DatasetIndex
from ..index.parsed import hold_parsed_footers
from ..planning.order import StreamOrder
from ..planning.plan import Position
from ..planning.text import Tokenize
from ..planning.tokens import TokenPacking
from ..storage.filesystem import Storage
from ..storage.remote import WINDOW
from .bestfit import whole_batches
from .chat import chat_tokenized
from .packing import pack_tokens
from .pieces import Opener, piece_chunks, piece_read
from .prefetch import prefetch
from .runs import Chunk, Run, cut_runs
from .shuffled import shuffled_chunks
from .tokenizing import tokenized
from .window import Rows

__all__ = ["ChunkSource", "SourceFiles", "StreamSource", "chunk_rows", "read_stream"]

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
# A stream's files' parsed footers are held within this part of its budget (``index.parsed``).
_FOOTER_SHARE = 8


@dataclass(frozen=True, kw_only=True)
class SourceFiles:
    """How to read one dataset's files: where they are, their format, the columns read, and
    the shuffle's memory budget per stream."""

    storage: Storage
    fmt: FileFormat
    columns: tuple[str, ...] | None
    memory_bytes: int
    tokenize: Tokenize | None = None

    def stream(self, order: StreamOrder) -> StreamSource:
        """The stream of ``order`` over these files."""
        return StreamSource(
            order=order,
            storage=self.storage,
            fmt=self.fmt,
            columns=self.columns,
            memory_bytes=self.memory_bytes,
            tokenize=self.tokenize,
        )


@dataclass(frozen=True, kw_only=True)
class StreamSource:
    """Everything one stream reads from: its order, the files and how to open them."""

    order: StreamOrder
    storage: Storage
    fmt: FileFormat
    columns: tuple[str, ...] | None
    memory_bytes: int
    tokenize: Tokenize | None = None  # text tokenized after decoding (and gathering)

    @property
    def index(self) -> DatasetIndex:
        return self.order.index

    @property
    def total(self) -> int:
        return self.order.total

    @property
    def schema(self) -> pa.Schema:
        """What the stream delivers: the files' columns read, tokenized text as its tokens."""
        schema = self.index.schema
        return schema if self.tokenize is None else self.tokenize.delivered(schema)

    @property
    def decodes_into_new_memory(self) -> bool:
        return self.fmt.decodes_into_new_memory

    def describe_at(self, position: Position) -> str:
        return self.order.describe_at(position)

    def chunks(
        self,
        start: Position,
        min_rows: int,
        read_ahead: int = 0,
        *,
        rows: bool = False,
        most_rows: int | None = None,
    ) -> Iterator[tuple[Chunk, int]]:
        """Decoded chunks of at least ``min_rows`` rows from ``start``, each with the position
        after its last row; with ``read_ahead`` > 0 decoded ahead in a thread (shuffled: the
        next window read while this one is handed out). Record batches; with ``rows``,
        shuffled rows as ``Rows``, for a caller that copies them anyway. ``most_rows`` caps a
        chunk (else about ``_READ_BYTES``), for a caller that holds many streams' chunks."""
        hold_parsed_footers(self.memory_bytes // _FOOTER_SHARE)
        read_rows = self.read_rows(min_rows)
        if most_rows is not None:
            read_rows = max(min_rows, min(read_rows, most_rows))
        chunks = _chunks(self, start, read_rows, read_ahead)
        if self.tokenize is not None:
            chunks = self._tokenized(_batches(chunks), self.tokenize)
        if read_ahead and self.order.shuffled is None:
            chunks = prefetch(chunks, read_ahead)
        return chunks if rows else _batches(chunks)

    def _tokenized(
        self, chunks: Iterator[tuple[pa.RecordBatch, int]], tokenize: Tokenize
    ) -> Iterator[tuple[Chunk, int]]:
        """``chunks`` with their text (or conversations) tokenized, cut where the tokenizer's
        calls end.

        In a DataLoader worker the tokenizer runs on one thread (the workers are the
        parallelism): ``tokenizers`` would start a pool of a thread per core in every worker
        whose parent had not used one, unless the user set ``TOKENIZERS_PARALLELISM``."""
        if detect_worker() is not None:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        encode = tokenize.encoder()
        try:
            for chunk, position in chunks:
                first = position - chunk.num_rows

                def describe(row: int, first: int = first) -> str:
                    return self.describe_row(first + row)

                parts = timed(
                    tokenized(chunk, tokenize, encode, describe)
                    if tokenize.chat is None
                    else chat_tokenized(chunk, tokenize, describe),
                    TRANSFORM,
                )
                for part, rows in parts:
                    yield part, first + rows
        finally:
            chunks.close()  # type: ignore[attr-defined]

    def describe_row(self, position: Position) -> str:
        """The file, unit and row the stream delivers as its row ``position``."""
        found = self.order.row_at(position)
        if found is None:
            return f"row {position} of {self.describe_at(position)}"
        display, unit, row = self.index.locate_row(*found)
        return f"{display}, {self.fmt.unit_name} {unit}, row {row}"

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
        tokens of rows of the share an earlier iteration delivered. Whole documents:
        ``reading.bestfit.whole_batches`` (which finds what earlier deals delivered itself)."""
        if packing.whole_documents:
            return whole_batches(
                self,
                packing,
                start=start,
                batch_size=batch_size,
                drop_last=drop_last,
                read_ahead=read_ahead,
                position_ids=position_ids,
            )
        return pack_tokens(
            self.chunks(start, 1, read_ahead),
            packing=packing,
            batch_size=batch_size,
            drop_last=drop_last,
            skips=skips,
            end=self.total,
            describe=self.describe_at,
            describe_row=self.describe_row,
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
        return min(max(self.memory_bytes // 8, _MIN_LANE_BYTES), WINDOW)


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
    rows = min(max(_READ_BYTES // max(1, row_bytes), _MIN_CHUNK_ROWS), _MAX_READ_ROWS)
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
    return cut_runs(
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
        return shuffled_chunks(source, source.order.shuffled, start, gather_rows, read_ahead)
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
    opener = Opener(source, pieces, first, skip)
    try:
        for number in range(first, len(pieces)):
            begin = int(pieces.ends[number] - pieces.rows[number])
            read = piece_read(source, pieces, number, skip if number == first else 0)
            for chunk, done in piece_chunks(source, read, opener.open(read), read_rows):
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
