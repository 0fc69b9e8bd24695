"""Moving batches from DataLoader workers to the main process in few, large messages.

Each tensor a worker puts on the DataLoader queue costs a fresh shared-memory segment, a file
descriptor handed over a socket and page faults on both sides; for batches of a few thousand
rows that overhead, not the bytes, bounds throughput. So a worker packs a run of consecutive
batches into a :class:`Packet` and writes their numeric columns into a slot of
:class:`SharedSlots`: a few shared-memory buffers per worker, allocated once per iteration by
the main process and reused. The queue then carries only offsets.

The main process hands out views of a slot (no copy) and takes the slot back once every view
is gone. So that a training loop that keeps batches can never starve a worker, at most
``slots - 2`` slots per worker stay lent out; a packet arriving beyond that is copied out and
its slot freed at once. Workers wait while all their slots are busy, which bounds memory.

A waiting worker blocks on a semaphore of its own, released by the main process whenever it
frees one of the worker's slots or starts or ends an iteration (no polling). Every
``_PARENT_CHECK`` seconds without news it checks that the main process is still alive, and
exits at once when it is not: a worker waiting here never returns to torch's worker loop,
whose watchdog would otherwise notice, so a trainer killed alone (the OOM killer) leaves no
worker behind.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ..base.compat import new_shared_storage, storage_use_count
from ..base.jagged import JaggedArray, JaggedTensorParts, is_jagged, jagged
from ..planning.plan import Position

__all__ = ["Derived", "Packet", "SharedSlots", "Slab", "Unjoined", "pack", "tensor_bytes"]

_ALIGN = 64
_FREE, _BUSY = 0, 1
_GENERATION, _EPOCH, _FLAGS = 0, 1, 2  # positions in SharedSlots.control
# Seconds a waiting worker blocks before it checks that the main process is alive.
_PARENT_CHECK = 0.25
_ORPHANED_EXIT = 70  # a worker's exit status once its main process is gone (EX_SOFTWARE)
_GUARDED: set[int] = set()  # worker processes whose parent guard thread runs


@dataclass(frozen=True)
class Slab:
    """A tensor stored at byte ``offset`` of a slot; ``numpy`` restores a numpy array."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    numpy: bool


class SharedSlots:
    """``slots`` shared-memory buffers of ``slot_bytes`` per worker, and their flags.

    ``control[0]`` is the iteration's generation (a worker of an older one stops waiting);
    ``control[1]`` the epoch when the iteration starts one afresh, else -1 (so persistent
    workers follow ``set_epoch`` without a restart); ``control[2 + w * slots + s]`` is slot
    ``s`` of worker ``w``: free or busy.

    ``context`` is the multiprocessing start method the workers use, for the wake-up
    semaphores; the default, ``"spawn"``, makes semaphores that also work in forked and
    forkserver workers. ``"fork"`` makes semaphores without a name (unlinked at once), which
    leave nothing behind when the process is SIGKILLed.
    """

    def __init__(
        self,
        num_workers: int,
        slots: int = 4,
        slot_bytes: int = 2 << 20,
        *,
        context: str | None = None,
    ) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        # Allocated shared from the start: share_memory_() would allocate twice and copy.
        self.buffers = [
            [
                torch.empty(0, dtype=torch.uint8).set_(new_shared_storage(slot_bytes))
                for _ in range(slots)
            ]
            for _ in range(num_workers)
        ]
        self.control = torch.zeros(_FLAGS + num_workers * slots, dtype=torch.int64)
        self.control.share_memory_()  # type: ignore[no-untyped-call]
        self._lent: dict[tuple[int, int], int] = {}  # main process: (worker, slot) -> use count
        # One per worker, released when something it may be waiting for changed.
        wake = multiprocessing.get_context(context or "spawn")
        self._wake = [wake.Semaphore(0) for _ in range(num_workers)]
        self._owner = os.getpid()
        self._parent: tuple[int, int] | None = None  # worker: (its pid, its parent's pid)

    @property
    def _flags(self) -> np.ndarray:
        return self.control.numpy()

    def begin(self, fresh_epoch: int | None) -> int:
        """Main process, before workers (re)start: new generation (returned, for ``end``);
        slots not lent are free.

        ``fresh_epoch`` is the epoch the iteration starts from its beginning, ``None`` for a
        resume. Slots still viewed by batches of an earlier iteration stay lent until those go.
        """
        flags = self._flags
        flags[_GENERATION] += 1
        flags[_EPOCH] = -1 if fresh_epoch is None else fresh_epoch
        for worker in {w for w, _ in self._lent}:
            self._reclaim(worker)
        fresh = np.full(len(flags) - _FLAGS, _FREE, dtype=flags.dtype)
        for worker, slot in self._lent:
            fresh[worker * self.slots + slot] = _BUSY
        flags[_FLAGS:] = fresh  # one store: a lent slot never reads FREE in between
        self._wake_all()
        return int(flags[_GENERATION])

    def fresh_epoch(self) -> int | None:
        """Worker: the epoch this iteration starts afresh, ``None`` when it resumes."""
        epoch = int(self._flags[_EPOCH])
        return None if epoch < 0 else epoch

    def generation(self) -> int:
        return int(self._flags[_GENERATION])

    def end(self, generation: int) -> None:
        """Main process: the iteration ``begin`` numbered ``generation`` is over; its workers
        still waiting for a slot give up. A no-op once a newer iteration has begun: an older
        iterator closed late (``del``, the garbage collector) must not end the running one."""
        if self._flags[_GENERATION] != generation:
            return
        self._flags[_GENERATION] += 1
        self._wake_all()

    def acquire(self, worker: int, generation: int) -> int | None:
        """Worker: a free slot, marked busy; ``None`` once the iteration has ended.

        Blocks while every slot is busy; exits the process if the main process dies meanwhile.
        """
        flags = self._flags
        first = _FLAGS + worker * self.slots
        self._watch_parent()
        while flags[_GENERATION] == generation:
            free = np.flatnonzero(flags[first : first + self.slots] == _FREE)
            if len(free):
                slot = int(free[0])
                flags[first + slot] = _BUSY
                if flags[_GENERATION] != generation:  # a new iteration began: not ours
                    flags[first + slot] = _FREE
                    return None
                return slot
            if not self._wake[worker].acquire(timeout=_PARENT_CHECK) and self._orphaned():
                os._exit(_ORPHANED_EXIT)  # nobody is left to report to or clean up for
        return None

    def guard_worker(self) -> None:
        """Worker: exit within ``_PARENT_CHECK`` seconds once the main process is gone, also
        while idle in torch's worker loop (which notices only after its 5 s poll)."""
        self._watch_parent()
        if os.getpid() in _GUARDED:
            return
        _GUARDED.add(os.getpid())
        threading.Thread(target=self._guard, name="tdu-parent-guard", daemon=True).start()

    def _guard(self) -> None:
        while True:
            time.sleep(_PARENT_CHECK)
            if self._orphaned():
                os._exit(_ORPHANED_EXIT)

    def _watch_parent(self) -> None:
        """Worker: remember its parent, to notice when it is adopted by another one."""
        if self._parent is None or self._parent[0] != os.getpid():
            self._parent = (os.getpid(), os.getppid())

    def _orphaned(self) -> bool:
        """Worker: has the main process died? Its children are then adopted (a new parent
        pid); a worker started by a forkserver also checks the main process itself."""
        assert self._parent is not None
        if os.getppid() != self._parent[1]:
            return True
        try:
            os.kill(self._owner, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # pragma: no cover - alive, under another user
            pass
        return False

    def _wake_all(self) -> None:
        for wake in self._wake:
            wake.release()

    def view(self, worker: int, slot: int, slab: Slab) -> torch.Tensor:
        nbytes = int(np.prod(slab.shape)) * slab.dtype.itemsize
        raw = self.buffers[worker][slot][slab.offset : slab.offset + nbytes]
        return raw.view(slab.dtype).view(slab.shape)

    def lend_or_copy(self, worker: int, slot: int) -> bool:
        """Main process, on receiving a packet in ``slot``: may its batches view the slot?"""
        self._reclaim(worker)
        if sum(1 for w, _ in self._lent if w == worker) >= self.slots - 2:
            return False
        self._lent[worker, slot] = storage_use_count(self.buffers[worker][slot].untyped_storage())
        return True

    def free(self, worker: int, slot: int) -> None:
        self._flags[_FLAGS + worker * self.slots + slot] = _FREE
        self._wake[worker].release()

    def _reclaim(self, worker: int) -> None:
        """Free the lent slots of ``worker`` whose views the training loop has dropped."""
        for key in [k for k in self._lent if k[0] == worker]:
            storage = self.buffers[key[0]][key[1]].untyped_storage()
            if storage_use_count(storage) <= self._lent[key]:
                del self._lent[key]
                self.free(*key)


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

    def unpack(self, slots: SharedSlots, *, pin: bool = False) -> list[tuple[Any, Position]]:
        """The batches: views of the slot when it may be lent, else copies (pinned if ``pin``)."""
        lend = not pin and slots.lend_or_copy(self.worker, self.slot)
        try:
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
