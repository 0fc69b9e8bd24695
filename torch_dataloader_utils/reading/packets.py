"""What a DataLoader worker sends to ``StructuredDataLoader``: packets of consecutive batches.

Packets grow 1, 2, 4, ... batches, so the first batch of a worker arrives fast, up to what one
shared-memory slot holds. Without a transform a packet is made of whole decoded chunks,
converted once each, so a worker does no per-batch work at all; with one, each batch is
converted and transformed on its own and the packet joins them.

Nothing a worker reads may vanish on the way. The DataLoader queue pickles in a background
thread that only prints what fails to pickle, so a worker pickles whatever is not in the slot
itself, once (the queue then copies bytes), and an unpicklable column raises
``UnsendableBatchError`` naming it. Packets are numbered, and an error raised while reading
ends the worker's stream in a packet of its own, so the main process raises it in stream
order with its own type and message (``StructuredDataLoader``).
"""

from __future__ import annotations

import io
import pickle
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pyarrow as pa

from ..base import stages
from ..base.errors import UnsendableBatchError
from ..planning.plan import Position
from ..transport.packet import Packet, Unjoined, pack, tensor_bytes
from ..transport.slots import SharedSlots, Slab
from .runs import Run

__all__ = [
    "WorkerFailure",
    "batch_parts",
    "chunk_parts",
    "run_sizes",
    "send",
    "slot_bytes",
]

# At most this many batches per packet, whatever fits in a slot.
_MAX_PACKET_BATCHES = 64

# What a packet is made of: parts (chunks or batches), rows per batch, positions, is-last.
Parts = tuple[list[Any], list[int] | list[dict[str, int]], list[Position], bool]


# Shared memory per slot: at least this, and room for two batches, up to the cap (a larger
# batch is shared by torch on its own, slower but whole).
_MIN_SLOT_BYTES = 2 << 20
_MAX_SLOT_BYTES = 256 << 20


def slot_bytes(batch_bytes: int) -> int:
    """Bytes per shared-memory slot for batches of about ``batch_bytes``: a power of two."""
    wanted = min(_MAX_SLOT_BYTES, max(_MIN_SLOT_BYTES, 2 * batch_bytes))
    return 1 << (wanted - 1).bit_length()


def run_sizes(batch_bytes: int, slot_bytes: int) -> Iterator[int]:
    """Batches per packet: 1, 2, 4, ... up to what fits in a slot (at least 1)."""
    return _doubling(max(1, min(_MAX_PACKET_BATCHES, slot_bytes // max(1, batch_bytes))))


def chunk_parts(runs: Iterable[Run], convert: Callable[[Run], list[Any]]) -> Iterator[Parts]:
    """One packet per run, from its converted chunks; then an empty last packet."""
    for run in runs:
        yield convert(run), run.lengths, run.positions, False
    yield [], [], [], True


def batch_parts(batches: Iterable[tuple[Any, Position]], slot_bytes: int) -> Iterator[Parts]:
    """Transformed batches grouped 1, 2, 4, ... while their tensors fit in a slot."""
    group: list[Any] = []
    positions: list[Position] = []
    sizes, nbytes = _doubling(_MAX_PACKET_BATCHES), 0
    size = next(sizes)
    for batch, position in batches:
        more = tensor_bytes(batch)
        if group and (len(group) >= size or nbytes + more > slot_bytes):
            yield group, _lengths(group), positions, False
            group, positions, nbytes, size = [], [], 0, next(sizes)
        group.append(batch)
        positions.append(position)
        nbytes += more
    yield group, _lengths(group), positions, True


@dataclass(frozen=True)
class WorkerFailure:
    """What ended a worker's stream: the exception (picklable, checked) and its traceback."""

    exception: BaseException
    traceback: str


def send(parts: Iterable[Parts], slots: SharedSlots, worker: int) -> Iterator[Packet]:
    """Each packet written into a free slot of ``worker``, numbered from 0, its other values
    pickled; stops if the iteration ends first. An error ends the stream in a packet."""
    generation = slots.generation()
    slots.guard_worker()
    stream = iter(parts)
    seq = 0
    began = stages.snapshot()  # each packet carries the worker's figures since
    while True:
        positions: list[Position] = []
        try:
            with stages.Stage(stages.DECODE):  # less the stages inside
                part = next(stream, None)
            if part is None:
                return
            group, lengths, positions, last = part
            with stages.Stage(stages.BLOCKED):
                slot = slots.acquire(worker, generation)
            if slot is None:  # the main process ended the iteration
                return
            with stages.Stage(stages.TRANSPORT):
                packet = pack(slots, worker, slot, group, lengths, positions, last=last, seq=seq)
                _pickle_payload(packet, slots)
            packet.stages = stages.snapshot() - began
        except Exception as exc:
            yield _failed(worker, seq, positions, exc)
            return
        yield packet
        seq += 1


def _failed(worker: int, seq: int, positions: list[Position], exc: Exception) -> Packet:
    """The packet that ends a stream with ``exc`` (re-raised here when it does not pickle)."""
    try:
        pickle.loads(ForkingPickler.dumps(exc))
    except Exception:
        raise exc from None  # torch's own wrapper carries its text instead
    failure = WorkerFailure(exc, "".join(traceback.format_exception(exc)))
    return Packet(worker, -1, positions, None, None, True, seq, failure)


class _Pickled:
    """A value pickled in the worker; unpickling the packet restores the value itself."""

    __slots__ = ("data",)

    def __init__(self, value: Any) -> None:
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(value)  # torch's reductions: tensors go by shared memory
        self.data = buffer.getvalue()

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        return pickle.loads, (self.data,)


def _pickle_payload(packet: Packet, slots: SharedSlots) -> None:
    """Pickle what of ``packet`` is not in its slot, naming the column that will not pickle.

    Slot offsets and numeric numpy arrays always pickle; everything else is pickled here, in
    the worker, where a failure can still be raised (the queue's thread would only print it).
    """
    try:
        if isinstance(packet.payload, dict):
            for key, value in packet.payload.items():
                if not _always_pickles(value):
                    packet.payload[key] = _pickled(value, key)
        else:
            packet.payload = _pickled(packet.payload)
    except BaseException:
        slots.free(packet.worker, packet.slot)
        raise


def _always_pickles(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return bool(value.dtype != object)
    return isinstance(value, Slab)


def _pickled(value: Any, key: str | None = None) -> _Pickled:
    try:
        return _Pickled(value)
    except Exception as exc:
        raise UnsendableBatchError(
            f"{_describe(value, key)} cannot be pickled: {type(exc).__name__}: {exc}"
        ) from exc


def _describe(value: Any, key: str | None) -> str:
    """What did not pickle, as a user would name it: a column and its type, or the batches."""
    if isinstance(value, pa.RecordBatch):
        return _unpicklable_column(value) or "a RecordBatch"
    if key is None:  # the batches as they are: name a column when one is to blame
        columns = (_unpicklable_value(b) for b in value if isinstance(b, dict))
        return next((c for c in columns if c), f"a batch of type {_types(value)}")
    if isinstance(value, Unjoined):
        return f"column {key!r} (per-batch values of type {_types(value.values)})"
    return f"column {key!r} ({type(value).__name__})"


def _types(values: list[Any]) -> str:
    return " / ".join(sorted({type(v).__name__ for v in values}))


def _unpicklable_value(batch: dict[str, Any]) -> str | None:
    """The first column of a dict batch that does not pickle, with its type."""
    for key, value in batch.items():
        try:
            ForkingPickler.dumps(value)
        except Exception:
            return f"column {key!r} ({type(value).__name__})"
    return None


def _unpicklable_column(batch: pa.RecordBatch) -> str | None:
    """The first column of ``batch`` that does not pickle, with its Arrow type."""
    for i, field in enumerate(batch.schema):
        try:  # a type pyarrow has no Python class for raises KeyError already in column()
            ForkingPickler.dumps(batch.column(i))
        except Exception:
            return f"column {field.name!r} ({field.type})"
    return None


def _doubling(cap: int) -> Iterator[int]:
    size = 1
    while True:
        yield min(size, cap)
        size *= 2


def _lengths(batches: list[Any]) -> list[int] | list[dict[str, int]]:
    if all(isinstance(b, dict) for b in batches):
        return [{k: _rows(v) for k, v in b.items()} for b in batches]
    return [_rows(b) for b in batches]


def _rows(value: Any) -> int:
    """Rows of a batch or column; 0 for a value without rows (a scalar, a 0-d tensor), which
    ``pack`` keeps one per batch."""
    if getattr(value, "ndim", None) == 0:
        return 0
    return len(value) if hasattr(value, "__len__") else 0
