"""``StructuredDataset``: a resumable IterableDataset over Parquet/Arrow files.

The class keeps one value, the ``Start`` of the next iteration; what it iterates is built in
``api.build``, its state dicts in ``api.states``, an iteration's hand-off in ``api.iteration``;
the pure epoch logic lives in ``planning.epochs`` and the reading of one stream in ``reading``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ..base.args import PathArg, flag, optional_flag, optional_whole, whole
from ..base.errors import EpochStartError
from ..base.world import World, detect_ranks, detect_worker
from ..checkpoint import distributed
from ..checkpoint.schema import check_shape as state_shape
from ..index.index import DatasetIndex
from ..mixing.carry import carried_start
from ..mixing.epochs import NO_CARRY, AnyProgress, MixedEpochs, MixedProgress
from ..mixing.resume import load_mixture, load_mixture_elastic
from ..mixing.source import Source
from ..mixing.state import check_shape as mixture_shape
from ..planning.config import DEFAULT_SHUFFLE_MEMORY_BYTES, DEFAULT_SPLIT_BYTES, DatasetConfig
from ..planning.epochs import Epochs, Start
from ..planning.text import Tokenize
from ..planning.tokens import TokenPacking
from ..reading.convert import warm_up
from ..reading.reader import StreamReader
from ..transport.slots import SharedSlots
from .build import build_epochs
from .handout import Mark
from .iteration import NOT_OUR_LOADER, READ_AHEAD, Iteration, log_start, stream_reader
from .loader import StructuredDataLoader
from .served import ServedDataset
from .states import FINISHED, at_epoch_end, encoded, start_state, warn_epoch_again

__all__ = ["StructuredDataset"]


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
    of fixed-length sequences, resumable to the token; ``tokenize`` (a ``Tokenize``) turns a
    text column into tokens first, in the workers (``docs/text.md``). ``share_index=True``
    makes building the dataset a collective under ``torch.distributed``: rank 0 reads the
    footers and the other ranks receive the index (every rank must build it together). Arguments:
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
        tokenize: Tokenize | None = None,
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
            tokenize=tokenize,
        )
        self._rank, self._world_size = detect_ranks(
            optional_whole("rank", rank, at_least=0),
            optional_whole("world_size", world_size, at_least=1),
        )
        world = World(self._rank, self._world_size)  # validates the pair
        self._epochs, self._opened = build_epochs(
            path, config, world=world,
            even_batches=self._world_size > 1 if even is None else even,
            storage_options=storage_options, share_index=share_index, weights=weights,
            epoch_size=epoch_size, source_column=source_column, schedule_block=schedule_block,
        )  # fmt: skip
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
        tokenize: Tokenize | None = None,
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
            tokenize=tokenize,
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
        # the epoch a state loaded at its end finished (and continued after), for one call
        finished, self._finished = self._finished, None
        if finished is not None and epoch in (finished, finished + 1):
            if epoch == finished + 1 and self._progress is None:
                return  # the state continues with that epoch, not iterated yet: already there
            warn_epoch_again(epoch, finished)
        start = self._carried(epoch)
        packed_mixture = (
            isinstance(self._epochs, MixedEpochs) and self._epochs.config.packing is not None
        )
        if start is None and epoch and packed_mixture:  # where its sources stand is unknown
            raise EpochStartError(NO_CARRY.format(epoch=epoch))
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
        """A packed mixture's ``epoch`` carried on from where the epoch before it stands
        (``mixing.carry``); ``None`` otherwise."""
        if not isinstance(self._epochs, MixedEpochs):
            return None
        return carried_start(self._epochs, self._start, self._progress, epoch)

    def state_dict(self) -> dict[str, Any]:
        """What the training loop has been handed in this epoch, by content (JSON-safe)."""
        if self._progress is not None:
            return encoded(self._epochs, self._progress, self._trainer_epochs)
        return start_state(self._epochs, self._start, self._known_workers())

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

    def _ended(self) -> bool:
        """Whether the next iteration starts at the end of its epoch (a loaded state taken
        after the epoch's last batch): it would hand out nothing."""
        return at_epoch_end(self._epochs, self._start, self._known_workers())

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
            raise RuntimeError(NOT_OUR_LOADER)
        worker = detect_worker()
        if worker is None:  # main process: this iteration consumes the loaded start
            if handoff is not None:  # the one our loader (num_workers=0) has begun
                assert self._progress is not None
                return self._deliver(0, self._progress, read_ahead=READ_AHEAD)
            with self._iteration(0) as progress:  # no worker to hand it to
                return self._deliver(0, progress, read_ahead=READ_AHEAD)
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

    def _attach_loader(self, num_workers: int, start_method: str) -> None:
        """Our loader's ``num_workers`` (``len()`` and states count its streams); from now on
        only iterations it begins (``_iteration``) may read this dataset."""
        if num_workers:
            self._epochs.config.check_sendable(start_method)
        self._loader_workers = num_workers

    def _trainer_moves_epochs(self) -> None:
        """A trainer moves the epochs (through our loader's sampler, or ``StructuredTrainer``):
        from now on a state taken after an epoch's last batch says ``finished``."""
        self._trainer_epochs = True

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
            return start_state(self._epochs, mark.start, self._known_workers())
        then = replace(mark.progress, positions=dict(mark.positions), cursor=mark.cursor)
        then._entries = {}
        return encoded(self._epochs, then, self._trainer_epochs)

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
        log_start(progress)
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
        """The reader of stream ``worker`` of ``progress``."""
        return stream_reader(progress, worker, self._epochs.config, self._opened)


_NO_SHUFFLE_WINDOW = (
    "shuffle_window was removed: a shuffled stream now hands out its rows in a random order "
    "inside windows sized by shuffle_memory_bytes (docs/shuffle.md); drop shuffle_window and "
    "pass shuffle_memory_bytes to trade memory for mixing"
)
