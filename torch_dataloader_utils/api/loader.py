"""``StructuredDataLoader``: a DataLoader that records what it hands to the training loop."""

from __future__ import annotations

import itertools
import multiprocessing
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.utils.data

from ..base.args import loader_options
from ..base.compat import ACCELERATE_PREPARED, accelerator_available, shutdown_workers
from ..base.errors import CheckpointMismatchError, LostBatchesError, UnsendableBatchError
from ..base.log import log
from ..base.stages import READ_AHEAD, timed
from ..mixing.epochs import AnyProgress
from ..planning.plan import Position
from ..reading.packets import WorkerFailure, slot_bytes
from ..transport.packet import Packet
from ..transport.slots import SharedSlots
from .feed import Feed
from .global_stats import GlobalStats, gather_stats
from .handout import KEEP, HandOuts
from .served import ServedDataset
from .stats import LoaderStats, Recorder

__all__ = ["StructuredDataLoader"]

# Batching and order belong to the dataset; a DataLoader setting them would break resume.
_OWNED_BY_DATASET = ("batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn", "drop_last")


def _as_is(batch: Any) -> Any:
    return batch


class StructuredDataLoader(torch.utils.data.DataLoader[Any]):
    """A DataLoader over a :class:`StructuredDataset` whose state is what it has yielded.

    Workers send runs of batches (``Packet``); this loader unpacks them and records each batch's
    provenance at the moment it hands the batch out, so prefetched batches never count. It
    yields batch by batch in round-robin over workers, starting a resumed epoch at the worker
    the checkpoint's cursor names, so the continuation is the uninterrupted run.
    """

    dataset: ServedDataset  # a StructuredDataset
    log_stats_every: float | None = None  # seconds between INFO lines of stats(); None: off

    def __init__(self, dataset: ServedDataset, **kwargs: Any) -> None:
        owned = sorted(set(kwargs) & set(_OWNED_BY_DATASET))
        if owned:
            raise TypeError(
                f"{owned} belong to the dataset (StructuredDataset batches and orders its rows); "
                f"pass batch_size/shuffle/drop_last to StructuredDataset or create_dataloader"
            )
        kwargs = loader_options(kwargs)  # builtins: "false" is not False, "2" not 2
        super().__init__(dataset, batch_size=None, collate_fn=_as_is, **kwargs)
        # DataLoader refuses a sampler for an IterableDataset and any later assignment
        object.__setattr__(self, "sampler", _EpochSampler(self))
        dataset._attach_loader(self.num_workers, self._start_method())
        self._slots: SharedSlots | None = None
        self._handouts: HandOuts | None = None  # the current iteration's
        self._recorder = Recorder(self.num_workers)  # the current iteration's timings
        # Weak: the feed holds the batches' generator, which holds this loader.
        self._feed: weakref.ref[Feed] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        feed = Feed(self._batches(), self.dataset, self.num_workers, self.log_stats_every)
        self._handouts, self._recorder, self._feed = feed.handouts, feed.recorder, weakref.ref(feed)
        return feed.handed_out()

    def _batches(self) -> Iterator[Any]:
        """A new iteration's batches, from where the dataset stands when it begins."""
        return self._unpacked() if self.num_workers else self._in_process()

    def _in_process(self) -> Iterator[Any]:
        """Without workers: a generator, so that, as with workers, the iteration begins at the
        first ``next``, not at ``iter()``. A trainer may create the iterator before it moves
        the dataset to its epoch (Lightning does, then calls ``sampler.set_epoch``)."""
        with self.dataset._iteration(0):  # the DataLoader calls iter(dataset) at once
            batches = super().__iter__()
        yield from batches

    def _unpacked(self) -> Iterator[Any]:
        """Batches in strict round-robin over workers from the cursor, whatever the packet sizes.

        A generator: nothing runs before the training loop's first ``next``. That is when
        the iteration's start is taken (``_next_start``), the workers start (a resume always
        starts new ones, which carry the start in their copy of the dataset; persistent ones
        learn a fresh epoch through the slots), and the dataset's next iteration is reset to
        a fresh epoch (``_iteration``). Closed early (the loop broke), it keeps persistent
        workers; an error, or the end without persistent workers, stops them. Either way the
        slots' generation ends, so a worker still waiting for a slot gives up.
        """
        dataset = self.dataset
        start = dataset._next_start
        # Persistent workers learn a fresh epoch through the slots; a resume needs new workers,
        # which take its start with their copy of the dataset.
        slots = self._slots
        if slots is None or not (
            start.is_fresh and self.persistent_workers and self._iterator is not None
        ):
            self._stop_workers()
            slots = self._slots = SharedSlots(
                self.num_workers,
                slot_bytes=slot_bytes(dataset._batch_bytes()),
                context=self._start_method(),
            )
        generation = slots.begin(start.epoch if start.is_fresh else None)
        with dataset._iteration(self.num_workers, slots) as progress:
            packets = super().__iter__()
        waited = timed(packets, READ_AHEAD)  # the loop waiting for the workers
        arrivals = _Arrivals(self, progress)
        pin = self.pin_memory and accelerator_available()
        worker = progress.cursor
        failed = True
        try:
            while arrivals.pending():
                while arrivals.awaits(worker):
                    arrivals.receive(next(waited, None), slots, pin)
                batch = arrivals.take(worker)
                if batch is not _NOTHING:
                    yield batch
                worker = (worker + 1) % self.num_workers
            failed = False
        except GeneratorExit:  # the training loop stopped early: persistent workers stay
            failed = False
            raise
        finally:
            slots.end(generation)  # its workers still waiting for a slot give up
            if failed or not self.persistent_workers:
                self._stop_workers(packets)
                # The next iteration starts new workers with new slots: the shared memory of
                # these goes with the last batch that views it, not with this loader.
                if self._slots is slots:
                    self._slots = None

    def _start_method(self) -> str:
        """How this loader's workers start: semaphores made for ``fork`` are unlinked at once,
        so a SIGKILLed training process leaves none for the resource tracker to report
        ("There appear to be N leaked semaphore objects")."""
        context = self.multiprocessing_context
        if context is None:
            return multiprocessing.get_start_method()
        return str(context.get_start_method())

    def _stop_workers(self, packets: Any = None) -> None:
        """Stop the workers of ``packets`` (all kept workers when ``None``) now, not when the
        iterator is collected: collected later, inside a forked worker of another loader, it
        prints ``Exception ignored in _MultiProcessingDataLoaderIter.__del__``.

        The kept (persistent) iterator is stopped only when it is ``packets``'s own: an older
        iterator that ends late must not stop the workers a newer iteration reads from.
        """
        if packets is None or packets is self._iterator:
            shutdown_workers(self._iterator)
            self._iterator = None
        shutdown_workers(packets)

    def stats(self, recent_seconds: float = 10.0) -> LoaderStats:
        """Is the training loop waiting on data, and on what? Figures of the current iteration
        since the loop's first ``next()`` and over the last ``recent_seconds``: the loop's wait,
        each process's stages, a mixture's sources, a ``bottleneck`` and ``advice``
        (docs/observability.md). A call costs 10-20 us: cheap enough for every step."""
        if not recent_seconds > 0:
            raise ValueError(f"stats(recent_seconds=...) must be > 0, got {recent_seconds!r}")
        return self._recorder.stats(recent_seconds, self.dataset._progress)

    def gather_stats(self, dst_rank: int = 0, recent_seconds: float = 10.0) -> GlobalStats | None:
        """Collective: every rank's ``stats()`` on ``dst_rank``, the slowest rank named."""
        return gather_stats(self.stats(recent_seconds), dst_rank)

    def __len__(self) -> int:
        """Batches this rank yields in the epoch (``DataLoader.__len__`` would count packets)."""
        return len(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """What the training loop has consumed: the batches this loader handed out, less any
        dict batch handed out and not read yet (a trainer reading ahead holds it)."""
        return self._consumed_state()

    def _consumed_state(self) -> dict[str, Any]:
        handouts = self._handouts
        unread = handouts.unread() if handouts is not None else None
        if handouts is None or unread is None or handouts.progress is not self.dataset._progress:
            return self.dataset.state_dict()
        count, mark = unread
        if mark is None:
            warnings.warn(
                f"state_dict(): the training loop holds {count} batches unread after the last "
                f"one it read, more than a trainer reads ahead ({KEEP}); they count as "
                f"consumed, so a resume from this state skips them. Take the state after the "
                f"step that used the last batch read (docs/trainers.md, 'Trainers that read "
                f"ahead')",
                stacklevel=3,
            )
            return self.dataset.state_dict()
        log.info(
            "state_dict(): %d batch(es) handed out and not read yet (a trainer reading ahead, "
            "e.g. Lightning's fetcher when the loader has no len()) are left out of the state; "
            "a resume delivers them",
            count,
        )
        return self.dataset._state_at(mark)

    def load_state_dict(
        self,
        state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        elastic: bool = False,
        reweight: bool = False,
    ) -> None:
        """Continue from ``state`` at the next iteration (see ``StructuredDataset``)."""
        try:
            self.dataset.load_state_dict(state, elastic=elastic, reweight=reweight)
        except CheckpointMismatchError as exc:
            if exc.field == "rank":
                exc.add_note(_ANOTHER_RANKS_STATE)
            raise

    # Megatron-Energon's names for the same states, for users who call them on the loader.

    def save_state_rank(self) -> dict[str, Any]:
        """This rank's state, as Megatron-Energon's ``loader.save_state_rank()``.

        The same as ``state_dict()``: what the training loop has consumed.
        """
        return self._consumed_state()

    def restore_state_rank(self, state: Mapping[str, Any]) -> None:
        """Continue from this rank's ``state``, as Megatron-Energon's ``restore_state_rank``.

        The same as ``load_state_dict(state)``; call before iterating.
        """
        self.dataset.load_state_dict(state)

    def save_state_global(self, dst_rank: int = 0) -> list[dict[str, Any]] | None:
        """Collective, as Megatron-Energon's ``save_state_global(dst_rank)``.

        Every rank's state as a list on ``dst_rank``, ``None`` on the others
        (``StructuredDataset.save_state_global``).
        """
        return self.dataset.save_state_global(dst_rank=dst_rank)

    def restore_state_global(
        self,
        state: Sequence[Mapping[str, Any]] | None,
        src_rank: int | None = 0,
        *,
        elastic: bool = False,
    ) -> None:
        """Collective, as Megatron-Energon's ``restore_state_global(state, src_rank)``.

        ``state`` is the list ``save_state_global`` returned, needed on ``src_rank`` only
        (``None`` elsewhere); ``src_rank=None`` means every rank holds it and nothing is sent.
        ``elastic=True`` accepts a job with another ``world_size``/``num_workers``
        (``StructuredDataset.restore_state_global``).
        """
        self.dataset.restore_state_global(state, src_rank=src_rank, elastic=elastic)


# Accelerate's `prepare` then returns our loader as it is (and registers it) instead of
# rebuilding a plain DataLoader over the dataset, which reads a batch ahead and never records
# what workers delivered (docs/trainers.md; tests/test_trainers.py).
setattr(StructuredDataLoader, ACCELERATE_PREPARED, True)


class _EpochSampler(torch.utils.data.Sampler[None]):
    """Our loader's ``sampler``: it samples nothing (the dataset orders and batches its rows),
    but its ``set_epoch`` is how trainers that move samplers to their epoch move the dataset:
    Lightning's ``Trainer`` before each epoch's first batch, with the epoch it trains (also
    after a resume), and Fabric's loader at each ``iter()``, with the number of earlier
    ``iter()`` calls (docs/trainers.md)."""

    def __init__(self, loader: StructuredDataLoader) -> None:
        # Weak: a cycle loader -> sampler -> loader would keep the loader's shared memory
        # until the garbage collector's next full pass.
        self._loader = weakref.ref(loader)

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)

    def set_epoch(self, epoch: int) -> None:
        """A trainer begins its epoch ``epoch``: ``dataset.set_epoch(epoch)`` if that is later
        than the dataset's, else nothing (the dataset is in that epoch already, resumed or
        fresh; or the trainer's count restarted behind it in a resumed process). An iteration
        whose batches the loop took and has read none of restarts in ``epoch`` under them
        (``api.feed``). From now on a state taken after an epoch's last batch says
        ``finished``."""
        loader = self._loader()
        if loader is None:  # the loader is gone: nothing reads through this sampler
            return
        dataset = loader.dataset
        dataset._trainer_moves_epochs()
        if epoch <= dataset.epoch:
            return
        feed = loader._feed() if loader._feed is not None else None
        if feed is None:  # no iterator held
            dataset.set_epoch(epoch)
            return
        feed.set_epoch(epoch, begin=loader._batches)
        loader._recorder = feed.recorder  # a restart's timings begin again


_NOTHING = object()  # no batch of this worker yet

_ANOTHER_RANKS_STATE = (
    "Likely cause: a trainer saved the checkpoint on process 0 only and gave its state to every "
    "process (Lightning's Trainer and Fabric do). With Lightning's Trainer add "
    "torch_dataloader_utils.integrations.lightning.LoaderStatesPerRank() to its callbacks; "
    "elsewhere save one state per process (docs/trainers.md, docs/ddp.md)"
)


class _Arrivals:
    """What has arrived from each worker: batches not yet handed out, and checks that none
    was lost (packets numbered without a gap, every worker's last one received)."""

    def __init__(self, loader: StructuredDataLoader, progress: AnyProgress) -> None:
        self._loader = loader
        self._progress = progress
        workers = range(loader.num_workers)
        self._waiting: dict[int, deque[tuple[Any, Position] | WorkerFailure]] = {
            w: deque() for w in workers
        }
        self._sending = set(workers)  # workers whose last packet has not arrived
        self._next = dict.fromkeys(workers, 0)  # the number of each worker's next packet
        self._received = {w: progress.positions[w] for w in workers}  # position after them

    def pending(self) -> bool:
        return bool(self._sending) or any(self._waiting.values())

    def awaits(self, worker: int) -> bool:
        """Must ``worker``'s next batch still arrive?"""
        return not self._waiting[worker] and worker in self._sending

    def receive(self, packet: Packet | None, slots: SharedSlots, pin: bool) -> None:
        """File ``packet`` (``None``: the DataLoader has ended) under its worker."""
        if packet is None:
            raise LostBatchesError(self._unfinished())
        worker = packet.worker
        if packet.seq != self._next[worker]:
            raise LostBatchesError(self._gap(worker, packet.seq))
        self._next[worker] += 1
        if packet.last:
            self._sending.discard(worker)
        if packet.error is not None:  # its positions are those of the batches it could not send
            self._waiting[worker].append(packet.error)
            return
        self._waiting[worker].extend(packet.unpack(slots, pin=pin))
        self._loader._recorder.stages.arrived(packet)
        if packet.positions:
            self._received[worker] = packet.positions[-1]

    def take(self, worker: int) -> Any:
        """``worker``'s next batch, its position recorded; raises what ended its stream."""
        if not self._waiting[worker]:
            return _NOTHING
        item = self._waiting[worker].popleft()
        if isinstance(item, WorkerFailure):
            raise self._reraised(worker, item)
        batch, position = item
        self._progress.record(worker, position, cursor=(worker + 1) % len(self._waiting))
        return batch

    def _reraised(self, worker: int, failure: WorkerFailure) -> BaseException:
        exc = failure.exception
        if isinstance(exc, UnsendableBatchError):
            where = self._describe(worker, self._received[worker] + 1)
            exc = UnsendableBatchError(
                f"DataLoader worker {worker} cannot send a batch of split {where} to the training "
                f"process: {exc}. Everything a worker sends must pickle: return tensors, "
                f"arrays, lists or plain Python values from the transform, cast or drop the "
                f"column (columns=[...]), or use num_workers=0"
            )
            exc.add_note(f"(raised in DataLoader worker {worker})")
            return exc
        exc.add_note(f"(raised in DataLoader worker {worker}; its traceback follows)")
        exc.add_note(failure.traceback.rstrip())
        return exc

    def _gap(self, worker: int, seq: int) -> str:
        expected = self._next[worker]
        if seq < expected:
            return (
                f"DataLoader worker {worker} sent packet {seq} after packet {expected - 1}: "
                f"its batches arrived out of order or twice"
            )
        lost = f"packet {expected}" if seq == expected + 1 else f"packets {expected}-{seq - 1}"
        return (
            f"DataLoader worker {worker} sent packet {seq}, but {lost} never arrived: its "
            f"batches after row {self._received[worker]} of its share of the epoch "
            f"({self._describe(worker, self._received[worker] + 1)}) were lost on the way to "
            f"the training process. {_NOTHING_RECORDED}"
        )

    def _unfinished(self) -> str:
        workers = sorted(self._sending)
        where = "; ".join(
            f"worker {w} after packet {self._next[w] - 1}, row {self._received[w]} of its share "
            f"({self._describe(w, self._received[w] + 1)})"
            for w in workers
        )
        return (
            f"DataLoader worker(s) {workers} stopped before their last packet arrived ({where}): "
            f"the rest of their share of the epoch was lost. {_NOTHING_RECORDED}"
        )

    def _describe(self, worker: int, position: Position) -> str:
        return self._loader.dataset._describe_stream(self._progress, worker, position)


_NOTHING_RECORDED = (
    "The state records only the batches handed out, so a resume from state_dict() or the last "
    "checkpoint re-reads the lost ones (see any error printed by the worker above)."
)
