"""Pure planning: cut files into splits, deal an epoch's rows to streams.

Nothing here does I/O; everything is a function of integers.

An epoch's *sequence* is the rows of its splits: in storage order, or shuffled (blocks of
every split in a keyed random order, ``planning.order.shuffled_sequence``). A *piece* is a row
range of one split, so the sequence is a list of pieces. The sequence is dealt to the
``S = world_size * num_workers`` *streams* in contiguous shares that differ by at most one row;
stream ``g = rank * num_workers + worker``. With ``even`` every rank gets ``N // world_size``
rows, dealt to its workers alike on every rank, so every rank yields the same number of
batches; the last ``N % world_size`` rows (fewer than ``world_size``) are *left out*.

An elastic resume deals the rest of an epoch anew: the sequence of the next *generation* is,
stream by stream, the rows each stream of the old deal had not delivered (then its left-out
rows), each a piece whose "split" is the old stream; a new stream reads them in the old
streams' order. So a plan is a chain of deals, and a position in any stream is one integer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from ..base.arrays import IntArray
from ..checkpoint.schema import Generation

__all__ = [
    "Deal",
    "EpochPlan",
    "Pieces",
    "Position",
    "splitmix64",
]

Position = int  # a stream's position: rows of its share delivered


_FIELDS = ("splits", "lo", "hi")


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
    def empty(cls) -> Pieces:
        return cls.of([])

    @classmethod
    def of(cls, items: Sequence[tuple[int, int, int]]) -> Pieces:
        """Pieces from ``(split, lo, hi)`` triples."""
        arrays = np.array(items, dtype=np.int64).reshape(-1, 3).T
        return cls(arrays[0], arrays[1], arrays[2])

    @classmethod
    def whole(cls, splits: IntArray, split_rows: IntArray) -> Pieces:
        """Splits ``splits``, whole, in that order."""
        return cls(splits, np.zeros(len(splits), dtype=np.int64), split_rows[splits])

    @classmethod
    def concat(cls, parts: Sequence[Pieces]) -> Pieces:
        """``parts`` one after another."""
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in _FIELDS))

    def take(self, index: slice | IntArray) -> Pieces:
        return Pieces(self.splits[index], self.lo[index], self.hi[index])

    def coalesced(self) -> Pieces:
        """Runs of pieces that continue each other (one split, one's ``hi`` the next's ``lo``)
        as one piece each."""
        first = np.ones(len(self), dtype=bool)
        first[1:] = (self.splits[1:] != self.splits[:-1]) | (self.lo[1:] != self.hi[:-1])
        last = np.append(first[1:], True)[: len(self)]
        return Pieces(self.splits[first], self.lo[first], self.hi[last])

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

    @cached_property
    def total(self) -> int:
        """Rows of the concatenation (computed once)."""
        return int(self.ends[-1]) if len(self) else 0


def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        z = x * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


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
    """One epoch's deal to ``world_size * num_workers`` streams.

    A first deal shares the epoch's split order; a later one (``previous``) shares the rows the
    previous deal's streams had not delivered. ``skips``: rows of the sequence an earlier deal
    cut mid-document, with their tokens already delivered.
    """

    epoch: int
    world_size: int
    num_workers: int  # streams per rank (at least 1)
    even: bool
    deal: Deal
    previous: EpochPlan | None = None
    skips: Mapping[int, int] = field(default_factory=dict)
    generation: Generation | None = field(default=None, compare=False)  # previous's ends

    @classmethod
    def first(
        cls,
        *,
        epoch: int,
        sequence: Pieces,
        world_size: int,
        num_workers: int,
        even: bool,
    ) -> EpochPlan:
        workers = max(1, num_workers)
        dealt = deal(sequence, world_size=world_size, num_workers=workers, even=even)
        return cls(epoch, world_size, workers, even, dealt)

    def then(self, generation: Generation, *, world_size: int, num_workers: int,
             even: bool) -> EpochPlan:  # fmt: skip
        """The rows this deal's streams had not delivered at ``generation``, dealt anew.

        Unless every stream had finished (the epoch is over: its left-out rows stay out), the
        old left-out rows come last, as stream ``streams`` of this deal: a chain of elastic
        resumes leaves out only what its last deal leaves out.
        """
        streams = self.deal.streams
        ids = np.arange(streams + 1, dtype=np.int64)
        lo = np.concatenate((generation.positions, [0]))
        shares = self.deal.shares
        over = bool((generation.positions >= shares).all())
        hi = np.concatenate((shares, [0 if over else self.deal.left_out().total]))
        keep = hi > lo
        sequence = Pieces(ids[keep], lo[keep], hi[keep])
        workers = max(1, num_workers)
        dealt = deal(sequence, world_size=world_size, num_workers=workers, even=even)
        starts = sequence.ends - sequence.rows
        skips: dict[int, int] = {}
        tokens = np.concatenate((generation.tokens, [0]))
        for start, g, first in zip(starts.tolist(), ids[keep].tolist(), lo[keep].tolist(),
                                   strict=True):  # fmt: skip
            cut = int(tokens[g])  # the old stream's next row, partly delivered
            if cut:
                skips[start] = cut
            for row, count in self.stream_skips(g).items():
                if row > first or (row == first and not cut):
                    skips[start + row - first] = count
        return EpochPlan(
            self.epoch, world_size, workers, even, dealt, previous=self,
            skips=MappingProxyType(skips), generation=generation,
        )  # fmt: skip

    def stream_share(self, stream: int) -> Pieces:
        """The pieces stream ``stream`` reads, in order (``streams``: the left-out rows)."""
        if stream == self.deal.streams:
            return self.deal.left_out()
        return self.deal.share(stream)

    def stream_skips(self, stream: int) -> dict[int, int]:
        """``skips`` as rows of stream ``stream``'s share."""
        if not self.skips:
            return {}
        bounds = self.deal.start(np.array([stream, stream + 1], dtype=np.int64)).tolist()
        if stream == self.deal.streams:
            bounds = [bounds[0], self.deal.sequence.total]
        lo, hi = bounds
        return {row - lo: tokens for row, tokens in self.skips.items() if lo <= row < hi}

    def rank_shares(self, rank: int) -> IntArray:
        """Rows each worker stream of ``rank`` reads."""
        return self.deal.shares_of(rank * self.num_workers, self.num_workers)
