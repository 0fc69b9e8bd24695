"""Pure: a shuffled epoch's sequence, and the order in which a stream delivers its share.

The sequence is every split cut into blocks of units (row groups / record batches) in a keyed
random order, so a stream's share (a run of it) is blocks from all over the dataset. A stream
takes its share in storage order and cuts it into *blocks*: runs of consecutive small units of
about 1/64 of a window, a unit longer than 1/24 of a window sliced into near-equal *parts*. The
blocks are dealt to ``ceil(rows / window_rows)`` *windows*, stratified: each run of as many
consecutive units as there are windows gives every window the first part of one of them, in a
keyed random order, and a unit's later parts go to the windows after that one (cyclically). So
each window holds blocks from all over the share (many splits, at random places inside them),
the windows are alike, and a sliced unit's parts are needed by consecutive windows, which lets
the reader decode it once. A window's rows (its blocks in storage order, concatenated) are
delivered in a keyed random permutation.

Everything is integer arithmetic of our own (xxhash, splitmix64, ``planning.bijection``),
so every platform and numpy version computes the same order, and every worker, rank and resumed
job recomputes it from ``(shuffle_seed, epoch, files, settings)`` without communication.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import xxhash

from ..base.arrays import IntArray
from ..index.index import DatasetIndex
from .bijection import (
    permutation,
    permuted,
    permuted_by,
    round_ints,
    round_keys,
    splitmix64_int,
    walk,
)
from .plan import EpochPlan, Pieces, splitmix64

__all__ = [
    "BLOCKS_PER_WINDOW",
    "Shuffle",
    "ShuffledShare",
    "StreamOrder",
    "cut_blocks",
    "shuffled_sequence",
]

# A window holds about this many blocks when the share needs more than one window: a batch,
# drawn from the whole window, then samples that many places of the share.
BLOCKS_PER_WINDOW = 64
# A share that fits one window is still cut into up to this many, of at least _SPLIT_ROWS rows
# each: the next window is read while one is handed out, so only the first one makes a stream
# wait (a window of 256 Ki rows keeps a batch of 1,024 rows' storage neighbours below 0.4 %).
_MIN_WINDOWS = 4
_SPLIT_ROWS = 1 << 18
# A unit is never sliced into parts shorter than this (slices re-decode what precedes them).
_MIN_SLICE_ROWS = 256
# A unit longer than 1/_MIN_PLACES of a window is sliced into parts of at most that, so a
# window holds at least about _MIN_PLACES places of the share, however long its units. A
# unit's parts go to consecutive windows and the reader carries the next windows' parts of
# the units it decodes (a window's rows at most), so a unit is decoded about once: more
# places would need more parts per unit, so more carried rows or more decoding.
_MIN_PLACES = 24
# A shuffled epoch's sequence is cut into at least about this many blocks (units allowing).
_SEQUENCE_BLOCKS = 4096
# Blocks a stream's share deals to its windows in Python ints, at most (numpy costs more on a
# few values: a small source of a mixture of many).
_FEW_BLOCKS = 16


def _stream_key(seed: int, epoch: int, tag: str) -> int:
    """The 64-bit key of one stream's order in one epoch (``tag`` names the stream)."""
    return int(xxhash.xxh64_intdigest(f"{seed}:{epoch}:{tag}".encode()))


def cut_blocks(
    pieces: Pieces, unit_starts: Callable[[int], IntArray], block_rows: int, part_rows: int
) -> tuple[Pieces, IntArray]:
    """``pieces`` cut into blocks on unit boundaries, and the part number of each block.

    ``unit_starts(split)``: the first row of each unit of the split, relative to the split.
    Consecutive units of a piece starting within the same ``block_rows`` of it make one block
    (less than ``2 * block_rows`` rows). A unit longer than ``part_rows`` (at least
    ``block_rows``) is sliced into near-equal *parts* of at most ``max(part_rows,
    _MIN_SLICE_ROWS)`` rows, each a block of its own, numbered ``0, 1, ...`` from the unit's
    start; every other block is numbered 0. Vectorised over the pieces: one stream's plan
    costs a look-up per piece, not Python per unit.
    """
    if not len(pieces):
        return Pieces.empty(), np.zeros(0, dtype=np.int64)
    count = len(pieces)
    inner, owner = [], []
    for number, (split, lo, hi) in enumerate(
        zip(pieces.splits.tolist(), pieces.lo.tolist(), pieces.hi.tolist(), strict=True)
    ):
        starts = unit_starts(split)
        if len(starts) > 1:  # a split of one unit has no boundary inside
            starts = starts[(starts > lo) & (starts < hi)]
            inner.append(starts)
            owner.append(np.full(len(starts), number, dtype=np.int64))
    ids = np.arange(count, dtype=np.int64)
    piece = np.concatenate([ids, *owner])
    edge = np.concatenate([pieces.lo, *inner])
    order = np.lexsort((edge, piece))
    piece, edge = piece[order], edge[order]
    # units of each piece: from each edge to the next one of the piece, or to the piece's end
    end = np.append(edge[1:], 0)
    last = np.append(piece[1:] != piece[:-1], True)
    end[last] = pieces.hi[piece[last]]
    length = end - edge
    block_rows = max(1, block_rows)
    parts = -(-length // max(part_rows, block_rows, _MIN_SLICE_ROWS))
    which = np.repeat(np.arange(len(edge), dtype=np.int64), parts)
    nth = np.arange(len(which), dtype=np.int64) - np.repeat(np.cumsum(parts) - parts, parts)
    start = edge[which] + nth * length[which] // parts[which]
    owner_of = piece[which]
    sliced = parts[which] > 1
    group = (start - pieces.lo[owner_of]) // block_rows
    first = np.ones(len(start), dtype=bool)
    first[1:] = (
        (owner_of[1:] != owner_of[:-1]) | (group[1:] != group[:-1]) | sliced[1:] | sliced[:-1]
    )
    lo = start[first]
    block_piece = owner_of[first]
    hi = np.append(lo[1:], 0)
    ends = np.append(block_piece[1:] != block_piece[:-1], True)
    hi[ends] = pieces.hi[block_piece[ends]]
    return Pieces(pieces.splits[block_piece], lo, hi), nth[first]


def shuffled_sequence(index: DatasetIndex, window_rows: int, seed: int, epoch: int) -> Pieces:
    """A shuffled epoch's sequence: every split cut into blocks on unit boundaries (the units
    starting in the same ``block_rows`` of the split; a longer unit a block of its own), all
    in a keyed random order.

    The sequence is dealt to the streams in runs, so a stream's share is blocks from all over
    the dataset, whatever the number of streams: never a few whole splits (one large file read
    by two workers: each its half). A block is about 1/64 of a window, and at most 1/4,096 of
    the dataset, so a share of one window still samples the whole of it.
    """
    split, start = index.units()
    if not len(split):
        return Pieces.empty()
    total = int(index.split_rows.sum())
    block_rows = max(1, min(window_rows // BLOCKS_PER_WINDOW, total // _SEQUENCE_BLOCKS))
    first = np.ones(len(split), dtype=bool)
    group = start // block_rows
    first[1:] = (split[1:] != split[:-1]) | (group[1:] != group[:-1])
    del group  # the sequence of 10^7 splits is the largest thing a rank plans: keep it lean
    splits, lo = split[first], start[first]
    del split, start, first
    hi = np.empty_like(lo)
    hi[:-1] = lo[1:]
    last = np.append(splits[1:] != splits[:-1], True)
    hi[last] = index.split_rows[splits[last]]
    order = permutation(len(lo), _stream_key(seed, epoch, "sequence"))
    return Pieces(splits[order], lo[order], hi[order])


def _stratified(count: int, windows: int, key: int) -> IntArray:
    """The window of each of ``count`` blocks: every run of ``windows`` consecutive blocks
    gives each window one block, in a keyed random order, so every window samples the whole
    share evenly."""
    if windows <= 1:  # one window: no keys to draw
        return np.zeros(count, dtype=np.int64)
    if count <= _FEW_BLOCKS:  # the same arithmetic on Python ints (as ``permuted``)
        rounds = round_ints.__wrapped__  # not cached: a key of each stratum, used once
        return np.array(
            [
                permuted_by(n % windows, windows, rounds(splitmix64_int(n // windows + key)))
                for n in range(count)
            ],
            dtype=np.int64,
        )
    stratum, place = np.divmod(np.arange(count, dtype=np.int64), windows)
    keys = splitmix64(stratum.astype(np.uint64) + np.uint64(key))
    window: IntArray = walk(place.astype(np.uint32), windows, round_keys(keys)).astype(np.int64)
    return window


@dataclass(frozen=True)
class ShuffledShare:
    """One stream's share in its shuffled order: ``blocks`` in delivery order, cut into windows.

    Window ``w`` holds ``blocks[bounds[w]:bounds[w + 1]]`` and ends after row ``ends[w]`` of
    the stream; its rows are delivered in ``permutation(rows, window_key(w))`` order.
    """

    blocks: Pieces
    bounds: IntArray
    key: int

    @classmethod
    def build(
        cls,
        share: Pieces,
        *,
        unit_starts: Callable[[int], IntArray],
        window_rows: int,
        key: int,
    ) -> ShuffledShare:
        # the share in storage order (adjacent blocks of the sequence as one piece), so the
        # stratified deal makes the windows alike and cuts blocks as if the share were whole
        share = share.take(np.lexsort((share.lo, share.splits))).coalesced()
        total = share.total
        windows = max(1, -(-total // window_rows), min(_MIN_WINDOWS, total // _SPLIT_ROWS))
        # One window: every row meets every other, blocks do not matter; else enough of them.
        block_rows = total if windows == 1 else max(1, total // windows // BLOCKS_PER_WINDOW)
        part_rows = total if windows == 1 else max(1, total // windows // _MIN_PLACES)
        blocks, part = cut_blocks(share, unit_starts, block_rows, part_rows)
        home_of = np.cumsum(part == 0) - 1  # the number of each block's first part among them
        homes = int(np.count_nonzero(part == 0))
        largest = int(blocks.rows.max()) if len(blocks) else 0
        while True:
            # a unit's parts go to consecutive windows, from the one its first part is dealt
            window = (_stratified(homes, windows, key)[home_of] + part) % windows
            sizes = np.bincount(window, weights=blocks.rows, minlength=windows)
            # a window may pass its rows by less than a block (the memory bound the docs state)
            if windows >= len(blocks) or sizes.max() <= window_rows + largest:
                break
            windows += 1
        blocks = blocks.take(np.argsort(window, kind="stable"))
        counts = np.bincount(window, minlength=windows)
        bounds = np.concatenate(([0], np.cumsum(counts[counts > 0])))
        return cls(blocks, bounds.astype(np.int64), key)

    @cached_property
    def ends(self) -> IntArray:
        """The stream row after each window."""
        ends: IntArray = (
            self.blocks.ends[self.bounds[1:] - 1]
            if len(self.blocks)
            else np.zeros(0, dtype=np.int64)
        )
        return ends

    def window_at(self, position: int) -> int:
        """The window holding stream row ``position`` (the last one at the end)."""
        return max(0, min(bisect.bisect_right(self._ends, position), len(self._ends) - 1))

    @cached_property
    def _ends(self) -> list[int]:
        """``ends`` as ints: a state looks a row up in them at every call."""
        ends: list[int] = self.ends.tolist()
        return ends

    def row_at(self, position: int) -> tuple[int, int]:
        """The split, and its row, delivered as stream row ``position``."""
        number = self.window_at(position)
        kept = self._kept_rows
        if kept[0] != number:  # the window's blocks as ints: a state looks a row up every step
            blocks, begin, key = self.window(number)
            starts = blocks.ends - blocks.hi + blocks.lo  # each block's first row in the window
            kept[:] = number, begin, key, blocks.total, blocks.ends.tolist(), starts.tolist()
            kept += blocks.lo.tolist(), blocks.splits.tolist()
        _, begin, key, total, ends, starts, lo, splits = kept
        row = permuted(position - begin, total, key)
        block = bisect.bisect_right(ends, row)
        return splits[block], lo[block] + row - starts[block]

    @cached_property
    def _kept_rows(self) -> list[Any]:
        """``[window, its first stream row, key, rows, then its blocks' ends, first rows, lo,
        splits as lists]`` of the window ``row_at`` last looked in."""
        return [-1]

    def window(self, number: int) -> tuple[Pieces, int, int]:
        """Window ``number``: its blocks in storage order, its first stream row, its key (the
        last one asked for is kept: ``state_dict`` asks for the same window every step)."""
        kept = self._kept.get(number)
        if kept is None:
            part = self.blocks.take(slice(int(self.bounds[number]), int(self.bounds[number + 1])))
            order = np.lexsort((part.lo, part.splits))
            begin = int(self.ends[number - 1]) if number else 0
            kept = part.take(order), begin, splitmix64_int(self.key + number + 1)
            self._kept.clear()
            self._kept[number] = kept
        return kept

    @cached_property
    def _kept(self) -> dict[int, tuple[Pieces, int, int]]:
        return {}


@dataclass(frozen=True, kw_only=True)
class Shuffle:
    """How shuffled streams order their shares: the seed and the rows of a window."""

    seed: int
    window_rows: int


@dataclass(frozen=True, kw_only=True)
class StreamOrder:
    """Which rows stream ``stream`` of ``plan`` delivers, and in which order.

    A first deal's stream delivers its pieces of splits in order, or shuffled (``shuffled``);
    a later deal's stream delivers pieces of the previous deal's streams, each in its order
    (``older``). Stream ``plan.deal.streams`` stands for the rows the deal left out, in order.
    """

    index: DatasetIndex
    plan: EpochPlan
    stream: int
    shuffle: Shuffle | None

    @cached_property
    def pieces(self) -> Pieces:
        """The share: pieces of splits, or of the previous deal's streams."""
        return self.plan.stream_share(self.stream)

    @cached_property
    def shuffled(self) -> ShuffledShare | None:
        """The shuffled order of a first deal's stream; ``None``: its pieces in order."""
        plan, shuffle = self.plan, self.shuffle
        if shuffle is None or plan.previous is not None or self.stream == plan.deal.streams:
            return None
        return ShuffledShare.build(
            self.pieces,
            unit_starts=self.index.unit_starts,
            window_rows=shuffle.window_rows,
            key=_stream_key(shuffle.seed, plan.epoch, f"{plan.world_size}x{plan.num_workers}/"
                           f"{self.stream}"),
        )  # fmt: skip

    @property
    def total(self) -> int:
        return self.pieces.total

    def older(self, stream: int) -> StreamOrder:
        """Stream ``stream`` of the previous deal, whose rest this stream was dealt."""
        assert self.plan.previous is not None
        return replace(self, plan=self.plan.previous, stream=stream)

    def row_at(self, position: int) -> tuple[int, int] | None:
        """The split, and its row, the stream delivers as its row ``position`` (``None`` at the
        end): what a checkpoint's position stands for, by content."""
        if position >= self.total:
            return None
        if self.shuffled is not None:
            return self.shuffled.row_at(position)
        number, offset = self._piece_at(position)
        if self.plan.previous is None:
            return int(self.pieces.splits[number]), offset
        return self.older(int(self.pieces.splits[number])).row_at(offset)

    def describe_at(self, position: int) -> str:
        """The split(s) the rows just before ``position`` come from (a shuffle window: all)."""
        if not len(self.pieces):
            return "an empty share"
        position = min(max(0, position - 1), self.total - 1)
        if self.shuffled is not None:
            blocks = self.shuffled.window(self.shuffled.window_at(position))[0]
            splits = list(dict.fromkeys(blocks.splits.tolist()))
            names = ", ".join(self.index.describe(s) for s in splits[:3])
            if len(splits) == 1:
                return names
            more = " ..." if len(splits) > 3 else ""
            return f"one of {len(splits)} splits of a shuffle window: {names}{more}"
        number, offset = self._piece_at(position)
        if self.plan.previous is None:
            return self.index.describe(int(self.pieces.splits[number]))
        return self.older(int(self.pieces.splits[number])).describe_at(offset + 1)

    def _piece_at(self, position: int) -> tuple[int, int]:
        """The piece holding stream row ``position``, and that row's place in the piece's
        split (or old stream)."""
        pieces = self.pieces
        number = int(np.searchsorted(pieces.ends, position, side="right"))
        begin = int(pieces.ends[number] - pieces.rows[number])
        return number, int(pieces.lo[number]) + position - begin
