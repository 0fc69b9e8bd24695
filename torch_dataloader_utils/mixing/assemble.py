"""A mixed chunk or packed batch assembled from its sources' rows or sequences: each put at
the places the schedule's interleave gives them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..base.arrays import IntArray, as_arrow, is_number, numbers
from ..planning.tokens import TokenPacking
from ..reading.packing import Columns, named_companions, packed_batch
from ..reading.runs import Chunk
from ..reading.window import Rows, gather
from .schedule import Interleave

__all__ = ["interleaved", "mixed_sequences"]


def interleaved(
    parts: list[list[Chunk]], mixed: Interleave, schema: pa.Schema, source_column: str | None
) -> pa.RecordBatch:
    """The sources' rows at their places in ``mixed`` (``parts[s]``: the rows of source ``s``,
    in order) with the columns of ``schema``, joined by name (a source's files may hold them
    in another order), then the source column. Each column of numbers without nulls is
    scattered straight into its output (one write per value); any other is gathered."""
    chunks = [c for part in parts for c in part]
    if len(chunks) == 1:
        joined = chunks[0].batch() if isinstance(chunks[0], Rows) else chunks[0]
        if joined.schema.names != schema.names:
            joined = joined.select(schema.names)
    else:
        columns = [[_columns(c, schema.names) for c in part] for part in parts]
        joined = pa.RecordBatch.from_arrays(
            [
                _column(schema.field(i).type, [[cs[i] for cs in part] for part in columns], mixed)
                for i in range(len(schema))
            ],
            schema=schema,
        )
    if source_column is None:
        return joined
    # a copy: the interleave is kept for later chunks, and a batch's tensors are the user's
    return joined.append_column(source_column, as_arrow(pa.int16(), mixed.sources.copy()))


def _columns(chunk: Chunk, names: list[str]) -> list[pa.Array | np.ndarray]:
    """A chunk's columns called ``names``, in that order; a window's plain ones as numpy
    views of its records."""
    columns = chunk.columns() if isinstance(chunk, Rows) else chunk.columns
    held = chunk.schema.names
    return columns if held == names else [columns[held.index(name)] for name in names]


def _column(
    kind: pa.DataType, pieces: list[list[pa.Array | np.ndarray]], mixed: Interleave
) -> pa.Array:
    """One column of the sources' rows (``pieces[s]``: source ``s``'s, in order) at their
    places in ``mixed``."""
    every = [p for part in pieces for p in part]
    arrow = [p for p in every if isinstance(p, pa.Array)]
    if is_number(kind) and not any(p.null_count for p in arrow):
        # numpy's memory: a chunk's column (~128 KiB) comes back from malloc without page
        # faults; Arrow's pool (mimalloc) gives such blocks back to the system when freed
        out = np.empty(len(mixed.sources), dtype=kind.to_pandas_dtype())
        for part, places in zip(pieces, mixed.places, strict=True):
            done = 0
            for piece in part:
                values = piece if isinstance(piece, np.ndarray) else numbers(piece)
                out[places[done : done + len(piece)]] = values
                done += len(piece)
        return as_arrow(kind, out)
    index = np.empty(len(mixed.sources), dtype=np.int64)
    index[np.concatenate(mixed.places)] = np.arange(len(mixed.sources), dtype=np.int64)
    arrays = [
        p if isinstance(p, pa.Array) else as_arrow(kind, np.ascontiguousarray(p)) for p in every
    ]
    return gather(arrays, index)


def mixed_sequences(
    blocks: list[tuple[Columns, IntArray]],
    mixed: Interleave,
    packing: TokenPacking,
    position_ids: object,
    real: int | None = None,
) -> dict[str, Any]:
    """A packed batch whose sequence ``i`` is the next sequence of source
    ``mixed.sources[i]``: ``blocks[s]`` holds source ``s``'s sequences (tokens and their
    companions, document starts); ``real``: its real tokens (``None``: all, no padding)."""
    seq_len = packing.seq_len
    places = np.concatenate(mixed.places)  # the output row of each sequence, source by source
    present = [columns for columns, _ in blocks if len(columns[0])]
    out = []
    for parts in zip(*present, strict=True):  # the tokens, then each companion
        joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
        column = np.empty((len(places), seq_len), dtype=joined.dtype)
        column[places] = joined.reshape(-1, seq_len)
        out.append(column.reshape(-1))
    starts, first = [], 0
    for (block_tokens, *_), block_starts in blocks:
        rows = first + block_starts // seq_len
        starts.append(places[rows] * seq_len + block_starts % seq_len)
        first += len(block_tokens) // seq_len
    return packed_batch(
        out[0], np.sort(np.concatenate(starts)), seq_len, position_ids, real=real,
        companions=named_companions(packing, tuple(out)),
    )  # fmt: skip
