"""Reading one stream of a mixture: each source's rows in its own order, interleaved by the
schedule, in chunks whose rows are in the order of the mixed positions."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..base.arrays import IntArray
from ..base.errors import DataSourceError
from ..planning.plan import Position
from ..planning.tokens import TokenPacking, TokenPosition
from ..reading.bestfit import (
    Documents,
    WholeDocuments,
    chunk_documents,
    delivered_before,
    left_out,
)
from ..reading.packing import Columns, Pending, documents
from ..reading.prefetch import prefetch
from ..reading.runs import Chunk
from ..reading.stream import SourceFiles, chunk_rows
from .assemble import interleaved, mixed_sequences
from .epochs import MixedProgress
from .places import MixPosition

__all__ = ["MixedSource"]

# Mixed positions assembled at a time, at most (at least a batch): one scatter of every column
# per chunk.
_MIX_ROWS = 65_536
# A mixed chunk and its interleave (``_PLACE_BYTES`` a position) take at most this part of the
# stream's budget: a stream holds about three (read ahead, being cut into batches, handed
# out), so at the default budget chunks stay at ``_MIX_ROWS`` (fewer cost throughput: 0.78
# -> 0.70 of one dataset for 3 shuffled sources at 16,384), and at a small one they do not
# outweigh the windows (16 MiB, 100 sources: 2.5 MiB a stream at 65,536).
_CHUNK_SHARE = 32
_PLACE_BYTES = 16
# Rows of a source's chunk, at least, in a mixed stream: each source holds one (gathered from
# its window), so at 1,000 sources 256 rows held 5 MiB; fewer cost a gather call more often.
_MIN_FEED_ROWS = 64
# Chunks without a token a packed source may read in a row before it is refused.
_MAX_EMPTY_CHUNKS = 1000


@dataclass(frozen=True)
class MixedSource:
    """Stream ``worker`` of a mixture's iteration; ``sources[s]`` opens source ``s`` for a given
    order (its storage, format and columns). Its rows carry the column ``source_column``: the
    number of the source each row comes from."""

    progress: MixedProgress
    worker: int
    sources: Sequence[SourceFiles]

    @property
    def schema(self) -> pa.Schema:
        return self.progress.mix.schema

    @property
    def decodes_into_new_memory(self) -> bool:
        return True  # every chunk is a fresh gather

    @property
    def total(self) -> int:
        return self.progress.total(self.worker)

    def describe_at(self, position: Position) -> str:
        """The source rows just before ``position``: each source's split there."""
        places = self.progress.places(self.worker, max(0, position))
        names = self.progress.mix.names
        return "; ".join(
            f"source {names[s]!r} epoch {p.epoch}: {p.order.describe_at(p.offset)}"
            for s, p in enumerate(places)
        )

    def read_rows(self, batch_size: int) -> int:
        """Positions mixed at a time: as many as a chunk of the widest source read in order,
        at most ``_MIX_ROWS``, and (with their interleave) at most ``1 / _CHUNK_SHARE`` of
        the stream's budget; at least a batch."""
        mix = self.progress.mix
        widest = max(epochs.index.row_bytes() for epochs in mix.sources)
        budget = mix.config.shuffle_memory_bytes // (_CHUNK_SHARE * (widest + _PLACE_BYTES))
        return max(batch_size, min(_MIX_ROWS, chunk_rows(widest, batch_size), budget))

    def chunks(
        self, start: Position, min_rows: int, read_ahead: int = 0, *, rows: bool = False
    ) -> Iterator[tuple[pa.RecordBatch, int]]:
        """Chunks of the mixed rows from ``start`` to the end of the epoch, each with the
        position after its last row (record batches, also with ``rows``); with
        ``read_ahead``, mixed ahead in one thread (where the shuffled sources' windows are
        read, one after another), and, unshuffled, each source's next chunk decoded ahead in
        one more: not a thread of each source's (each would keep its own freed memory)."""
        chunks = self._chunks(start, min_rows, read_ahead)
        return prefetch(chunks, read_ahead) if read_ahead else chunks

    def _chunks(
        self, start: Position, min_rows: int, read_ahead: int
    ) -> Iterator[tuple[pa.RecordBatch, int]]:
        progress = self.progress
        step, total = self.read_rows(min_rows), self.total
        weights = progress.mix.timeline.schedule.weights
        # sources read in order decode their next chunks in one thread; a shuffled one reads
        # its window when its rows are due (read early, a window would hold up the others')
        shuffled = progress.mix.config.shuffle
        reader = ThreadPoolExecutor(1, "tdu-mix-read") if read_ahead and not shuffled else None
        feeds = [
            # a source's chunks about its rows of a mixed chunk: a source read 1 in 100 holds
            # a hundredth of a chunk, not a chunk of its own
            _Feed(self, s, int(n), 1, as_rows=True, reader=reader,
                  most_rows=max(_MIN_FEED_ROWS, -(-step * weights[s] // sum(weights))))
            for s, n in enumerate(progress.counts(self.worker, start).tolist())
        ]  # fmt: skip
        try:
            for lo in range(start, total, step):
                hi = min(lo + step, total)
                mixed = progress.interleave(self.worker, lo, hi)
                parts = [feed.take(len(p)) for feed, p in zip(feeds, mixed.places, strict=True)]
                yield interleaved(parts, mixed, progress.mix.source_schema,
                                   progress.mix.source_column), hi  # fmt: skip
        finally:
            for feed in feeds:
                feed.close()
            if reader is not None:
                reader.shutdown()

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
        """Batches of ``batch_size`` sequences from ``start`` to the end of the epoch: each
        source packs its own documents, and the schedule deals the sequences. ``skips`` is
        for one dataset's stream: a mixture's packers know their own cut documents (``start``
        and the elastic deals of ``MixedEpochs.skips``); with ``read_ahead``, packed ahead in
        one thread, as ``chunks``."""
        batches = self._packed(packing, start, batch_size, drop_last, position_ids)
        return prefetch(batches, read_ahead) if read_ahead else batches

    def _packed(
        self, packing: TokenPacking, start: Position, batch_size: int, drop_last: bool,
        position_ids: object,
    ) -> Iterator[tuple[dict[str, Any], Position]]:  # fmt: skip
        progress = self.progress
        assert isinstance(start, MixPosition)
        packers: list[_Packer | _WholePacker] = []
        stream, workers = progress.stream(self.worker), progress.num_workers
        for s, (row, tokens) in enumerate(start.sources):
            describe = functools.partial(self._describe_row, s)
            if packing.whole_documents:  # windows end with each epoch of the source
                feed = _Feed(self, s, row, 1, whole=packing)
                docs = _feed_documents(feed, packing, describe)
                whole = WholeDocuments(docs, packing, TokenPosition(row, tokens), describe,
                                       functools.partial(self._epoch_end, s))  # fmt: skip
                packers.append(_WholePacker(feed, whole))
                continue
            feed = _Feed(self, s, row, 1)
            cut = {r: t for r, t in progress.mix.skips(s, stream, workers).items() if r >= row}
            if tokens:
                cut[row] = tokens
            locate = functools.partial(self._locate_row, s)
            packers.append(_Packer(feed, packing, cut, (row, tokens), describe, locate))
        end = (
            self.total if not drop_last else start + (self.total - start) // batch_size * batch_size
        )
        try:
            for lo in range(start, end, batch_size):
                hi = min(lo + batch_size, end)
                mixed = progress.interleave(self.worker, lo, hi)
                blocks = [p.take(len(n)) for p, n in zip(packers, mixed.places, strict=True)]
                reals = [p.real for p in packers if isinstance(p, _WholePacker)]
                real = sum(reals) if packing.whole_documents else None
                batch = mixed_sequences(blocks, mixed, packing, position_ids, real)
                if progress.mix.source_column is not None:
                    batch[progress.mix.source_column] = mixed.sources.copy()
                yield batch, MixPosition(hi, tuple(p.position for p in packers))
        finally:
            for packer in packers:
                packer.close()

    def _epoch_end(self, source: int, row: int) -> int:
        """The row (over all the source's epochs) after the last of row ``row``'s epoch."""
        progress = self.progress
        place = progress.mix.place(source, progress.stream(self.worker), row,
                                   progress.num_workers)  # fmt: skip
        return row - place.offset + place.order.total

    def _describe_row(self, source: int, row: int) -> str:
        """Row ``row`` (over all epochs) of source ``source`` of this stream, for errors."""
        progress = self.progress
        place = progress.mix.place(source, progress.stream(self.worker), max(0, row - 1),
                                   progress.num_workers)  # fmt: skip
        return (
            f"source {progress.mix.names[source]!r} epoch {place.epoch}: "
            f"{place.order.describe_at(place.offset + 1)}"
        )

    def _locate_row(self, source: int, row: int) -> str:
        """The file and row of row ``row`` (over all epochs) of source ``source`` of this
        stream, for errors."""
        progress = self.progress
        place = progress.mix.place(source, progress.stream(self.worker), row,
                                   progress.num_workers)  # fmt: skip
        located = self.sources[source].stream(place.order).describe_row(place.offset)
        return f"source {progress.mix.names[source]!r} epoch {place.epoch}: {located}"


class _Feed:
    """One source's rows for one stream, from row ``ordinal`` on, epoch after epoch; rows are
    counted over all its epochs (``MixedEpochs.places_from``). Chunks are record batches; with
    ``as_rows``, a shuffled source's are the ``Rows`` gathered from its window (copied once, by
    the interleave). With ``whole`` (whole-document packing), ``delivered`` holds the rows of
    the current epoch an earlier deal delivered (``reading.bestfit.delivered_before``)."""

    def __init__(
        self, mixed: MixedSource, source: int, ordinal: int, min_rows: int,
        *, as_rows: bool = False, most_rows: int | None = None,
        reader: ThreadPoolExecutor | None = None, whole: TokenPacking | None = None,
    ) -> None:  # fmt: skip
        self._mixed, self._source = mixed, source
        self._min_rows, self._as_rows, self._most_rows = min_rows, as_rows, most_rows
        self._reader = reader
        self._ahead: futures.Future[tuple[Chunk, int]] | None = None  # read in ``reader``
        self._whole = whole
        self.delivered: IntArray = np.empty(0, dtype=np.int64)
        progress = mixed.progress
        self._places = progress.mix.places_from(
            source, progress.stream(mixed.worker), ordinal, progress.num_workers
        )
        self._base = ordinal  # the row (over all epochs) at the start of the current place
        self._chunks = self._open()
        self._held: list[Chunk] = []
        self._rows = 0

    def _open(self) -> Iterator[tuple[Chunk, int]]:
        place = next(self._places)
        self._base -= place.offset
        source = self._mixed.sources[self._source].stream(place.order)
        self._total = place.order.total
        if self._whole is not None:
            self.delivered = self._base + delivered_before(source, self._whole)
        return source.chunks(
            place.offset, self._min_rows, rows=self._as_rows, most_rows=self._most_rows
        )

    def next_chunk(self) -> tuple[Chunk, int]:
        """The next decoded chunk, and the row (over all epochs) after its last; with a
        ``reader``, the one after it is read there meanwhile (one thread reads ahead for every
        source of the stream)."""
        if self._reader is None:
            return self._read_chunk()
        ahead = self._ahead or self._reader.submit(self._read_chunk)
        self._ahead = None
        chunk = ahead.result()
        self._ahead = self._reader.submit(self._read_chunk)
        return chunk

    def _read_chunk(self) -> tuple[Chunk, int]:
        while True:
            chunk = next(self._chunks, None)
            if chunk is not None:
                return chunk[0], self._base + chunk[1]
            self._chunks.close()  # type: ignore[attr-defined]
            self._base += self._total  # this epoch of the source is over: its next one
            self._chunks = self._open()

    def take(self, rows: int) -> list[Chunk]:
        """The next ``rows`` rows (slices of the decoded chunks)."""
        while self._rows < rows:
            chunk, _ = self.next_chunk()
            self._held.append(chunk)
            self._rows += chunk.num_rows
        out, need = [], rows
        while need:
            head = self._held[0]
            if head.num_rows <= need:
                out.append(self._held.pop(0))
                need -= head.num_rows
            else:
                out.append(head.slice(0, need))
                self._held[0] = head.slice(need)
                need = 0
        self._rows -= rows
        return out

    def close(self) -> None:
        if self._ahead is not None and not self._ahead.cancel():
            futures.wait([self._ahead])  # not closed while its generator runs
        self._chunks.close()  # type: ignore[attr-defined]


class _Packer:
    """One source's documents for one stream, packed: whole sequences on demand, from a
    ``position`` (a row over all the source's epochs, and the tokens of it handed out)."""

    def __init__(self, feed: _Feed, packing: TokenPacking, skips: Mapping[int, int],
                 position: tuple[int, int], describe: Callable[[int], str],
                 locate: Callable[[int], str]) -> None:  # fmt: skip
        self._feed, self._packing, self._describe = feed, packing, describe
        self._locate = locate  # names a row (over all epochs) by file and row, for errors
        self._skips = skips  # rows (over all epochs) whose first tokens were delivered before
        self._pending: Pending | None = None
        self.position = position

    def take(self, sequences: int) -> tuple[Columns, IntArray]:
        """The tokens (and companions) of the next ``sequences`` sequences, and where
        documents start in them."""
        need = sequences * self._packing.seq_len
        if not need:
            empty = np.empty(0, dtype=np.int64)
            return (empty,) * (1 + len(self._packing.companions)), empty
        empty_chunks = 0
        while self._pending is None or self._pending.size < need:
            chunk, after = self._feed.next_chunk()
            tokens, rows, starts, skipped = documents(
                chunk, self._packing, after - chunk.num_rows, self._skips, self._describe,
                self._locate,
            )  # fmt: skip
            if self._pending is None:
                self._pending = Pending([], rows[:0], starts[:0], skipped[:0])
            self._pending.extend(tokens, rows, starts, skipped)
            empty_chunks = empty_chunks + 1 if not len(tokens[0]) else 0
            if empty_chunks > _MAX_EMPTY_CHUNKS:
                raise DataSourceError(
                    f"{self._describe(after)}: {empty_chunks} chunks in a row without a token; "
                    f"a packed source needs tokens (or a separator) to make sequences"
                )
        pending = self._pending
        tokens = pending.tokens(0, need)
        starts = pending.starts_within(0, need)
        after = pending.position_after(need)
        pending.drop(need)
        self.position = (int(after), after.tokens)
        return tokens, starts

    def close(self) -> None:
        self._feed.close()


class _WholePacker:
    """One source's documents for one stream, packed whole (``reading.bestfit``): the
    ``_Packer`` calls, and the real tokens of the sequences last taken."""

    def __init__(self, feed: _Feed, packer: WholeDocuments) -> None:
        self._feed, self._packer = feed, packer
        self.real = 0

    @property
    def position(self) -> tuple[int, int]:
        """The source's window start (a row over all its epochs), its sequences delivered."""
        position = self._packer.position
        return int(position), position.tokens

    def take(self, sequences: int) -> tuple[Columns, IntArray]:
        """The tokens (and companions) of the next ``sequences`` sequences, and where
        documents and paddings start in them."""
        columns, starts, self.real, _ = self._packer.take(sequences)
        return columns, starts

    def close(self) -> None:
        self._feed.close()


def _feed_documents(
    feed: _Feed, packing: TokenPacking, describe: Callable[[int], str]
) -> Iterator[Documents]:
    """A source's documents from ``feed``, epoch after epoch (refused once it reads
    ``_MAX_EMPTY_CHUNKS`` chunks in a row without a token)."""
    empty_chunks = 0
    while True:
        chunk, after = feed.next_chunk()
        first = after - chunk.num_rows
        columns, lengths = chunk_documents(chunk, packing, first, describe)
        columns, lengths = left_out(columns, lengths, first, feed.delivered)
        empty_chunks = empty_chunks + 1 if not len(columns[0]) else 0
        if empty_chunks > _MAX_EMPTY_CHUNKS:
            raise DataSourceError(
                f"{describe(after)}: {empty_chunks} chunks in a row without a token; "
                f"a packed source needs tokens (or a separator) to make sequences"
            )
        yield columns, lengths, first
