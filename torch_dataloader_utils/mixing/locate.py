"""The second step of a mixture's resume: where every stream of every source stands.

Unpacked, a stream's row of each source follows from its position (``MixedProgress.counts``);
packed, from the place the state stores (how far a source got depends on its tokens). Either
way the stored place must be that row's, by content: a changed file, split or plan of any
source fails to match, and the error names the source.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..base.arrays import IntArray
from ..base.errors import InvalidStateError
from ..checkpoint.checks import misplaced
from .read import ReadState, SourceStreams
from .state import MAX_POSITION, in_source

__all__ = ["Rows", "located", "located_job"]

# Per worker stream with a position: the row (over all the source's epochs) it hands out next,
# and the tokens of that row handed out.
Rows = dict[int, tuple[int, int]]


def located(read: ReadState) -> dict[str, Rows]:
    """Each source's ``Rows`` of the read state, checked against the places it stores."""
    return {name: _source_rows(read, name, streams) for name, streams in read.sources.items()}


def located_job(read: Sequence[ReadState]) -> tuple[IntArray, IntArray]:
    """Where every stream of an old job (``read``: its states by rank) stands in every source:
    per source and old stream, the row it hands out next over all the source's epochs, and
    the tokens of that row handed out (packed)."""
    mix, streams = read[0].mix, max(1, read[0].then.num_workers)
    ordinals = np.zeros((len(mix.names), mix.world_size * streams), dtype=np.int64)
    tokens = np.zeros_like(ordinals)
    for rank in read:
        for name, rows in located(rank).items():
            source = mix.names.index(name)
            for worker, (ordinal, delivered) in rows.items():
                ordinals[source, rank.then.stream(worker)] = ordinal
                tokens[source, rank.then.stream(worker)] = delivered
    return ordinals, tokens


def _source_rows(read: ReadState, name: str, streams: SourceStreams) -> Rows:
    mix, then = read.mix, read.then
    source = mix.names.index(name)
    epochs = mix.sources[source]
    workers = then.num_workers
    stored = then.mix.names.index(name)
    rows = {}
    for worker, position in then.positions.items():
        entry, epoch = streams.entries[worker], streams.epochs[worker]
        stream = then.stream(worker)
        if mix.config.packing is None:
            ordinal = int(then.counts(worker, position)[stored])
        else:
            ordinal = then.mix.ordinal_of(source, stream, epoch, entry.position, workers)
        if not 0 <= ordinal < MAX_POSITION:
            raise InvalidStateError(
                f"state keys 'sources.{name}.epochs' ({epoch} for worker "
                f"{worker}) and '.fresh' ({streams.fresh!r:.40}) put that worker at row "
                f"{ordinal} of the source's epochs, outside [0, 2**62): the state is corrupted"
            )
        place = then.mix.place(source, stream, ordinal, workers, entry.tokens)
        if (place.epoch, entry.position, entry.rows, entry.next_row) != (
            epoch,
            place.offset,
            place.order.total,
            place.order.row_at(place.offset),
        ):
            where = "the end of a share"
            if entry.next_row is not None:
                where = f"{epochs.index.describe(entry.next_row[0])} row {entry.next_row[1]}"
            raise in_source(misplaced(where, epochs.settings(workers), worker), name)
        rows[worker] = (ordinal, entry.tokens)
    return rows
