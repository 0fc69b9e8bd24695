"""Arrow IPC file format (Feather v2): units are record batches.

The IPC footer locates batches but not their row counts, so indexing reads each batch's
message header (not its body, and nothing is decoded; see ``_ipc_footer``). Unit sizes are
the batches' bytes on storage (header + body), like Parquet's compressed sizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.ipc

from ._base import FileFormat, FileMetadata, read_at
from ._ipc_footer import record_batches

__all__ = ["ArrowFormat"]


class ArrowFormat(FileFormat):
    name = "arrow"
    extensions = (".arrow", ".feather", ".ipc")
    decodes_into_new_memory = False

    def read_metadata(self, source: Any) -> FileMetadata:
        reader = pyarrow.ipc.open_file(source)
        batches = record_batches(lambda at, n: read_at(source, at, n), source.size())
        if len(batches) != reader.num_record_batches:
            raise ValueError(
                f"its footer lists {len(batches)} record batches where pyarrow finds "
                f"{reader.num_record_batches}"
            )
        return FileMetadata(
            schema=reader.schema,
            unit_rows=tuple(rows for rows, _ in batches),
            unit_bytes=tuple(size for _, size in batches),
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
            # Nothing else checks an IPC body against its header: corrupted lengths, null counts
            # or offsets would otherwise surface later as wrong values or another error.
            batch.validate(full=True)
            for start in range(0, batch.num_rows, batch_rows):
                yield batch.slice(start, batch_rows)
