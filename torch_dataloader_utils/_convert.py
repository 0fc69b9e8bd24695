"""Arrow record batches to the user's output type, column by column, without per-row Python.

Mapping for ``output="torch"`` (``"numpy"`` is the same with numpy arrays):

=============================  ==============================================================
Arrow type                     value
=============================  ==============================================================
int*, uint*, float*, bool      tensor of the same dtype (floats: nulls become NaN)
timestamp, date, time,         int64 (int32 for date32/time32) tensor of the stored unit
duration
fixed_size_list of the above   tensor of shape ``(rows, size, ...)``
dictionary                     decoded, then as its value type
string, large_string           ``list[str]`` (numpy: object array)
interval (any unit)            ``ValueError`` naming the column and its type: pyarrow's
                               Python form (``MonthDayNano``) does not pickle, so it could
                               not leave a DataLoader worker; cast it in the data, or read
                               with ``output="arrow"``
anything else                  ``list`` of Python values (``to_pylist``)
=============================  ==============================================================

Nulls in integer, boolean, temporal or fixed-size-list columns have no tensor value; they
raise ``ValueError`` naming the column and its type. So does a value that Python cannot
represent (a timestamp past year 9999 inside a struct, say), and a batch with two columns of
one name (a dict holds one). Use ``output="arrow"`` to handle these yourself. Messages name the
column, not the file: callers add where the batch came from.

Tensors share memory with Arrow (DLPack, no copy) when the format decodes into fresh memory
(Parquet); otherwise (Arrow IPC, whose buffers may view the bytes read from storage) they are
copied once.
numpy outputs are read-only views where Arrow allows it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.types as pat
import torch
from torch.utils.dlpack import from_dlpack

__all__ = ["OUTPUTS", "convert", "converted_row_bytes"]

OUTPUTS = ("torch", "numpy", "arrow")


def convert(batch: pa.RecordBatch, output: str, *, copy: bool) -> Any:
    """``batch`` as ``output``; ``copy`` when Arrow's buffers must not back writable tensors."""
    if output == "arrow":
        return batch
    names = batch.schema.names
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"column(s) {twice} appear more than once; output={output!r} is a dict with one "
            f"entry per name: rename them in the data, leave them out with columns=, or read with "
            f"output='arrow'"
        )
    columns = zip(names, batch.columns, strict=True)
    if output == "numpy":
        return {name: _array(column, name) for name, column in columns}
    return {name: _tensor(column, name, copy) for name, column in columns}


def converted_row_bytes(schema: pa.Schema) -> int:
    """Bytes per row of the numeric arrays/tensors ``convert`` makes for ``schema``."""
    return sum(_fixed_bytes(field.type) for field in schema)


def _fixed_bytes(kind: pa.DataType) -> int:
    if pat.is_dictionary(kind):
        return _fixed_bytes(kind.value_type)
    if pat.is_fixed_size_list(kind):
        return int(kind.list_size) * _fixed_bytes(kind.value_type)
    if pat.is_boolean(kind):
        return 1
    if pat.is_integer(kind) or pat.is_floating(kind) or pat.is_temporal(kind):
        return max(1, int(kind.bit_width) // 8)
    return 0


def _tensor(array: pa.Array, name: str, copy: bool) -> Any:
    array = _decoded(array)
    flat = _fixed_width(array, name)
    if flat is None:
        if pat.is_string(array.type) or pat.is_large_string(array.type):
            return array.to_pylist()
        return _python(array, name)
    values, shape = flat
    if values.null_count or pat.is_boolean(values.type):  # NaN-filled or unpacked: a new array
        return torch.from_numpy(values.to_numpy(zero_copy_only=False).reshape(shape))
    tensor = from_dlpack(values)
    if len(shape) > 1:
        tensor = tensor.reshape(shape)
    return tensor.clone() if copy else tensor


def _array(array: pa.Array, name: str) -> Any:
    array = _decoded(array)
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
