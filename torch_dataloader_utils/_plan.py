"""Pure planning: cut files into splits, order them per epoch, deal their rows to streams.

Nothing here does I/O; everything is a function of integers, a seed and an epoch.

An epoch's *sequence* is the rows of its splits in the seeded order, minus what an earlier run
already delivered (``base``). A *piece* is a row range of one split, so the sequence is a list of
pieces. The sequence is dealt to the ``S = world_size * num_workers`` *streams* in contiguous
shares that differ by at most one row; stream ``g = rank * num_workers + worker``. With
``even`` every rank gets ``N // world_size`` rows, dealt to its workers alike on every rank, so
every rank yields the same number of batches; the last ``N % world_size`` rows (fewer than
``world_size``) are *left out* of the epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import numpy.typing as npt
import xxhash

from ._world import World

__all__ = [
    "Consumed",
    "Deal",
    "EpochPlan",
    "IntArray",
    "Intervals",
    "Pieces",
    "Split",
    "cut_splits",
    "epoch_order",
    "remaining_pieces",
]

IntArray = npt.NDArray[np.int64]
# Sorted, disjoint, non-empty ``(lo, hi)`` row ranges relative to a split's first row.
Intervals = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Split:
    """Rows ``[row_offset, row_offset + row_length)`` of file ``file``: its units ``units``.

    Every rank holds one per split of the dataset, so it has slots (no ``__dict__``).
    """

    file: int
    units: range
    row_offset: int
    row_length: int


@dataclass(frozen=True)
class Pieces:
    """Parallel arrays: piece ``i`` is rows ``[lo[i], hi[i])`` of split ``splits[i]``."""

    splits: IntArray
    lo: IntArray
    hi: IntArray

    def __len__(self) -> int:
        return len(self.splits)

    @property
    def rows(self) -> IntArray:
        return self.hi - self.lo

    @classmethod
    def concat(cls, parts: Sequence[Pieces]) -> Pieces:
        return cls(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("splits", "lo", "hi"))
        )

    @classmethod
    def empty(cls) -> Pieces:
        return cls.of([])

    @classmethod
    def of(cls, items: Sequence[tuple[int, int, int]]) -> Pieces:
        """Pieces from ``(split, lo, hi)`` triples."""
        arrays = np.array(items, dtype=np.int64).reshape(-1, 3).T
        return cls(arrays[0], arrays[1], arrays[2])

    def take(self, index: slice | IntArray) -> Pieces:
        return Pieces(self.splits[index], self.lo[index], self.hi[index])

    @cached_property
    def ends(self) -> IntArray:
        """Rows of the concatenation up to the end of each piece (computed once)."""
        ends: IntArray = np.cumsum(self.rows)
        return ends

    def rows_range(self, start: int, stop: int) -> Pieces:
        """The pieces cut to rows ``[start, stop)`` of their concatenation.

        Costs two binary searches and the pieces in the range, not the whole sequence.
        """
        ends = self.ends
        first = int(np.searchsorted(ends, start, side="right"))
        # the piece holding row ``stop - 1`` is the last; a piece past it would come out empty
        last = min(len(self), int(np.searchsorted(ends, stop, side="left")) + 1)
        part = self.take(slice(first, last))
        part_ends = ends[first:last]
        lo = part.lo + np.maximum(0, start - (part_ends - part.rows))
        hi = part.hi - np.maximum(0, part_ends - stop)
        keep = hi > lo
        return Pieces(part.splits[keep], lo[keep], hi[keep])

    @property
    def total(self) -> int:
        """Rows of the concatenation."""
        return int(self.ends[-1]) if len(self) else 0


@dataclass(frozen=True)
class Consumed:
    """Rows an epoch has delivered: ``done[s]`` for whole splits, ``partial[s]`` of others."""

    done: npt.NDArray[np.bool_]
    partial: Mapping[int, Intervals]

    @classmethod
    def nothing(cls, num_splits: int) -> Consumed:
        return cls(np.zeros(num_splits, dtype=bool), {})

    def is_empty(self) -> bool:
        return not (self.done.any() or self.partial)

    def plus(self, pieces: Pieces, split_rows: IntArray) -> Consumed:
        """This plus the rows of ``pieces``; a split whose rows are all covered becomes done.

        Whole splits are set in the bitmap at once, and a piece that is the only news of a
        split with no rows yet is its interval as it stands; only the rest are merged.
        """
        done = self.done.copy()
        known = np.isin(pieces.splits, list(self.partial))
        fresh = ~known & (pieces.lo == 0) & (pieces.hi == split_rows[pieces.splits])
        done[pieces.splits[fresh]] = True
        partial = {s: v for s, v in self.partial.items() if not done[s]}
        rest = np.flatnonzero(~fresh & (pieces.hi > pieces.lo))
        rest = rest[~done[pieces.splits[rest]]]
        splits = pieces.splits[rest]
        once = np.isin(splits, _repeated(splits), invert=True) & ~known[rest]
        lo, hi = pieces.lo[rest[once]].tolist(), pieces.hi[rest[once]].tolist()
        partial.update(
            (s, ((a, b),)) for s, a, b in zip(splits[once].tolist(), lo, hi, strict=True)
        )
        self._merge_into(partial, done, pieces.take(rest[~once]), split_rows)
        return Consumed(done, partial)

    @staticmethod
    def _merge_into(
        partial: dict[int, Intervals],
        done: npt.NDArray[np.bool_],
        pieces: Pieces,
        split_rows: IntArray,
    ) -> None:
        """Merge ``pieces`` into ``partial``; splits they complete move to ``done``."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for s, lo, hi in zip(
            pieces.splits.tolist(), pieces.lo.tolist(), pieces.hi.tolist(), strict=True
        ):
            ranges.setdefault(s, list(partial.get(s, ()))).append((lo, hi))
        for s, items in ranges.items():
            merged = merge_intervals(items)
            if merged == ((0, int(split_rows[s])),):
                done[s] = True
                partial.pop(s, None)
            else:
                partial[s] = merged

    def union(self, other: Consumed, split_rows: IntArray) -> Consumed:
        pieces = _partial_pieces(other.partial)
        return Consumed(self.done | other.done, self.partial).plus(pieces, split_rows)


def merge_intervals(items: Iterable[tuple[int, int]]) -> Intervals:
    """Sorted, disjoint union of ``(lo, hi)`` ranges; empty ranges vanish."""
    merged: list[list[int]] = []
    for lo, hi in sorted(i for i in items if i[1] > i[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def _repeated(values: IntArray) -> IntArray:
    """The values that occur more than once."""
    unique, counts = np.unique(values, return_counts=True)
    repeated: IntArray = unique[counts > 1]
    return repeated


def _partial_pieces(partial: Mapping[int, Intervals]) -> Pieces:
    return Pieces.of([(s, lo, hi) for s, ranges in partial.items() for lo, hi in ranges])


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


@lru_cache(maxsize=1)
def epoch_order(num_splits: int, seed: int, epoch: int, shuffle: bool) -> IntArray:
    """The epoch's split order: identity, or a permutation keyed by ``(seed, epoch)``.

    The permutation sorts splits by a splitmix64 hash of their index, so it is the same on every
    platform and numpy version. It is the one O(splits log splits) step of a rank's plan, asked
    for by ``len``, the main process and each worker in turn, so the last one is kept
    (read-only; forked workers inherit it).
    """
    index = np.arange(num_splits, dtype=np.int64)
    if shuffle:
        key = np.uint64(xxhash.xxh64_intdigest(f"{seed}:{epoch}".encode()))
        index = np.argsort(_splitmix64(index.astype(np.uint64) + key), kind="stable")
        index = index.astype(np.int64, copy=False)
    index.flags.writeable = False
    return index


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        z = x * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def remaining_pieces(order: IntArray, consumed: Consumed, split_rows: IntArray) -> Pieces:
    """The rows of the splits in ``order`` that ``consumed`` has not delivered, as pieces."""
    splits = order[~consumed.done[order]]
    hi = split_rows[splits].astype(np.int64)
    if not consumed.partial:
        return Pieces(splits, np.zeros(len(splits), dtype=np.int64), hi)
    items: list[tuple[int, int, int]] = []
    for split, length in zip(splits.tolist(), hi.tolist(), strict=True):
        ranges = consumed.partial.get(split)
        gaps = _gaps(ranges, length) if ranges else [(0, length)]
        items.extend((split, a, b) for a, b in gaps)
    return Pieces.of(items)


def _gaps(ranges: Intervals, length: int) -> list[tuple[int, int]]:
    """The complement of ``ranges`` in ``[0, length)``."""
    bounds = [0, *(v for r in ranges for v in r), length]
    return [(a, b) for a, b in zip(bounds[::2], bounds[1::2], strict=True) if b > a]


@dataclass(frozen=True)
class Deal:
    """The epoch's sequence cut into stream shares: stream ``g`` reads rows ``[start(g),
    start(g + 1))``, a closed form of the sequence's length, so one stream's share costs its
    own pieces, whatever the number of streams.

    Rows from ``start(streams)`` to the end of the sequence are left out (``even`` only).
    """

    sequence: Pieces
    world_size: int
    num_workers: int
    even: bool

    @property
    def streams(self) -> int:
        return self.world_size * self.num_workers

    def start(self, streams: IntArray) -> IntArray:
        """The first row of each stream in ``streams`` (``streams`` itself: the end)."""
        total, workers = self.sequence.total, self.num_workers
        if self.even:
            per_rank = total // self.world_size
            quota, extra = divmod(per_rank, workers)
            rank, worker = np.divmod(streams, workers)
            starts: IntArray = rank * per_rank + worker * quota + np.minimum(worker, extra)
            return starts
        quota, extra = divmod(total, self.streams)
        starts = streams * quota + np.minimum(streams, extra)
        return starts

    def share(self, stream: int) -> Pieces:
        start, stop = self.start(np.array([stream, stream + 1], dtype=np.int64)).tolist()
        return self.sequence.rows_range(start, stop)

    def left_out(self) -> Pieces:
        end = int(self.start(np.array([self.streams], dtype=np.int64))[0])
        return self.sequence.rows_range(end, self.sequence.total)

    def shares_of(self, first: int, count: int) -> IntArray:
        """Rows of streams ``first .. first + count - 1``."""
        return np.diff(self.start(np.arange(first, first + count + 1, dtype=np.int64)))

    @property
    def bounds(self) -> IntArray:
        """The first row of every stream, then the end of the dealt rows (O(streams))."""
        return self.start(np.arange(self.streams + 1, dtype=np.int64))

    @property
    def shares(self) -> IntArray:
        """Rows of every stream, in stream order (O(streams))."""
        return np.diff(self.bounds)


def deal(sequence: Pieces, *, world_size: int, num_workers: int, even: bool) -> Deal:
    """Contiguous shares of ``sequence`` for ``world_size * num_workers`` streams.

    Shares differ by at most one row, the larger ones first. With ``even`` every rank gets
    ``N // world_size`` rows, shared by its workers in the same pattern on every rank, so every
    rank yields the same number of batches; the last ``N % world_size`` rows are left out.
    """
    return Deal(sequence, world_size=world_size, num_workers=num_workers, even=even)


@dataclass(frozen=True)
class EpochPlan:
    """One epoch: the splits in ``order`` minus ``base``, dealt to ``world_size * workers`` streams.

    ``base`` is empty for a fresh epoch; an elastic resume deals only what its checkpoints had
    not delivered, so it starts from their union.
    """

    epoch: int
    order: IntArray
    base: Consumed
    world_size: int
    num_workers: int  # streams per rank (at least 1)
    even: bool
    deal: Deal

    @classmethod
    def build(
        cls,
        *,
        epoch: int,
        order: IntArray,
        base: Consumed,
        split_rows: IntArray,
        world_size: int,
        num_workers: int,
        even: bool,
    ) -> EpochPlan:
        workers = max(1, num_workers)
        sequence = remaining_pieces(order, base, split_rows)
        dealt = deal(sequence, world_size=world_size, num_workers=workers, even=even)
        return cls(epoch, order, base, world_size, workers, even, dealt)

    def stream(self, world: World) -> Pieces:
        """The pieces stream ``world`` reads, in order."""
        return self.deal.share(world.rank * self.num_workers + world.worker)

    def rank_shares(self, rank: int) -> IntArray:
        """Rows each worker stream of ``rank`` reads."""
        return self.deal.shares_of(rank * self.num_workers, self.num_workers)
