"""Reading one stream of a mixture: each source's rows in its own order, interleaved by the
schedule, in chunks whose rows are in the order of the mixed positions."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.types as pat

from ._mix_epochs import MixedProgress
from ._stream import Position, SourceFiles

__all__ = ["MixedSource"]

# Mixed positions assembled at a time (at least a batch): one gather of every column per chunk.
_MIX_ROWS = 16_384


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
        mix = self.progress.mix
        lengths = mix.epoch_lengths(self.progress.num_workers)
        return int(lengths[self.progress.stream(self.worker)])

    def describe_at(self, position: Position) -> str:
        """The source rows just before ``position``: each source's split there."""
        places = self.progress.places(self.worker, max(0, position))
        names = self.progress.mix.names
        return "; ".join(
            f"source {names[s]!r} epoch {p.epoch}: {p.order.describe_at(p.offset)}"
            for s, p in enumerate(places)
        )

    def read_rows(self, batch_size: int) -> int:
        return max(batch_size, _MIX_ROWS)

    def chunks(
        self, start: Position, min_rows: int, read_ahead: int = 0
    ) -> Iterator[tuple[pa.RecordBatch, int]]:
        """Chunks of the mixed rows from ``start`` to the end of the epoch, each with the
        position after its last row."""
        progress = self.progress
        feeds = [
            _Feed(self, s, p.epoch, p.offset, min_rows, read_ahead)
            for s, p in enumerate(progress.places(self.worker, start))
        ]
        step = self.read_rows(min_rows)
        try:
            for lo in range(start, self.total, step):
                hi = min(lo + step, self.total)
                ids = progress.sources(self.worker, lo, hi)
                counts = np.bincount(ids, minlength=len(feeds))
                parts = [feed.take(int(n)) for feed, n in zip(feeds, counts, strict=True)]
                yield _interleaved(parts, ids, progress.mix.source_column), hi
        finally:
            for feed in feeds:
                feed.close()


class _Feed:
    """One source's rows for one stream, from a place on, epoch after epoch."""

    def __init__(
        self, mixed: MixedSource, source: int, epoch: int, offset: int, min_rows: int,
        read_ahead: int,
    ) -> None:  # fmt: skip
        self._mixed, self._source = mixed, source
        self._min_rows, self._read_ahead = min_rows, read_ahead
        self._epoch = epoch
        self._chunks = self._open(offset)
        self._held: list[pa.RecordBatch] = []
        self._rows = 0

    def _open(self, offset: int) -> Iterator[tuple[pa.RecordBatch, int]]:
        progress = self._mixed.progress
        order = progress.mix.order(
            self._source, progress.stream(self._mixed.worker), self._epoch, progress.num_workers
        )
        source = self._mixed.sources[self._source].stream(order)
        return source.chunks(offset, self._min_rows, self._read_ahead)

    def take(self, rows: int) -> list[pa.RecordBatch]:
        """The next ``rows`` rows (slices of the decoded chunks)."""
        while self._rows < rows:
            chunk = next(self._chunks, None)
            if chunk is None:  # this epoch of the source is over: its next one
                self._chunks.close()  # type: ignore[attr-defined]
                self._epoch += 1
                self._chunks = self._open(0)
                continue
            self._held.append(chunk[0])
            self._rows += chunk[0].num_rows
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
        self._chunks.close()  # type: ignore[attr-defined]


def _interleaved(
    parts: list[list[pa.RecordBatch]], ids: npt.NDArray[np.int16], source_column: str | None
) -> pa.RecordBatch:
    """The sources' rows in the order of the positions ``ids`` (``parts[s]``: the rows of
    source ``s``, in order), then the source column. Each fixed-width column without nulls is
    scattered straight into its output (one write per value); any other is gathered."""
    batches = [b for part in parts for b in part]
    if len(batches) == 1:
        joined = batches[0]
    else:
        # the output places of each source's rows, in order: source 0's, then source 1's, ...
        places = np.argsort(ids, kind="stable")
        joined = pa.RecordBatch.from_arrays(
            [
                _column([b.column(c) for b in batches], places)
                for c in range(batches[0].num_columns)
            ],
            schema=batches[0].schema,
        )
    if source_column is None:
        return joined
    return joined.append_column(source_column, pa.array(ids))


def _column(pieces: list[pa.Array], places: npt.NDArray[np.intp]) -> pa.Array:
    """``pieces`` (one column, concatenated) with value ``i`` at output place ``places[i]``."""
    kind = pieces[0].type
    if (pat.is_integer(kind) or pat.is_floating(kind)) and not any(p.null_count for p in pieces):
        out = np.empty(len(places), dtype=kind.to_pandas_dtype())
        done = 0
        for piece in pieces:
            out[places[done : done + len(piece)]] = piece.to_numpy(zero_copy_only=True)
            done += len(piece)
        return pa.array(out)
    index = np.empty(len(places), dtype=np.int64)
    index[places] = np.arange(len(places), dtype=np.int64)
    return pa.concat_arrays(pieces).take(pa.array(index))
