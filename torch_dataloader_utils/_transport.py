"""Moving batches from DataLoader workers to the main process in few, large messages.

Each tensor a worker puts on the DataLoader queue costs a fresh shared-memory segment, a file
descriptor handed over a socket and page faults on both sides; for batches of a few thousand
rows that overhead, not the bytes, bounds throughput. So a worker packs a run of consecutive
batches into a :class:`Packet` and writes their tensor columns into :class:`Rings`: a few
fixed shared-memory slots per worker, allocated once per iteration. The queue then carries
only offsets. The main process copies each batch out of its slot (the training loop owns what
it is handed) and frees the slot; a worker waits while all its slots are in use, which also
bounds memory.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ._stream import Position

__all__ = ["Packet", "Rings", "pack"]

_ALIGN = 64


@dataclass(frozen=True)
class _Slab:
    """A tensor stored in a worker's ring at byte ``offset``; ``numpy`` restores an array."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    numpy: bool


class Rings:
    """Per worker, ``slots`` shared-memory slots of ``slot_bytes`` bytes, and their counters.

    ``control[0]`` is the iteration's generation (a worker of an older one stops waiting);
    ``control[1 + w]`` counts the packets of worker ``w`` the main process has released.
    """

    def __init__(self, num_workers: int, slots: int = 3, slot_bytes: int = 2 << 20) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        # Allocated shared from the start: share_memory_() would allocate twice and copy.
        self.buffers = [
            torch.empty(0, dtype=torch.uint8).set_(
                torch.UntypedStorage._new_shared(slots * slot_bytes)  # type: ignore[no-untyped-call]
            )
            for _ in range(num_workers)
        ]
        self.control = torch.zeros(num_workers + 1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]

    def begin(self) -> None:
        """Main process, before workers start an iteration: new generation, all slots free."""
        self.control[0] += 1
        self.control[1:] = 0

    def generation(self) -> int:
        return int(self.control[0])

    def wait_for_slot(self, worker: int, packet: int, generation: int) -> bool:
        """Block until packet number ``packet`` may use its slot; False if the iteration ended."""
        while packet - int(self.control[1 + worker]) >= self.slots:
            if int(self.control[0]) != generation:
                return False
            time.sleep(0.0005)
        return int(self.control[0]) == generation

    def release(self, worker: int) -> None:
        self.control[1 + worker] += 1

    def view(self, worker: int, slab: _Slab) -> torch.Tensor:
        count = int(np.prod(slab.shape)) * _itemsize(slab.dtype)
        raw = self.buffers[worker][slab.offset : slab.offset + count]
        return raw.view(slab.dtype).view(slab.shape)


@dataclass
class Packet:
    """Consecutive batches of one worker and the stream position after each of them.

    ``payload`` is a dict of columns joined across the batches, one joined RecordBatch, or the
    batches as they are (``lengths is None``). ``lengths`` gives each batch's rows, one number
    for all columns or one per column (a transform may change lengths per column).
    """

    worker: int
    number: int
    positions: list[Position]
    payload: Any
    lengths: list[int] | list[dict[str, int]] | None
    last: bool

    def unpack(self, rings: Rings, *, pin: bool = False) -> list[tuple[Any, Position]]:
        """The batches, copied out of the ring (into pinned memory if ``pin``), slot released."""
        try:
            return list(zip(self._batches(rings, pin), self.positions, strict=True))
        finally:
            rings.release(self.worker)

    def _batches(self, rings: Rings, pin: bool) -> Iterator[Any]:
        if self.lengths is None:
            yield from self.payload
        elif isinstance(self.payload, pa.RecordBatch):
            offset = 0
            for length in self.lengths:
                yield self.payload.slice(offset, length)
                offset += length  # type: ignore[operator]
        else:
            columns = {
                key: _cut(value, self._lengths_of(key), rings, self.worker, pin)
                for key, value in self.payload.items()
            }
            for i in range(len(self.positions)):
                yield {key: parts[i] for key, parts in columns.items()}

    def _lengths_of(self, key: str) -> list[int]:
        lengths = self.lengths or []
        return [n[key] if isinstance(n, dict) else n for n in lengths]


def pack(
    rings: Rings,
    worker: int,
    number: int,
    parts: list[Any],
    lengths: list[int] | list[dict[str, int]],
    positions: list[Position],
    *,
    last: bool,
) -> Packet:
    """Packet ``number`` of ``worker`` from ``parts`` (chunks or batches) in stream order.

    Dict parts have their tensor and numeric numpy columns written into the worker's ring slot.
    """
    if parts and all(isinstance(p, pa.RecordBatch) for p in parts):
        return Packet(worker, number, positions, pa.concat_batches(parts), lengths, last)
    if parts and all(isinstance(p, dict) and list(p) == list(parts[0]) for p in parts):
        offset = (number % rings.slots) * rings.slot_bytes
        end = offset + rings.slot_bytes
        payload: dict[str, Any] = {}
        for key in parts[0]:
            payload[key], offset = _join([p[key] for p in parts], rings, worker, offset, end)
        return Packet(worker, number, positions, payload, lengths, last)
    return Packet(worker, number, positions, parts, None, last)


def tensor_bytes(batch: Any) -> int:
    """Bytes of the numeric columns of a dict batch (what a ring slot must hold)."""
    if not isinstance(batch, dict):
        return 0
    return sum(
        v.nbytes + _ALIGN for v in batch.values() if isinstance(v, torch.Tensor | np.ndarray)
    )


def _join(values: list[Any], rings: Rings, worker: int, offset: int, end: int) -> tuple[Any, int]:
    """One value for a column across parts, in the ring when it is numeric and fits."""
    first = values[0]
    numeric = isinstance(first, torch.Tensor) or (
        isinstance(first, np.ndarray) and first.dtype != object
    )
    if numeric and first.ndim and _uniform(values):
        shape = (sum(v.shape[0] for v in values), *first.shape[1:])
        is_numpy = isinstance(first, np.ndarray)
        dtype = torch.from_numpy(np.empty(0, first.dtype)).dtype if is_numpy else first.dtype
        slab = _Slab(offset, dtype, shape, is_numpy)
        nbytes = int(np.prod(shape)) * _itemsize(dtype)
        if offset + nbytes > end:  # larger than a slot: let torch share it on its own
            joined = np.concatenate(values) if is_numpy else torch.cat(values)
            return joined, offset
        target = rings.view(worker, slab)
        if is_numpy:
            np.concatenate(values, out=target.numpy())
        else:
            torch.cat(values, out=target)
        return slab, offset + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    if isinstance(first, list) and all(isinstance(v, list) for v in values):
        return [item for value in values for item in value], offset
    if isinstance(first, np.ndarray) and all(isinstance(v, np.ndarray) for v in values):
        return np.concatenate(values), offset
    return _Parts(values), offset


def _uniform(values: list[Any]) -> bool:
    first = values[0]
    return all(
        type(v) is type(first) and v.dtype == first.dtype and v.shape[1:] == first.shape[1:]
        for v in values
    )


@dataclass(frozen=True)
class _Parts:
    """A column whose per-batch values could not be joined; kept one per batch."""

    values: list[Any]


def _cut(value: Any, lengths: list[int], rings: Rings, worker: int, pin: bool) -> list[Any]:
    if isinstance(value, _Parts):
        return value.values
    if isinstance(value, _Slab):
        parts = torch.split(rings.view(worker, value), lengths)
        if value.numpy:
            return [p.numpy().copy() for p in parts]
        return [p.pin_memory() if pin else p.clone() for p in parts]
    if isinstance(value, torch.Tensor):
        return [p.pin_memory() if pin else p for p in torch.split(value, lengths)]
    bounds = np.cumsum([0, *lengths])
    return [value[a:b] for a, b in itertools.pairwise(bounds)]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
