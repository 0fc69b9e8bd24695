"""``StructuredDataLoader``: a DataLoader that records what it hands to the training loop."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.utils.data

from ._dataset import StructuredDataset
from ._stream import Position
from ._transport import SharedSlots

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

    dataset: StructuredDataset

    def __init__(self, dataset: StructuredDataset, **kwargs: Any) -> None:
        owned = sorted(set(kwargs) & set(_OWNED_BY_DATASET))
        if owned:
            raise TypeError(
                f"{owned} belong to the dataset (StructuredDataset batches and orders its rows); "
                f"pass batch_size/shuffle/drop_last to StructuredDataset or create_dataloader"
            )
        super().__init__(dataset, batch_size=None, collate_fn=_as_is, **kwargs)
        dataset._loader_workers = self.num_workers
        self._slots: SharedSlots | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.num_workers == 0:
            return super().__iter__()
        return self._unpacked()

    def _unpacked(self) -> Iterator[Any]:
        """Batches in strict round-robin over workers from the cursor, whatever the packet sizes."""
        dataset = self.dataset
        start = dataset._next_start
        # Persistent workers learn a fresh epoch through the slots; a resume needs new workers,
        # which take its start with their copy of the dataset.
        slots = self._slots
        if slots is None or not (
            start.is_fresh and self.persistent_workers and self._iterator is not None
        ):
            if self._iterator is not None:
                self._iterator._shutdown_workers()  # type: ignore[attr-defined]
                self._iterator = None
            slots = self._slots = SharedSlots(self.num_workers)
        slots.begin(start.epoch if start.is_fresh else None)
        with dataset._iteration(self.num_workers, slots) as progress:
            packets = super().__iter__()
        waiting: dict[int, deque[tuple[Any, Position]]] = {
            w: deque() for w in range(self.num_workers)
        }
        sending = set(waiting)  # workers whose last packet has not arrived
        worker = progress.cursor
        pin = self.pin_memory and torch.accelerator.is_available()
        try:
            while sending or any(waiting.values()):
                while not waiting[worker] and worker in sending:
                    packet = next(packets)
                    waiting[packet.worker].extend(packet.unpack(slots, pin=pin))
                    if packet.last:
                        sending.discard(packet.worker)
                if waiting[worker]:
                    batch, position = waiting[worker].popleft()
                    progress.positions[worker] = position
                    progress.cursor = (worker + 1) % self.num_workers
                    yield batch
                worker = (worker + 1) % self.num_workers
        finally:
            slots.end()  # workers still waiting for a slot give up

    def __len__(self) -> int:
        """Batches this rank yields in the epoch (``DataLoader.__len__`` would count packets)."""
        return len(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's state: what this loader has handed to the training loop."""
        return self.dataset.state_dict()

    def load_state_dict(
        self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, elastic: bool = False
    ) -> None:
        """Continue from ``state`` at the next iteration (see ``StructuredDataset``)."""
        self.dataset.load_state_dict(state, elastic=elastic)

    # Megatron-Energon's names for the same states, for users who call them on the loader.

    def save_state_rank(self) -> dict[str, Any]:
        """This rank's state, as Megatron-Energon's ``loader.save_state_rank()``.

        The same as ``state_dict()``: what this loader has handed to the training loop.
        """
        return self.dataset.state_dict()

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
