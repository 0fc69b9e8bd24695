"""Lightning ``Trainer``: every process's loader state in the checkpoint.

With one process Lightning needs nothing: it saves ``loader.state_dict()`` in its checkpoint
and loads it on ``fit(ckpt_path=...)``, the loader leaves out the batch Lightning's fetcher
holds ahead when the loader has no ``len()``, and Lightning's ``sampler.set_epoch`` at each
epoch's start moves the loader to its epoch (docs/trainers.md, "Epochs"). With several
processes (DDP) Lightning writes the checkpoint of process 0 only, so every process would
load process 0's state (and refuse it: ``CheckpointMismatchError``). ``LoaderStatesPerRank``
gathers each process's states into the checkpoint and gives each its own back on load.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from ..api.loader import StructuredDataLoader
from ..base.compat import LIGHTNING_LOADER_STATES

__all__ = ["DataStats", "LoaderStatesPerRank"]

# Where the states of every process go in the checkpoint, beside Lightning's own (process 0's).
KEY = "torch_dataloader_utils/loader_states_per_rank"


class LoaderStatesPerRank(Callback):
    """Keep every process's training loader state in Lightning's checkpoint (DDP).

    ``Trainer(callbacks=[LoaderStatesPerRank(), ...])``. Saving is collective (every process
    sends its states to the others; Lightning saves on all of them at once); loading gives
    each process the states it saved. Resume with as many processes as saved.
    """

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        mine = _lightning_states(checkpoint)
        if mine is None:
            return
        everyone: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        checkpoint[KEY] = everyone

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        everyone = checkpoint.get(KEY)
        if everyone is None or _lightning_states(checkpoint) is None:
            return
        if len(everyone) != trainer.world_size:
            raise ValueError(
                f"the checkpoint holds the loader states of {len(everyone)} process(es), this "
                f"run has {trainer.world_size}: resume with {len(everyone)} process(es), or "
                f"load checkpoint[{KEY!r}] yourself with load_state_dict(states, elastic=True) "
                f"(docs/ddp.md)"
            )
        loop = checkpoint
        for key in LIGHTNING_LOADER_STATES[:-1]:
            loop = loop[key]
        loop[LIGHTNING_LOADER_STATES[-1]] = everyone[trainer.global_rank]


class DataStats(Callback):
    """Logs ``loader.stats()``'s key figures (``data/wait_fraction``, ``data/rows_per_second``,
    ..., ``LoaderStats.metrics()``) with the module's own metrics, every
    ``log_every_n_steps`` training batches: ``Trainer(callbacks=[DataStats(loader)])``."""

    def __init__(self, loader: StructuredDataLoader, recent_seconds: float = 10.0) -> None:
        self.loader = loader
        self.recent_seconds = recent_seconds

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = int(getattr(trainer, "log_every_n_steps", 50))  # set by Trainer(...), undeclared
        if batch_idx % max(1, every):
            return
        pl_module.log_dict(self.loader.stats(self.recent_seconds).metrics(), on_step=True)


def _lightning_states(checkpoint: dict[str, Any]) -> Any:
    """The loader states Lightning put in ``checkpoint`` (this process's), if any."""
    found: Any = checkpoint
    for key in LIGHTNING_LOADER_STATES:
        if not isinstance(found, dict) or key not in found:
            return None
        found = found[key]
    return found
