"""A stream's schedule when sources have a maximum number of epochs: phases, in closed form.

From its segment's start a stream reads the sources its schedule names. A source with a limit
(``max_epochs`` times the stream's share of it) leaves the schedule at the position right after
its last allowed row: with its policy ``stop`` the stream ends there; with ``renormalize`` the
sources left go on under their own weights (a new schedule from that position, counting on
from where each stood). A *phase* is a stretch with one set of sources; the phases follow from
the weights, the counts at the segment's start and the limits, so every count and every
position's source stays integer arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from .schedule import Interleave, Schedule

__all__ = ["Phase", "phase_counts", "phase_interleave", "phase_sources", "phases", "stream_end"]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Phase:
    """From schedule position ``start``: the rows of each source read before it (``base``),
    the sources read (``active``, by number) and their schedule (``None``: the stream ended)."""

    start: int
    base: tuple[int, ...]
    active: tuple[int, ...]
    schedule: Schedule | None


@lru_cache(maxsize=256)
def phases(
    weights: tuple[int, ...],
    base: tuple[int, ...],
    limits: tuple[int | None, ...],
    stops: tuple[bool, ...],
) -> tuple[Phase, ...]:
    """The phases of a stream whose sources have ``weights``, had read ``base`` rows at the
    segment's start, may read at most ``limits`` rows (``None``: no limit), and end the stream
    when they reach it (``stops``) or leave the others to go on."""
    out: list[Phase] = []
    start, counts = 0, np.array(base, dtype=np.int64)
    while True:
        active = tuple(s for s in range(len(weights)) if limits[s] is None or counts[s] < limits[s])
        if not active:
            out.append(Phase(start, tuple(counts.tolist()), (), None))
            return tuple(out)
        schedule = _schedule(tuple(weights[s] for s in active))
        out.append(Phase(start, tuple(counts.tolist()), active, schedule))
        ends = {
            s: schedule.position_after(i, int(limits[s] - counts[s]))
            for i, s in enumerate(active)
            if limits[s] is not None
        }
        if not ends:
            return tuple(out)
        step = min(ends.values())
        counts[list(active)] += schedule.counts(step)
        start += step
        if any(stops[s] for s, at in ends.items() if at == step):
            out.append(Phase(start, tuple(counts.tolist()), (), None))
            return tuple(out)


def phase_counts(stream: tuple[Phase, ...], position: int) -> IntArray:
    """Rows of each source read before schedule position ``position``."""
    phase = stream[_phase_at(stream, position)]
    counts = np.array(phase.base, dtype=np.int64)
    if phase.schedule is not None:
        counts[list(phase.active)] += phase.schedule.counts(position - phase.start)
    return counts


def phase_sources(stream: tuple[Phase, ...], start: int, stop: int) -> npt.NDArray[np.int16]:
    """The source of each schedule position in ``[start, stop)`` (before the stream's end)."""
    out = np.empty(stop - start, dtype=np.int16)
    number = _phase_at(stream, start)
    lo = start
    while lo < stop:
        phase = stream[number]
        if phase.schedule is None:
            raise ValueError(f"schedule position {lo} is past the stream's end {phase.start}")
        hi = stop if number + 1 == len(stream) else min(stop, stream[number + 1].start)
        local = phase.schedule.sources(lo - phase.start, hi - phase.start)
        out[lo - start : hi - start] = np.array(phase.active, dtype=np.int16)[local]
        lo, number = hi, number + 1
    return out


def phase_interleave(stream: tuple[Phase, ...], start: int, stop: int) -> Interleave:
    """The interleave of schedule positions ``[start, stop)`` (before the stream's end), by
    the sources' numbers in the stream."""
    number = _phase_at(stream, start)
    phase, count = stream[number], len(stream[0].base)
    last = number + 1 == len(stream) or stop <= stream[number + 1].start
    if phase.schedule is None or not last:
        return Interleave.of(phase_sources(stream, start, stop), count)
    within = phase.schedule.interleave(start - phase.start, stop - phase.start)
    return within if phase.active == tuple(range(count)) else within.renumbered(phase.active, count)


def stream_end(stream: tuple[Phase, ...]) -> int | None:
    """The schedule position where the stream ends (``None``: never)."""
    last = stream[-1]
    return last.start if last.schedule is None else None


def _phase_at(stream: tuple[Phase, ...], position: int) -> int:
    starts = [phase.start for phase in stream]
    return max(0, int(np.searchsorted(starts, position, side="right")) - 1)


@lru_cache(maxsize=64)
def _schedule(weights: tuple[int, ...]) -> Schedule:
    return Schedule(weights)
