"""Moving batches from DataLoader workers to the main process in few, large messages.

Every tensor a worker sends costs a shared-memory segment and a file descriptor; for batches of
a few thousand rows that overhead, not the bytes, bounds throughput. A worker therefore packs a
run of consecutive batches into a :class:`Packet`: one tensor per column for the whole run
(``torch.cat``), with the row counts to cut it apart again. The main process unpacks views,
not copies, and records each batch's provenance as it hands the batch to the training loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ._stream import Position

__all__ = ["Packet", "pack"]


@dataclass
class Packet:
    """Consecutive batches of one worker and the stream position after each of them."""

    worker: int
    positions: list[Position]
    payload: Any
    lengths: list[dict[str, int]] | list[int] | None
    last: bool = False

    def unpack(self) -> Iterator[tuple[Any, Position]]:
        if self.lengths is None:
            yield from zip(self.payload, self.positions, strict=True)
            return
        if isinstance(self.payload, pa.RecordBatch):
            offsets = np.cumsum([0, *self.lengths[:-1]])
            for offset, length, position in zip(offsets, self.lengths, self.positions, strict=True):
                yield self.payload.slice(int(offset), length), position
            return
        columns = {k: _cut(v, [n[k] for n in self.lengths]) for k, v in self.payload.items()}  # type: ignore[index]
        for i, position in enumerate(self.positions):
            yield {k: _restore(parts[i]) for k, parts in columns.items()}, position

    def pin_memory(self) -> Packet:
        """Called by the DataLoader's pin-memory thread."""
        if isinstance(self.payload, dict):
            payload = {
                k: v.pin_memory() if isinstance(v, torch.Tensor) else v
                for k, v in self.payload.items()
            }
            return Packet(self.worker, self.positions, payload, self.lengths, self.last)
        return self


def pack(worker: int, batches: list[Any], positions: list[Position], *, last: bool) -> Packet:
    """One packet for ``batches``: columns concatenated when every batch has the same layout."""
    if batches and all(isinstance(b, pa.RecordBatch) for b in batches):
        payload = pa.concat_batches(batches)
        return Packet(worker, positions, payload, [b.num_rows for b in batches], last)
    if batches and all(isinstance(b, dict) for b in batches) and _same_layout(batches):
        payload = {k: _join([b[k] for b in batches]) for k in batches[0]}
        lengths = [{k: len(v) for k, v in b.items()} for b in batches]
        return Packet(worker, positions, payload, lengths, last)
    return Packet(worker, positions, batches, None, last)


def _same_layout(batches: list[dict[str, Any]]) -> bool:
    keys = list(batches[0])
    for key in keys:
        first = batches[0][key]
        for batch in batches[1:]:
            if list(batch) != keys or type(batch[key]) is not type(first):
                return False
            if not isinstance(first, torch.Tensor | np.ndarray | list):
                return False
            if isinstance(first, torch.Tensor | np.ndarray) and (
                batch[key].dtype != first.dtype or batch[key].shape[1:] != first.shape[1:]
            ):
                return False
        if isinstance(first, torch.Tensor | np.ndarray) and first.ndim == 0:
            return False
    return all(isinstance(batches[0][k], torch.Tensor | np.ndarray | list) for k in keys)


def _join(values: list[Any]) -> Any:
    if isinstance(values[0], torch.Tensor):
        # Concatenate straight into shared memory: the queue then sends a handle, not a copy.
        first = values[0]
        rows = sum(len(v) for v in values)
        out = torch.empty((rows, *first.shape[1:]), dtype=first.dtype).share_memory_()
        return torch.cat(values, out=out)
    if isinstance(values[0], np.ndarray):
        joined = np.concatenate(values)
        # numeric numpy travels as a shared-memory tensor; object arrays are pickled.
        return _NumpyAsTensor(torch.from_numpy(joined)) if joined.dtype != object else joined
    return [item for value in values for item in value]


@dataclass
class _NumpyAsTensor:
    tensor: torch.Tensor


def _cut(value: Any, lengths: list[int]) -> list[Any]:
    if isinstance(value, _NumpyAsTensor):
        return [_NumpyAsTensor(t) for t in torch.split(value.tensor, lengths)]
    if isinstance(value, torch.Tensor):
        return list(torch.split(value, lengths))
    bounds = np.cumsum([0, *lengths])
    return [value[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _restore(value: Any) -> Any:
    return value.tensor.numpy() if isinstance(value, _NumpyAsTensor) else value
