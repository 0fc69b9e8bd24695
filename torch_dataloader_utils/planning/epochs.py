"""One epoch as values: where an iteration starts, each stream's position, the state it makes.

``Epochs`` holds what never changes for a dataset (the index, the options, the rank) and turns
values into values: a ``Start`` (fresh, or decoded from a checkpoint) into the ``Progress`` of an
iteration for a given ``num_workers``, a ``Progress`` into a state dict, a ``Start`` into the
number of batches. Nothing here reads files.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa

from ..base.errors import InvalidStateError
from ..checkpoint.checks import check_setting, misplaced
from ..checkpoint.files import stored_split
from ..checkpoint.merge import merge_states
from ..checkpoint.schema import Decoded, Generation, Settings, StreamEntry
from ..checkpoint.state import decode, encode
from ..index.index import DatasetIndex
from .config import DatasetConfig
from .order import Shuffle, StreamOrder, shuffled_sequence
from .plan import EpochPlan, Pieces
from .tokens import TokenPosition

__all__ = ["Epochs", "Progress", "Start"]


@dataclass(frozen=True, kw_only=True)
class Start:
    """Where the next iteration begins: the epoch's earlier deals (elastic resumes) and, for a
    checkpoint, the position of each of this rank's streams (``None``: their beginnings)."""

    epoch: int
    generations: tuple[Generation, ...] = ()
    # TokenPosition when packed; None for a stream whose progress the state does not hold
    positions: tuple[int | None, ...] | None = None
    cursor: int = 0
    checkpoint_workers: int | None = None  # the num_workers to hold the checkpoint to
    checkpoint_split: str = ""

    @classmethod
    def fresh(cls, epoch: int) -> Start:
        return cls(epoch=epoch)

    @property
    def is_fresh(self) -> bool:
        """Whether an iteration from here starts the epoch from its beginning."""
        return self.positions is None and not self.generations


@dataclass
class Progress:
    """Delivery in one epoch: rows of its share each worker stream has handed out (for a
    packed stream a ``TokenPosition``: also the tokens of its next row), and the rows of each
    share an earlier deal cut mid-document (``skips``: row of the share -> tokens)."""

    plan: EpochPlan
    settings: Settings
    orders: Mapping[int, StreamOrder]
    generations: tuple[Generation, ...]
    positions: dict[int, int] = field(default_factory=dict)
    skips: dict[int, dict[int, int]] = field(default_factory=dict)
    cursor: int = 0
    _entries: dict[int, tuple[int, StreamEntry]] = field(default_factory=dict, repr=False)

    def record(self, worker: int, position: int, cursor: int) -> None:
        """Stream ``worker`` has handed out its rows up to ``position``; ``cursor`` is next."""
        self.positions[worker] = position
        self.cursor = cursor

    def entries(self) -> list[StreamEntry | None]:
        """Each stream's place, by content (kept until the stream moves); ``None`` for a stream
        this process does not iterate (a DataLoader worker's copy knows its own stream only)."""
        out: list[StreamEntry | None] = []
        for worker in range(self.settings.streams_per_rank):
            position = self.positions.get(worker)
            if position is None:
                out.append(None)
                continue
            kept = self._entries.get(worker)
            if kept is None or kept[0] != position:
                order = self.orders[worker]
                tokens = position.tokens if isinstance(position, TokenPosition) else 0
                entry = StreamEntry(int(position), tokens, order.total, order.row_at(position))
                self._entries[worker] = kept = (position, entry)
            out.append(kept[1])
        return out

    def left_out(self) -> int:
        return self.plan.deal.left_out().total

    def ended(self) -> bool:
        """Whether every stream of the rank has handed out its whole share of the epoch."""
        positions = self.positions
        return len(positions) == self.settings.streams_per_rank and all(
            int(p) >= self.orders[w].total for w, p in positions.items()
        )


@dataclass(frozen=True, kw_only=True)
class Epochs:
    """The pure part of a dataset: plans, positions and states for its index and options."""

    index: DatasetIndex
    config: DatasetConfig
    rank: int
    world_size: int
    even_batches: bool

    @property
    def schema(self) -> pa.Schema:
        """The columns of a batch (tokenized text as its tokens)."""
        return self.config.delivered(self.index.schema)

    @property
    def shuffle(self) -> Shuffle | None:
        config = self.config
        if not config.shuffle:
            return None
        return Shuffle(seed=config.shuffle_seed, window_rows=self.window_rows)

    @property
    def window_rows(self) -> int:
        return self.config.window_rows(self.index.file_row_bytes) if self.config.shuffle else 0

    def settings(self, num_workers: int) -> Settings:
        config = self.config
        return Settings(
            format=config.format,
            split_bytes=config.split_bytes,
            shuffle=config.shuffle,
            shuffle_seed=config.shuffle_seed,
            memory_bytes=config.shuffle_memory_bytes,
            window_rows=self.window_rows,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=num_workers,
            even_batches=self.even_batches,
            packing=None if config.packing is None else config.packing.setting,
            tokenize=None if config.tokenize is None else config.tokenize.setting,
            whole_documents=None if config.packing is None else config.packing.whole_setting,
            companions=None if config.packing is None else config.packing.companion_setting,
        )

    def plan(self, start: Start, num_workers: int) -> EpochPlan:
        """The deal of ``start``'s epoch to this job, after its earlier deals."""
        generations = start.generations
        first = generations[0] if generations else None
        plan = EpochPlan.first(
            epoch=start.epoch,
            sequence=self.sequence(start.epoch),
            world_size=self.world_size if first is None else first.world_size,
            num_workers=num_workers if first is None else first.num_workers,
            even=self.even_batches if first is None else first.even,
        )
        for number, generation in enumerate(generations):
            following = generations[number + 1] if number + 1 < len(generations) else None
            plan = plan.then(
                generation,
                world_size=self.world_size if following is None else following.world_size,
                num_workers=num_workers if following is None else following.num_workers,
                even=self.even_batches if following is None else following.even,
            )
        return plan

    def sequence(self, epoch: int) -> Pieces:
        """The epoch's sequence (the last one asked for is kept: ``len``, the main process
        and each forked worker ask for the same one)."""
        kept = self._sequences.get(epoch)
        if kept is None:
            index, config = self.index, self.config
            kept = (
                shuffled_sequence(index, self.window_rows, config.shuffle_seed, epoch)
                if config.shuffle
                else Pieces.whole(np.arange(len(index.splits), dtype=np.int64), index.split_rows)
            )
            self._sequences.clear()
            self._sequences[epoch] = kept
        return kept

    @cached_property
    def _sequences(self) -> dict[int, Pieces]:
        return {}

    def order(self, plan: EpochPlan, stream: int) -> StreamOrder:
        return StreamOrder(index=self.index, plan=plan, stream=stream, shuffle=self.shuffle)

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
        chosen = range(settings.streams_per_rank) if workers is None else workers
        first = self.rank * plan.num_workers
        # whole documents: the reader finds an earlier deal's delivered documents itself
        # (``reading.bestfit``); a position's tokens count sequences, never cut tokens
        whole = settings.whole_documents is not None
        progress = Progress(
            plan,
            settings,
            {w: self.order(plan, first + w) for w in chosen},
            start.generations,
            cursor=start.cursor,
        )
        for worker in chosen:
            position = 0 if start.positions is None else start.positions[worker]
            if position is None:
                raise InvalidStateError(
                    f"state key 'streams[{worker}]' is null: the state holds no position for "
                    f"worker {worker}: it was saved by another worker's copy of the dataset "
                    f"(StatefulDataLoader keeps one state per worker); load each worker's state "
                    f"in that worker, or save the state through the loader"
                )
            skips = {
                row: tokens
                for row, tokens in plan.stream_skips(first + worker).items()
                if row >= position and not whole
            }
            tokens = position.tokens if isinstance(position, TokenPosition) else 0
            if not tokens and position in skips:
                position = TokenPosition(position, skips[position])
            elif tokens:
                skips[position] = tokens
            progress.positions[worker] = position
            if skips:
                progress.skips[worker] = skips
        return progress

    def encode(self, progress: Progress) -> dict[str, Any]:
        """The state dict of ``progress``."""
        return encode(
            epoch=progress.plan.epoch,
            streams=progress.entries(),
            generations=progress.generations,
            cursor=progress.cursor,
            index=self.index,
            settings=progress.settings,
        )

    def encode_start(self, start: Start, num_workers: int) -> dict[str, Any]:
        """The state dict of an iteration that has not begun."""
        return self.encode(self.begin(start, num_workers))

    def load(self, state: Mapping[str, Any], num_workers: int | None) -> Start:
        """The start a checkpoint describes, validated against the files and settings."""
        workers = state.get("_num_workers", 0) if num_workers is None else num_workers
        settings = self.settings(workers)
        decoded = decode(state, index=self.index, settings=settings)
        start = Start(epoch=state["epoch"], generations=decoded.generations)
        positions = self._positions(start, decoded, settings, state["_num_workers"])
        return Start(
            epoch=state["epoch"],
            generations=decoded.generations,
            positions=positions,
            cursor=int(state["cursor"]),
            checkpoint_workers=state["_num_workers"],
            checkpoint_split=stored_split(state),
        )

    def load_elastic(self, states: Sequence[Mapping[str, Any]], num_workers: int) -> Start:
        """A start that deals anew what every old rank's state had not delivered."""
        first, decoded = merge_states(states, index=self.index, settings=self.settings(num_workers))
        old = Epochs(
            index=self.index,
            config=self.config,
            rank=0,
            world_size=first["_world_size"],
            even_batches=first["_even_batches"],
        )
        start = Start(epoch=first["epoch"], generations=decoded.generations)
        settings = old.settings(first["_num_workers"])
        workers = first["_num_workers"]
        positions = old._positions(start, decoded, settings, workers, every=True, check=())
        generation = Generation(
            first["_world_size"],
            workers,
            first["_even_batches"],
            np.array([int(p or 0) for p in positions], dtype=np.int64),
            np.array([getattr(p, "tokens", 0) for p in positions], dtype=np.int64),
        )
        elastic = Start(epoch=first["epoch"], generations=(*decoded.generations, generation))
        # The content of the old streams whose rest this rank reads (not every old stream's:
        # a rank's plan costs its own share)
        plan = self.plan(elastic, num_workers)
        mine = range(self.rank * plan.num_workers, (self.rank + 1) * plan.num_workers)
        read = {int(g) for w in mine for g in plan.stream_share(w).splits.tolist()}
        old._positions(start, decoded, settings, workers, every=True, check=read)
        return elastic

    def _positions(
        self,
        start: Start,
        decoded: Decoded,
        settings: Settings,
        num_workers: int,
        *,
        every: bool = False,
        check: Collection[int] | None = None,
    ) -> tuple[int | None, ...]:
        """The positions of ``decoded``'s streams, checked against the plan: this rank's
        streams, or (``every``) all streams of the job in order. Every stream's rows are
        checked; the row it hands out next, for the streams in ``check`` (default: all)."""
        plan = self.plan(start, num_workers)
        first = 0 if every else self.rank * plan.num_workers
        count = plan.deal.streams if every else plan.num_workers
        shares = plan.deal.shares_of(first, count).tolist()
        if len(decoded.streams) != count:
            raise InvalidStateError(
                f"state key 'streams' holds {len(decoded.streams)} entries, but "
                f"num_workers={num_workers} makes {count} stream(s): the state is corrupted"
            )
        positions: list[int | None] = []
        for number, entry in enumerate(decoded.streams):
            if entry is None:
                if every:
                    raise InvalidStateError(
                        f"state key 'streams[{number}]' is null (a DataLoader worker's copy of "
                        f"the dataset saved it): an elastic resume needs every stream's position"
                    )
                positions.append(None)
                continue
            stream = first + number
            checked = check is None or stream in check
            if entry.rows != shares[number] or (
                checked and entry.next_row != self.order(plan, stream).row_at(entry.position)
            ):
                where = "the end of a share"
                if entry.next_row is not None:
                    split, row = entry.next_row
                    where = f"{self.index.describe(split)} row {row}"
                raise misplaced(where, settings, stream % plan.num_workers)
            positions.append(
                TokenPosition(entry.position, entry.tokens) if entry.tokens else entry.position
            )
        return tuple(positions)
