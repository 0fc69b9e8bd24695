"""Arrow record batches to the user's output type, column by column, without per-row Python.

Mapping for ``output="torch"`` (``"numpy"`` is the same with numpy arrays):

=============================  ==============================================================
Arrow type                     value
=============================  ==============================================================
int*, uint*, float*, bool      tensor of the same dtype (floats: nulls become NaN)
timestamp, date, time,         int64 (int32 for date32/time32) tensor of the stored unit
duration
fixed_size_list of the above   tensor of shape ``(rows, size, ...)``
list, large_list of int*,      ``torch.jagged`` nested tensor (``rows`` x ragged): Arrow's
uint*, float*, bool,           values (as tensors above) and ``int64`` offsets from 0, via
timestamp, date, time,         ``torch.nested.nested_tensor_from_jagged``; numpy:
duration                       :class:`JaggedArray` ``(values, offsets)``
list of fixed_size_list        ``ValueError`` naming the column and its type
list of anything else          ``list`` of Python lists (``to_pylist``), as below
dictionary                     decoded, then as its value type
string, large_string           ``list[str]`` (numpy: object array)
interval (any unit)            ``ValueError`` naming the column and its type: pyarrow's
                               Python form (``MonthDayNano``) does not pickle, so it could
                               not leave a DataLoader worker; cast it in the data, or read
                               with ``output="arrow"``
anything else                  ``list`` of Python values (``to_pylist``)
=============================  ==============================================================

Nulls in integer, boolean, temporal or fixed-size-list columns have no tensor value; they
raise ``ValueError`` naming the column and its type. So do null rows of a list column turned
into a jagged tensor, and null values inside its lists (floats included). So does a value
that Python cannot represent (a timestamp past year 9999 inside a struct, say), and a batch
with two columns of one name (a dict holds one). Use ``output="arrow"`` to handle these
yourself. Messages name the column, not the file: callers add where the batch came from.

The first jagged tensor in a process imports torch's symbolic-shape machinery (about 0.4 s,
once; forked workers inherit it). A padded ``(rows, max_len)`` tensor is one call away:
``torch.nested.to_padded_tensor(t, pad_value)``.

Tensors share memory with Arrow (DLPack, no copy) when the format decodes into fresh memory
(Parquet); otherwise (Arrow IPC, whose buffers may view the bytes read from storage) they are
copied once. A jagged tensor's values follow the same rule; its offsets are always a new
``int64`` tensor (Arrow's, minus the first, so a sliced array starts at 0).
numpy outputs are read-only views where Arrow allows it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.types as pat
import torch
from torch.utils.dlpack import from_dlpack

from ..base.arrays import is_number
from ..base.jagged import JaggedArray, JaggedTensorParts
from ..base.row_bytes import is_list
from .window import Rows

__all__ = ["convert", "warm_up"]


def convert(batch: pa.RecordBatch | Rows, output: str, *, copy: bool, nested: bool = True) -> Any:
    """``batch`` as ``output``; ``copy`` when Arrow's buffers must not back writable tensors;
    ``nested=False``: torch list columns as ``JaggedTensorParts``. ``Rows`` keep their plain
    columns as strided views of their records, which a later copy makes contiguous."""
    if output == "arrow":
        return batch.batch() if isinstance(batch, Rows) else batch
    names = batch.schema.names
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"column(s) {twice} appear more than once; output={output!r} is a dict with one "
            f"entry per name: rename them in the data, leave them out with columns=, or read with "
            f"output='arrow'"
        )
    columns = zip(
        names, batch.columns() if isinstance(batch, Rows) else _columns(batch), strict=True
    )
    if output == "numpy":
        return {name: _array(column, name) for name, column in columns}
    return {name: _tensor(column, name, copy, nested) for name, column in columns}


def _columns(batch: pa.RecordBatch) -> list[pa.Array]:
    """``batch.columns``, or ``ValueError`` naming the column of a type that pyarrow has no
    Python class for (intervals of months, or of days and milliseconds: a bare ``KeyError``
    from inside pyarrow)."""
    with contextlib.suppress(KeyError):  # found and named column by column below
        return list(batch.columns)
    columns = []
    for i, field in enumerate(batch.schema):
        try:
            columns.append(batch.column(i))
        except KeyError as exc:
            raise ValueError(
                f"column {field.name!r} ({field.type}) is of a type pyarrow cannot hand to "
                f"Python (KeyError {exc} inside pyarrow); leave it out with columns=[...] or "
                f"cast it in the data"
            ) from exc
    return columns


def warm_up(schema: pa.Schema, output: str) -> None:
    """Convert one row of zeros of ``schema`` once, in the main process, when it has list
    columns: building the first jagged tensor loads ~2 s of torch modules, which DataLoader
    workers forked afterwards inherit instead of each loading them again."""
    if output == "arrow" or not any(is_list(f.type) for f in schema):
        return
    lists = [f for f in schema if is_list(f.type)]
    sample = pa.RecordBatch.from_arrays(
        [pa.array([[]], type=f.type) for f in lists], names=[f.name for f in lists]
    )
    # A list type that raises is reported, naming it, by the real batches.
    with contextlib.suppress(ValueError):
        convert(sample, output, copy=False)


def _tensor(array: pa.Array | np.ndarray, name: str, copy: bool, nested: bool = True) -> Any:
    if isinstance(array, np.ndarray):  # a plain column of gathered rows
        return torch.from_numpy(array)
    kind = array.type
    if not array.null_count and is_number(kind):
        return _shared(array, (len(array),), copy)  # most columns: nothing else to check
    array = _decoded(array)
    parts = _list_parts(array, name)
    if parts is not None:
        values, offsets = parts
        joined = JaggedTensorParts(_tensor(values, name, copy), offsets)
        return joined.nested() if nested else joined
    flat = _fixed_width(array, name)
    if flat is None:
        if pat.is_string(array.type) or pat.is_large_string(array.type):
            return array.to_pylist()
        return _python(array, name)
    values, shape = flat
    if values.null_count or pat.is_boolean(values.type):  # NaN-filled or unpacked: a new array
        return torch.from_numpy(values.to_numpy(zero_copy_only=False).reshape(shape))
    return _shared(values, shape, copy)


def _shared(values: pa.Array, shape: tuple[int, ...], copy: bool) -> torch.Tensor:
    """A tensor of ``values`` (a primitive array without nulls) in ``shape``: a view of
    Arrow's buffer (DLPack), or a copy of it."""
    tensor = from_dlpack(values)
    if len(shape) > 1:
        tensor = tensor.reshape(shape)
    return tensor.clone() if copy else tensor


def _array(array: pa.Array | np.ndarray, name: str) -> Any:
    if isinstance(array, np.ndarray):  # a plain column of gathered rows
        return array
    array = _decoded(array)
    parts = _list_parts(array, name)
    if parts is not None:
        values, offsets = parts
        return JaggedArray(_array(values, name), offsets)
    flat = _fixed_width(array, name)
    if flat is None:
        if pat.is_string(array.type) or pat.is_large_string(array.type):
            return array.to_numpy(zero_copy_only=False)
        return _python(array, name)
    values, shape = flat
    return values.to_numpy(zero_copy_only=False).reshape(shape)


def _fixed_width(array: pa.Array, name: str) -> tuple[pa.Array, tuple[int, ...]] | None:
    """A primitive array of the column's values and the shape to give them; ``None`` if none."""
    array = _decoded(array)
    kind = array.type
    if pat.is_interval(kind):
        raise ValueError(
            f"column {name!r} ({kind}) has no tensor or picklable Python form; cast it in the "
            f"data (e.g. to int64 nanoseconds) or read with output='arrow'"
        )
    if pat.is_temporal(kind):
        _no_nulls(array, name)  # named by its own type, before the view as integers
        return _fixed_width(array.view(pa.int32() if kind.bit_width == 32 else pa.int64()), name)
    if pat.is_fixed_size_list(kind):
        _no_nulls(array, name)
        inner = _fixed_width(array.flatten(), name)
        return None if inner is None else (inner[0], (len(array), kind.list_size, *inner[1][1:]))
    if pat.is_integer(kind) or pat.is_boolean(kind):
        _no_nulls(array, name)
    elif not pat.is_floating(kind):
        return None
    return array, (len(array),)


def _list_parts(array: pa.Array, name: str) -> tuple[pa.Array, np.ndarray] | None:
    """A list column's values and ``int64`` offsets from 0; ``None`` when its items have no
    tensor form (strings, lists, structs: left to ``to_pylist``)."""
    kind = array.type
    if not is_list(kind):
        return None
    item = kind.value_type
    if pat.is_dictionary(item):
        item = item.value_type
    if pat.is_fixed_size_list(item):
        raise ValueError(
            f"column {name!r} ({kind}): lists of fixed-size lists have no tensor form here; "
            f"store the items flat (list<{item.value_type}>) or read with output='arrow'"
        )
    tensor_items = (pat.is_integer, pat.is_floating, pat.is_boolean, pat.is_temporal)
    if not any(test(item) for test in tensor_items) and not pat.is_interval(item):
        return None  # (intervals go on, to be refused by name)
    if array.null_count:
        raise ValueError(
            f"column {name!r} ({kind}) has {array.null_count} null list(s), which have no "
            f"tensor value; fill them in the data (an empty list) or read with output='arrow'"
        )
    values = array.flatten()  # the rows' items only, also for a sliced array (zero-copy)
    if values.null_count:
        raise ValueError(
            f"column {name!r} ({kind}) has {values.null_count} null value(s) inside its lists, "
            f"which have no tensor value; fill them in the data or read with output='arrow'"
        )
    offsets = array.offsets.to_numpy()
    return values, np.subtract(offsets, offsets[0], dtype=np.int64)


def _python(array: pa.Array, name: str) -> list[Any]:
    """Python values of ``array``; ``ValueError`` naming the column when Python has none."""
    try:
        return list(array.to_pylist())
    except (OverflowError, ValueError, KeyError, pa.ArrowException) as exc:
        raise ValueError(
            f"column {name!r} ({array.type}) holds values Python cannot represent "
            f"({type(exc).__name__}: {exc}); read it with output='arrow'"
        ) from exc


def _decoded(array: pa.Array) -> pa.Array:
    return array.dictionary_decode() if pat.is_dictionary(array.type) else array


def _no_nulls(array: pa.Array, name: str) -> None:
    if array.null_count:
        raise ValueError(
            f"column {name!r} ({array.type}) has {array.null_count} null(s), which have no "
            f"tensor value; fill them in the data or read with output='arrow'"
        )
