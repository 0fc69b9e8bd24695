"""Parquet: units are row groups; sizes are the compressed bytes of their column chunks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ._base import FileFormat, FileMetadata

__all__ = ["ParquetFormat"]


class ParquetFormat(FileFormat):
    name = "parquet"
    extensions = (".parquet", ".parq", ".pq")
    decodes_into_new_memory = True

    def read_metadata(self, source: Any) -> FileMetadata:
        footer = pq.ParquetFile(source).metadata
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

    def read_units(
        self,
        source: Any,
        metadata: FileMetadata,
        units: range,
        columns: Sequence[str] | None,
        batch_rows: int,
    ) -> Iterator[pa.RecordBatch]:
        reader = pq.ParquetFile(source, metadata=metadata.footer)
        yield from reader.iter_batches(
            batch_size=batch_rows,
            row_groups=list(units),
            columns=None if columns is None else list(columns),
            use_threads=False,
        )
