"""A shuffle window's rows, held in a layout that is cheap to gather from in random order.

A window is larger than the CPU caches, so a random gather pays a cache miss per value it
reads: per column, one a row. Plain numeric columns without nulls (most of a training table)
are therefore held row-major, one record per row, and a gather copies whole records: one or
two cache lines a row, whatever the number of columns. Filling the records is the one copy a
window's parts needed anyway to become one block. Lists of plain numbers (token ids) are
held as their values and offsets and gathered by numpy, a thousand rows at a time (the
source index of each value fits in cache: 1.6x as fast as Arrow's ``take``). The other
columns (strings, booleans, nulls, ...) stay Arrow arrays, gathered by Arrow's ``take``.

Gathered rows (:class:`Rows`) are cut into columns by the next copy: into new arrays
(``Rows.batch``), or, in a DataLoader worker, straight into its shared-memory slot (the plain
columns are strided views of the records, which that copy reads).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.types as pat

__all__ = ["Rows", "Window"]

# Rows of a list column gathered at a time (their values' source index stays in cache).
_LIST_ROWS = 1024


class Window:
    """The rows of ``parts`` (record batches of one schema, at least one) one after another.

    ``parts`` is emptied as they are copied, each part let go of once its rows are in: the
    window's assembly holds about its rows once (its copy growing as its parts go), not twice.
    """

    def __init__(self, parts: list[pa.RecordBatch]) -> None:
        self.schema = schema = parts[0].schema
        self.num_rows = sum(part.num_rows for part in parts)
        every = range(len(schema))
        plain = [i for i in every if _is_plain(schema.field(i).type, parts, i)]
        lists = [
            i
            for i in every
            if _is_number_list(schema.field(i).type, [part.column(i) for part in parts])
        ]
        self._plain = plain
        self._dtype = _record_dtype(schema, plain)
        self._records = _pooled(self.num_rows, self._dtype)
        filling = {i: _Lists.filling([part.column(i) for part in parts]) for i in lists}
        others: dict[int, list[pa.Array]] = {i: [] for i in every if i not in plain + lists}
        row = 0
        parts.reverse()  # popped from the end: first part first
        while parts:
            part = parts.pop()
            for i in plain:
                self._records[f"c{i}"][row : row + part.num_rows] = _numbers(part.column(i))
            for i, lists_of in filling.items():
                lists_of.put(row, part.column(i))
            for i, arrays in others.items():
                arrays.append(part.column(i))
            row += part.num_rows
        self._lists = filling
        self._others = {i: pa.concat_arrays(arrays) for i, arrays in others.items()}

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
                values = np.ascontiguousarray(column)
                buffers = [None, pa.py_buffer(values)]  # pa.array's numpy path imports pandas
                column = pa.Array.from_buffers(field.type, len(values), buffers)
            arrays.append(column)
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


@dataclass(frozen=True)
class _Lists:
    """A list column of numbers without nulls: every row's ``values`` one after another, and
    ``offsets`` (``int64``, one more than the rows, from 0)."""

    kind: pa.DataType
    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def filling(cls, arrays: list[pa.Array]) -> _Lists:
        """Room for the rows of ``arrays`` (one after another), filled by ``put``."""
        values = sum(len(array.flatten()) for array in arrays)
        dtype = np.dtype(arrays[0].type.value_type.to_pandas_dtype())
        offsets = np.zeros(sum(len(array) for array in arrays) + 1, dtype=np.int64)
        return cls(arrays[0].type, _pooled(values, dtype), offsets)

    def put(self, row: int, array: pa.Array) -> None:
        """``array``'s lists as rows ``row, row + 1, ...`` (the rows before it are in)."""
        first = int(self.offsets[row])
        values = _numbers(array.flatten())
        self.values[first : first + len(values)] = values
        ends = _numbers(array.offsets)[1:] - _numbers(array.offsets)[0]
        np.add(ends, first, out=self.offsets[row + 1 : row + 1 + len(array)])

    def take(self, index: npt.NDArray[np.int64]) -> pa.Array:
        """Rows ``index`` as a new list array, its values in memory of Arrow's pool."""
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        bounds = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        chunks = [*range(0, len(index), _LIST_ROWS), len(index)]
        scratch = np.empty(int(np.diff(bounds[chunks]).max(initial=0)), dtype=np.int64)
        out = _pooled(int(bounds[-1]), self.values.dtype)
        for lo, hi in itertools.pairwise(chunks):
            source = scratch[: bounds[hi] - bounds[lo]]
            _sources(starts[lo:hi], lengths[lo:hi], bounds[lo:hi] - bounds[lo], source)
            # mode="clip": unbuffered (every index is in range)
            np.take(self.values, source, out=out[bounds[lo] : bounds[hi]], mode="clip")
        if pat.is_list(self.kind):
            bounds = bounds.astype(np.int32)
        values = pa.Array.from_buffers(self.kind.value_type, len(out), [None, pa.py_buffer(out)])
        buffers = [None, pa.py_buffer(bounds)]
        return pa.Array.from_buffers(self.kind, len(index), buffers, children=[values])


def _sources(
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    firsts: npt.NDArray[np.int64],
    out: npt.NDArray[np.int64],
) -> None:
    """The source of every value of rows (``starts``, ``lengths``) laid end to end from
    ``firsts``, into ``out``: a running count that jumps to each row's start at its first."""
    full = lengths > 0
    starts, lengths, firsts = starts[full], lengths[full], firsts[full]
    out.fill(1)
    out[firsts[1:]] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1
    out[:1] = starts[:1]
    np.cumsum(out, out=out)


def _is_number_list(kind: pa.DataType, arrays: list[pa.Array]) -> bool:
    """Is ``kind`` a list of integers or floats, without nulls in ``arrays`` (lists or items),
    whose offsets hold all the items at once?"""
    if not (pat.is_list(kind) or pat.is_large_list(kind)):
        return False
    item = kind.value_type
    if not (pat.is_integer(item) or pat.is_floating(item)):
        return False
    if any(array.null_count or array.flatten().null_count for array in arrays):
        return False
    return pat.is_large_list(kind) or sum(len(a.flatten()) for a in arrays) < 2**31


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


def _pooled(length: int, dtype: np.dtype) -> np.ndarray:
    """A new array of ``length`` values in memory of Arrow's pool: it keeps pages it freed, so
    a window's next one reuses them (a fresh numpy array this large costs a page fault per
    4 KiB, up to a third of a shuffled epoch's time)."""
    return np.frombuffer(pa.allocate_buffer(length * dtype.itemsize), dtype=dtype, count=length)


def _numbers(array: pa.Array) -> np.ndarray:
    """A numeric array without nulls as a numpy view (``to_numpy`` imports pandas: 0.2 s)."""
    dtype = np.dtype(array.type.to_pandas_dtype())
    return np.frombuffer(array.buffers()[1], dtype=dtype)[array.offset : array.offset + len(array)]
