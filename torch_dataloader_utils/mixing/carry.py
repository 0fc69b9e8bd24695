"""Where a packed mixture's epoch starts: each source where the epoch before it stands.

How far a packed source got depends on its tokens, so an epoch after the first starts from the
positions the one before reached (iterated in this process, or loaded), or again from where it
began; without either it cannot start (``NO_CARRY``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..planning.epochs import Start
from .epochs import AnyProgress, MixedEpochs, MixedProgress
from .places import MixPosition

__all__ = ["carried_start"]


def carried_start(
    mix: MixedEpochs, start: Start, progress: AnyProgress | None, epoch: int
) -> Start | None:
    """A packed mixture's ``epoch`` continuing each source where the epoch before it stands
    (``progress`` of it iterated here, or a loaded ``start``), or again from where it began;
    ``None`` otherwise (and for a mixture not packed)."""
    if mix.config.packing is None:
        return None
    before: Sequence[object] | None = start.positions
    if isinstance(progress, MixedProgress) and progress.epoch == epoch - 1:
        workers = max(1, progress.num_workers)
        before = [progress.positions.get(w) for w in range(workers)]
    elif start.epoch == epoch and start.positions and all(p == 0 for p in start.positions):
        # its beginning (of this timeline's, not an elastic resume's rest)
        return start if mix.timeline.begins(epoch) else None
    elif start.epoch != epoch - 1:
        return None
    if before is None or not all(isinstance(p, MixPosition) for p in before):
        return None
    positions = tuple(MixPosition(0, p.sources) for p in before if isinstance(p, MixPosition))
    return Start(epoch=epoch, positions=positions, checkpoint_workers=len(positions))
