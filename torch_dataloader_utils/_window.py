"""A shuffle window's rows, held in a layout that is cheap to gather from in random order.

A window is larger than the CPU caches, so a random gather pays a cache miss per value it
reads: per column, one a row. Plain numeric columns without nulls (most of a training table)
are therefore held row-major, one record per row, and a gather copies whole records: one or
two cache lines a row, whatever the number of columns. Filling the records is the one copy a
window's parts needed anyway to become one block. The other columns (strings, lists,
booleans, nulls, ...) stay Arrow arrays, gathered by Arrow's ``take``.

Gathered rows (:class:`Rows`) are cut into columns by the next copy: into new arrays
(``Rows.batch``), or, in a DataLoader worker, straight into its shared-memory slot (the plain
columns are strided views of the records, which that copy reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.types as pat

__all__ = ["Rows", "Window"]


class Window:
    """The rows of ``parts`` (record batches of one schema, at least one) one after another."""

    def __init__(self, parts: Sequence[pa.RecordBatch]) -> None:
        self.schema = schema = parts[0].schema
        self.num_rows = sum(part.num_rows for part in parts)
        plain = [i for i, f in enumerate(schema) if _is_plain(f.type, parts, i)]
        self._dtype = _record_dtype(schema, plain)
        self._records = np.empty(self.num_rows, dtype=self._dtype)
        row = 0
        for part in parts:
            for i in plain:
                self._records[f"c{i}"][row : row + part.num_rows] = part.column(i).to_numpy()
            row += part.num_rows
        self._plain = plain
        self._others = {
            i: pa.concat_arrays([part.column(i) for part in parts])
            for i in range(len(schema))
            if i not in plain
        }

    def take(self, index: npt.NDArray[np.int64]) -> Rows:
        """Rows ``index``, in that order (a copy)."""
        records = None
        if self._plain:
            whole = np.dtype((np.void, self._dtype.itemsize))
            records = np.take(self._records.view(whole), index).view(self._dtype)
        others = {i: column.take(index) for i, column in self._others.items()}
        return Rows(schema=self.schema, num_rows=len(index), records=records, others=others)


@dataclass(frozen=True, kw_only=True)
class Rows:
    """Rows gathered from a window: the plain columns as ``records`` (fields ``c<column>``),
    the others (by column number) as Arrow arrays. Sliced like a record batch."""

    schema: pa.Schema
    num_rows: int
    records: np.ndarray | None
    others: dict[int, pa.Array]

    def columns(self) -> list[pa.Array | np.ndarray]:
        """The columns in schema order; plain ones as strided numpy views of the records."""
        records = self.records
        return [
            self.others[i] if records is None or i in self.others else records[f"c{i}"]
            for i in range(len(self.schema))
        ]

    def slice(self, offset: int, length: int | None = None) -> Rows:
        stop = self.num_rows if length is None else min(self.num_rows, offset + length)
        records = None if self.records is None else self.records[offset:stop]
        others = {i: column.slice(offset, stop - offset) for i, column in self.others.items()}
        return Rows(schema=self.schema, num_rows=stop - offset, records=records, others=others)

    def batch(self) -> pa.RecordBatch:
        """The rows as a record batch of new, contiguous columns."""
        arrays = []
        for field, column in zip(self.schema, self.columns(), strict=True):
            if isinstance(column, np.ndarray):
                values = np.ascontiguousarray(column)
                buffers = [None, pa.py_buffer(values)]  # pa.array's numpy path imports pandas
                column = pa.Array.from_buffers(field.type, len(values), buffers)
            arrays.append(column)
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _is_plain(kind: pa.DataType, parts: Sequence[pa.RecordBatch], column: int) -> bool:
    """Is ``column`` a number per row (integer or float) without nulls in every part?"""
    if not (pat.is_integer(kind) or pat.is_floating(kind)):
        return False
    return all(part.column(column).null_count == 0 for part in parts)


def _record_dtype(schema: pa.Schema, plain: list[int]) -> np.dtype[np.void]:
    """One record of the ``plain`` columns (fields ``c<column>``), widest first so that every
    field is aligned to its size, padded to a multiple of the widest (records stay aligned)."""
    widths = {i: int(schema.field(i).type.bit_width) // 8 for i in plain}
    order = sorted(plain, key=lambda i: -widths[i])
    offsets = np.cumsum([0, *(widths[i] for i in order)]).tolist()
    widest = max(widths.values(), default=1)
    itemsize = -(-offsets[-1] // widest) * widest
    formats = [schema.field(i).type.to_pandas_dtype() for i in order]
    names = [f"c{i}" for i in order]
    return np.dtype(
        {"names": names, "formats": formats, "offsets": offsets[:-1], "itemsize": itemsize}
    )
