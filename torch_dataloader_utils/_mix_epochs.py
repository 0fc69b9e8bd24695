"""A mixture's epochs as values: where each stream stands in every source, and its state.

Every stream (rank, DataLoader worker) of a mixture reads one mixed sequence of positions
``k = 0, 1, 2, ...`` that never restarts: position ``k`` reads source ``schedule.period[k % W]``
(``_schedule``), and its ``n``-th row of source ``s`` is row ``n % q`` of its share of source
epoch ``n // q``, ``q`` being its share of one epoch of ``s`` (each source is dealt to the same
streams as a dataset of its own, every row once, in the source's own shuffled order keyed by
its name). A mixture epoch is a stretch of ``L`` positions of every stream (``rows_per_epoch``
dealt to the streams): epoch ``m`` covers ``[m L, (m + 1) L)``, so a stream's position in the
epoch fixes, in closed form, every source's epoch and row. Nothing here reads files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import pyarrow as pa
import xxhash

from ._config import DatasetConfig
from ._epoch import Epochs, Progress, Start
from ._errors import CheckpointMismatchError, InvalidStateError
from ._order import StreamOrder
from ._plan import Deal, IntArray, Pieces
from ._schedule import Schedule
from ._state import (
    STATE_VERSION,
    StreamEntry,
    check_setting,
    decode,
    encode_stream,
    misplaced,
)

__all__ = ["AnyProgress", "MixedEpochs", "MixedProgress", "SourcePlace", "source_seed"]


# Stream orders a mixture keeps: a few per source and stream (its epoch and the next).
_KEPT_ORDERS = 256


def source_seed(seed: int, name: str) -> int:
    """The shuffle seed of source ``name``: its order is its own, not its neighbours'."""
    return xxhash.xxh64_intdigest(f"{seed}:{name}".encode()) >> 1


@dataclass(frozen=True)
class SourcePlace:
    """Where a stream stands in one source: that source's epoch, the stream's order in it, and
    the rows of its share there it has read."""

    epoch: int
    order: StreamOrder
    offset: int


@dataclass
class MixedProgress:
    """Delivery in one mixture epoch: positions handed out by each worker stream of this rank
    in this epoch, and the worker whose batch comes next."""

    mix: MixedEpochs
    epoch: int
    num_workers: int
    positions: dict[int, int] = field(default_factory=dict)
    cursor: int = 0
    _entries: dict[int, tuple[int, list[tuple[int, StreamEntry]]]] = field(
        default_factory=dict, repr=False
    )

    def record(self, worker: int, position: int, cursor: int) -> None:
        self.positions[worker] = position
        self.cursor = cursor

    def stream(self, worker: int) -> int:
        return self.mix.rank * max(1, self.num_workers) + worker

    def absolute(self, worker: int, position: int) -> int:
        """The stream's position in its whole mixed sequence."""
        length = int(self.mix.epoch_lengths(self.num_workers)[self.stream(worker)])
        return self.epoch * length + position

    def places(self, worker: int, position: int) -> list[SourcePlace]:
        """Where stream ``worker`` stands in each source after ``position`` rows of the epoch."""
        counts = self.mix.schedule.counts(self.absolute(worker, position))
        return [
            self.mix.place(s, self.stream(worker), int(n), self.num_workers)
            for s, n in enumerate(counts.tolist())
        ]

    def entries(self, worker: int) -> list[tuple[int, StreamEntry]]:
        """Each source's epoch and place of stream ``worker``, by content (kept until it moves)."""
        position = self.positions[worker]
        kept = self._entries.get(worker)
        if kept is None or kept[0] != position:
            entries = [
                (p.epoch, StreamEntry(p.offset, 0, p.order.total, p.order.row_at(p.offset)))
                for p in self.places(worker, position)
            ]
            self._entries[worker] = kept = (position, entries)
        return kept[1]

    def left_out(self) -> int:
        return 0  # positions carry over to the next epoch: no row of a source is left out


@dataclass(frozen=True, kw_only=True)
class MixedEpochs:
    """The pure part of a mixture: its sources' ``Epochs`` (each dealt to the job's streams,
    never evened), its schedule and the positions per epoch."""

    names: tuple[str, ...]
    sources: tuple[Epochs, ...]
    schedule: Schedule
    config: DatasetConfig
    rank: int
    world_size: int
    even_batches: bool
    rows_per_epoch: int
    source_column: str
    _orders: dict[tuple[int, int, int, int], StreamOrder] = field(
        default_factory=dict, compare=False, repr=False
    )

    @cached_property
    def schema(self) -> pa.Schema:
        """The columns of a batch: the sources' (the same in every source), then the source
        number of each row."""
        schema = self.sources[0].index.schema
        return schema.append(pa.field(self.source_column, pa.int64(), nullable=False))

    @cached_property
    def weights(self) -> dict[str, int]:
        return dict(zip(self.names, self.schedule.weights, strict=True))

    def epoch_lengths(self, num_workers: int) -> IntArray:
        """Positions of a mixture epoch, per stream of the job: ``rows_per_epoch`` dealt."""
        return _lengths(
            self.rows_per_epoch, self.world_size, max(1, num_workers), self.even_batches
        )

    def place(self, source: int, stream: int, ordinal: int, num_workers: int) -> SourcePlace:
        """Where row ``ordinal`` of source ``source`` is for stream ``stream``."""
        epoch, offset = divmod(ordinal, self.share(source, stream, num_workers))
        return SourcePlace(epoch, self.order(source, stream, epoch, num_workers), offset)

    def order(self, source: int, stream: int, epoch: int, num_workers: int) -> StreamOrder:
        """Stream ``stream``'s order in epoch ``epoch`` of ``source`` (the last few kept: a
        shuffled order costs its share's blocks)."""
        key = (source, stream, epoch, num_workers)
        order = self._orders.get(key)
        if order is None:
            epochs = self.sources[source]
            order = epochs.order(epochs.plan(Start.fresh(epoch), num_workers), stream)
            if len(self._orders) >= _KEPT_ORDERS:
                del self._orders[next(iter(self._orders))]
            self._orders[key] = order
        return order

    def share(self, source: int, stream: int, num_workers: int) -> int:
        """Rows of one epoch of ``source`` that stream ``stream`` reads (the same every epoch)."""
        rows = int(self.sources[source].index.split_rows.sum())
        deal = Deal(Pieces.of([(0, 0, rows)]), self.world_size, max(1, num_workers), False)
        share = int(deal.shares_of(stream, 1)[0])
        if share == 0:
            raise ValueError(
                f"source {self.names[source]!r} has {rows} row(s), fewer than the "
                f"{deal.streams} streams (world_size x num_workers) that each read a share of it"
            )
        return share

    def begin(
        self, start: Start, num_workers: int, workers: Iterable[int] | None = None
    ) -> MixedProgress:
        streams = max(1, num_workers)
        if start.checkpoint_workers is not None:
            check_setting(
                "num_workers", start.checkpoint_workers, num_workers, start.checkpoint_split
            )
        for s in range(len(self.sources)):  # every stream must read every source
            self.share(s, self.world_size * streams - 1, num_workers)
        progress = MixedProgress(self, start.epoch, num_workers, cursor=start.cursor)
        for worker in range(streams) if workers is None else workers:
            position = 0 if start.positions is None else start.positions[worker]
            if position is None:
                raise InvalidStateError(
                    f"the state holds no position for worker {worker}: it was saved by another "
                    f"worker's copy of the dataset; save the state through the loader"
                )
            progress.positions[worker] = int(position)
        return progress

    def batches(self, start: Start, num_workers: int) -> int:
        lengths = self.epoch_lengths(num_workers)
        streams = max(1, num_workers)
        rows = lengths[self.rank * streams : (self.rank + 1) * streams]
        size = self.config.batch_size
        per_stream = rows // size if self.config.drop_last else -(-rows // size)
        return int(per_stream.sum())

    # ----------------------------------------------------------------- states

    def encode(self, progress: MixedProgress) -> dict[str, Any]:
        streams = max(1, progress.num_workers)
        positions: list[int | None] = []
        per_source: list[list[tuple[int, StreamEntry] | None]] = [[] for _ in self.sources]
        for worker in range(streams):
            if worker not in progress.positions:
                positions.append(None)
                for entries in per_source:
                    entries.append(None)
                continue
            positions.append(progress.positions[worker])
            for s, entry in enumerate(progress.entries(worker)):
                per_source[s].append(entry)
        sources = {}
        for s, (name, epochs) in enumerate(zip(self.names, self.sources, strict=True)):
            known = next((e for e in per_source[s] if e is not None), None)
            epoch = 0 if known is None else known[0]
            sub = Progress(
                epochs.plan(Start.fresh(epoch), progress.num_workers),
                epochs.settings(progress.num_workers), {}, (),
            )  # fmt: skip
            state = epochs.encode(sub)
            state["streams"] = [
                None if e is None else encode_stream(e[1], epochs.index) for e in per_source[s]
            ]
            sources[name] = state
        return {
            "version": STATE_VERSION,
            "epoch": progress.epoch,
            "_mixture": {"weights": self.weights, "rows_per_epoch": self.rows_per_epoch},
            "_num_workers": progress.num_workers,
            "_rank": self.rank,
            "_world_size": self.world_size,
            "_even_batches": self.even_batches,
            "streams": positions,
            "cursor": progress.cursor,
            "sources": sources,
        }

    def encode_start(self, start: Start, num_workers: int) -> dict[str, Any]:
        return self.encode(self.begin(start, num_workers))

    def load(self, state: Mapping[str, Any], num_workers: int | None) -> Start:
        """The start a mixture's checkpoint describes, validated source by source."""
        _check_mixture_shape(state)
        workers = state["_num_workers"] if num_workers is None else num_workers
        split = f"of source {self.names[0]!r}"
        for name, (expected, found) in {
            "world_size": (state["_world_size"], self.world_size),
            "rank": (state["_rank"], self.rank),
            "even_batches": (state["_even_batches"], self.even_batches),
            "num_workers": (state["_num_workers"], workers),
        }.items():
            check_setting(name, expected, found, split)
        self._check_mixture(state["_mixture"], state["sources"])
        start = Start(
            epoch=state["epoch"],
            positions=tuple(state["streams"]),
            cursor=state["cursor"],
            checkpoint_workers=state["_num_workers"],
            checkpoint_split=split,
        )
        progress = self.begin(start, workers)
        for s, (name, epochs) in enumerate(zip(self.names, self.sources, strict=True)):
            sub = state["sources"][name]
            try:
                decoded = decode(sub, index=epochs.index, settings=epochs.settings(workers))
            except CheckpointMismatchError as exc:
                raise _in_source(exc, name) from exc
            self._check_places(progress, s, decoded.streams)
        return start

    def _check_mixture(self, stored: Mapping[str, Any], sources: Mapping[str, Any]) -> None:
        if list(sources) != list(self.names) or stored.get("weights") != self.weights:
            raise CheckpointMismatchError(
                f"this checkpoint's mixture is {stored.get('weights')!r}, the current one "
                f"{self.weights!r}: a position of the mixture reads other sources under other "
                f"weights or sources, so the checkpoint cannot be continued exactly."
                f"\nLikely cause: weights or sources changed: checkpoint="
                f"{stored.get('weights')!r}, current={self.weights!r}",
                split=f"mixture {list(sources)}", field="weights",
                expected=stored.get("weights"), found=self.weights,
            )  # fmt: skip
        if stored.get("rows_per_epoch") != self.rows_per_epoch:
            check_setting(
                "rows_per_epoch", stored.get("rows_per_epoch"), self.rows_per_epoch,
                f"mixture {list(sources)}",
            )  # fmt: skip

    def _check_places(
        self, progress: MixedProgress, source: int, entries: Sequence[StreamEntry | None]
    ) -> None:
        """The state's place of each stream in ``source`` is where its position puts it."""
        streams = max(1, progress.num_workers)
        if len(entries) != streams:
            raise InvalidStateError(
                f"state key 'sources.{self.names[source]}.streams' holds {len(entries)} "
                f"entries for {streams} stream(s): the state is corrupted"
            )
        for worker, entry in enumerate(entries):
            if entry is None or worker not in progress.positions:
                continue
            place = progress.places(worker, progress.positions[worker])[source]
            if (entry.position, entry.rows, entry.next_row) != (
                place.offset,
                place.order.total,
                place.order.row_at(place.offset),
            ):
                index = self.sources[source].index
                where = "the end of a share"
                if entry.next_row is not None:
                    where = f"{index.describe(entry.next_row[0])} row {entry.next_row[1]}"
                settings = self.sources[source].settings(progress.num_workers)
                raise _in_source(misplaced(where, settings, worker), self.names[source])


def _lengths(rows: int, world_size: int, workers: int, even: bool) -> IntArray:
    deal = Deal(Pieces.of([(0, 0, rows)]), world_size, workers, even)
    return deal.shares


def _in_source(exc: CheckpointMismatchError, name: str) -> CheckpointMismatchError:
    """``exc`` naming the mixture's source it is about."""
    return CheckpointMismatchError(
        f"source {name!r}: {exc}", split=exc.split, field=exc.field, expected=exc.expected,
        found=exc.found,
    )  # fmt: skip


_MIXTURE_KEYS: dict[str, type] = {
    "version": int, "epoch": int, "_mixture": dict, "_num_workers": int, "_rank": int,
    "_world_size": int, "_even_batches": bool, "streams": list, "cursor": int, "sources": dict,
}  # fmt: skip


def _check_mixture_shape(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping) or "_mixture" not in state:
        raise InvalidStateError(
            "this dataset is a mixture, but the state is not a mixture's (it has no key "
            "'_mixture'): it was saved by a dataset of one source"
        )
    for key, kind in _MIXTURE_KEYS.items():
        value = state.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidStateError(
                f"state key {key!r} must be {kind.__name__}, got {type(value).__name__}"
            )
    if state["version"] != STATE_VERSION:
        raise InvalidStateError(
            f"unknown state version {state['version']!r}: this library reads version "
            f"{STATE_VERSION}"
        )
    for number, position in enumerate(state["streams"]):
        if position is not None and (type(position) is not int or position < 0):
            raise InvalidStateError(
                f"state key 'streams[{number}]' must be a position >= 0 or null, got "
                f"{position!r:.80}"
            )


# The progress of an iteration: of one dataset, or of a mixture.
AnyProgress = Progress | MixedProgress
