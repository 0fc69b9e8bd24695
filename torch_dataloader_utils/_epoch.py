"""One epoch as values: where an iteration starts, each stream's position, the state it makes.

``Epochs`` holds what never changes for a dataset (the index, the options, the rank) and turns
values into values: a ``Start`` (fresh, or decoded from a checkpoint) into the ``Progress`` of an
iteration for a given ``num_workers``, a ``Progress`` into a state dict, a ``Start`` into the
number of batches. Nothing here reads files.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._config import DatasetConfig
from ._errors import InvalidStateError
from ._index import DatasetIndex
from ._interleave import counts_at, stream_counts, stream_index, stream_row, window_start
from ._plan import Consumed, EpochPlan, IntArray, Pieces, epoch_order
from ._state import (
    Cuts,
    Settings,
    check_setting,
    decode,
    decode_cuts,
    encode,
    merge_states,
    misplaced,
    stored_split,
)
from ._tokens import TokenPosition

__all__ = ["Epochs", "Progress", "Start"]


@dataclass(frozen=True, kw_only=True)
class Start:
    """Where the next iteration begins: nothing delivered, or a checkpoint's progress."""

    epoch: int
    base: Consumed
    delivered: Consumed
    cuts: Cuts = field(default_factory=dict)  # packed rows partly delivered: tokens
    cursor: int = 0
    checkpoint_workers: int | None = None  # the num_workers to hold the checkpoint to
    checkpoint_split: str = ""

    @classmethod
    def fresh(cls, epoch: int, num_splits: int) -> Start:
        nothing = Consumed.nothing(num_splits)
        return cls(epoch=epoch, base=nothing, delivered=nothing)

    @property
    def is_fresh(self) -> bool:
        """Whether an iteration from here starts the epoch from its beginning."""
        return self.checkpoint_workers is None and self.delivered.is_empty() and not self.cuts


@dataclass
class Progress:
    """Delivery in one epoch: rows of its share each worker stream has handed out (for a
    packed stream a ``TokenPosition``: also the tokens of its next row), and the rows of each
    share that an earlier iteration cut mid-document (``skips``: row of the share -> tokens)."""

    plan: EpochPlan
    settings: Settings
    shares: Mapping[int, Pieces]
    positions: dict[int, int] = field(default_factory=dict)
    skips: dict[int, dict[int, int]] = field(default_factory=dict)
    cursor: int = 0
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def delivered(self, split_rows: IntArray) -> Consumed:
        """Base, the rows ``even_batches`` left out, and every stream's delivered rows.

        What lies before each stream's current window changes only when a window ends, so it is
        kept between calls: a call costs the windows in progress, not the epoch; and a stream's
        window is recomputed only when its position moved (one stream per batch handed out).
        """
        settled: dict[int, int] = {}
        moving = [Pieces.empty()]
        for worker, position in self.positions.items():
            settled[worker], part = self._window(worker, int(position))
            moving.append(part)
        return self._settled(settled, split_rows).plus(Pieces.concat(moving), split_rows)

    def _window(self, worker: int, position: int) -> tuple[int, Pieces]:
        """The first piece of stream ``worker``'s window at ``position``, and the rows of the
        window delivered by then (kept until the stream moves)."""
        kept = self._cache.get(("window", worker))
        if kept is not None and kept[0] == position:
            return kept[1], kept[2]
        pieces = self.shares[worker]
        ends = pieces.ends
        first = window_start(ends, self.settings.window, position)
        part = pieces.take(slice(first, first + self.settings.window))
        if len(part):
            counts = counts_at(part.rows, position - int(ends[first] - part.rows[0]))
            taken = np.flatnonzero(counts)
            part = Pieces(part.splits[taken], part.lo[taken], part.lo[taken] + counts[taken])
        self._cache["window", worker] = (position, first, part)
        return first, part

    def _settled(self, firsts: dict[int, int], split_rows: IntArray) -> Consumed:
        """Base, left-out rows and every piece before each stream's window ``firsts[worker]``."""
        key = tuple(sorted(firsts.items()))
        if self._cache.get("settled_key") != key:
            before = [self.shares[w].take(slice(0, first)) for w, first in firsts.items()]
            pieces = Pieces.concat([self.plan.deal.left_out(), *before])
            self._cache["settled"] = self.plan.base.plus(pieces, split_rows)
            self._cache["settled_key"] = key
        settled: Consumed = self._cache["settled"]
        return settled

    def left_out(self) -> int:
        return int(self.plan.deal.left_out().rows.sum())

    def cuts(self) -> Cuts:
        """Rows partly delivered, to the token: each stream's next row, and the rows cut
        before that it has not reached."""
        cuts = {}
        for worker, position in self.positions.items():
            # A row cut before and not passed yet, the next one included: a batch may end just
            # before it (position ``(row, 0)``), its delivered tokens still to be skipped.
            later = {i: n for i, n in self.skips.get(worker, {}).items() if i >= position}
            if isinstance(position, TokenPosition) and position.tokens:
                later[position] = position.tokens  # at least the skip: tokens count from 0
            for row, count in later.items():
                cuts[self._split_row(worker, row)] = count
        return cuts

    def _split_row(self, worker: int, position: int) -> tuple[int, int]:
        """The split, and its row, that stream ``worker`` delivers as its row ``position``."""
        pieces = self.shares[worker]
        piece, row = stream_row(pieces.rows, pieces.ends, self.settings.window, position)
        return int(pieces.splits[piece]), int(pieces.lo[piece]) + row


@dataclass(frozen=True, kw_only=True)
class Epochs:
    """The pure part of a dataset: plans, positions and states for its index and options."""

    index: DatasetIndex
    config: DatasetConfig
    rank: int
    world_size: int
    even_batches: bool

    def settings(self, num_workers: int) -> Settings:
        config = self.config
        return Settings(
            format=config.format,
            split_bytes=config.split_bytes,
            shuffle=config.shuffle,
            shuffle_seed=config.shuffle_seed,
            window=config.window,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=num_workers,
            even_batches=self.even_batches,
            packing=None if config.packing is None else config.packing.setting,
        )

    def plan(self, start: Start, num_workers: int) -> EpochPlan:
        config = self.config
        return EpochPlan.build(
            epoch=start.epoch,
            order=epoch_order(
                len(self.index.splits), config.shuffle_seed, start.epoch, config.shuffle
            ),
            base=start.base,
            split_rows=self.index.split_rows,
            world_size=self.world_size,
            num_workers=num_workers,
            even=self.even_batches,
        )

    def batches(self, start: Start, num_workers: int) -> int:
        """Batches this rank yields in the epoch ``start`` belongs to."""
        rows = self.plan(start, num_workers).rank_shares(self.rank)
        size = self.config.batch_size
        per_stream = rows // size if self.config.drop_last else -(-rows // size)
        return int(per_stream.sum())

    def begin(
        self, start: Start, num_workers: int, workers: Iterable[int] | None = None
    ) -> Progress:
        """Progress at ``start`` for ``workers`` (all by default); mismatch if it does not fit."""
        if start.checkpoint_workers is not None:
            check_setting(
                "num_workers", start.checkpoint_workers, num_workers, start.checkpoint_split
            )
        settings = self.settings(num_workers)
        if not 0 <= start.cursor < settings.streams_per_rank:
            raise InvalidStateError(
                f"state key 'cursor' is {start.cursor}, but there are "
                f"{settings.streams_per_rank} worker stream(s): the state is corrupted"
            )
        plan = self.plan(start, num_workers)
        every = range(settings.streams_per_rank)
        shares = {w: plan.stream(settings.world(w)) for w in every}
        progress = Progress(plan, settings, shares, cursor=start.cursor)
        for worker, pieces in shares.items():
            progress.positions[worker] = self._position(pieces, start.delivered, settings, worker)
        progress.skips = self._skips(shares, start, settings)
        for worker, skips in progress.skips.items():
            position = progress.positions[worker]
            if position in skips:
                progress.positions[worker] = TokenPosition(position, skips[position])
        rows = self.index.split_rows
        claimed = start.delivered.union(plan.base, rows).plus(plan.deal.left_out(), rows)
        stray = _first_difference(claimed, progress.delivered(rows), self.index)
        if stray is not None:
            raise misplaced(stray, settings, None)
        if workers is not None:
            progress.positions = {w: progress.positions[w] for w in workers}
        return progress

    def _position(
        self, pieces: Pieces, delivered: Consumed, settings: Settings, worker: int
    ) -> int:
        """Rows of ``pieces`` that ``delivered`` holds, if they are a position of the stream."""
        full = delivered.done[pieces.splits]
        got = np.where(full, pieces.rows, 0)
        partial = np.flatnonzero(~full & np.isin(pieces.splits, list(delivered.partial)))
        for i in partial.tolist():
            split, lo, hi = int(pieces.splits[i]), int(pieces.lo[i]), int(pieces.hi[i])
            inside = [(max(a, lo), min(b, hi)) for a, b in delivered.partial[split]]
            inside = [(a, b) for a, b in inside if b > a]
            if len(inside) > 1 or (inside and inside[0][0] != lo):  # not a prefix of the piece
                raise misplaced(self.index.describe(split), settings, worker)
            got[i] = inside[0][1] - lo if inside else 0
        position = int(got.sum())
        expected = stream_counts(pieces.rows, settings.window, position)
        if not np.array_equal(got, expected):
            late = int(pieces.splits[int(np.argmax(got != expected))])
            raise misplaced(self.index.describe(late), settings, worker)
        return position

    def _skips(
        self, shares: Mapping[int, Pieces], start: Start, settings: Settings
    ) -> dict[int, dict[int, int]]:
        """Where each stream meets the rows ``start`` cut mid-document: row of share -> tokens.

        A checkpoint of this rank names only rows of its own streams, at or after their
        positions; an elastic start names every old rank's, each met by one stream of the job.
        """
        if not start.cuts:
            return {}
        by_split: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for (split, row), count in start.cuts.items():
            by_split[split].append((row, count))
        wanted = np.fromiter(by_split, dtype=np.int64)
        skips: dict[int, dict[int, int]] = {}
        met = set()
        for worker, pieces in shares.items():
            for i in np.flatnonzero(np.isin(pieces.splits, wanted)).tolist():
                split, lo, hi = int(pieces.splits[i]), int(pieces.lo[i]), int(pieces.hi[i])
                for row, count in by_split[split]:
                    if lo <= row < hi:
                        at = stream_index(pieces.rows, pieces.ends, settings.window, i, row - lo)
                        skips.setdefault(worker, {})[at] = count
                        met.add((split, row))
        if start.checkpoint_workers is not None and len(met) != len(start.cuts):
            split, row = min(set(start.cuts) - met)
            raise misplaced(f"{self.index.describe(split)} row {row}", settings, None)
        return skips

    def encode(self, progress: Progress) -> dict[str, Any]:
        """The state dict of ``progress``."""
        return encode(
            epoch=progress.plan.epoch,
            delivered=progress.delivered(self.index.split_rows),
            base=progress.plan.base,
            cursor=progress.cursor,
            index=self.index,
            settings=progress.settings,
            cuts=progress.cuts(),
        )

    def encode_start(self, start: Start, num_workers: int) -> dict[str, Any]:
        """The state dict of an iteration that has not begun."""
        if start.cuts:  # only this rank's: an elastic start holds every rank's
            return self.encode(self.begin(start, num_workers))
        return encode(
            epoch=start.epoch,
            delivered=start.delivered,
            base=start.base,
            cursor=start.cursor,
            index=self.index,
            settings=self.settings(num_workers),
        )

    def load(self, state: Mapping[str, Any], num_workers: int | None) -> Start:
        """The start a checkpoint describes, validated against the files and settings."""
        workers = state.get("_num_workers", 0) if num_workers is None else num_workers
        delivered, base = decode(state, index=self.index, settings=self.settings(workers))
        return Start(
            epoch=state["epoch"],
            base=base,
            delivered=delivered,
            cuts=decode_cuts(state, self.index, delivered),
            cursor=int(state["cursor"]),
            checkpoint_workers=state["_num_workers"],
            checkpoint_split=stored_split(state),
        )

    def load_elastic(self, states: Sequence[Mapping[str, Any]], num_workers: int) -> Start:
        """A start that re-deals what every old rank's state had not delivered."""
        epoch, delivered, cuts = merge_states(
            states, index=self.index, settings=self.settings(num_workers)
        )
        return Start(epoch=epoch, base=delivered, delivered=delivered, cuts=cuts)


def _first_difference(claimed: Consumed, implied: Consumed, index: DatasetIndex) -> str | None:
    """The first split whose delivered rows the state claims differently from what the
    streams' positions imply, described with both; ``None`` when they agree."""
    differ = claimed.done != implied.done
    splits = set(np.flatnonzero(differ).tolist())
    splits |= {s for s in set(claimed.partial) | set(implied.partial)
               if claimed.partial.get(s) != implied.partial.get(s)}  # fmt: skip
    if not splits:
        return None
    split = min(splits)

    def rows(consumed: Consumed) -> str:
        if consumed.done[split]:
            return "all rows"
        return "rows " + (
            ", ".join(f"[{a}, {b})" for a, b in consumed.partial.get(split, ())) or "none"
        )

    return f"{index.describe(split)} ({rows(claimed)} delivered, positions imply {rows(implied)})"
