"""What a DataLoader worker sends to ``StructuredDataLoader``: packets of consecutive batches.

Packets grow 1, 2, 4, ... batches, so the first batch of a worker arrives fast, up to what one
shared-memory slot holds. Without a transform a packet is made of whole decoded chunks,
converted once each, so a worker does no per-batch work at all; with one, each batch is
converted and transformed on its own and the packet joins them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ._stream import Position, Run
from ._transport import Packet, SharedSlots, pack, tensor_bytes

__all__ = ["batch_parts", "chunk_parts", "run_sizes", "send"]

# At most this many batches per packet, whatever fits in a slot.
_MAX_PACKET_BATCHES = 64

# What a packet is made of: parts (chunks or batches), rows per batch, positions, is-last.
Parts = tuple[list[Any], list[int] | list[dict[str, int]], list[Position], bool]


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


def send(parts: Iterable[Parts], slots: SharedSlots, worker: int) -> Iterator[Packet]:
    """Each packet written into a free slot of ``worker``; stops if the iteration ends first."""
    generation = slots.generation()
    for group, lengths, positions, last in parts:
        slot = slots.acquire(worker, generation)
        if slot is None:  # the main process ended the iteration
            return
        yield pack(slots, worker, slot, group, lengths, positions, last=last)


def _doubling(cap: int) -> Iterator[int]:
    size = 1
    while True:
        yield min(size, cap)
        size *= 2


def _lengths(batches: list[Any]) -> list[int] | list[dict[str, int]]:
    if all(isinstance(b, dict) for b in batches):
        return [{k: len(v) for k, v in b.items()} for b in batches]
    return [len(b) for b in batches]
