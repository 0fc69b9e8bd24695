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
anything else                  ``list`` of Python values (``to_pylist``)
=============================  ==============================================================

Nulls in integer, boolean or fixed-size-list columns have no tensor value; they raise
``ValueError`` naming the column. Use ``output="arrow"`` to handle them yourself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.types as pat
import torch

__all__ = ["OUTPUTS", "convert"]

OUTPUTS = ("torch", "numpy", "arrow")


def convert(batch: pa.RecordBatch, output: str) -> Any:
    """``batch`` as ``output``: a RecordBatch, or a dict of column name to array/tensor/list."""
    if output == "arrow":
        return batch
    as_tensor = output == "torch"
    return {
        name: _column(batch.column(i), name, as_tensor) for i, name in enumerate(batch.schema.names)
    }


def _column(array: pa.Array, name: str, as_tensor: bool) -> Any:
    if pat.is_dictionary(array.type):
        array = array.dictionary_decode()
    values = _numeric(array, name)
    if values is None:
        if pat.is_string(array.type) or pat.is_large_string(array.type):
            return array.to_numpy(zero_copy_only=False) if not as_tensor else array.to_pylist()
        return array.to_pylist()
    if not as_tensor:
        return values
    # Arrow buffers are read-only (and memory-mapped for local Arrow files): copy once.
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def _numeric(array: pa.Array, name: str) -> np.ndarray | None:
    """A numpy view/copy of a numeric-like column, ``None`` for other types."""
    kind = array.type
    if pat.is_temporal(kind):
        width = pa.int32() if kind.bit_width == 32 else pa.int64()
        return _numeric(array.view(width) if array.null_count == 0 else array.cast(width), name)
    if pat.is_fixed_size_list(kind):
        _no_nulls(array, name)
        inner = _numeric(array.flatten(), name)
        if inner is None:
            return None
        return inner.reshape(len(array), kind.list_size, *inner.shape[1:])
    if pat.is_floating(kind):
        return array.to_numpy(zero_copy_only=False)
    if pat.is_integer(kind) or pat.is_boolean(kind):
        _no_nulls(array, name)
        return array.to_numpy(zero_copy_only=False)
    return None


def _no_nulls(array: pa.Array, name: str) -> None:
    if array.null_count:
        raise ValueError(
            f"column {name!r} ({array.type}) has {array.null_count} null(s), which have no "
            f"tensor value; fill them in the data or read with output='arrow'"
        )
