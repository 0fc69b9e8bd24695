"""The interface one file format implements: read footer metadata, describe where units lie,
read a range of units.

A *unit* is the smallest independently readable piece of a file: a Parquet row group or an
Arrow IPC record batch. Splits are cut on unit boundaries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pyarrow as pa

__all__ = ["FileFormat", "FileMetadata", "Span", "joined", "read_at"]

Span = tuple[int, int]  # [start, stop) byte offsets in a file


@dataclass(frozen=True)
class FileMetadata:
    """What planning needs from one file's footer.

    ``footer`` is the format's own parsed footer, handed back to :meth:`FileFormat.read_units` so
    that workers never read it again; it must pickle.
    """

    schema: pa.Schema
    unit_rows: tuple[int, ...]
    unit_bytes: tuple[int, ...]
    footer: Any = None

    @property
    def num_rows(self) -> int:
        return sum(self.unit_rows)


class FileFormat(ABC):
    """One on-storage format. Sources are pyarrow-readable files (``pa.NativeFile`` or paths)."""

    name: ClassVar[str]
    # File name endings of the format: a directory holding any is read for those files only.
    extensions: ClassVar[tuple[str, ...]]
    # True when decoding always produces fresh, writable memory (never the file's own bytes),
    # so tensors may share it without a copy.
    decodes_into_new_memory: ClassVar[bool]
    # What its units are called in messages ("row group").
    unit_name: ClassVar[str]

    @abstractmethod
    def read_metadata(self, source: Any) -> FileMetadata:
        """Parse the footer of ``source``."""

    def dump_footer(self, footer: Any) -> bytes:
        """``footer`` as the format's own bytes (data, never pickle) for the index cache."""
        return b""

    def load_footer(self, data: bytes) -> Any:
        """The footer :meth:`dump_footer` wrote; ``None`` for formats that keep none."""
        return None

    def unit_spans(
        self, metadata: FileMetadata, units: range, columns: Sequence[str] | None
    ) -> list[tuple[Span, ...]] | None:
        """The byte spans (sorted, disjoint) that reading each unit of ``units`` with ``columns``
        touches, so a reader can fetch them ahead; ``None`` when the footer does not say."""
        return None

    def known_bytes(self, metadata: FileMetadata) -> tuple[int, bytes] | None:
        """``(offset, bytes)`` of the file that :meth:`read_units` reads and the index already
        holds (a footer), so no split fetches them again; ``None`` if there are none."""
        return None

    @abstractmethod
    def read_units(
        self,
        source: Any,
        metadata: FileMetadata,
        units: range,
        columns: Sequence[str] | None,
        batch_rows: int,
    ) -> Iterator[pa.RecordBatch]:
        """Yield the rows of ``units``, in order, as record batches of at most ``batch_rows``."""


def read_at(source: Any, offset: int, length: int) -> bytes:
    """Exactly ``length`` bytes of ``source`` (a ``pa.NativeFile`` or a seekable Python file)
    from ``offset``; ``ValueError`` when the file ends before."""
    if isinstance(source, pa.NativeFile):
        data = source.read_at(length, offset)
    else:
        source.seek(offset)
        data = source.read(length)
    if len(data) != length:
        raise ValueError(f"file ends before byte {offset + length} (expected {length} bytes)")
    return bytes(data)


def joined(spans: Sequence[Span]) -> tuple[Span, ...]:
    """``spans`` sorted, with touching or overlapping ones joined."""
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)
