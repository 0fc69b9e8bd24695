"""A dataset's state dicts: of an iteration's progress, or of a start no iteration has begun;
and ``FINISHED``, the mark of a state taken after its epoch's last batch by a loader whose
epochs a trainer moves."""

from __future__ import annotations

import warnings
from typing import Any

from ..mixing.epochs import AnyProgress, MixedEpochs, MixedProgress
from ..mixing.state import encode_mixture
from ..planning.epochs import Epochs, Start

__all__ = ["FINISHED", "at_epoch_end", "encoded", "start_state", "warn_epoch_again"]

# The key of a state taken after its epoch's last batch by a loader whose epochs a trainer
# moves (Lightning and Fabric through the sampler's set_epoch, StructuredTrainer): loaded, it
# continues with the next epoch, for a trainer restores it as mid-epoch and may read from the
# loader before it moves the epoch. Any other state taken there resumes to the empty rest of
# its epoch (a loop's own set_epoch then starts the next).
FINISHED = "finished"


def encoded(
    epochs: Epochs | MixedEpochs, progress: AnyProgress, trainer_epochs: bool
) -> dict[str, Any]:
    """The state dict of ``progress``; with ``trainer_epochs``, ``FINISHED`` once every stream
    has finished its epoch."""
    if isinstance(progress, MixedProgress):
        state = encode_mixture(progress.mix, progress)
    else:
        assert isinstance(epochs, Epochs)
        state = epochs.encode(progress)
    if trainer_epochs and progress.ended():
        state[FINISHED] = True
    return state


def start_state(epochs: Epochs | MixedEpochs, start: Start, workers: int | None) -> dict[str, Any]:
    """The state dict of an iteration from ``start`` not begun yet, with ``workers``
    DataLoader workers (``start``'s own, if it came from a state)."""
    if start.checkpoint_workers is not None:
        workers = start.checkpoint_workers
    if isinstance(epochs, MixedEpochs):
        progress = epochs.begin(start, workers or 0)
        return encode_mixture(progress.mix, progress)
    return epochs.encode_start(start, workers or 0)


def at_epoch_end(epochs: Epochs | MixedEpochs, start: Start, workers: int | None) -> bool:
    """Whether an iteration from ``start`` (a loaded state's), with ``workers`` DataLoader
    workers (``None``: the state's own), starts at the end of its epoch."""
    if start.positions is None and not start.generations:
        return False
    if start.positions is not None and None in start.positions:  # a worker copy's state
        return False
    if workers is None:  # no loader yet: the state's own
        workers = start.checkpoint_workers or 0
    return epochs.begin(start, workers).ended()


def warn_epoch_again(epoch: int, finished: int) -> None:
    """Warn that ``set_epoch(epoch)`` trains an epoch again after loading a state taken at the
    end of epoch ``finished``, which continued with ``finished + 1``: ``finished`` itself, or
    ``finished + 1`` iterated since (a loop counting epochs from the checkpoint's instead of
    ``dataset.epoch``)."""
    since = ", iterated since" if epoch == finished + 1 else ""
    warnings.warn(
        f"set_epoch({epoch}) trains epoch {epoch} again: the state loaded was taken at the "
        f"end of epoch {finished} and continued with epoch {finished + 1}{since}. After "
        f"load_state_dict count epochs from dataset.epoch (README) and call set_epoch only "
        f"for the ones after it.",
        stacklevel=3,
    )
