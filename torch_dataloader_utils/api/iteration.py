"""One iteration of a dataset: what our loader hands the dataset's copies in its workers
(``Iteration``), the reader of one of its streams, and what the log says where it starts."""

from __future__ import annotations

from dataclasses import dataclass

from ..base.log import log
from ..mixing.epochs import AnyProgress, MixedProgress
from ..mixing.stream import MixedSource
from ..planning.config import DatasetConfig
from ..planning.epochs import Progress, Start
from ..reading.reader import StreamReader
from ..reading.stream import ChunkSource, SourceFiles
from ..transport.slots import SharedSlots

__all__ = ["NOT_OUR_LOADER", "READ_AHEAD", "Iteration", "log_start", "stream_reader"]

# Decoded chunks a main-process stream reads ahead, in a thread, of the batch being converted.
# Worker streams do not: the DataLoader already overlaps them with the main process.
READ_AHEAD = 2

# A DataLoader rebuilt over a dataset whose StructuredDataLoader exists would read ahead of the
# training loop, or let workers deliver batches the state never records: rows lost or repeated.
NOT_OUR_LOADER = (
    "this StructuredDataset is being iterated by a DataLoader other than the StructuredDataLoader "
    "created for it, so its state_dict() would not be what the training loop consumed (rows "
    "lost or repeated on resume). Likely cause: a trainer rebuilt the loader from loader.dataset "
    "(e.g. Accelerate's skip_first_batches, which transformers.Trainer calls to resume "
    "mid-epoch, or prepare_data_loader). With transformers.Trainer, train with "
    "torch_dataloader_utils.integrations.hf.StructuredTrainer(model=..., args=..., "
    "train_dataloader=loader) (or StructuredTrainerMixin for a Trainer subclass): it saves the "
    "loader's state in each checkpoint and resumes from it. Elsewhere, iterate the loader from "
    "create_dataloader itself and resume with loader.load_state_dict(state) (docs/trainers.md)"
)


@dataclass(frozen=True)
class Iteration:
    """The iteration our loader is starting: where it starts, and the slots its workers pack
    into (``None`` without workers). Worker copies of the dataset carry it."""

    start: Start
    slots: SharedSlots | None = None


def stream_reader(
    progress: AnyProgress, worker: int, config: DatasetConfig, opened: tuple[SourceFiles, ...]
) -> StreamReader:
    """The reader of stream ``worker`` of ``progress``, from the files ``opened`` (one per
    source), from where the stream stands."""
    source: ChunkSource
    if isinstance(progress, MixedProgress):
        source = MixedSource(progress, worker, opened)
    else:
        source = opened[0].stream(progress.orders[worker])
    return StreamReader(
        source=source,
        config=config,
        start=progress.positions[worker],
        skips=progress.skips.get(worker, {}) if isinstance(progress, Progress) else {},
    )


def log_start(progress: AnyProgress) -> None:
    """Log where this rank's streams start (a resume), and what even_batches leaves out."""
    if isinstance(progress, MixedProgress):
        log.info(
            "mixture %s, epoch %d: rank %d starts at positions %s of its %d stream(s)",
            progress.mix.weights, progress.epoch, progress.mix.rank,
            list(progress.positions.values()), len(progress.positions),
        )  # fmt: skip
        return
    plan = progress.plan
    settings = progress.settings
    left_out = progress.left_out()
    if left_out:
        log.info(
            "even_batches: %d row(s) of epoch %d left out so that every one of %d rank(s) "
            "reads %d rows (set even_batches=False to deliver every row)",
            left_out, plan.epoch, plan.world_size, int(plan.rank_shares(0).sum()),
        )  # fmt: skip
    if any(progress.positions.values()):
        log.info(
            "rank %d resumes epoch %d at rows %s of its %d stream(s)",
            settings.rank, plan.epoch, list(progress.positions.values()), len(progress.positions),
        )  # fmt: skip
