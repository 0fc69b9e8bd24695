"""Row counts and sizes of an Arrow IPC file's record batches, without decoding any of them.

pyarrow has no call for this: ``RecordBatchFileReader.get_batch`` reads and decodes a batch
(decompressing it when the file is compressed), and ``RecordBatch.nbytes`` kills the process
with SIGSEGV on some 0-row batches with union columns. So this module reads the file's
flatbuffer footer (the list of blocks: offset, header length, body length of each record
batch) and each batch's message header (its row count), and never a body.

Layout (Arrow columnar format, "IPC File Format")::

    <magic ARROW1 + padding> <stream messages ...> <footer flatbuffer> <int32 footer length> ARROW1

A record batch's size on storage is its header plus its body, the bytes a read of it fetches.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

__all__ = ["record_batches"]

_MAGIC = b"ARROW1"
_CONTINUATION = b"\xff\xff\xff\xff"
_RECORD_BATCH = 3  # MessageHeader union tag
_FOOTER_BATCHES = 3  # Footer.recordBatches: [Block]
_BLOCK = struct.Struct("<qi4xq")  # Block: offset, metaDataLength, (padding), bodyLength

ReadAt = Callable[[int, int], bytes]


def record_batches(read_at: ReadAt, size: int) -> list[tuple[int, int]]:
    """``(rows, bytes on storage)`` of each record batch of the IPC file of ``size`` bytes.

    ``read_at(offset, length)`` returns exactly ``length`` bytes. ``ValueError`` (saying what
    is wrong) when the footer or a header is not a valid Arrow IPC structure.
    """
    try:
        return _record_batches(read_at, size)
    except (struct.error, IndexError) as exc:
        raise ValueError(f"corrupt Arrow IPC footer or record batch header ({exc})") from None


def _record_batches(read_at: ReadAt, size: int) -> list[tuple[int, int]]:
    tail = read_at(size - 10, 10) if size >= 10 else b""
    if tail[4:] != _MAGIC:
        raise ValueError("not an Arrow IPC file (no ARROW1 magic at its end)")
    length = int.from_bytes(tail[:4], "little", signed=True)
    if not 0 < length <= size - 18:
        raise ValueError(f"Arrow IPC footer length {length} does not fit the file's {size} bytes")
    footer = _Table.root(read_at(size - 10 - length, length))
    start, count = footer.vector(_FOOTER_BATCHES)
    batches = []
    for i in range(count):
        offset, header, body = _BLOCK.unpack_from(footer.buf, start + i * _BLOCK.size)
        if offset < 0 or header <= 0 or body < 0 or offset + header + body > size:
            raise ValueError(f"record batch {i} lies outside the file ({offset}, {header}, {body})")
        batches.append((_rows(read_at(offset, header), i), header + body))
    return batches


def _rows(message: bytes, index: int) -> int:
    """The row count in the header of record batch ``index`` (``message``: its header bytes)."""
    start = 8 if message[:4] == _CONTINUATION else 4  # before Arrow 0.15: no continuation
    header = _Table.root(message[start:])
    kind = header.scalar(1, "<B", 0)
    batch = header.table(2)
    if kind != _RECORD_BATCH or batch is None:
        raise ValueError(f"block {index} of the footer is not a record batch (message type {kind})")
    rows = int(batch.scalar(0, "<q", 0))  # a default (0) is left out of the buffer
    if rows < 0:
        raise ValueError(f"record batch {index} has no valid row count ({rows})")
    return rows


class _Table:
    """A flatbuffer table at ``pos`` of ``buf``: its fields by index, through its vtable."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self._vtable = pos - _unpack("<i", buf, pos)
        self._vtable_size = _unpack("<H", buf, self._vtable)

    @classmethod
    def root(cls, buf: bytes) -> _Table:
        return cls(buf, _unpack("<I", buf, 0))

    def _field(self, index: int) -> int | None:
        at = 4 + 2 * index
        offset = _unpack("<H", self.buf, self._vtable + at) if at < self._vtable_size else 0
        return self.pos + offset if offset else None

    def scalar(self, index: int, fmt: str, default: Any) -> Any:
        at = self._field(index)
        return default if at is None else _unpack(fmt, self.buf, at)

    def table(self, index: int) -> _Table | None:
        at = self._field(index)
        return None if at is None else _Table(self.buf, at + _unpack("<I", self.buf, at))

    def vector(self, index: int) -> tuple[int, int]:
        """``(position of the first element, element count)``; ``(0, 0)`` when absent."""
        at = self._field(index)
        if at is None:
            return 0, 0
        start = at + _unpack("<I", self.buf, at)
        return start + 4, _unpack("<I", self.buf, start)


def _unpack(fmt: str, buf: bytes, pos: int) -> Any:
    if pos < 0:  # struct would count from the end
        raise IndexError(f"offset {pos} before the start of a flatbuffer")
    return struct.unpack_from(fmt, buf, pos)[0]
