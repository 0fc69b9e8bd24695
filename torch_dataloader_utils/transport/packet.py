"""Moving batches from DataLoader workers to the main process in few, large messages.

For batches of a few thousand rows the cost of a message per tensor, not the bytes, bounds
throughput. So a worker packs a run of consecutive batches into a :class:`Packet`: their
columns joined across the batches, the numeric ones written into a slot of
``transport.slots.SharedSlots``; the main process cuts them back into batches, views of the
slot when it may lend it, else copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ..base.jagged import JaggedArray, JaggedTensorParts, is_jagged, jagged
from ..base.stages import TRANSPORT, Stage
from ..planning.plan import Position
from .slots import SharedSlots, Slab

__all__ = ["Derived", "Packet", "Unjoined", "pack", "tensor_bytes"]

_ALIGN = 64


@dataclass
class Packet:
    """Consecutive batches of one worker and the stream position after each of them.

    ``payload`` is a dict of columns joined across the batches (numeric ones in ``slot``), one
    joined RecordBatch, or the batches as they are (``lengths is None``). ``lengths`` gives
    each batch's rows, one number for all columns or one per column (a transform may change
    lengths per column).

    ``seq`` numbers a worker's packets from 0 in each iteration, so the main process notices a
    packet that never arrived. ``error`` ends a worker's stream with the exception it raised
    (``slot`` is then -1 and there are no batches).
    """

    worker: int
    slot: int
    positions: list[Position]
    payload: Any
    lengths: list[int] | list[dict[str, int]] | None
    last: bool
    seq: int = 0
    error: Any = None
    stages: Any = None  # the worker's figures (``base.stages``) since its stream began

    def unpack(self, slots: SharedSlots, *, pin: bool = False) -> list[tuple[Any, Position]]:
        """The batches: views of the slot when it may be lent, else copies (pinned if ``pin``)."""
        lend = not pin and slots.lend_or_copy(self.worker, self.slot)
        try:
            with Stage(TRANSPORT):
                return list(zip(self._batches(slots, lend, pin), self.positions, strict=True))
        finally:
            if not lend:
                slots.free(self.worker, self.slot)

    def _batches(self, slots: SharedSlots, lend: bool, pin: bool) -> Iterator[Any]:
        if self.lengths is None:  # batches as they were (dicts of differing keys, ...)
            yield from (_completed(b, pin) if isinstance(b, dict) else b for b in self.payload)
        elif isinstance(self.payload, pa.RecordBatch):
            offset = 0
            for length in self.lengths:
                yield self.payload.slice(offset, length)
                offset += length  # type: ignore[operator]
        else:
            columns = {
                key: _cut(value, self._lengths_of(key), self._slot_view(slots), lend, pin)
                for key, value in self.payload.items()
            }
            for i in range(len(self.positions)):
                yield _completed({key: parts[i] for key, parts in columns.items()}, pin)

    def _slot_view(self, slots: SharedSlots) -> Any:
        return lambda slab: slots.view(self.worker, self.slot, slab)

    def _lengths_of(self, key: str) -> list[int]:
        lengths = self.lengths or []
        return [n[key] if isinstance(n, dict) else n for n in lengths]


def pack(
    slots: SharedSlots,
    worker: int,
    slot: int,
    parts: list[Any],
    lengths: list[int] | list[dict[str, int]],
    positions: list[Position],
    *,
    last: bool,
    seq: int = 0,
) -> Packet:
    """Packet ``seq`` of ``worker`` from ``parts`` (chunks or batches) in stream order.

    Dict parts have their tensor and numeric numpy columns written into ``slot``; a column of
    scalars or 0-d tensors/arrays (a transform's per-batch value) stays one value per batch.
    """
    if parts and all(isinstance(p, pa.RecordBatch) for p in parts):
        return Packet(worker, slot, positions, pa.concat_batches(parts), lengths, last, seq)
    if parts and all(isinstance(p, dict) and list(p) == list(parts[0]) for p in parts):
        offset = 0
        payload: dict[str, Any] = {}
        for key in parts[0]:
            values = [p[key] for p in parts]
            if any(_is_scalar(v) for v in values):
                payload[key] = Unjoined(values)
                continue
            payload[key], offset = _join(
                values, lambda slab: slots.view(worker, slot, slab), offset, slots.slot_bytes
            )
        return Packet(worker, slot, positions, payload, lengths, last, seq)
    return Packet(worker, slot, positions, parts, None, last, seq)


def _is_scalar(value: Any) -> bool:
    """A value without rows: a Python scalar, or a 0-d tensor or array."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.ndim == 0
    return not hasattr(value, "__len__")


def tensor_bytes(batch: Any) -> int:
    """Bytes of the numeric columns of a dict batch (what a slot must hold)."""
    if not isinstance(batch, dict):
        return 0
    return sum(_nbytes(v) for v in batch.values())


def _nbytes(value: Any) -> int:
    if is_jagged(value):
        return int(value.values().nbytes + value.offsets().nbytes) + 2 * _ALIGN
    if isinstance(value, JaggedArray):
        return int(value.values.nbytes + value.offsets.nbytes) + 2 * _ALIGN
    if isinstance(value, torch.Tensor | np.ndarray):
        return int(value.nbytes) + _ALIGN
    return 0


def _join(values: list[Any], view: Any, offset: int, end: int) -> tuple[Any, int]:
    """One value for a column across parts, in the slot when it is numeric and fits."""
    first = values[0]
    jagged = _jagged_parts(values)
    if jagged is not None:
        return _join_jagged(*jagged, view, offset, end)
    if isinstance(first, JaggedTensorParts):  # items of different types: one value per batch
        return Unjoined([v.nested() for v in values]), offset
    numeric = isinstance(first, torch.Tensor) or (
        isinstance(first, np.ndarray) and first.dtype != object
    )
    if numeric and first.ndim and _uniform(values):
        shape = (sum(v.shape[0] for v in values), *first.shape[1:])
        is_numpy = isinstance(first, np.ndarray)
        dtype = torch.from_numpy(np.empty(0, first.dtype)).dtype if is_numpy else first.dtype
        slab = Slab(offset, dtype, shape, is_numpy)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if offset + nbytes > end:  # larger than a slot: let torch share it on its own
            joined = np.concatenate(values) if is_numpy else torch.cat(values)
            return joined, offset
        _concatenate(values, view(slab))
        return slab, offset + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    if isinstance(first, list) and all(isinstance(v, list) for v in values):
        return [item for value in values for item in value], offset
    if isinstance(first, np.ndarray) and all(isinstance(v, np.ndarray) for v in values):
        return np.concatenate(values), offset
    return Unjoined(values), offset


@dataclass(frozen=True)
class _Jagged:
    """A jagged column joined across parts: every row's values, then ``int64`` offsets from 0
    (rows + 1); each a ``Slab`` in the slot, or a tensor when the slot is too small."""

    values: Any
    offsets: Any
    numpy: bool


def _jagged_parts(values: list[Any]) -> tuple[list[Any], list[np.ndarray], bool] | None:
    """Values and offsets of parts that are all jagged alike; ``None`` otherwise."""
    kinds = {type(v) for v in values}
    if kinds == {JaggedArray} or kinds == {JaggedTensorParts}:
        parts, offsets = [v.values for v in values], [v.offsets for v in values]
        is_numpy = kinds == {JaggedArray}
    elif all(is_jagged(v) for v in values):
        parts, offsets = [v.values() for v in values], [v.offsets().numpy() for v in values]
        is_numpy = False
    else:
        return None
    return (parts, offsets, is_numpy) if _uniform(parts) else None


def _join_jagged(
    parts: list[Any], offsets: list[np.ndarray], is_numpy: bool, view: Any, offset: int,
    end: int,
) -> tuple[_Jagged, int]:  # fmt: skip
    """Values one after another (as ``_join`` does), offsets shifted by the rows before."""
    rows = sum(len(o) - 1 for o in offsets)
    values, after = _join(parts, view, offset, end)
    slab = Slab(after, torch.int64, (rows + 1,), is_numpy)
    nbytes = (rows + 1) * 8
    if isinstance(values, Slab) and after + nbytes <= end:
        _shifted(offsets, view(slab).numpy())
        return _Jagged(values, slab, is_numpy), after + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    joined = np.empty(rows + 1, dtype=np.int64)
    _shifted(offsets, joined)
    return _Jagged(values, joined, is_numpy), after


def _shifted(offsets: list[np.ndarray], out: np.ndarray) -> None:
    """``offsets`` of consecutive parts as one run of offsets from 0, written into ``out``."""
    row, base = 0, 0
    for own in offsets:
        np.add(own[:-1], base - own[0], out=out[row : row + len(own) - 1])
        row, base = row + len(own) - 1, base + int(own[-1] - own[0])
    out[row] = base


def _concatenate(values: list[Any], target: torch.Tensor) -> None:
    """Copy ``values`` one after another into ``target`` (numpy's copy is the fastest here)."""
    try:
        arrays = [v if isinstance(v, np.ndarray) else v.numpy() for v in values]
    except TypeError:  # a dtype numpy lacks (bfloat16, ...)
        torch.cat([torch.as_tensor(v) for v in values], out=target)
    else:
        np.concatenate(arrays, out=target.numpy())


def _uniform(values: list[Any]) -> bool:
    first = values[0]
    return all(
        type(v) is type(first) and v.dtype == first.dtype and v.shape[1:] == first.shape[1:]
        for v in values
    )


@dataclass(frozen=True)
class Derived:
    """A column a worker leaves for the main process to compute from the rest of its batch,
    when that is cheaper than sending it (``build`` is pickled by reference)."""

    build: Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class Unjoined:
    """A column whose per-batch values could not be joined; kept one per batch."""

    values: list[Any]


def _completed(batch: dict[str, Any], pin: bool) -> dict[str, Any]:
    """``batch`` with its ``Derived`` columns computed (pinned if ``pin``), in their places."""
    if not any(isinstance(value, Derived) for value in batch.values()):
        return batch
    done = {}
    for key, value in batch.items():
        if isinstance(value, Derived):
            value = value.build(batch)
            if pin and isinstance(value, torch.Tensor):
                value = value.pin_memory()
        done[key] = value
    return done


def _cut(value: Any, lengths: list[int], view: Any, lend: bool, pin: bool) -> list[Any]:
    """A joined column cut back into per-batch values (slot views, or copies of them)."""
    if isinstance(value, Unjoined):
        return value.values
    if isinstance(value, _Jagged):
        return _cut_jagged(value, lengths, view, lend, pin)
    if isinstance(value, Slab):
        parts = torch.split(view(value), lengths)
        if not lend:
            parts = tuple(p.pin_memory() if pin else p.clone() for p in parts)
        return [p.numpy() for p in parts] if value.numpy else list(parts)
    if isinstance(value, torch.Tensor):
        return [p.pin_memory() if pin else p for p in torch.split(value, lengths)]
    bounds = np.cumsum([0, *lengths])
    return [value[a:b] for a, b in itertools.pairwise(bounds)]


def _cut_jagged(value: _Jagged, lengths: list[int], view: Any, lend: bool, pin: bool) -> list[Any]:
    """Per-batch jagged values: views of the joined values (copies unless the slot is lent),
    offsets rebased to 0 (always new: they are small)."""
    in_slot = isinstance(value.values, Slab)
    values = view(value.values) if in_slot else torch.as_tensor(value.values)
    offsets = value.offsets
    bounds = view(offsets).numpy() if isinstance(offsets, Slab) else offsets
    out: list[Any] = []
    row = 0
    for length in lengths:
        own = bounds[row : row + length + 1]
        part = values[int(own[0]) : int(own[-1])]
        if in_slot and not lend:
            part = part.clone()
        rebased = torch.from_numpy(np.subtract(own, own[0]))
        if value.numpy:
            out.append(JaggedArray(part.numpy(), rebased.numpy()))
        elif pin:
            out.append(jagged(part.pin_memory(), rebased.pin_memory()))
        else:
            out.append(jagged(part, rebased))
        row += length
    return out
