"""``StructuredDataset``: a resumable IterableDataset over Parquet/Arrow files."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.utils.data

from ._config import DEFAULT_SPLIT_BYTES, DatasetConfig
from ._convert import convert, converted_row_bytes
from ._errors import InvalidStateError
from ._formats import get_format
from ._index import build_index
from ._packing import batch_parts, chunk_parts, run_sizes, send
from ._plan import (
    Consumed,
    EpochPlan,
    IntArray,
    epoch_order,
    even_row_budgets,
    remaining_pieces,
    stream_rows,
)
from ._state import (
    Progress,
    Settings,
    check_setting,
    decode_consumed,
    encode,
    merge_states,
    positions_of,
    stored_split,
)
from ._storage import Storage
from ._stream import Position, Run, read_stream
from ._transport import Packet, SharedSlots
from ._world import World, detect_ranks, detect_worker

if TYPE_CHECKING:
    from ._loader import StructuredDataLoader

__all__ = ["StructuredDataset"]

# Decoded chunks a main-process stream reads ahead, in a thread, of the batch being converted.
# Worker streams do not: the DataLoader already overlaps them with the main process.
_READ_AHEAD = 2


@dataclass(frozen=True)
class _Start:
    """Where the next iteration begins: nothing delivered, or a checkpoint's progress."""

    epoch: int
    base: Consumed
    delivered: Consumed
    cursor: int = 0
    checkpoint_workers: int | None = None  # the num_workers to hold the checkpoint to
    checkpoint_split: str = ""

    @classmethod
    def fresh(cls, epoch: int, num_splits: int) -> _Start:
        nothing = Consumed.nothing(num_splits)
        return cls(epoch, nothing, nothing)


@dataclass(frozen=True)
class _Iteration:
    """What workers need to start: where, and the slots to pack into for our loader."""

    start: _Start
    slots: SharedSlots | None = None


class StructuredDataset(torch.utils.data.IterableDataset[Any]):
    """Streams Parquet/Arrow files as batches of exactly ``batch_size`` rows, resumable exactly.

    Files are cut into splits of at most ``split_bytes`` stored bytes on row-group / record-batch
    boundaries, ordered per epoch (shuffled with ``shuffle_seed`` if ``shuffle``) and dealt
    round-robin to ranks, then DataLoader workers. ``state_dict()`` records what has been
    delivered by content; ``load_state_dict()`` continues exactly there.

    ``even_batches`` (default: on when ``world_size > 1``) makes every rank yield the same
    number of batches, as DDP needs, by leaving out the rows past the fewest any rank has.
    Arguments are described in ``docs/usage.md``; the state in ``docs/checkpoints.md``.
    """

    def __init__(
        self,
        path: str | Sequence[str],
        format: str = "parquet",
        *,
        batch_size: int = 1024,
        columns: Sequence[str] | None = None,
        shuffle: bool = False,
        shuffle_seed: int = 0,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        rank: int | None = None,
        world_size: int | None = None,
        output: str = "torch",
        transform: Callable[[Any], Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        drop_last: bool = False,
        even_batches: bool | None = None,
    ) -> None:
        super().__init__()
        self._config = DatasetConfig(
            format=format, batch_size=batch_size, columns=DatasetConfig.columns_from(columns),
            shuffle=bool(shuffle), shuffle_seed=shuffle_seed, split_bytes=split_bytes,
            output=output, transform=transform, drop_last=bool(drop_last),
        )  # fmt: skip
        self._format = get_format(format)
        self._rank, self._world_size = detect_ranks(rank, world_size)
        World(self._rank, self._world_size)  # validates the pair
        self._even_batches = self._world_size > 1 if even_batches is None else even_batches
        first = path if isinstance(path, str) else next(iter(path), "")
        self._storage = Storage(first, storage_options)
        self._index = build_index(
            self._storage, self._format, path, self._config.columns, split_bytes
        )
        self._split_rows = np.array([s.row_length for s in self._index.splits], dtype=np.int64)
        self._num_workers: int | None = None  # the DataLoader's, once known
        self._iteration = _Iteration(_Start.fresh(0, len(self._index.splits)))
        self._progress: Progress | None = None
        self._resumed = False

    @classmethod
    def create_dataloader(
        cls,
        path: str | Sequence[str],
        format: str = "parquet",
        *,
        batch_size: int = 1024,
        columns: Sequence[str] | None = None,
        shuffle: bool = False,
        shuffle_seed: int = 0,
        num_workers: int = 0,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        rank: int | None = None,
        world_size: int | None = None,
        output: str = "torch",
        transform: Callable[[Any], Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        drop_last: bool = False,
        even_batches: bool | None = None,
        **dataloader_kwargs: Any,
    ) -> tuple[StructuredDataLoader, StructuredDataset]:
        """``(loader, dataset)``: the loader records what it hands out and resumes exactly."""
        from ._loader import StructuredDataLoader

        dataset = cls(
            path, format, batch_size=batch_size, columns=columns, shuffle=shuffle,
            shuffle_seed=shuffle_seed, split_bytes=split_bytes, rank=rank, world_size=world_size,
            output=output, transform=transform, storage_options=storage_options,
            drop_last=drop_last, even_batches=even_batches,
        )  # fmt: skip
        return StructuredDataLoader(dataset, num_workers=num_workers, **dataloader_kwargs), dataset

    # ----------------------------------------------------------------- epochs and checkpoints

    @property
    def epoch(self) -> int:
        return self._iteration.start.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` afresh (its own permutation); discards any progress or loaded state."""
        if self._resumed and epoch == self.epoch:
            warnings.warn(
                f"set_epoch({epoch}) after load_state_dict discards the checkpoint's progress in "
                f"epoch {epoch}; the epoch restarts from its first batch. Call set_epoch only "
                f"for the epochs after the resumed one.",
                stacklevel=2,
            )
        self._iteration = _Iteration(_Start.fresh(epoch, len(self._index.splits)))
        self._progress = None
        self._resumed = False

    def state_dict(self) -> dict[str, Any]:
        """What the training loop has been handed in this epoch, by content (JSON-safe)."""
        if self._progress is not None:
            p = self._progress
            return encode(
                p.plan.epoch, p.delivered(), p.plan.base, p.cursor, self._index, p.settings
            )
        start = self._iteration.start
        worker = detect_worker()  # inside a worker the DataLoader's count is known for sure
        workers = worker[1] if worker is not None else self._num_workers
        if start.checkpoint_workers is not None:
            workers = start.checkpoint_workers
        return encode(
            start.epoch, start.delivered, start.base, start.cursor, self._index,
            self._settings(workers or 0),
        )  # fmt: skip

    def load_state_dict(
        self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, elastic: bool = False
    ) -> None:
        """Continue from ``state`` at the next iteration; call before iterating.

        ``elastic=True`` takes the list of every old rank's state (or one state) and re-deals
        what they had not delivered to the current ranks and workers: each row exactly once,
        in a different order. Raises ``CheckpointMismatchError`` when files or settings differ.
        """
        worker = detect_worker()
        workers = worker[1] if worker is not None else self._num_workers
        if elastic:
            states = [state] if isinstance(state, Mapping) else list(state)
            epoch, delivered = merge_states(states, self._index, self._settings(workers or 0))
            start = _Start(epoch, delivered, delivered)
        else:
            if not isinstance(state, Mapping):
                raise TypeError(
                    f"load_state_dict takes a state dict, got {type(state).__name__}; a list "
                    f"of every rank's states needs elastic=True"
                )
            settings = self._settings(state.get("_num_workers", 0) if workers is None else workers)
            delivered, base = decode_consumed(state, self._index, settings)
            start = _Start(
                state["epoch"], base, delivered, int(state["cursor"]),
                checkpoint_workers=state["_num_workers"], checkpoint_split=stored_split(state),
            )  # fmt: skip
        self._iteration = _Iteration(start)
        self._progress = None
        self._resumed = True

    def save_state_global(self, dst_rank: int = 0) -> list[dict[str, Any]] | None:
        """Collective: every rank's ``state_dict()`` on ``dst_rank`` (``None`` elsewhere)."""
        from ._distributed import gather_states

        return gather_states(self.state_dict(), dst_rank)

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
        from ._distributed import scatter_states

        mine = scatter_states(states, src_rank, self._rank, self._world_size, elastic=elastic)
        self.load_state_dict(mine, elastic=elastic)

    # ----------------------------------------------------------------- iteration

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (with the loader's ``num_workers``)."""
        rows = self._stream_rows(self._plan(self._iteration.start), self._num_workers or 0)
        batches = -(-rows[self._rank] // self._config.batch_size)
        if self._config.drop_last:
            batches = rows[self._rank] // self._config.batch_size
        return int(batches.sum())

    def _stream_rows(self, plan: EpochPlan, num_workers: int) -> IntArray:
        """Rows each ``[rank, worker]`` stream delivers this epoch (evened out if asked)."""
        workers = max(1, num_workers)
        pieces = remaining_pieces(plan.order, plan.base)
        rows = stream_rows(pieces, self._split_rows, self._world_size, workers)
        if not self._even_batches:
            return rows
        return even_row_budgets(rows, self._config.batch_size, self._config.drop_last)

    def __iter__(self) -> Iterator[Any]:
        worker = detect_worker()
        iteration = self._iteration
        if worker is None:  # main process: this iteration consumes the loaded start
            progress = self._begin_iteration(0)
            self._end_iteration_setup()
            return self._deliver(0, progress)
        start = iteration.start
        if iteration.slots is not None and (epoch := iteration.slots.fresh_epoch()) is not None:
            start = _Start.fresh(epoch, len(self._index.splits))  # persistent worker, new epoch
        progress = self._begin(start, worker[1])
        progress.positions = {worker[0]: progress.positions[worker[0]]}
        if iteration.slots is not None:
            return self._packets(worker[0], progress, iteration.slots)
        return self._deliver(worker[0], progress)

    def _begin_iteration(self, num_workers: int, slots: SharedSlots | None = None) -> Progress:
        """Main process: validate the start for ``num_workers``, hand it to workers, track it.

        Later iterations start the epoch afresh unless a state is loaded again.
        """
        start = self._iteration.start
        progress = self._begin(start, num_workers)
        self._progress = progress
        self._iteration = _Iteration(start, slots)
        return progress

    def _starts_fresh(self) -> bool:
        """Whether the next iteration starts the epoch from its beginning."""
        start = self._iteration.start
        return start.checkpoint_workers is None and not (
            start.delivered.done.any() or start.delivered.partial or start.base.done.any()
        )

    def _end_iteration_setup(self) -> None:
        """Main process, once workers hold their copy: later iterations start afresh."""
        self._iteration = _Iteration(_Start.fresh(self.epoch, len(self._index.splits)))
        self._resumed = False

    def _begin(self, start: _Start, num_workers: int) -> Progress:
        """Progress at ``start`` for every worker; mismatch if the start does not fit them."""
        if start.checkpoint_workers is not None:
            check_setting(
                "num_workers", start.checkpoint_workers, num_workers, start.checkpoint_split
            )
        if not 0 <= start.cursor < max(1, num_workers):
            raise InvalidStateError(
                f"state key 'cursor' is {start.cursor}, but there are {max(1, num_workers)} "
                f"worker stream(s): the state is corrupted"
            )
        settings = self._settings(num_workers)
        plan = self._plan(start)
        positions = positions_of(
            plan, start.delivered, settings, range(max(1, num_workers)), self._index
        )
        return Progress(plan, settings, positions, start.cursor)

    def _deliver(self, worker: int, progress: Progress) -> Iterator[Any]:
        """Batches of one stream, recording each position before handing the batch out."""
        self._progress = progress
        for batch, position in self._batches(worker, progress):
            progress.positions[worker] = position
            progress.cursor = 0
            yield batch

    def _packets(self, worker: int, progress: Progress, slots: SharedSlots) -> Iterator[Packet]:
        """The stream as packets for ``StructuredDataLoader``; the last (maybe empty) ends it."""
        config = self._config
        if config.transform is None:
            batch_bytes = config.batch_size * converted_row_bytes(self._index.schema)
            runs = self._read(worker, progress, run_sizes(batch_bytes, slots.slot_bytes))
            # Tensors may view Arrow's buffers: packing copies them into the slot.
            parts = chunk_parts(runs, lambda run: self._converted(run, progress, worker, False))
        else:
            parts = batch_parts(self._batches(worker, progress, copy=False), slots.slot_bytes)
        return send(parts, slots, worker)

    def _batches(
        self, worker: int, progress: Progress, *, copy: bool = True
    ) -> Iterator[tuple[Any, Position]]:
        """Converted, transformed batches; ``copy=False`` when they are copied again anyway."""
        transform = self._config.transform
        copy = copy and not self._format.decodes_into_new_memory
        for run in self._read(worker, progress, itertools.repeat(1)):
            run.chunks = [run.batch()]
            (out,) = self._converted(run, progress, worker, copy)
            yield (out if transform is None else transform(out)), run.positions[0]

    def _converted(self, run: Run, progress: Progress, worker: int, copy: bool) -> list[Any]:
        """``run``'s chunks in the output type; a value error names the split it came from."""
        try:
            return [convert(chunk, self._config.output, copy=copy) for chunk in run.chunks]
        except ValueError as exc:
            count, rows = run.positions[-1]
            pieces = progress.plan.stream(progress.settings.world(worker))
            split = int(pieces.splits[count if rows else count - 1])
            raise ValueError(f"split {self._index.describe(split)}: {exc}") from exc

    def _read(self, worker: int, progress: Progress, sizes: Iterator[int]) -> Iterator[Run]:
        config = self._config
        return read_stream(
            self._index, self._storage, self._format,
            progress.plan.stream(progress.settings.world(worker)),
            progress.positions.get(worker, (0, 0)), config.columns, config.batch_size,
            config.drop_last, run_sizes=sizes,
            read_ahead=_READ_AHEAD if detect_worker() is None else 0,
            row_budget=self._row_budget(progress, worker),
        )  # fmt: skip

    def _row_budget(self, progress: Progress, worker: int) -> int | None:
        if not self._even_batches:
            return None
        budgets = self._stream_rows(progress.plan, progress.settings.num_workers)
        return int(budgets[self._rank, worker])

    def _plan(self, start: _Start) -> EpochPlan:
        config = self._config
        order = epoch_order(
            len(self._index.splits), config.shuffle_seed, start.epoch, config.shuffle
        )
        return EpochPlan(start.epoch, order, start.base)

    def _settings(self, num_workers: int) -> Settings:
        config = self._config
        return Settings(
            config.format, config.split_bytes, config.shuffle, config.shuffle_seed,
            self._rank, self._world_size, num_workers, self._even_batches,
        )  # fmt: skip
