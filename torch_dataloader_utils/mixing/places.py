"""Where a mixture's stream stands: its position (``MixPosition``, packed: with each source's
place), its place in one source (``SourcePlace``), and a source's epochs an elastic resume left
(``SourceRest``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.schema import Generation
from ..planning.order import StreamOrder

__all__ = ["MixPosition", "SourcePlace", "SourceRest"]


class MixPosition(int):
    """A packed mixture stream's position: the sequences of the epoch handed out (the int's
    value), and where each source's packing stands: the rows of its share it has handed out
    over all its epochs, and the tokens of the next row handed out too. (Unpacked, a stream's
    position in every source follows from its position; packed, from the tokens read.)"""

    sources: tuple[tuple[int, int], ...]

    def __new__(cls, position: int, sources: tuple[tuple[int, int], ...]) -> MixPosition:
        value = super().__new__(cls, position)
        value.sources = sources
        return value

    def __getnewargs__(self) -> tuple[int, tuple[tuple[int, int], ...]]:  # type: ignore[override]
        return int(self), self.sources

    def __repr__(self) -> str:
        return f"MixPosition({int(self)}, sources={self.sources})"


@dataclass(frozen=True)
class SourcePlace:
    """Where a stream stands in one source: that source's epoch, the stream's order in it, the
    rows of its share there it has read, and (packed) the tokens of the next row read too."""

    epoch: int
    order: StreamOrder
    offset: int
    tokens: int = 0


@dataclass(frozen=True)
class SourceRest:
    """A source's epochs an elastic resume left unfinished, each with the deals before it (its
    generations), which every stream reads first, in this order; then its epochs from
    ``fresh`` on, each dealt afresh. Empty until an elastic resume."""

    epochs: tuple[tuple[int, tuple[Generation, ...]], ...] = ()
    fresh: int = 0
