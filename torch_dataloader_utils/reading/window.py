"""A shuffle window's rows, held in a layout that is cheap to gather from in random order.

A window is larger than the CPU caches, so a random gather pays a cache miss per value it
reads: per column, one a row. Plain numeric columns without nulls (most of a training table)
are therefore held row-major, one record per row, and a gather copies whole records: one or
two cache lines a row, whatever the number of columns. Filling the records, part by part as
they are decoded, is the one copy a window's parts needed anyway to become one block. Lists
of plain numbers (token ids) are held as one block of values and offsets, and a gather copies
each row's values in one piece: Arrow flattens a list view of the rows where they lie (1.5-1.7
ns a value where numpy's take by a per-value index cost 2.5-2.9, and Arrow's ``take`` of a
list array 3.4). The other columns (strings, booleans, nulls, ...) stay Arrow arrays,
gathered by Arrow's ``take``.

Gathered rows (:class:`Rows`) are cut into columns by the next copy: into new arrays
(``Rows.batch``), or, in a DataLoader worker, straight into its shared-memory slot (the plain
columns are strided views of the records, which that copy reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from ..base.arrays import as_arrow, is_number, numbers, pooled

__all__ = ["Rows", "Window", "gather", "owned"]


class Window:
    """A window of ``num_rows`` rows, filled part by part (``put``) in any order, then
    ``finish``-ed; every row is put once.

    A part's plain columns are copied into the records as it is put, so the reader lets go of
    what it decoded run by run (the window never holds its rows twice); a part's other columns
    are held until ``finish`` makes them one block. A column of numbers is plain until a part
    brings nulls in it: the rows put so far are copied out of the records, and the column is
    held as the others from then on.
    """

    def __init__(self, num_rows: int, where: str) -> None:
        self.num_rows = num_rows
        self._where = where  # the splits the window holds, for errors
        self.schema = pa.schema([])
        self._plain: list[int] = []
        self._dtype = np.dtype([])
        self._records = np.empty(0, dtype=self._dtype)
        self._held: dict[int, list[tuple[int, pa.Array]]] = {}
        self._puts: list[tuple[int, int]] = []  # (first row, rows) of every part put
        self._lists: dict[int, _Lists] = {}
        self._others: dict[int, pa.Array] = {}

    def put(self, row: int, part: pa.RecordBatch) -> None:
        """``part``'s rows as the window's rows ``row, row + 1, ...``."""
        if not self._puts:  # the first part: the columns' layout
            self.schema = part.schema
            every = range(len(part.schema))
            self._plain = [i for i in every if is_number(part.schema.field(i).type)]
            self._dtype = _record_dtype(part.schema, tuple(self._plain))  # kept: every window
            self._records = pooled(self.num_rows, self._dtype)
            self._held = {i: [] for i in every if i not in self._plain}
        for i in [i for i in self._plain if part.column(i).null_count]:
            self._hold(i)
        for i in self._plain:
            self._records[f"c{i}"][row : row + part.num_rows] = numbers(part.column(i))
        for i, held in self._held.items():
            held.append((row, owned(part.column(i))))
        self._puts.append((row, part.num_rows))

    def finish(self) -> None:
        """Make the held columns one block each (once every row is put)."""
        if not _covers(self._puts, self.num_rows):  # a reader's bug: never hand it out
            raise RuntimeError(
                f"a shuffle window of {self.num_rows} rows ({self._where}) was given rows "
                f"{sorted(self._puts)} (first row, rows): expected each row once"
            )
        for i in list(self._held):
            arrays = [array for _, array in sorted(self._held.pop(i), key=lambda held: held[0])]
            if _is_number_list(self.schema.field(i).type, arrays):
                self._lists[i] = _Lists.filled(arrays)
            else:
                self._others[i] = pa.concat_arrays(arrays)

    def _hold(self, column: int) -> None:
        """Hold plain ``column`` as the others from now on (its rows put so far copied)."""
        values = self._records[f"c{column}"]
        kind = self.schema.field(column).type
        self._held[column] = [
            (row, as_arrow(kind, values[row : row + rows].copy())) for row, rows in self._puts
        ]
        self._plain.remove(column)

    def take(self, index: npt.NDArray[np.int64]) -> Rows:
        """Rows ``index``, in that order (a copy)."""
        records = None
        if self._plain:
            whole = np.dtype((np.void, self._dtype.itemsize))
            records = np.take(self._records.view(whole), index).view(self._dtype)
        others = {i: column.take(index) for i, column in self._others.items()}
        others |= {i: column.take(index) for i, column in self._lists.items()}
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
                column = as_arrow(field.type, np.ascontiguousarray(column))
            arrays.append(column)
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


@dataclass(frozen=True)
class _Lists:
    """A list column of numbers without nulls: every row's ``values`` one after another, and
    ``offsets`` (``int64``, one more than the rows, from 0)."""

    kind: pa.DataType
    values: np.ndarray
    offsets: np.ndarray

    @property
    def arrow(self) -> pa.Array:
        """``values`` as an Arrow array (no copy)."""
        return as_arrow(self.kind.value_type, self.values)

    @classmethod
    def filled(cls, arrays: list[pa.Array]) -> _Lists:
        """The rows of ``arrays``, one after another; ``arrays`` is emptied as they are
        copied (each let go of once copied: the rows are not held twice)."""
        values = sum(len(array.flatten()) for array in arrays)
        dtype = np.dtype(arrays[0].type.value_type.to_pandas_dtype())
        offsets = np.zeros(sum(len(array) for array in arrays) + 1, dtype=np.int64)
        lists = cls(arrays[0].type, pooled(values, dtype), offsets)
        row = 0
        arrays.reverse()
        while arrays:
            array = arrays.pop()
            lists._put(row, array)
            row += len(array)
        return lists

    def _put(self, row: int, array: pa.Array) -> None:
        """``array``'s lists as rows ``row, row + 1, ...`` (the rows before it are in)."""
        first = int(self.offsets[row])
        values = numbers(array.flatten())
        self.values[first : first + len(values)] = values
        ends = numbers(array.offsets)[1:] - numbers(array.offsets)[0]
        np.add(ends, first, out=self.offsets[row + 1 : row + 1 + len(array)])

    def take(self, index: npt.NDArray[np.int64]) -> pa.Array:
        """Rows ``index`` as a new list array: Arrow copies each row's values in one piece
        (flattening a list view of the rows where they lie)."""
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        where = pa.LargeListViewArray.from_arrays(
            as_arrow(pa.int64(), starts), as_arrow(pa.int64(), lengths), self.arrow
        )
        bounds = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        if pat.is_list(self.kind):
            bounds = bounds.astype(np.int32)
        buffers = [None, pa.py_buffer(bounds)]
        values = pc.list_flatten(where)
        return pa.Array.from_buffers(self.kind, len(index), buffers, children=[values])


def gather(arrays: list[pa.Array], index: npt.NDArray[np.int64]) -> pa.Array:
    """Rows ``index`` of ``arrays`` laid end to end, as a new array: lists of numbers without
    nulls by their values and offsets (as a window holds them), any other by Arrow."""
    if _is_number_list(arrays[0].type, arrays):
        return _Lists.filled(list(arrays)).take(index)
    return pa.concat_arrays(arrays).take(index)


def _is_number_list(kind: pa.DataType, arrays: list[pa.Array]) -> bool:
    """Is ``kind`` a list of integers or floats, without nulls in ``arrays`` (lists or items),
    whose offsets hold all the items at once?"""
    if not (pat.is_list(kind) or pat.is_large_list(kind)):
        return False
    item = kind.value_type
    if not is_number(item):
        return False
    if any(array.null_count or array.flatten().null_count for array in arrays):
        return False
    return pat.is_large_list(kind) or sum(len(a.flatten()) for a in arrays) < 2**31


def owned(array: pa.Array) -> pa.Array:
    """``array``, copied if it is a slice of less than half the buffers it keeps in memory."""
    if array.get_total_buffer_size() > 2 * array.nbytes:
        return pa.concat_arrays([array])
    return array


def _covers(puts: list[tuple[int, int]], rows: int) -> bool:
    """Do ``puts`` (first row, rows) cover rows ``0 .. rows - 1``, each once?"""
    row = 0
    for first, count in sorted(puts):
        if first != row:
            return False
        row += count
    return row == rows


@lru_cache(maxsize=64)
def _record_dtype(schema: pa.Schema, plain: tuple[int, ...]) -> np.dtype[np.void]:
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
