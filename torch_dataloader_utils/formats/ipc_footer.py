"""An Arrow IPC file's footer and record batch headers, read without touching any body.

pyarrow has no call for this: ``RecordBatchFileReader.get_batch`` reads and decodes a batch
(decompressing it when the file is compressed), and ``RecordBatch.nbytes`` kills the process
with SIGSEGV on some 0-row batches with union columns. So this module reads the file's
flatbuffer footer (the list of blocks: offset, header length, body length of each record
batch) and each batch's message header (its row count and the offsets of its body buffers),
and never a body. The buffers let a reader fetch only the projected columns of a batch.

Layout (Arrow columnar format, "IPC File Format")::

    <magic ARROW1 + padding> <stream messages ...> <footer flatbuffer> <int32 footer length> ARROW1

A record batch's size on storage is its header plus its body, the bytes a read of it fetches.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

__all__ = ["Block", "IpcFooter", "buffer_counts", "read_footer"]

_MAGIC = b"ARROW1"
_CONTINUATION = b"\xff\xff\xff\xff"
_RECORD_BATCH = 3  # MessageHeader union tag
_FOOTER_DICTIONARIES = 2  # Footer.dictionaries: [Block]
_FOOTER_BATCHES = 3  # Footer.recordBatches: [Block]
_BATCH_BUFFERS = 2  # RecordBatch.buffers: [Buffer]
_BATCH_VARIADIC = 4  # RecordBatch.variadicBufferCounts: [long] (view types)
_BLOCK = struct.Struct("<qi4xq")  # Block: offset, metaDataLength, (padding), bodyLength
_BUFFER = struct.Struct("<qq")  # Buffer: offset, length (in the body)
_LENGTH = struct.Struct("<q")

ReadAt = Callable[[int, int], bytes]
Span = tuple[int, int]


@dataclass(frozen=True)
class Block:
    """One record batch: where its message starts, its header and body lengths, its row count,
    and its body buffers ``(offset in the body, length)``; ``None`` for view types."""

    offset: int
    header: int
    body: int
    rows: int
    buffers: tuple[Span, ...] | None


@dataclass(frozen=True)
class IpcFooter:
    """What the index keeps of an IPC file: the bytes from its footer to its end (``tail``, at
    ``offset``) and every record batch's message header, in the footer's order."""

    offset: int
    tail: bytes
    headers: tuple[bytes, ...]

    @cached_property
    def blocks(self) -> tuple[Block, ...]:
        starts = _blocks(self.tail[: len(self.tail) - 10], self.offset + len(self.tail))
        return tuple(
            Block(offset, header, body, *_parse_header(message, i))
            for i, ((offset, header, body), message) in enumerate(
                zip(starts, self.headers, strict=True)
            )
        )

    @cached_property
    def dictionaries(self) -> tuple[Span, ...]:
        """Byte spans of the dictionary batches, which pyarrow reads when a file is opened."""
        blocks = _blocks(
            self.tail[: len(self.tail) - 10], self.offset + len(self.tail), _FOOTER_DICTIONARIES
        )
        return tuple((offset, offset + header + body) for offset, header, body in blocks)

    def units(self) -> list[tuple[int, int]]:
        """``(rows, bytes on storage)`` of each record batch: header plus body."""
        return [(b.rows, b.header + b.body) for b in self.blocks]

    def as_file(self) -> bytes:
        """A file holding only the footer (magic, footer, length, magic): pyarrow reads its
        schema from it without any I/O."""
        return _MAGIC + b"\0\0" + self.tail

    def dump(self) -> bytes:
        """The IPC bytes themselves: offset, tail length, tail, headers (lengths in the tail)."""
        return (
            _LENGTH.pack(self.offset)
            + _LENGTH.pack(len(self.tail))
            + self.tail
            + b"".join(self.headers)
        )

    @classmethod
    def load(cls, data: bytes) -> IpcFooter:
        """The footer :meth:`dump` wrote; ``ValueError`` when it does not parse."""
        try:
            offset, length = _LENGTH.unpack_from(data, 0)[0], _LENGTH.unpack_from(data, 8)[0]
            tail = data[16 : 16 + length]
            at, headers = 16 + length, []
            for _, header, _ in _blocks(tail[: len(tail) - 10], offset + len(tail)):
                headers.append(data[at : at + header])
                at += header
        except (struct.error, IndexError) as exc:
            raise ValueError(f"corrupt cached Arrow IPC footer ({exc})") from None
        if at != len(data):
            raise ValueError("corrupt cached Arrow IPC footer (wrong length)")
        return cls(offset, tail, tuple(headers))


def read_footer(read_at: ReadAt, size: int) -> IpcFooter:
    """The footer of the IPC file of ``size`` bytes and the header of each record batch.

    ``read_at(offset, length)`` returns exactly ``length`` bytes; only the footer and the
    headers are read, never a body. ``ValueError`` (saying what is wrong) when the footer or a
    header is not a valid Arrow IPC structure.
    """
    try:
        footer = _read_footer(read_at, size)
        _ = footer.blocks  # parse now: a corrupt header fails here, naming the batch
    except (struct.error, IndexError) as exc:
        raise ValueError(f"corrupt Arrow IPC footer or record batch header ({exc})") from None
    return footer


def _read_footer(read_at: ReadAt, size: int) -> IpcFooter:
    end = read_at(size - 10, 10) if size >= 10 else b""
    if end[4:] != _MAGIC:
        raise ValueError("not an Arrow IPC file (no ARROW1 magic at its end)")
    length = int.from_bytes(end[:4], "little", signed=True)
    if not 0 < length <= size - 18:
        raise ValueError(f"Arrow IPC footer length {length} does not fit the file's {size} bytes")
    offset = size - 10 - length
    tail = read_at(offset, length) + end
    headers = tuple(read_at(at, header) for at, header, _ in _blocks(tail[:length], size))
    return IpcFooter(offset, tail, headers)


def _blocks(footer: bytes, size: int, field: int = _FOOTER_BATCHES) -> list[tuple[int, int, int]]:
    """``(offset, header length, body length)`` of each record (or dictionary) batch."""
    table = _Table.root(footer)
    start, count = table.vector(field)
    blocks = []
    for i in range(count):
        offset, header, body = _BLOCK.unpack_from(table.buf, start + i * _BLOCK.size)
        if offset < 0 or header <= 0 or body < 0 or offset + header + body > size:
            raise ValueError(f"record batch {i} lies outside the file ({offset}, {header}, {body})")
        blocks.append((offset, header, body))
    return blocks


def _parse_header(message: bytes, index: int) -> tuple[int, tuple[Span, ...] | None]:
    """Row count and body buffers in the header of record batch ``index``."""
    start = 8 if message[:4] == _CONTINUATION else 4  # before Arrow 0.15: no continuation
    header = _Table.root(message[start:])
    kind = header.scalar(1, "<B", 0)
    batch = header.table(2)
    if kind != _RECORD_BATCH or batch is None:
        raise ValueError(f"block {index} of the footer is not a record batch (message type {kind})")
    rows = int(batch.scalar(0, "<q", 0))  # a default (0) is left out of the buffer
    if rows < 0:
        raise ValueError(f"record batch {index} has no valid row count ({rows})")
    if batch.vector(_BATCH_VARIADIC)[1]:
        return rows, None
    at, count = batch.vector(_BATCH_BUFFERS)
    return rows, tuple(_BUFFER.unpack_from(batch.buf, at + i * _BUFFER.size) for i in range(count))


def buffer_counts(messages: Sequence[bytes]) -> list[int] | None:
    """Body buffers in each of ``messages`` (serialized empty record batches of one field each:
    how many buffers that field's column takes); ``None`` if any uses variadic buffers."""
    counts = []
    for i, message in enumerate(messages):
        _, buffers = _parse_header(message, i)
        if buffers is None:
            return None
        counts.append(len(buffers))
    return counts


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
