"""The iterator ``iter(loader)`` returns, and its restart in a later epoch.

The iterator hands out the current iteration's batches (``Feed.batches``), each marked with
where delivery stood before it (``HandOuts``) and timed (``Recorder``). A trainer moves the
loader to its epoch through ``loader.sampler.set_epoch`` (``Feed.set_epoch``). Lightning,
resumed from a checkpoint saved at an epoch's end with a loader without ``len()`` (token
packing), loads no loader state and takes one batch ahead before it does so: a batch of the
epoch before, held unread. Then the iteration restarts in the trainer's epoch under the same
iterator (its workers stopped, new ones started), and each dict batch the loop holds unread
is refilled in place with the new iteration's next batch: the loop trains the new epoch from
its first batch. A batch that is not a dict cannot be refilled: the iterator raises instead.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from ..mixing.epochs import AnyProgress
from .handout import HandOuts, Mark
from .served import ServedDataset
from .stats import Recorder

__all__ = ["Feed"]

_NOTHING = object()  # the iteration has ended


class Feed:
    """What the iterator the training loop holds reads: the current iteration's batches,
    which of them it handed out and the loop read (``handouts``), and their timings
    (``recorder``). A restart swaps the batches and the timings."""

    def __init__(
        self,
        batches: Iterator[Any],
        dataset: ServedDataset,
        num_workers: int,
        log_every: float | None = None,
    ) -> None:
        self.batches = batches
        self.handouts = HandOuts()
        self._new_recorder = functools.partial(Recorder, num_workers, log_every=log_every)
        self.recorder = self._new_recorder()
        self._dataset = dataset
        self._superseded: str | None = None  # why the iterator must not hand out more

    def handed_out(self) -> Iterator[Any]:
        """The batches as handed to the training loop; closing it closes ``batches``."""
        try:
            while (taken := self._take()) is not None:
                yield self.handouts.hand_out(*taken)
        finally:
            _close(self.batches)

    def set_epoch(self, epoch: int, begin: Callable[[], Iterator[Any]]) -> None:
        """The trainer moves the loader to ``epoch``, later than the dataset's. If this
        iteration is running and the loop has read none of its batches, it restarts in
        ``epoch`` (``begin`` starts the new one) under the batches the loop holds."""
        dataset, handouts = self._dataset, self.handouts
        progress = dataset._progress
        running = progress is not None and handouts.progress is progress and not progress.ended()
        held = handouts.start_over() if running else None
        if held is None:
            if running and (handouts.none_read() or handouts.opaque):
                # batches of the epoch before, that cannot be refilled: never train them
                self._superseded = _CANNOT_REFILL.format(epoch=epoch, began=dataset.epoch)
            dataset.set_epoch(epoch)
            return
        _close(self.batches)  # stops its workers (persistent ones learn the new epoch)
        dataset.set_epoch(epoch)
        self.batches = begin()
        self.recorder = self._new_recorder()
        for batch in held:
            taken = self._take()
            if taken is None:
                raise RuntimeError(_TOO_SHORT.format(epoch=epoch, held=len(held)))
            handouts.hand_out(*taken, into=batch)

    def _take(self) -> tuple[Any, Mark, AnyProgress | None] | None:
        """The iteration's next batch, timed, with where delivery stood before it and the
        iteration's progress after it; ``None`` at the iteration's end."""
        if self._superseded is not None:
            raise RuntimeError(self._superseded)
        dataset = self._dataset
        asked = time.perf_counter()
        mark = dataset._mark()
        batch = next(self.batches, _NOTHING)
        if batch is _NOTHING:
            return None
        self.recorder.record(asked, time.perf_counter(), batch)
        progress = dataset._progress
        if progress is not mark.progress:  # the first batch: before it, the start
            mark = replace(mark, progress=None)
        return batch, mark, progress


def _close(batches: Iterator[Any]) -> None:
    close = getattr(batches, "close", None)
    if close is not None:
        close()


# Lightning, resumed from an epoch-end checkpoint, does not load the loader's state (nothing
# to restart, it thinks) and, when the loader has no len(), takes a batch before moving it.
_CANNOT_REFILL = (
    "the trainer moved the loader to epoch {epoch} after it took batches of epoch {began} "
    "ahead, which this iterator cannot replace: they are not dicts (output='arrow', or a "
    "transform returning another type), or more than a trainer reads ahead; training on "
    "would repeat epoch {began}. Lightning's Trainer does so when the loader has no len() "
    "(token packing) and it resumes from a checkpoint saved at an epoch's end, whose loader "
    "state it does not load. Return dict batches, or resume from a checkpoint of "
    "ModelCheckpoint(every_n_train_steps=...) instead (docs/trainers.md)"
)
_TOO_SHORT = (
    "the trainer moved the loader to epoch {epoch} after it took {held} batch(es) of the "
    "epoch before ahead, but epoch {epoch} has fewer batches to put in their place: "
    "its first step would train a batch of the epoch before. Give each rank more data per "
    "epoch, or resume from a checkpoint of ModelCheckpoint(every_n_train_steps=...) "
    "(docs/trainers.md)"
)
