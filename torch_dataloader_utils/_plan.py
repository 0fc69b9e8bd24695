"""Pure planning: cut files into splits, order them per epoch, deal them to streams.

Nothing here does I/O; everything is a function of integers, a seed and an epoch.

A *stream* is one (rank, worker) pair; stream ``g = rank + world_size * worker`` of
``S = world_size * num_workers``. Dealing round-robin to ranks and then to workers gives stream
``g`` the pieces ``pieces[g::S]``.

A *piece* is a split to read from a start row (0 unless an earlier run consumed a prefix).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from ._world import World

__all__ = [
    "Consumed",
    "EpochPlan",
    "Pieces",
    "Split",
    "cut_splits",
    "epoch_order",
    "even_row_budgets",
    "remaining_pieces",
    "stream_pieces",
    "stream_rows",
]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Split:
    """Rows ``[row_offset, row_offset + row_length)`` of file ``file``: its units ``units``."""

    file: int
    units: range
    row_offset: int
    row_length: int


@dataclass(frozen=True)
class Pieces:
    """Parallel arrays: piece ``i`` reads split ``splits[i]`` from its row ``starts[i]``."""

    splits: IntArray
    starts: IntArray

    def __len__(self) -> int:
        return len(self.splits)


@dataclass(frozen=True)
class Consumed:
    """What an epoch has delivered: ``done[s]`` for whole splits, ``partial[s]`` rows of others."""

    done: npt.NDArray[np.bool_]
    partial: Mapping[int, int]

    @classmethod
    def nothing(cls, num_splits: int) -> Consumed:
        return cls(np.zeros(num_splits, dtype=bool), {})


def cut_splits(
    unit_bytes: Sequence[Sequence[int]], unit_rows: Sequence[Sequence[int]], split_bytes: int
) -> list[Split]:
    """Greedy, per file: consecutive units while their bytes stay within ``split_bytes``.

    A unit larger than the bound is a split of its own; splits without rows are dropped.
    """
    if split_bytes <= 0:
        raise ValueError(f"split_bytes must be positive, got {split_bytes}")
    splits: list[Split] = []
    for file, (sizes, rows) in enumerate(zip(unit_bytes, unit_rows, strict=True)):
        first, size, offset = 0, 0, 0
        for unit, unit_size in enumerate(sizes):
            if unit > first and size + unit_size > split_bytes:
                splits.append(_split(file, first, unit, rows, offset))
                offset += splits[-1].row_length
                first, size = unit, 0
            size += unit_size
        if len(sizes) > first:
            splits.append(_split(file, first, len(sizes), rows, offset))
    return [s for s in splits if s.row_length > 0]


def _split(file: int, first: int, end: int, rows: Sequence[int], offset: int) -> Split:
    return Split(file, range(first, end), offset, sum(rows[first:end]))


def epoch_order(num_splits: int, seed: int, epoch: int, shuffle: bool) -> IntArray:
    """The epoch's split order: identity, or a permutation keyed by ``(seed, epoch)``.

    The permutation sorts splits by a splitmix64 hash of their index, so it is the same on every
    platform and numpy version.
    """
    index = np.arange(num_splits, dtype=np.int64)
    if not shuffle:
        return index
    key = np.uint64(xxhash.xxh64_intdigest(f"{seed}:{epoch}".encode()))
    return np.argsort(_splitmix64(index.astype(np.uint64) + key), kind="stable").astype(np.int64)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        z = x * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def remaining_pieces(order: IntArray, consumed: Consumed) -> Pieces:
    """The epoch's pieces in ``order`` after what ``consumed`` already delivered."""
    splits = order[~consumed.done[order]]
    offsets = np.zeros(len(consumed.done), dtype=np.int64)
    if consumed.partial:
        offsets[list(consumed.partial)] = list(consumed.partial.values())
    return Pieces(splits, offsets[splits])


def stream_pieces(pieces: Pieces, world: World) -> Pieces:
    """Round-robin to ranks, then workers: stream ``rank + world_size * worker`` of all."""
    stream = world.rank + world.world_size * world.worker
    step = world.world_size * world.num_workers
    return Pieces(pieces.splits[stream::step], pieces.starts[stream::step])


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's dealing: splits in ``order``, minus ``base``, round-robin to streams.

    ``base`` is empty for a fresh epoch; an elastic resume deals only what its checkpoints had
    not delivered, so it starts from their union.
    """

    epoch: int
    order: IntArray
    base: Consumed

    def stream(self, world: World) -> Pieces:
        return stream_pieces(remaining_pieces(self.order, self.base), world)


def stream_rows(
    pieces: Pieces, split_rows: IntArray, world_size: int, num_workers: int
) -> IntArray:
    """Rows each stream reads, shaped ``[rank, worker]``."""
    streams = world_size * num_workers
    rows = split_rows[pieces.splits] - pieces.starts
    per_stream = np.bincount(np.arange(len(rows)) % streams, weights=rows, minlength=streams)
    return per_stream.astype(np.int64).reshape(num_workers, world_size).T


def even_row_budgets(rows: IntArray, batch_size: int, drop_last: bool) -> IntArray:
    """Rows each ``[rank, worker]`` stream may deliver so every rank yields as many batches.

    Every rank keeps the first ``B`` batches of its round-robin over workers, ``B`` being the
    fewest batches any rank has; the rest of the epoch's rows are not delivered.
    """
    batches = rows // batch_size if drop_last else -(-rows // batch_size)
    target = int(batches.sum(axis=1).min())
    kept = np.stack([_round_robin_take(rank, target) for rank in batches])
    return np.minimum(rows, kept * batch_size)


def _round_robin_take(counts: IntArray, total: int) -> IntArray:
    """How many of each worker's batches are among the first ``total`` in round-robin order."""
    low, high = 0, int(counts.max(initial=0))
    while low < high:  # the most full rounds that fit in ``total``
        middle = (low + high + 1) // 2
        low, high = (
            (middle, high) if np.minimum(counts, middle).sum() <= total else (low, middle - 1)
        )
    take = np.minimum(counts, low)
    rest = total - int(take.sum())
    take[np.flatnonzero(counts > low)[:rest]] += 1
    return take
