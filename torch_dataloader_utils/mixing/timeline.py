"""Which source each position of a mixture's streams reads: the ``Timeline`` (the sources'
names and schedule, the positions of an epoch, each source's limit) and the ``Segment`` it
counts from.

A state loaded with ``reweight=True`` under other weights, sources or ``epoch_size`` starts
a *segment*: from each stream's position then, the new schedule counts on from the rows of
each source read before it, so no row of a source is read twice or skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

from .phases import Phase, phases
from .schedule import Schedule

__all__ = ["Segment", "Timeline"]


@dataclass(frozen=True)
class Segment:
    """Where the current schedule took over: the mixture epoch then, each worker stream's
    position in it (``()``: all 0), the rows of each source it had read (a source not named:
    none) and the positions of that epoch per stream where the change fixed them (the rest an
    elastic resume dealt; after a reweight, an epoch a stream had ended; ``()``: the epoch's
    own, or the position if later). The origin until a state is loaded with ``reweight=True``
    or ``elastic=True``."""

    epoch: int = 0
    positions: tuple[int, ...] = ()
    counts: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
    lengths: tuple[int, ...] = ()


@dataclass(frozen=True)
class Timeline:
    """Which source each position of each stream reads: the sources' names and schedule, the
    positions of an epoch, the segment the schedule counts from, and each source's maximum
    number of epochs (``None``: it cycles) and whether reaching it ends the stream (``stops``)
    or leaves the others to go on."""

    names: tuple[str, ...]
    schedule: Schedule
    epoch_size: int
    segment: Segment = Segment()
    max_epochs: tuple[int | None, ...] = ()
    stops: tuple[bool, ...] = ()

    @cached_property
    def weights(self) -> dict[str, int]:
        return dict(zip(self.names, self.schedule.weights, strict=True))

    @cached_property
    def described(self) -> str:
        """What of a mixture a state compares: its weights, epoch size and policies."""
        text = f"{self.weights} with epoch_size={self.epoch_size}"
        if self.schedule.block:
            text += f", schedule_block={self.schedule.block} (seed {self.schedule.seed})"
        return text + (f", policies {self.policies}" if self.policies else "")

    @cached_property
    def policies(self) -> dict[str, list[Any]]:
        """Each limited source's ``[max_epochs, "stop" | "renormalize"]``."""
        limits = self.max_epochs or (None,) * len(self.names)
        stops = self.stops or (False,) * len(self.names)
        return {
            name: [limit, "stop" if stop else "renormalize"]
            for name, limit, stop in zip(self.names, limits, stops, strict=True)
            if limit is not None
        }

    def offset(self, length: int, worker: int, epoch: int, position: int) -> int:
        """Position ``position`` of epoch ``epoch`` of stream ``worker`` (of epochs of
        ``length`` positions) as a position of the schedule, which starts at the segment."""
        segment = self.segment
        begin = segment.positions[worker] if segment.positions else 0
        first = self.first_length(length, worker)
        offset = (epoch - segment.epoch) * length + position - begin
        if epoch > segment.epoch:  # the segment's epoch has ``first`` positions
            offset += first - length
        if offset < 0:
            raise ValueError(
                f"epoch {epoch} position {position} of worker {worker} comes before the mixture "
                f"changed (epoch {segment.epoch}, position {begin}): those rows were read under "
                f"the earlier weights; continue with epoch {segment.epoch} or a later one"
            )
        return offset

    def first_length(self, length: int, worker: int) -> int:
        """Positions of the segment's epoch for stream ``worker``: what an elastic resume
        dealt of it, or an epoch's, but never fewer than the stream had read when the mixture
        changed (a shorter epoch ends where the stream stood)."""
        segment = self.segment
        if segment.lengths:
            return segment.lengths[worker]
        return max(length, segment.positions[worker] if segment.positions else 0)

    def begins(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` runs under this timeline from its first position: an epoch
        after the segment's, or the segment's when it took over at that epoch's start."""
        segment = self.segment
        if epoch != segment.epoch:
            return epoch > segment.epoch
        return not any(segment.positions) and not segment.lengths

    def phases(self, worker: int, shares: tuple[int, ...]) -> tuple[Phase, ...]:
        """Stream ``worker``'s phases; ``shares``: its rows of one epoch of each source."""
        segment, count = self.segment, len(self.names)
        base = tuple(segment.counts[n][worker] if n in segment.counts else 0 for n in self.names)
        if not self.policies:  # one phase, under the timeline's own (maybe permuted) schedule
            return (Phase(0, base, tuple(range(count)), self.schedule),)
        limits = tuple(
            None if m is None or not q else m * q
            for m, q in zip(self.max_epochs or (None,) * count, shares, strict=True)
        )
        stops = self.stops or (False,) * count
        return phases(self.schedule.weights, base, limits, stops)
