"""Arrays of numbers between Arrow and numpy: views without copies (and without pandas, which
pyarrow's ``to_numpy`` and ``pa.array``'s numpy path import: 0.2 s), and new arrays in memory
of Arrow's pool."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.types as pat

__all__ = ["IntArray", "as_arrow", "is_number", "numbers", "pooled"]

IntArray = npt.NDArray[np.int64]


def is_number(kind: pa.DataType) -> bool:
    """Is ``kind`` a number per row (integer or float)?"""
    return bool(pat.is_integer(kind) or pat.is_floating(kind))


def numbers(array: pa.Array) -> np.ndarray:
    """A numeric Arrow array without nulls as a numpy view."""
    dtype = np.dtype(array.type.to_pandas_dtype())
    return np.frombuffer(array.buffers()[1], dtype=dtype)[array.offset : array.offset + len(array)]


def as_arrow(kind: pa.DataType, values: np.ndarray) -> pa.Array:
    """Contiguous numbers ``values`` as an Arrow array of ``kind`` without nulls, no copy."""
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def pooled(length: int, dtype: np.dtype) -> np.ndarray:
    """A new array of ``length`` values in memory of Arrow's pool: it keeps pages it freed, so
    the next array of a loop reuses them (a fresh numpy array this large costs a page fault per
    4 KiB, up to a third of a shuffled epoch's time)."""
    return np.frombuffer(pa.allocate_buffer(length * dtype.itemsize), dtype=dtype, count=length)
