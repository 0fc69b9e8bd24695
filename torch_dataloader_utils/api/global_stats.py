"""``loader.gather_stats()``: every rank's ``loader.stats()`` on one rank, the slowest named.

Under DDP every step waits for the slowest rank, so the rank that waits longest on data sets
the pace of all: that is the rank named, with its verdict. One collective
(``checkpoint.distributed.gather_stats``), like ``save_state_global``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint import distributed
from .stats import LoaderStats

__all__ = ["GlobalStats", "gather_stats"]


@dataclass(frozen=True)
class GlobalStats:
    """Every rank's ``stats().as_dict()`` (``ranks[r]``), the rank whose training loop waits
    the largest share of its recent time on data (``slowest_rank``; ties: the one handing
    out the fewest rows per second), its ``bottleneck`` and ``advice``."""

    ranks: list[dict[str, Any]]
    slowest_rank: int
    bottleneck: str
    advice: str

    def as_dict(self) -> dict[str, Any]:
        """The figures as plain JSON-able types."""
        return {
            "ranks": self.ranks,
            "slowest_rank": self.slowest_rank,
            "bottleneck": self.bottleneck,
            "advice": self.advice,
        }


def gather_stats(stats: LoaderStats, dst_rank: int) -> GlobalStats | None:
    """Collective: ``stats`` of every rank on ``dst_rank`` (``None`` elsewhere)."""
    gathered = distributed.gather_stats(stats.as_dict(), dst_rank)
    if gathered is None:
        return None
    slowest = max(range(len(gathered)), key=lambda r: _pace(gathered[r]))
    return GlobalStats(
        ranks=gathered,
        slowest_rank=slowest,
        bottleneck=gathered[slowest]["bottleneck"],
        advice=f"rank {slowest}: {gathered[slowest]['advice']}",
    )


def _pace(stats: dict[str, Any]) -> tuple[float, float]:
    """Larger for a rank that holds the others up: its wait share, then slower delivery."""
    recent = stats["recent"]
    rate = recent["rows"] / recent["seconds"] if recent["seconds"] > 0 else 0.0
    return recent["wait_fraction"], -rate
