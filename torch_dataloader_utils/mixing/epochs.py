"""A mixture's epochs as values: its sources' epochs and orders (``MixedEpochs``), and the
delivery in one mixture epoch (``MixedProgress``): where each stream stands in every source.

Every stream (rank, DataLoader worker) of a mixture reads one mixed sequence of positions
``k = 0, 1, 2, ...`` that never restarts: position ``k`` reads source ``schedule.period[k % W]``
(``mixing.schedule``), and its ``n``-th row of source ``s`` is row ``n % q`` of its share of source
epoch ``n // q``, ``q`` being its share of one epoch of ``s`` (each source is dealt to the same
streams as a dataset of its own, every row once, in the source's own shuffled order keyed by
its name). A mixture epoch is a stretch of ``L`` positions of every stream (``epoch_size``
dealt to the streams): epoch ``m`` covers ``[m L, (m + 1) L)``, so a stream's position in the
epoch fixes, in closed form, every source's epoch and row, counted from the timeline's
segment (``mixing.timeline``). Nothing here reads files.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ..base.arrays import IntArray
from ..base.errors import EpochStartError, InvalidStateError
from ..checkpoint.checks import check_setting
from ..checkpoint.state import stream_list
from ..planning.config import DatasetConfig
from ..planning.epochs import Epochs, Progress, Start
from ..planning.order import StreamOrder
from ..planning.plan import Deal, Pieces
from .compact import SettingsStates, settings_states
from .phases import Phase, phase_counts, phase_interleave, phase_sources, stream_end
from .places import MixPosition, SourcePlace, SourceRest
from .schedule import Interleave
from .timeline import Segment, Timeline

__all__ = [
    "NO_CARRY",
    "AnyProgress",
    "MixedEpochs",
    "MixedProgress",
]

# A packed mixture's sources stand where the tokens read put them: known by reading, not by
# arithmetic, so an epoch continues from the one before (or restarts from its beginning, when
# this process knows it).
NO_CARRY = (
    "a packed mixture's epoch {epoch} continues each source where the epoch before it ended "
    "(how far a source got depends on its tokens), so it starts from the state saved at the "
    "end of that epoch, or after iterating it in this process (and starts again where it "
    "began in this process): load that state, or begin at epoch 0"
)

# Stream orders a mixture keeps at least (its epoch and the next of each source and stream).
_KEPT_ORDERS = 256


_NO_REST = SourceRest()


@dataclass
class MixedProgress:
    """Delivery in one mixture epoch: positions handed out by each worker stream of this rank
    in this epoch, and the worker whose batch comes next."""

    mix: MixedEpochs
    epoch: int
    num_workers: int
    positions: dict[int, int] = field(default_factory=dict)
    cursor: int = 0
    _entries: dict[int, tuple[Any, list[Any], list[tuple[int, list[Any] | None]]]] = field(
        default_factory=dict, repr=False
    )
    # per worker stream: its epoch's positions and its phases (asked for at every chunk read)
    _lengths: dict[int, int] = field(default_factory=dict, repr=False)
    _kept_phases: dict[int, tuple[Phase, ...]] = field(default_factory=dict, repr=False)

    def record(self, worker: int, position: int, cursor: int) -> None:
        self.positions[worker] = position
        self.cursor = cursor

    def stream(self, worker: int) -> int:
        return self.mix.rank * max(1, self.num_workers) + worker

    def length(self, worker: int) -> int:
        """Positions of an epoch for stream ``worker`` (the segment's own may differ)."""
        if worker not in self._lengths:
            lengths = self.mix.epoch_lengths(self.num_workers)
            self._lengths[worker] = int(lengths[self.stream(worker)])
        return self._lengths[worker]

    def shares(self, worker: int) -> tuple[int, ...]:
        """Rows of one epoch of each source of the timeline that stream ``worker`` reads (0:
        a source this mixture no longer has)."""
        stream, known = self.stream(worker), self.mix.source_names
        return tuple(
            self.mix.share(known.index(n), stream, self.num_workers) if n in known else 0
            for n in self.mix.timeline.names
        )

    def _phases(self, worker: int) -> tuple[Phase, ...]:
        if worker not in self._kept_phases:
            self._kept_phases[worker] = self.mix.timeline.phases(worker, self.shares(worker))
        return self._kept_phases[worker]

    def _offset(self, worker: int, position: int) -> int:
        return self.mix.timeline.offset(self.length(worker), worker, self.epoch, position)

    def counts(self, worker: int, position: int) -> IntArray:
        """Rows of each source stream ``worker`` has read after ``position`` of the epoch."""
        return phase_counts(self._phases(worker), self._offset(worker, position))

    def sources(self, worker: int, start: int, stop: int) -> npt.NDArray[np.int16]:
        """The source of each of positions ``[start, stop)`` of stream ``worker``."""
        offset = self._offset(worker, start)
        return phase_sources(self._phases(worker), offset, offset + stop - start)

    def interleave(self, worker: int, start: int, stop: int) -> Interleave:
        """The interleave of positions ``[start, stop)`` of stream ``worker``."""
        offset = self._offset(worker, start)
        return phase_interleave(self._phases(worker), offset, offset + stop - start)

    def total(self, worker: int) -> int:
        """Positions stream ``worker`` has in this epoch: its share of ``epoch_size`` (of
        what an elastic resume left of it), or fewer where its sources ran out."""
        timeline, length = self.mix.timeline, self.length(worker)
        segment = timeline.segment
        if self.epoch == segment.epoch:
            length = timeline.first_length(length, worker)
        end = stream_end(self._phases(worker))
        if end is None:
            return length
        first = (
            timeline.offset(self.length(worker), worker, self.epoch, 0)
            if (self.epoch > segment.epoch)
            else -(segment.positions[worker] if segment.positions else 0)
        )
        return int(min(length, max(0, end - first)))

    def ended(self) -> bool:
        """Whether every stream of the rank has handed out all its positions of the epoch."""
        positions = self.positions
        return len(positions) == max(1, self.num_workers) and all(
            int(p) >= self.total(w) for w, p in positions.items()
        )

    def places(self, worker: int, position: int) -> list[SourcePlace]:
        """Where stream ``worker`` stands in each source after ``position`` rows of the epoch."""
        if isinstance(position, MixPosition):
            return [
                self.mix.place(s, self.stream(worker), row, self.num_workers, tokens)
                for s, (row, tokens) in enumerate(position.sources)
            ]
        place, stream, workers = self.mix.place, self.stream(worker), self.num_workers
        return [
            place(s, stream, n, workers)
            for s, n in enumerate(self.counts(worker, position).tolist())
        ]

    def entries(self, worker: int) -> list[tuple[int, list[Any] | None]]:
        """Each source's epoch and place of stream ``worker``, by content, as a state writes
        it (kept until the stream moves; then each source's while its row and tokens are)."""
        position = self.positions[worker]
        kept = self._entries.get(worker)
        if kept is None or kept[0] != position:
            rows = (
                list(position.sources)
                if isinstance(position, MixPosition)
                else [(n, 0) for n in self.counts(worker, position).tolist()]
            )
            before, was = (kept[1], kept[2]) if kept is not None else ([], [])
            stream, sources = self.stream(worker), self.mix.sources
            entries = []
            for s, (row, tokens) in enumerate(rows):
                if s < len(before) and before[s] == (row, tokens):
                    entries.append(was[s])
                    continue
                place = self.mix.place(s, stream, row, self.num_workers, tokens)
                order, offset = place.order, place.offset
                entry = stream_list(
                    offset, place.tokens, order.total, order.row_at(offset), sources[s].index
                )
                entries.append((place.epoch, entry))
            self._entries[worker] = kept = (position, rows, entries)
        return kept[2]


@dataclass(frozen=True, kw_only=True)
class MixedEpochs:
    """The pure part of a mixture: its sources' ``Epochs`` (each dealt to the job's streams,
    never evened) and its timeline (a loaded state's, whose names may differ, only counts)."""

    timeline: Timeline
    sources: tuple[Epochs, ...]
    source_names: tuple[str, ...]  # of ``sources``: the timeline's names, or a loaded state's
    config: DatasetConfig
    rank: int
    world_size: int
    even_batches: bool
    source_column: str | None
    rests: tuple[SourceRest, ...] = ()  # per source, after an elastic resume
    # per source: whether it shuffles within a share of ``config.shuffle_memory_bytes``
    # (``mixing.budget``), not a budget of its own
    sharing: tuple[bool, ...] = ()
    # the sources as built, when a loaded state gave some the budgets it records
    built: tuple[Epochs, ...] = ()
    _orders: dict[tuple[int, int, int, int], StreamOrder] = field(
        default_factory=dict, compare=False, repr=False
    )
    _shares: dict[tuple[int, int, int], int] = field(
        default_factory=dict, compare=False, repr=False
    )
    _settings_states: dict[tuple[int, int], SettingsStates] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def names(self) -> tuple[str, ...]:
        return self.timeline.names

    @property
    def weights(self) -> dict[str, int]:
        return self.timeline.weights

    @cached_property
    def source_schema(self) -> pa.Schema:
        """The columns every source holds (``mixing.source.check_schemas``), in the first source's
        order: a batch joins its sources' columns by name, in this order."""
        return self.sources[0].schema

    @cached_property
    def schema(self) -> pa.Schema:
        """The columns of a batch: the sources' (``source_schema``), then (unless
        ``source_column`` is None) the number of each row's source."""
        schema = self.source_schema
        if self.source_column is None:
            return schema
        return schema.append(pa.field(self.source_column, pa.int16(), nullable=False))

    def following(
        self, timeline: Timeline, rests: tuple[SourceRest, ...] | None = None
    ) -> MixedEpochs:
        """This mixture under ``timeline`` (and ``rests``) of a loaded state."""
        rests = self.rests if rests is None else rests
        return replace(self, timeline=timeline, rests=rests, _orders={})

    def epoch_lengths(self, num_workers: int) -> IntArray:
        """Positions of a mixture epoch, per stream of the job: ``epoch_size`` dealt."""
        workers = max(1, num_workers)
        rows = self.timeline.epoch_size
        deal = Deal(Pieces.of([(0, 0, rows)]), self.world_size, workers, self.even_batches)
        return self.whole_batches(deal.shares)

    def whole_batches(self, lengths: IntArray) -> IntArray:
        """``lengths`` (a stream's positions of an epoch), with ``drop_last`` cut to whole
        batches: the positions of a last, partial batch open the next epoch (dropped, their
        rows would be skipped in their sources' epochs, which run on across mixture epochs)."""
        if not self.config.drop_last:
            return lengths
        return lengths - lengths % self.config.batch_size

    def rest(self, source: int) -> SourceRest:
        return self.rests[source] if self.rests else _NO_REST

    def place(
        self, source: int, stream: int, ordinal: int, num_workers: int, tokens: int = 0
    ) -> SourcePlace:
        """Where row ``ordinal`` of source ``source`` is for stream ``stream``: in an epoch an
        elastic resume left (``rest``), or in one dealt afresh."""
        rest = self.rest(source)
        if rest.epochs:
            return next(self.places_from(source, stream, ordinal, num_workers, tokens))
        return self._fresh_place(source, stream, ordinal, num_workers, tokens)

    def places_from(
        self, source: int, stream: int, ordinal: int, num_workers: int, tokens: int = 0
    ) -> Iterator[SourcePlace]:
        """Stream ``stream``'s places in ``source`` from row ``ordinal`` on: that row's, then
        the beginning of each following epoch of the source, without end."""
        rest = self.rest(source)
        for epoch, _ in rest.epochs:
            order = self.order(source, stream, epoch, num_workers)
            if ordinal < order.total:
                yield SourcePlace(epoch, order, ordinal, tokens)
                ordinal, tokens = 0, 0
            else:
                ordinal -= order.total
        first = self._fresh_place(source, stream, ordinal, num_workers, tokens)
        yield first
        for number in itertools.count(first.epoch + 1):
            yield SourcePlace(number, self.order(source, stream, number, num_workers), 0)

    def _fresh_place(
        self, source: int, stream: int, ordinal: int, num_workers: int, tokens: int
    ) -> SourcePlace:
        """Row ``ordinal`` of the source's epochs dealt afresh (after any an elastic resume
        left), for stream ``stream``."""
        epoch, offset = divmod(ordinal, self.share(source, stream, num_workers))
        epoch += self.rest(source).fresh
        return SourcePlace(epoch, self.order(source, stream, epoch, num_workers), offset, tokens)

    def skips(self, source: int, stream: int, num_workers: int) -> dict[int, int]:
        """Rows (over all the source's epochs) an elastic resume's deal cut mid-document, with
        the tokens of them delivered before: in the epochs it left, none in fresh ones."""
        out, before = {}, 0
        for epoch, _ in self.rest(source).epochs:
            order = self.order(source, stream, epoch, num_workers)
            for row, tokens in order.plan.stream_skips(stream).items():
                out[before + row] = tokens
            before += order.total
        return out

    def ordinal_of(
        self, source: int, stream: int, epoch: int, offset: int, num_workers: int
    ) -> int:
        """The row (over all the source's epochs) that row ``offset`` of epoch ``epoch`` is."""
        before = 0
        for rest_epoch, _ in self.rest(source).epochs:
            if rest_epoch == epoch:
                return before + offset
            before += self.order(source, stream, rest_epoch, num_workers).total
        fresh = self.rest(source).fresh
        return before + (epoch - fresh) * self.share(source, stream, num_workers) + offset

    def order(self, source: int, stream: int, epoch: int, num_workers: int) -> StreamOrder:
        """Stream ``stream``'s order in epoch ``epoch`` of ``source`` (the last few kept: a
        shuffled order costs its share's blocks)."""
        key = (source, stream, epoch, num_workers)
        order = self._orders.get(key)
        if order is None:
            epochs = self.sources[source]
            deals = dict(self.rest(source).epochs).get(epoch, ())
            plan = epochs.plan(Start(epoch=epoch, generations=deals), num_workers)
            order = epochs.order(plan, stream)
            # every stream of this process in two epochs of each source: a state names them all
            kept = max(_KEPT_ORDERS, 2 * max(1, num_workers) * len(self.sources))
            if len(self._orders) >= kept:  # the oldest, named in one step: a state_dict()
                # may be here while the stream is read ahead in a thread of its own
                self._orders.pop(next(iter(self._orders.copy())), None)
            self._orders[key] = order
        return order

    def share(self, source: int, stream: int, num_workers: int) -> int:
        """Rows of one epoch of ``source`` that stream ``stream`` reads (the same every epoch)."""
        key = (source, stream, num_workers)
        if key not in self._shares:
            self._shares[key] = self._share(source, stream, num_workers)
        return self._shares[key]

    def _share(self, source: int, stream: int, num_workers: int) -> int:
        rows = int(self.sources[source].index.split_rows.sum())
        deal = Deal(Pieces.of([(0, 0, rows)]), self.world_size, max(1, num_workers), False)
        share = int(deal.shares_of(stream, 1)[0])
        if share == 0:
            raise ValueError(
                f"source {self.names[source]!r} has {rows} row(s), fewer than the "
                f"{deal.streams} streams (world_size x num_workers) that each read a share of it"
            )
        return share

    def serving(self, start: Start) -> MixedEpochs:
        """The mixture an iteration from ``start`` reads: this one, or, for an epoch begun
        afresh that its timeline does not run from its first position (a loaded state's
        epoch, which it changed or re-dealt mid-way, or an earlier one), the mixture as
        built (its sources' budgets too): the epoch afresh, as one dataset's ``set_epoch``
        after a load."""
        if not start.is_fresh or self.timeline.begins(start.epoch):
            return self
        served = self.following(replace(self.timeline, segment=Segment()), ())
        if not self.built:
            return served
        return replace(served, sources=self.built, built=(), _settings_states={})

    def begin(
        self, start: Start, num_workers: int, workers: Iterable[int] | None = None
    ) -> MixedProgress:
        """The progress of an iteration from ``start`` (of the mixture that serves it)."""
        if (served := self.serving(start)) is not self:
            return served.begin(start, num_workers, workers)
        streams = max(1, num_workers)
        if start.checkpoint_workers is not None:
            check_setting(
                "num_workers", start.checkpoint_workers, num_workers, start.checkpoint_split
            )
        segment = self.timeline.segment
        if segment.positions and len(segment.positions) != streams:
            check_setting(
                "num_workers", len(segment.positions), streams, "(where the mixture changed)"
            )
        for s in range(len(self.sources)):  # every stream must read every source
            self.share(s, self.world_size * streams - 1, num_workers)
        progress = MixedProgress(self, start.epoch, num_workers, cursor=start.cursor)
        for worker in range(streams) if workers is None else workers:
            position = 0 if start.positions is None else start.positions[worker]
            if position is None:
                raise InvalidStateError(
                    f"state key 'streams[{worker}]' is null: the state holds no position for "
                    f"worker {worker}: it was saved by another worker's copy of the dataset; "
                    f"save the state through the loader"
                )
            if self.config.packing is not None and not isinstance(position, MixPosition):
                if start.epoch or position:
                    raise EpochStartError(NO_CARRY.format(epoch=start.epoch))
                position = MixPosition(0, ((0, 0),) * len(self.sources))
            progress.positions[worker] = position
            progress.counts(worker, int(position))  # not before the segment
        return progress

    def batches(self, start: Start, num_workers: int) -> int:
        """Batches this rank yields in ``start``'s epoch: all of its positions, those before
        a loaded state's position too."""
        progress = MixedProgress(self.serving(start), start.epoch, num_workers)
        rows = np.array([progress.total(w) for w in range(max(1, num_workers))])
        size = self.config.batch_size
        per_stream = rows // size if self.config.drop_last else -(-rows // size)
        return int(per_stream.sum())

    def source_states(self, num_workers: int) -> SettingsStates:
        """Each source's settings and files as a state writes them (``mixing.compact``): the
        same at every call, so made once."""
        key = (num_workers, self.timeline.schedule.seed)
        if key not in self._settings_states:
            self._settings_states[key] = settings_states(
                self.sources, self.names, self.timeline.schedule.seed, num_workers
            )
        return self._settings_states[key]


# The progress of an iteration: of one dataset, or of a mixture.
AnyProgress = Progress | MixedProgress
