"""The bytes a row takes once converted to arrays or tensors, from its schema alone: what
sizes shared-memory packets and decoded chunks before a row is read."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.types as pat

__all__ = ["converted_row_bytes", "is_list"]

# Items per row assumed for a list column when sizing shared-memory packets from the schema
# alone (real widths vary; a packet that outgrows its slot still arrives, shared by torch).
_LIST_ROW_ITEMS = 256


def converted_row_bytes(schema: pa.Schema) -> int:
    """Bytes per row of the numeric arrays/tensors ``convert`` makes for ``schema``."""
    return sum(_fixed_bytes(field.type) for field in schema)


def is_list(kind: pa.DataType) -> bool:
    """Is ``kind`` a list (32- or 64-bit offsets)?"""
    return bool(pat.is_list(kind) or pat.is_large_list(kind))


def _fixed_bytes(kind: pa.DataType) -> int:
    if is_list(kind):  # offsets, and the items at an assumed width
        items = _fixed_bytes(kind.value_type)
        return 8 + _LIST_ROW_ITEMS * items if items else 0
    if pat.is_dictionary(kind):
        return _fixed_bytes(kind.value_type)
    if pat.is_fixed_size_list(kind):
        return int(kind.list_size) * _fixed_bytes(kind.value_type)
    if pat.is_boolean(kind):
        return 1
    if pat.is_integer(kind) or pat.is_floating(kind) or pat.is_temporal(kind):
        return max(1, int(kind.bit_width) // 8)
    return 0
