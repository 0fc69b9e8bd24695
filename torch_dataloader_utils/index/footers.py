"""A file's footer, read once, and the content fingerprint computed from it.

Both formats end the same way: ``<footer> <int32 footer length> <magic>`` (Parquet: the Thrift
``FileMetaData`` and ``PAR1``; Arrow IPC: the flatbuffer ``Footer`` and ``ARROW1``). ``TailFile``
reads the last ``TAIL`` bytes of a file (more when the footer is larger) in one request and
serves every read inside them from memory, so the format's parser and the fingerprint share one
fetch. Other reads (Arrow record batch headers) go to the file.

The fingerprint is xxhash of the file's size, its footer bytes as stored and the footer's unit
layout: it names content, not a copy, so it is the same on ``s3://`` and on a local copy with
other mtimes. A footer holds every row group's byte offsets, sizes and (usually) column
statistics, and an IPC footer every record batch's offset and length, so a rewritten file
almost always changes it; what it cannot see is documented in ``docs/checkpoints.md``.
"""

from __future__ import annotations

import io
from typing import Any

import xxhash

from ..formats import FileFormat, FileMetadata
from ..formats.base import read_at

__all__ = ["TAIL", "TailFile", "content_fingerprint"]

# pyarrow's own first footer read (``footer_read_size``): a larger tail would not save a GET.
TAIL = 64 * 2**10
_MAGIC = {"parquet": b"PAR1", "arrow": b"ARROW1"}


class TailFile(io.RawIOBase):
    """``source`` (``size`` bytes) with its footer region held in memory after one read."""

    def __init__(self, source: Any, size: int, fmt: FileFormat) -> None:
        super().__init__()
        self._source, self._size, self._pos = source, size, 0
        start = max(0, size - TAIL)
        tail = read_at(source, start, size - start)
        need = _footer_span(tail, size, _MAGIC[fmt.name])
        if need is not None and need > len(tail):  # a large footer: the rest in one more read
            tail = read_at(source, size - need, need - len(tail)) + tail
        self._start, self._tail = size - len(tail), tail
        self.footer = tail[len(tail) - need :] if need is not None else None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        stop = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        start, self._pos = self._pos, max(self._pos, stop)
        if stop <= start:
            return b""
        if start >= self._start:
            return self._tail[start - self._start : stop - self._start]
        below = read_at(self._source, start, min(stop, self._start) - start)
        return below + self._tail[: max(0, stop - self._start)]

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer)[: len(data)] = data
        return len(data)


def _footer_span(tail: bytes, size: int, magic: bytes) -> int | None:
    """Bytes from the footer's start to the end of the file, or ``None`` if ``tail`` does not
    end like the format (the format's parser then says what is wrong)."""
    if len(tail) < len(magic) + 4 or not tail.endswith(magic):
        return None
    at = len(tail) - len(magic) - 4
    length = int.from_bytes(tail[at : at + 4], "little", signed=True)
    need = length + 4 + len(magic)
    return need if length > 0 and need <= size else None


def content_fingerprint(size: int, footer: bytes | None, meta: FileMetadata) -> str:
    """xxhash of the size, the stored footer bytes and the unit layout (rows, bytes)."""
    if footer is None:  # the parser accepted a file whose end is not the format's own
        raise ValueError("its footer length or magic bytes at the end of the file are invalid")
    h = xxhash.xxh64()
    for part in (str(size).encode(), footer, _ints(meta.unit_rows), _ints(meta.unit_bytes)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _ints(values: tuple[int, ...]) -> bytes:
    return ",".join(map(str, values)).encode()
