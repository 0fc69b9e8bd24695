"""Arrow IPC file format (Feather v2): units are record batches.

The IPC footer locates batches but not their row counts, so indexing reads the footer and each
batch's message header (not its body, and nothing is decoded; see ``ipc_footer``). The index
keeps them: a split never reads the footer again, and a reader fetches of each batch only its
header and the body buffers of the projected columns. Unit sizes are the batches' bytes on
storage (header + body), like Parquet's compressed sizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

import pyarrow as pa
import pyarrow.ipc

from .base import FileFormat, FileMetadata, Span, joined, read_at
from .ipc_footer import IpcFooter, buffer_counts, read_footer
from .structure import validate_structure

__all__ = ["ArrowFormat"]


class ArrowFormat(FileFormat):
    name = "arrow"
    extensions = (".arrow", ".feather", ".ipc")
    unit_name = "record batch"
    decodes_into_new_memory = False

    def read_metadata(self, source: Any) -> FileMetadata:
        footer = read_footer(lambda at, n: read_at(source, at, n), source.size())
        reader = pyarrow.ipc.open_file(pa.BufferReader(footer.as_file()))
        units = footer.units()
        if len(units) != reader.num_record_batches:
            raise ValueError(
                f"its footer lists {len(units)} record batches where pyarrow finds "
                f"{reader.num_record_batches}"
            )
        _check_empty_batches(source, [rows for rows, _ in units])
        return FileMetadata(
            schema=reader.schema,
            unit_rows=tuple(rows for rows, _ in units),
            unit_bytes=tuple(size for _, size in units),
            footer=footer,
        )

    def dump_footer(self, footer: Any) -> bytes:
        return b"" if footer is None else bytes(footer.dump())

    def load_footer(self, data: bytes) -> Any:
        return IpcFooter.load(data) if data else None

    def unit_spans(
        self, metadata: FileMetadata, units: range, columns: Sequence[str] | None
    ) -> list[tuple[Span, ...]] | None:
        """Each batch's header, and the body buffers of the projected columns (the whole body
        when the columns' buffers cannot be told apart); the first also the dictionary batches,
        which pyarrow reads whole when it opens the file."""
        footer = metadata.footer
        if not isinstance(footer, IpcFooter):
            return None
        counts = None if columns is None else _buffer_counts(metadata.schema)
        fields = None if columns is None else _field_indices(metadata.schema, columns)
        spans: list[tuple[Span, ...]] = []
        for unit in units:
            block = footer.blocks[unit]
            body = block.offset + block.header
            header = (block.offset, body)
            extra = list(footer.dictionaries) if unit == units.start else []
            buffers = block.buffers
            if fields is None or counts is None or buffers is None or len(buffers) != sum(counts):
                spans.append(joined([*extra, (block.offset, body + block.body)]))
                continue
            starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
            chosen = [
                (body + offset, body + offset + length)
                for i in fields
                for offset, length in buffers[starts[i] : starts[i + 1]]
                if length
            ]
            spans.append(joined([*extra, header, *chosen]))
        return spans

    def known_bytes(self, metadata: FileMetadata) -> tuple[int, bytes] | None:
        footer = metadata.footer
        return (footer.offset, footer.tail) if isinstance(footer, IpcFooter) else None

    def read_units(
        self,
        source: Any,
        metadata: FileMetadata,
        units: range,
        columns: Sequence[str] | None,
        batch_rows: int,
    ) -> Iterator[pa.RecordBatch]:
        options = None
        if columns is not None:
            fields = _field_indices(metadata.schema, columns)
            options = pyarrow.ipc.IpcReadOptions(included_fields=sorted(set(fields)))
        reader = pyarrow.ipc.open_file(source, options=options)
        for unit in units:
            batch = reader.get_batch(unit)
            if columns is not None:
                batch = batch.select(list(columns))
            # Nothing else checks an IPC body against its header: corrupted lengths, null counts
            # or offsets would otherwise surface later as wrong values or another error. Values
            # (a decimal's precision, UTF-8) are not checked: pyarrow reads them as they are.
            validate_structure(batch)
            for start in range(0, batch.num_rows, batch_rows):
                yield batch.slice(start, batch_rows)


def _check_empty_batches(source: Any, rows: Sequence[int]) -> None:
    """Have pyarrow read each record batch whose header says 0 rows (rare: a writer's empty
    batch). A flatbuffer leaves a field at its default out, so a header corrupted where its row
    count was also reads as 0 rows; such a batch is never read again, and its rows would be
    lost without an error where pyarrow refuses the file ("Invalid flatbuffers message")."""
    empty = [unit for unit, count in enumerate(rows) if count == 0]
    if not empty:
        return
    reader = pyarrow.ipc.open_file(source)
    for unit in empty:
        batch = reader.get_batch(unit)
        if batch.num_rows:
            raise ValueError(
                f"record batch {unit} has {batch.num_rows} rows where its header reads as 0"
            )


def _field_indices(schema: pa.Schema, columns: Sequence[str]) -> list[int]:
    return [schema.get_field_index(name) for name in columns]


@lru_cache(maxsize=64)
def _buffer_counts(schema: pa.Schema) -> tuple[int, ...] | None:
    """Body buffers each top-level field takes, from empty batches of it; ``None`` if unknown."""
    try:
        messages = [
            pa.RecordBatch.from_arrays([pa.array([], f.type)], schema=pa.schema([f]))
            .serialize()
            .to_pybytes()
            for f in schema
        ]
    except (pa.ArrowException, TypeError, ValueError):
        return None
    counts = buffer_counts(messages)
    return None if counts is None else tuple(counts)
