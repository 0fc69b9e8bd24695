"""A stream's chunks cut into runs of batches of exactly the batch size, each batch with the
stream position after its last row; rows are sliced, never copied."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeAlias

import pyarrow as pa

from ..planning.plan import Position
from .window import Rows

__all__ = ["Chunk", "Run", "cut_runs"]

# Rows of a stream: decoded, or gathered from a shuffle window and not yet cut into columns.
Chunk: TypeAlias = "pa.RecordBatch | Rows"


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


def cut_runs(
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
