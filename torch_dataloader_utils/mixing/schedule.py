"""The mixing schedule: which source each position of a mixed stream reads, in closed form.

Integer weights ``w`` (divided by their gcd) make a *period* of ``W = sum(w)`` positions in which
source ``s`` appears ``w[s]`` times; position ``k`` reads source ``period[k % W]``, and before
``k`` source ``s`` has been read ``(k // W) * w[s] + (its count in period[:k % W])`` times. The
period is Tijdeman's solution of the chairman assignment problem (earliest deadline first, each
source's ``i``-th position released and due at fixed fractions of ``W / w[s]``), which keeps
every source's count within ``1 - 1 / (2n - 2)`` of ``k * w[s] / W`` after every ``k``, for
any number ``n`` of sources. Nothing is drawn at random and nothing is per row in Python.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property, lru_cache

import numpy as np
import numpy.typing as npt
import xxhash

from ..planning.bijection import permutation

__all__ = ["MAX_BLOCK", "MAX_PERIOD", "Interleave", "Schedule"]

# Positions of a period: a bound on the work of building it (weights to 1/65,536 are finer than
# any mixture needs).
MAX_PERIOD = 2**16
# Positions of a permuted block: each is materialised (2 bytes a position) when read.
MAX_BLOCK = 2**22

# Up to this many sources, a source's places are found by a comparison each (cheaper than
# numpy's stable argsort of the source ids, 17 ns a position).
_FEW_SOURCES = 8

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Interleave:
    """Consecutive positions of a schedule: the source of each (``sources``), and where each
    source's positions are among them (``places[s]``, from 0, in order). Read-only: a
    schedule keeps the interleave of a repeating stretch for the next time it comes."""

    sources: npt.NDArray[np.int16]
    places: tuple[npt.NDArray[np.intp], ...]

    @classmethod
    def of(cls, sources: npt.NDArray[np.int16], count: int) -> Interleave:
        """The interleave of positions whose sources (of ``count``) are ``sources``."""
        if count <= _FEW_SOURCES:
            places = tuple(np.flatnonzero(sources == s) for s in range(count))
        else:
            order = np.argsort(sources, kind="stable")
            bounds = np.cumsum(np.bincount(sources, minlength=count))[:-1]
            places = tuple(np.split(order, bounds))
        arrays: list[np.ndarray] = [sources, *places]
        for array in arrays:
            array.flags.writeable = False
        return cls(sources, places)

    def renumbered(self, numbers: tuple[int, ...], count: int) -> Interleave:
        """Source ``s`` as source ``numbers[s]`` of ``count`` (the others have no positions)."""
        places = [np.empty(0, dtype=np.intp)] * count
        for s, number in enumerate(numbers):
            places[number] = self.places[s]
        return Interleave(np.array(numbers, dtype=np.int16)[self.sources], tuple(places))


@dataclass(frozen=True)
class Schedule:
    """The schedule of integer ``weights`` (one per source, each at least 1).

    With ``block`` (positions, rounded up to whole periods) the positions of each block are
    permuted, keyed by ``seed`` and the block's number: every block still holds each source's
    exact share, and its order no longer repeats. Without, the period repeats in order.
    """

    weights: tuple[int, ...]
    block: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.weights or min(self.weights) < 1:
            raise ValueError(f"weights must be positive integers, got {list(self.weights)}")
        if not 0 <= self.block <= MAX_BLOCK:
            raise ValueError(f"schedule_block must be 1 to {MAX_BLOCK} positions, got {self.block}")
        if self.period_length > MAX_PERIOD:
            raise ValueError(
                f"weights {list(self.weights)} make a schedule period of {self.period_length} "
                f"positions (their sum over their gcd); at most {MAX_PERIOD} are allowed: round "
                f"them, e.g. to per-mille"
            )

    @cached_property
    def reduced(self) -> tuple[int, ...]:
        """The weights over their gcd: source ``s`` fills ``reduced[s]`` positions a period."""
        gcd = math.gcd(*self.weights)
        return tuple(w // gcd for w in self.weights)

    @property
    def period_length(self) -> int:
        return sum(self.reduced)

    @cached_property
    def period(self) -> npt.NDArray[np.int16]:
        """The source of each position of a period."""
        return _period(self.reduced)

    @property
    def block_length(self) -> int:
        """Positions of a block: ``block`` rounded up to whole periods, or one period."""
        period = self.period_length
        return -(-self.block // period) * period if self.block else period

    def counts(self, position: int) -> IntArray:
        """How many positions of each source come before ``position``."""
        blocks, rest = divmod(position, self.block_length)
        counts = np.bincount(self._block(blocks)[:rest], minlength=len(self.weights))
        periods = blocks * (self.block_length // self.period_length)
        return counts.astype(np.int64) + periods * np.array(self.reduced, dtype=np.int64)

    def _block(self, number: int) -> npt.NDArray[np.int16]:
        """The source of each position of block ``number``."""
        if not self.block:
            return self.period
        return _permuted_block(self.reduced, self.block_length, self.seed, number)

    def position_after(self, source: int, count: int) -> int:
        """The position just after source ``source``'s ``count``-th (``count >= 1``; the
        schedule unpermuted)."""
        assert not self.block, "a permuted schedule has no closed-form position of a count"
        periods, rest = divmod(count - 1, self.reduced[source])
        return periods * self.period_length + int(self._occurrences[source][rest]) + 1

    @cached_property
    def _occurrences(self) -> list[npt.NDArray[np.intp]]:
        """The places of each source in the period."""
        return [np.flatnonzero(self.period == s) for s in range(len(self.weights))]

    def sources(self, start: int, stop: int) -> npt.NDArray[np.int16]:
        """The source of each position in ``[start, stop)``."""
        length = self.block_length
        if not self.block:
            return _periodic(self.period, start % length, stop - start)
        parts = []
        for number in range(start // length, -(-stop // length)):
            lo, hi = max(start, number * length), min(stop, (number + 1) * length)
            parts.append(self._block(number)[lo - number * length : hi - number * length])
        return np.concatenate([np.empty(0, np.int16), *parts])

    def interleave(self, start: int, stop: int) -> Interleave:
        """The interleave of positions ``[start, stop)``."""
        if self.block:
            return Interleave.of(self.sources(start, stop), len(self.weights))
        return _periodic_interleave(self.reduced, start % self.period_length, stop - start)


# Interleaves kept per process: a stream reads chunks of equal length, whose offsets in the
# period come back after at most ``period / gcd(period, chunk)`` chunks (5 for ``7:2:1`` and
# 65,536 positions; 10 bytes a position: 5.2 MB at most).
@lru_cache(maxsize=8)
def _periodic_interleave(reduced: tuple[int, ...], offset: int, length: int) -> Interleave:
    """The interleave of ``length`` positions of the unpermuted schedule of ``reduced`` from
    ``offset`` in its period."""
    return Interleave.of(_periodic(_period(reduced), offset, length), len(reduced))


def _periodic(period: npt.NDArray[np.int16], offset: int, length: int) -> npt.NDArray[np.int16]:
    """``length`` values of ``period`` repeated, from ``offset`` (``< len(period)``)."""
    return np.tile(period, -(-(offset + length) // len(period)))[offset : offset + length]


@lru_cache(maxsize=4)
def _permuted_block(
    reduced: tuple[int, ...], length: int, seed: int, number: int
) -> npt.NDArray[np.int16]:
    """Block ``number`` of a permuted schedule: its whole periods in a keyed random order."""
    periods = np.tile(_period(reduced), length // sum(reduced))
    key = xxhash.xxh64_intdigest(f"{seed}:schedule:{number}".encode())
    return periods[permutation(length, key)]


@lru_cache(maxsize=8)
def _period(weights: tuple[int, ...]) -> npt.NDArray[np.int16]:
    """Tijdeman's schedule of one period: at time ``t = 1 .. W`` the released position with
    the earliest deadline (ties: the lower source). Source ``s``'s ``i``-th position is
    released at ``(i m + 1) W / (m w)`` and due at ``((i + 1) m - 1) W / (m w)``, ``m = 2n - 2``:
    it is never taken more than ``1 - 1/m`` ahead of its share nor left that far behind."""
    total, n = sum(weights), len(weights)
    out = np.zeros(total, dtype=np.int16)
    if n == 1:
        return out
    m = 2 * n - 2
    releases = sorted(
        (Fraction((i * m + 1) * total, m * w), s, i)
        for s, w in enumerate(weights)
        for i in range(w)
    )
    ready: list[tuple[Fraction, int]] = []
    taken = 0
    for t in range(1, total + 1):
        while taken < len(releases) and releases[taken][0] <= t:
            _, s, i = releases[taken]
            heapq.heappush(ready, (Fraction(((i + 1) * m - 1) * total, m * weights[s]), s))
            taken += 1
        out[t - 1] = heapq.heappop(ready)[1]
    return out
