"""``StructuredDataset``: a resumable IterableDataset over Parquet/Arrow files.

The class builds the index and keeps one value, the ``Start`` of the next iteration; the pure
epoch logic lives in ``planning.epochs`` and the reading of one stream in ``reading.reader``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from ..base.args import (
    PathArg,
    dataset_paths,
    flag,
    optional_flag,
    optional_mapping,
    optional_whole,
    whole,
)
from ..base.log import log
from ..base.world import World, detect_ranks, detect_worker
from ..checkpoint import distributed
from ..checkpoint.state import check_shape as state_shape
from ..formats import get_format
from ..index.index import DatasetIndex, build_index
from ..mixing.epochs import NO_CARRY, AnyProgress, MixedEpochs, MixedProgress, source_seed
from ..mixing.places import MixPosition
from ..mixing.resume import load_mixture, load_mixture_elastic
from ..mixing.schedule import MAX_BLOCK, Schedule
from ..mixing.source import (
    MAX_EPOCH_SIZE,
    Source,
    check_schemas,
    mixture_sources,
    source_column_name,
)
from ..mixing.state import check_shape as mixture_shape
from ..mixing.state import encode_mixture
from ..mixing.stream import MixedSource
from ..mixing.timeline import Timeline
from ..planning.config import DEFAULT_SHUFFLE_MEMORY_BYTES, DEFAULT_SPLIT_BYTES, DatasetConfig
from ..planning.epochs import Epochs, Progress, Start
from ..planning.tokens import TokenPacking
from ..reading.convert import warm_up
from ..reading.reader import StreamReader
from ..reading.stream import ChunkSource, SourceFiles
from ..storage.filesystem import Storage
from ..transport.slots import SharedSlots
from .handout import Mark
from .loader import StructuredDataLoader
from .served import ServedDataset

__all__ = ["Iteration", "StructuredDataset"]


# Decoded chunks a main-process stream reads ahead, in a thread, of the batch being converted.
# Worker streams do not: the DataLoader already overlaps them with the main process.
_READ_AHEAD = 2


@dataclass(frozen=True)
class Iteration:
    """The iteration our loader is starting: where it starts, and the slots its workers pack
    into (``None`` without workers). Worker copies of the dataset carry it."""

    start: Start
    slots: SharedSlots | None = None


class StructuredDataset(ServedDataset):
    """Streams Parquet/Arrow files as batches of exactly ``batch_size`` rows, resumable exactly.

    Files are cut into splits of at most ``split_bytes`` stored bytes on row-group / record-batch
    boundaries and ordered per epoch (shuffled with ``shuffle_seed`` if ``shuffle``); the epoch's
    rows are dealt to the streams (rank, DataLoader worker) in contiguous shares that differ by
    at most one row. With ``shuffle`` each stream hands its rows out in a random order inside
    windows that hold blocks from all over its share, two windows filling
    ``shuffle_memory_bytes`` (``docs/shuffle.md``). ``state_dict()`` records each stream's
    position by content; ``load_state_dict()`` continues exactly there.

    ``even_batches`` (default: on when ``world_size > 1``) gives every rank the same number of
    rows, dealt alike to its workers, so every rank yields the same number of batches, as DDP
    needs; the fewer than ``world_size`` rows left over are left out of the epoch (logged, and
    recorded as consumed). ``packing`` (a ``TokenPacking``) turns a token column into batches
    of fixed-length sequences, resumable to the token. ``share_index=True`` makes building the
    dataset a collective under ``torch.distributed``: rank 0 reads the footers and the other
    ranks receive the index (every rank must build it together). Arguments:
    ``docs/usage.md``; the state: ``docs/checkpoints.md``.
    """

    def __init__(
        self,
        path: PathArg | Mapping[str, PathArg | Source],
        format: str = "parquet",
        *,
        batch_size: int = 1024,
        columns: Sequence[str] | None = None,
        shuffle: bool = False,
        shuffle_seed: int = 0,
        shuffle_memory_bytes: int = DEFAULT_SHUFFLE_MEMORY_BYTES,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        rank: int | None = None,
        world_size: int | None = None,
        output: str = "torch",
        transform: Callable[[Any], Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        drop_last: bool = False,
        even_batches: bool | None = None,
        packing: TokenPacking | None = None,
        share_index: bool = False,
        weights: Mapping[str, int] | None = None,
        epoch_size: int | None = None,
        source_column: str | None = "source",
        schedule_block: int | None = None,
    ) -> None:
        super().__init__()
        even = optional_flag("even_batches", even_batches)
        share_index = flag("share_index", share_index)
        config = DatasetConfig(
            format=format,
            batch_size=batch_size,
            columns=DatasetConfig.columns_from(columns),
            shuffle=flag("shuffle", shuffle),
            shuffle_seed=shuffle_seed,
            shuffle_memory_bytes=shuffle_memory_bytes,
            split_bytes=split_bytes,
            output=output,
            transform=transform,
            drop_last=flag("drop_last", drop_last),
            packing=packing,
        )
        self._rank, self._world_size = detect_ranks(
            optional_whole("rank", rank, at_least=0),
            optional_whole("world_size", world_size, at_least=1),
        )
        World(self._rank, self._world_size)  # validates the pair
        even = self._world_size > 1 if even is None else even
        self._epochs: Epochs | MixedEpochs
        self._opened: tuple[SourceFiles, ...]
        if isinstance(path, Mapping):
            self._epochs, self._opened = self._mixture(
                path, weights, config, storage_options, share_index, even,
                epoch_size=optional_whole("epoch_size", epoch_size, at_least=1,
                                          at_most=MAX_EPOCH_SIZE),
                source_column=source_column_name(source_column, packed=packing is not None),
                schedule_block=optional_whole("schedule_block", schedule_block, at_least=1,
                                              at_most=MAX_BLOCK),
            )  # fmt: skip
        else:
            if weights is not None or epoch_size is not None or schedule_block is not None:
                raise TypeError(
                    "weights=, epoch_size= and schedule_block= are for a mixture: pass path "
                    "as a mapping of source names to paths (docs/mixing.md)"
                )
            index, opened = self._source(path, config, storage_options, share_index)
            self._epochs = Epochs(
                index=index,
                config=config,
                rank=self._rank,
                world_size=self._world_size,
                even_batches=even,
            )
            self._opened = (opened,)
        if packing is not None:
            packing.check(self._epochs.schema)
        warm_up(self._epochs.schema, config.output)
        self._loader_workers: int | None = None  # the num_workers of our loader, once known
        self._start = Start.fresh(0)
        self._handoff: Iteration | None = None  # the iteration our loader is starting
        self._progress: AnyProgress | None = None
        self._resumed = False
        self._finished: int | None = None  # the epoch a loaded state had finished
        self._trainer_epochs = False  # a trainer moves the epochs: states say ``finished``

    def _source(
        self,
        path: object,
        config: DatasetConfig,
        storage_options: Mapping[str, Any] | None,
        share_index: bool,
    ) -> tuple[DatasetIndex, SourceFiles]:
        """The index of one dataset's files, and how to read them."""
        path = dataset_paths("path", path)
        first = path if isinstance(path, str) else next(iter(path), "")
        storage = Storage(first, optional_mapping("storage_options", storage_options))
        fmt = get_format(config.format)
        # a collective only when asked for: the library calls dist.* only where told to
        shared = share_index and distributed.spans_process_group(self._rank, self._world_size)
        job = distributed if shared else None
        index = build_index(storage, fmt, path, config.read_columns, config.split_bytes, job=job)
        files = SourceFiles(
            storage=storage,
            fmt=fmt,
            columns=config.read_columns,
            memory_bytes=config.shuffle_memory_bytes,
        )
        return index, files

    def _mixture(
        self,
        paths: Mapping[str, PathArg | Source],
        weights: Mapping[str, int] | None,
        config: DatasetConfig,
        storage_options: Mapping[str, Any] | None,
        share_index: bool,
        even: bool,
        *,
        epoch_size: int | None,
        source_column: str | None,
        schedule_block: int | None,
    ) -> tuple[MixedEpochs, tuple[SourceFiles, ...]]:
        """The epochs of a mixture of ``paths`` and how to read each source."""
        if config.packing is not None and epoch_size is None:
            raise ValueError(
                "a packed mixture needs epoch_size= (packed sequences per epoch, over all "
                "ranks): how many sequences its sources make depends on their tokens"
            )
        specs = mixture_sources(
            paths, weights, format=config.format, storage_options=storage_options,
            split_bytes=config.split_bytes, shuffle_memory_bytes=config.shuffle_memory_bytes,
        )  # fmt: skip
        sources, files = [], []
        for spec in specs:
            try:
                own = replace(
                    config, format=spec.format, split_bytes=spec.split_bytes,
                    shuffle_seed=source_seed(config.shuffle_seed, spec.name),
                    shuffle_memory_bytes=spec.memory_bytes,
                )  # fmt: skip
            except ValueError as exc:
                raise ValueError(f"source {spec.name!r}: {exc}") from exc
            index, opened = self._source(spec.path, own, spec.storage_options, share_index)
            sources.append(
                Epochs(index=index, config=own, rank=self._rank, world_size=self._world_size,
                       even_batches=False)
            )  # fmt: skip
            files.append(opened)
        names = tuple(spec.name for spec in specs)
        check_schemas(names, [epochs.index.schema for epochs in sources])
        if source_column is not None and source_column in sources[0].index.schema.names:
            raise ValueError(
                f"the sources have a column {source_column!r}, the name of the column that "
                f"tells each row's source: pass source_column= another name"
            )
        total = sum(int(epochs.index.split_rows.sum()) for epochs in sources)
        schedule = Schedule(
            tuple(spec.weight for spec in specs), block=schedule_block or 0,
            seed=config.shuffle_seed,
        )  # fmt: skip
        timeline = Timeline(
            names,
            schedule,
            total if epoch_size is None else epoch_size,
            max_epochs=tuple(spec.max_epochs for spec in specs),
            stops=tuple(spec.stops for spec in specs),
        )
        _check_policies(timeline, config, even and self._world_size > 1)
        mix = MixedEpochs(
            timeline=timeline,
            sources=tuple(sources),
            source_names=names,
            config=config,
            rank=self._rank,
            world_size=self._world_size,
            even_batches=even,
            source_column=source_column,
        )
        return mix, tuple(files)

    @classmethod
    def create_dataloader(
        cls,
        path: PathArg | Mapping[str, PathArg | Source],
        format: str = "parquet",
        *,
        batch_size: int = 1024,
        columns: Sequence[str] | None = None,
        shuffle: bool = False,
        shuffle_seed: int = 0,
        shuffle_memory_bytes: int = DEFAULT_SHUFFLE_MEMORY_BYTES,
        num_workers: int = 0,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        rank: int | None = None,
        world_size: int | None = None,
        output: str = "torch",
        transform: Callable[[Any], Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        drop_last: bool = False,
        even_batches: bool | None = None,
        packing: TokenPacking | None = None,
        share_index: bool = False,
        weights: Mapping[str, int] | None = None,
        epoch_size: int | None = None,
        source_column: str | None = "source",
        schedule_block: int | None = None,
        **dataloader_kwargs: Any,
    ) -> tuple[StructuredDataLoader, StructuredDataset]:
        """``(loader, dataset)``: the loader records what it hands out and resumes exactly."""
        if "shuffle_window" in dataloader_kwargs:
            raise TypeError(_NO_SHUFFLE_WINDOW)
        dataset = cls(
            path,
            format,
            batch_size=batch_size,
            columns=columns,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            shuffle_memory_bytes=shuffle_memory_bytes,
            split_bytes=split_bytes,
            rank=rank,
            world_size=world_size,
            output=output,
            transform=transform,
            storage_options=storage_options,
            drop_last=drop_last,
            even_batches=even_batches,
            packing=packing,
            share_index=share_index,
            weights=weights,
            epoch_size=epoch_size,
            source_column=source_column,
            schedule_block=schedule_block,
        )
        return StructuredDataLoader(dataset, num_workers=num_workers, **dataloader_kwargs), dataset

    # ----------------------------------------------------------------- epochs and checkpoints

    @property
    def epoch(self) -> int:
        """The epoch the next iteration belongs to (``set_epoch``, or a loaded checkpoint's)."""
        return self._start.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` afresh (its own permutation); discards any progress or loaded state.

        A packed mixture's epoch after the first continues each source where the epoch before
        it ended, or starts again where it began, as far as this process knows either (a
        ``ValueError`` otherwise: load the state saved at the end of the epoch before)."""
        epoch = whole("epoch", epoch, at_least=0)  # -1 means "a resume" to persistent workers
        if self._after_finished(epoch):
            return
        start = self._carried(epoch)
        packed_mixture = (
            isinstance(self._epochs, MixedEpochs) and self._epochs.config.packing is not None
        )
        if start is None and epoch and packed_mixture:  # where its sources stand is unknown
            raise ValueError(NO_CARRY.format(epoch=epoch))
        if self._resumed and epoch == self.epoch:
            warnings.warn(
                f"set_epoch({epoch}) after load_state_dict discards the checkpoint's progress in "
                f"epoch {epoch}; the epoch restarts from its first batch. Call set_epoch only "
                f"for the epochs after the resumed one.",
                stacklevel=2,
            )
        self._start = start or Start.fresh(epoch)
        self._progress = None
        self._resumed = False

    def _carried(self, epoch: int) -> Start | None:
        """A packed mixture's ``epoch`` continuing each source where the epoch before it
        stands (iterated here, or loaded), or again from where it began; ``None`` otherwise."""
        if not isinstance(self._epochs, MixedEpochs) or self._epochs.config.packing is None:
            return None
        start = self._start
        before: Sequence[object] | None = start.positions
        if isinstance(self._progress, MixedProgress) and self._progress.epoch == epoch - 1:
            workers = max(1, self._progress.num_workers)
            before = [self._progress.positions.get(w) for w in range(workers)]
        elif start.epoch == epoch and start.positions and all(p == 0 for p in start.positions):
            # its beginning (of this timeline's, not an elastic resume's rest)
            return start if self._epochs.timeline.begins(epoch) else None
        elif start.epoch != epoch - 1:
            return None
        if before is None or not all(isinstance(p, MixPosition) for p in before):
            return None
        positions = tuple(MixPosition(0, p.sources) for p in before if isinstance(p, MixPosition))
        return Start(epoch=epoch, positions=positions, checkpoint_workers=len(positions))

    def state_dict(self) -> dict[str, Any]:
        """What the training loop has been handed in this epoch, by content (JSON-safe)."""
        if self._progress is not None:
            return _encoded(self._epochs, self._progress, self._trainer_epochs)
        return self._start_state(self._start)

    def _start_state(self, start: Start) -> dict[str, Any]:
        workers = self._known_workers()
        if start.checkpoint_workers is not None:
            workers = start.checkpoint_workers
        if isinstance(self._epochs, MixedEpochs):
            progress = self._epochs.begin(start, workers or 0)
            return encode_mixture(progress.mix, progress)
        return self._epochs.encode_start(start, workers or 0)

    def load_state_dict(
        self,
        state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        elastic: bool = False,
        reweight: bool = False,
    ) -> None:
        """Continue from ``state`` at the next iteration; call before iterating.

        ``elastic=True`` takes the list of every old rank's state (or one state) and re-deals
        what they had not delivered to the current ranks and workers: each row exactly once,
        in a different order. Raises ``CheckpointMismatchError`` when files or settings differ.
        ``reweight=True`` (a mixture) continues a state saved under other weights, sources or
        ``epoch_size`` under the current ones, each source from where it stood.
        """
        workers = self._known_workers()
        reweight = flag("reweight", reweight)
        if isinstance(self._epochs, MixedEpochs) and isinstance(state, Mapping) and not elastic:
            start, self._epochs = load_mixture(self._epochs, state, workers, reweight=reweight)
        elif flag("elastic", elastic):
            states = [state] if isinstance(state, Mapping) else list(state)
            if isinstance(self._epochs, MixedEpochs):
                start, self._epochs = load_mixture_elastic(self._epochs, states, workers or 0)
            else:
                start = self._epochs.load_elastic(states, workers or 0)
        elif isinstance(state, Mapping):
            assert isinstance(self._epochs, Epochs)
            start = self._epochs.load(state, workers)
        else:
            raise TypeError(
                f"load_state_dict takes a state dict, got {type(state).__name__}; a list "
                f"of every rank's states needs elastic=True"
            )
        self._start = start
        self._progress = None
        self._resumed = True
        self._finished = None
        given = [state] if isinstance(state, Mapping) else list(state)
        if all(s.get(FINISHED) is True for s in given) and self._ended():
            # taken after the epoch's last batch: the next epoch comes next
            self._finished = self.epoch
            self._start = self._carried(self.epoch + 1) or Start.fresh(self.epoch + 1)
            self._resumed = False

    def save_state_global(self, dst_rank: int = 0) -> list[dict[str, Any]] | None:
        """Collective: every rank's ``state_dict()`` on ``dst_rank`` (``None`` elsewhere)."""
        return distributed.gather_states(self.state_dict(), dst_rank)

    def restore_state_global(
        self,
        states: Sequence[Mapping[str, Any]] | None,
        src_rank: int | None = 0,
        *,
        elastic: bool = False,
    ) -> None:
        """Collective: load this rank's state from the list held by ``src_rank``.

        ``src_rank=None`` means every rank already holds the full list. With ``elastic=True``
        the list may come from a job with another ``world_size``/``num_workers``.
        """
        mixture = isinstance(self._epochs, MixedEpochs)
        mine = distributed.scatter_states(
            states, src_rank, self._rank, self._world_size, elastic=elastic,
            check=mixture_shape if mixture else state_shape,
        )  # fmt: skip
        if src_rank is None:  # every rank holds the list: no communication at all
            self.load_state_dict(mine, elastic=elastic)
            return
        before = (self._start, self._epochs, self._progress, self._resumed)
        try:
            distributed.agree(lambda: self.load_state_dict(mine, elastic=elastic))
        except Exception:  # another rank's load failed: this one's is undone too
            self._start, self._epochs, self._progress, self._resumed = before
            raise

    @property
    def _index(self) -> DatasetIndex:
        """The index of a dataset of one source (tests and tools look at it)."""
        assert isinstance(self._epochs, Epochs)
        return self._epochs.index

    def _known_workers(self) -> int | None:
        """The DataLoader's ``num_workers``: for sure inside a worker, else our loader's."""
        worker = detect_worker()
        return worker[1] if worker is not None else self._loader_workers

    def _after_finished(self, epoch: int) -> bool:
        """``set_epoch(epoch)`` after loading a state taken at the end of an epoch ``f``, which
        continues with epoch ``f + 1``: for ``f + 1`` not iterated yet, already there (True:
        nothing to do, as before this meaning of the state). Warns where it trains an epoch
        again: ``f``, or ``f + 1`` iterated since (a loop counting epochs from the
        checkpoint's instead of ``dataset.epoch``)."""
        finished, self._finished = self._finished, None
        if finished is None or epoch not in (finished, finished + 1):
            return False
        if epoch == finished + 1 and self._progress is None:
            return True
        since = ", iterated since" if epoch == finished + 1 else ""
        warnings.warn(
            f"set_epoch({epoch}) trains epoch {epoch} again: the state loaded was taken at the "
            f"end of epoch {finished} and continued with epoch {finished + 1}{since}. After "
            f"load_state_dict count epochs from dataset.epoch (README) and call set_epoch only "
            f"for the ones after it.",
            stacklevel=3,
        )
        return False

    def _ended(self) -> bool:
        """Whether the next iteration starts at the end of its epoch (a loaded state taken
        after the epoch's last batch): it would hand out nothing."""
        start = self._start
        if start.positions is None and not start.generations:
            return False
        if start.positions is not None and None in start.positions:  # a worker copy's state
            return False
        workers = self._known_workers()
        if workers is None:  # no loader yet: the state's own
            workers = start.checkpoint_workers or 0
        return self._epochs.begin(start, workers).ended()

    # ----------------------------------------------------------------- iteration

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (with the loader's ``num_workers``)."""
        if isinstance(self._epochs, MixedEpochs):
            return self._epochs.batches(self._start, self._loader_workers or 0)
        if self._epochs.config.packing is not None:
            raise TypeError(
                "a packed dataset has no len(): its batches count tokens, which the files' "
                "metadata does not give; train for a number of steps, or count an epoch once"
            )
        return self._epochs.batches(self._start, self._loader_workers or 0)

    def __iter__(self) -> Iterator[Any]:
        handoff = self._handoff
        if self._loader_workers is not None and handoff is None:
            raise RuntimeError(_NOT_OUR_LOADER)
        worker = detect_worker()
        if worker is None:  # main process: this iteration consumes the loaded start
            if handoff is not None:  # the one our loader (num_workers=0) has begun
                assert self._progress is not None
                return self._deliver(0, self._progress, read_ahead=_READ_AHEAD)
            with self._iteration(0) as progress:  # no worker to hand it to
                return self._deliver(0, progress, read_ahead=_READ_AHEAD)
        iteration = handoff or Iteration(self._start)
        start = iteration.start
        if iteration.slots is not None and (epoch := iteration.slots.fresh_epoch()) is not None:
            start = Start.fresh(epoch)  # persistent worker
        progress = self._begin(start, worker[1], workers=[worker[0]])
        if iteration.slots is not None:
            return self._reader(progress, worker[0]).packets(iteration.slots, worker[0])
        self._progress = progress
        return self._deliver(worker[0], progress)

    # ----------------------------------------------------------------- our loader's side

    def _attach_loader(self, num_workers: int) -> None:
        """Our loader's ``num_workers`` (``len()`` and states count its streams); from now on
        only iterations it begins (``_iteration``) may read this dataset."""
        self._loader_workers = num_workers

    def _batch_bytes(self) -> int:
        """About how many bytes a batch holds (to size our loader's shared memory)."""
        return self._epochs.config.batch_bytes(self._epochs.schema)

    def _mark(self) -> Mark:
        """Where delivery stands now (before our loader hands out its next batch)."""
        progress = self._progress
        if progress is None:
            return Mark(progress=None, positions={}, cursor=0, start=self._start)
        return Mark(
            progress=progress,
            positions=dict(progress.positions),
            cursor=progress.cursor,
            start=self._start,
        )

    def _state_at(self, mark: Mark) -> dict[str, Any]:
        """The state dict as it was at ``mark``."""
        if mark.progress is None:
            return self._start_state(mark.start)
        then = replace(mark.progress, positions=dict(mark.positions), cursor=mark.cursor)
        then._entries = {}
        return _encoded(self._epochs, then, self._trainer_epochs)

    @property
    def _next_start(self) -> Start:
        """Where the next iteration starts (a frozen value)."""
        return self._start

    @contextmanager
    def _iteration(
        self, num_workers: int, slots: SharedSlots | None = None
    ) -> Iterator[AnyProgress]:
        """Main process: the progress of the iteration that starts inside the block (its
        workers forked there, or, without workers, the ``iter()`` the DataLoader calls there).

        Validates the start for ``num_workers`` and logs what even_batches leaves out; after
        the block, later iterations start the epoch afresh unless a state is loaded again.
        """
        progress = self._begin(self._start, num_workers)
        _log_start(progress)
        self._progress = progress
        self._handoff = Iteration(self._start, slots)
        try:
            yield progress
        finally:
            self._handoff = None
            self._start = self._carried(self.epoch) or Start.fresh(self.epoch)
            self._resumed = False

    def _begin(
        self, start: Start, num_workers: int, workers: Sequence[int] | None = None
    ) -> AnyProgress:
        """The progress of an iteration from ``start``. A mixture that restarts an epoch a
        loaded state changed mid-way is the mixture as built from then on (its next epochs
        too, so that a state saved in it resumes exactly): in the main process and in every
        worker's copy alike, each of which begins the same iterations."""
        progress = self._epochs.begin(start, num_workers, workers)
        if isinstance(progress, MixedProgress):
            self._epochs = progress.mix
        return progress

    def _deliver(self, worker: int, progress: AnyProgress, read_ahead: int = 0) -> Iterator[Any]:
        """Batches of one stream, recording each position before handing the batch out."""
        for batch, position in self._reader(progress, worker).batches(read_ahead=read_ahead):
            progress.record(worker, position, cursor=0)
            yield batch

    def _describe_stream(self, progress: AnyProgress, worker: int, position: int) -> str:
        """The split(s) of stream ``worker`` that hold the rows just before ``position``."""
        return self._reader(progress, worker).source.describe_at(position)

    def _reader(self, progress: AnyProgress, worker: int) -> StreamReader:
        config = self._epochs.config
        source: ChunkSource
        if isinstance(progress, MixedProgress):
            source = MixedSource(progress, worker, self._opened)
        else:
            source = self._opened[0].stream(progress.orders[worker])
        return StreamReader(
            source=source,
            config=config,
            start=progress.positions[worker],
            skips=progress.skips.get(worker, {}) if isinstance(progress, Progress) else {},
        )


_NO_SHUFFLE_WINDOW = (
    "shuffle_window was removed: a shuffled stream now hands out its rows in a random order "
    "inside windows sized by shuffle_memory_bytes (docs/shuffle.md); drop shuffle_window and "
    "pass shuffle_memory_bytes to trade memory for mixing"
)

# A DataLoader rebuilt over a dataset whose StructuredDataLoader exists would read ahead of the
# training loop, or let workers deliver batches the state never records: rows lost or repeated.
_NOT_OUR_LOADER = (
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


def _check_policies(timeline: Timeline, config: DatasetConfig, lockstep: bool) -> None:
    """Refuse exhaustion policies the mixture cannot honour: packed (a source runs out when
    its tokens do, known only by reading), or ending streams at different batches under DDP."""
    if not timeline.policies:
        return
    if timeline.schedule.block:
        raise ValueError(
            "schedule_block with max_epochs is not supported: where a source runs out is "
            "closed-form arithmetic on the schedule in order"
        )
    if config.packing is not None:
        raise ValueError(
            f"max_epochs with packing is not supported yet (sources {list(timeline.policies)}): "
            f"a packed source runs out when its tokens do"
        )
    limited = all(m is not None for m in timeline.max_epochs)
    if lockstep and (any(timeline.stops) or limited):
        raise ValueError(
            "under DDP with even_batches, a mixture's streams must not end (each would end at "
            "its own batch, and DDP would hang): let at least one source cycle (no "
            "max_epochs) and use when_exhausted='renormalize'"
        )


def _encoded(
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


# The key of a state taken after its epoch's last batch by a loader whose epochs a trainer
# moves (Lightning and Fabric through the sampler's set_epoch, StructuredTrainer): loaded, it
# continues with the next epoch, for a trainer restores it as mid-epoch and may read from the
# loader before it moves the epoch. Any other state taken there resumes to the empty rest of
# its epoch (a loop's own set_epoch then starts the next).
FINISHED = "finished"


def _log_start(progress: AnyProgress) -> None:
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
