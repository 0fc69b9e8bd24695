"""What a mixture delivered per source, against its schedule's share (``loader.stats()``).

A mixed stream's position says how many rows of each source it has handed out (the
schedule in closed form, ``MixedProgress.counts``; packed, the position carries them), so
the figures cost nothing per batch: they are computed from the positions the loader
recorded when ``stats()`` is called, and kept until those positions move.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mixing.epochs import AnyProgress, MixedProgress
from ..mixing.places import MixPosition

__all__ = ["SourceStats", "mixture_stats"]


@dataclass(frozen=True)
class SourceStats:
    """One source of a mixture on this rank: its ``weight`` and the schedule's ``share``
    (``weight / sum of weights``); the ``rows`` of it the training loop was handed in the
    mixture's current epoch (packed: the rows whose tokens went into the sequences handed
    out, over the source's epochs), their ``delivered_share`` of all sources' rows, and the
    source's own ``epoch`` (the furthest of this rank's streams)."""

    name: str
    weight: int
    share: float
    rows: int
    delivered_share: float
    epoch: int


class MixtureFigures:
    """``mixture_stats`` of the last positions seen, recomputed when they move."""

    def __init__(self) -> None:
        self._seen: tuple[object, ...] = ()
        self._figures: tuple[SourceStats, ...] = ()

    def of(self, progress: AnyProgress | None) -> tuple[SourceStats, ...]:
        if not isinstance(progress, MixedProgress):
            return ()
        seen = (progress, *progress.positions.items())
        if seen != self._seen:
            self._seen, self._figures = seen, mixture_stats(progress)
        return self._figures


def mixture_stats(progress: MixedProgress) -> tuple[SourceStats, ...]:
    """Each source's figures from the positions of ``progress``'s streams."""
    mix = progress.mix
    names, weights = mix.names, mix.weights
    rows, epochs = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for worker, position in progress.positions.items():
        if isinstance(position, MixPosition):  # rows by source, in the sources' order
            counts = zip(mix.source_names, (row for row, _ in position.sources), strict=True)
        else:  # rows by source, in the timeline's order
            counts = zip(names, progress.counts(worker, position).tolist(), strict=True)
        for name, n in counts:
            if name in rows:
                rows[name] += int(n)
        places = progress.places(worker, position)
        for name, place in zip(mix.source_names, places, strict=True):
            if name in epochs:
                epochs[name] = max(epochs[name], place.epoch)
    total, weight_sum = sum(rows.values()), sum(weights.values())
    return tuple(
        SourceStats(
            name=name,
            weight=weights[name],
            share=weights[name] / weight_sum if weight_sum else 0.0,
            rows=rows[name],
            delivered_share=rows[name] / total if total else 0.0,
            epoch=epochs[name],
        )
        for name in names
    )
