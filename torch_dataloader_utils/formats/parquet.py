"""Parquet: units are row groups; sizes are the compressed bytes of their column chunks.

Files with Parquet modular encryption are refused before any column chunk is touched: with a
plaintext footer, pyarrow aborts the process (SIGABRT, an uncaught C++ exception) on the first
access to an encrypted column's metadata. Such a footer is followed by its 28-byte signature
(nonce and GCM tag), which is how it is recognised without decrypting anything. Encrypted
footers are refused by pyarrow itself with an ``OSError``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .base import FileFormat, FileMetadata, Span, joined, read_at

__all__ = ["ParquetFormat"]

_FOOTER_SIGNATURE = 28  # nonce (12) + AES-GCM tag (16) after a signed plaintext footer


class ParquetFormat(FileFormat):
    name = "parquet"
    extensions = (".parquet", ".parq", ".pq")
    unit_name = "row group"
    decodes_into_new_memory = True

    def read_metadata(self, source: Any) -> FileMetadata:
        footer = pq.ParquetFile(source).metadata
        _refuse_encrypted(source, footer)
        groups = [footer.row_group(i) for i in range(footer.num_row_groups)]
        return FileMetadata(
            schema=footer.schema.to_arrow_schema(),
            unit_rows=tuple(g.num_rows for g in groups),
            unit_bytes=tuple(
                sum(g.column(c).total_compressed_size for c in range(g.num_columns)) for g in groups
            ),
            footer=footer,
        )

    def dump_footer(self, footer: Any) -> bytes:
        """The footer as a ``_metadata`` file: its Thrift bytes between ``PAR1`` magics."""
        sink = pa.BufferOutputStream()
        footer.write_metadata_file(sink)
        return bytes(sink.getvalue().to_pybytes())

    def load_footer(self, data: bytes) -> Any:
        return pq.read_metadata(pa.BufferReader(data))

    def unit_spans(
        self, metadata: FileMetadata, units: range, columns: Sequence[str] | None
    ) -> list[tuple[Span, ...]] | None:
        """Each row group's projected column chunks (dictionary page included)."""
        footer = metadata.footer
        if footer is None:
            return None
        wanted = None if columns is None else set(columns)
        spans = []
        for r in units:
            group = footer.row_group(r)
            chunks = []
            for c in range(group.num_columns):
                col = group.column(c)
                if wanted is not None and col.path_in_schema.split(".")[0] not in wanted:
                    continue
                start = col.data_page_offset
                if col.has_dictionary_page and 0 < col.dictionary_page_offset < start:
                    start = col.dictionary_page_offset
                chunks.append((start, start + col.total_compressed_size))
            spans.append(joined(chunks))
        return spans

    def read_units(
        self,
        source: Any,
        metadata: FileMetadata,
        units: range,
        columns: Sequence[str] | None,
        batch_rows: int,
    ) -> Iterator[pa.RecordBatch]:
        # A Python file (``RemoteFile``) fetches the spans of ``unit_spans`` ahead itself;
        # pyarrow's pre-buffering would coalesce them across holes into reads it cannot serve.
        reader = pq.ParquetFile(
            source, metadata=metadata.footer, pre_buffer=not isinstance(source, io.IOBase)
        )
        yield from reader.iter_batches(
            batch_size=batch_rows,
            row_groups=list(units),
            columns=None if columns is None else list(columns),
            use_threads=False,
        )


def _refuse_encrypted(source: Any, footer: Any) -> None:
    """``ValueError`` for a plaintext footer of an encrypted file (see the module docstring)."""
    tail = read_at(source, source.size() - 8, 8)
    stored = int.from_bytes(tail[:4], "little")
    if stored - footer.serialized_size == _FOOTER_SIGNATURE:
        raise ValueError(
            "it uses Parquet modular encryption (a signed plaintext footer; encrypted column "
            "metadata cannot be read without keys, which this library does not take); decrypt "
            "the file, or rewrite it without encryption"
        )
