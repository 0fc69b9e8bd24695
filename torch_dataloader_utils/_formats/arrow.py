"""Arrow IPC file format (Feather v2): units are record batches.

The IPC footer locates batches but not their row counts, so indexing opens each batch once
(cheap for uncompressed files: no decoding). Unit sizes are in-memory bytes, which bound the
on-storage size from above for compressed files.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.ipc

from ._base import FileFormat, FileMetadata

__all__ = ["ArrowFormat"]


class ArrowFormat(FileFormat):
    name = "arrow"
    extensions = (".arrow", ".feather", ".ipc")
    decodes_into_new_memory = False

    def read_metadata(self, source: Any) -> FileMetadata:
        reader = pyarrow.ipc.open_file(source)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return FileMetadata(
            schema=reader.schema,
            unit_rows=tuple(b.num_rows for b in batches),
            unit_bytes=tuple(b.nbytes for b in batches),
        )

    def read_units(
        self,
        source: Any,
        metadata: FileMetadata,
        units: range,
        columns: Sequence[str] | None,
        batch_rows: int,
    ) -> Iterator[pa.RecordBatch]:
        reader = pyarrow.ipc.open_file(source)
        for unit in units:
            batch = reader.get_batch(unit)
            if columns is not None:
                batch = batch.select(list(columns))
            for start in range(0, batch.num_rows, batch_rows):
                yield batch.slice(start, batch_rows)
