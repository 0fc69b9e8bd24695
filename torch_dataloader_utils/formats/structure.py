"""Validate a record batch's structure, not its values.

An Arrow IPC body is trusted by nothing else: corrupted offsets, buffer sizes, null counts,
dictionary indices or union type codes make readers read out of bounds (a crash, or garbage).
``RecordBatch.validate(full=True)`` checks all of that, and also rules on values — UTF-8 in
strings, a decimal's precision, whole days in ``date64``, times within a day — which would
refuse files that pyarrow itself reads. So the batch is validated in full as a view of the same
buffers under types without value rules (``string`` as ``binary``, ``decimal128(p, s)`` as
``fixed_size_binary(16)``, ``date64``/``time64`` as ``int64``, ``time32`` as ``int32``, nested
types likewise): every structural check runs, no value check does. Values are the user's
(``docs/formats.md``); invalid UTF-8 is reported when a string column is converted.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import pyarrow as pa

__all__ = ["structural_type", "validate_structure"]


def validate_structure(batch: pa.RecordBatch) -> None:
    """Raise ``pa.ArrowInvalid`` if ``batch`` could make a reader read out of its buffers."""
    try:
        kind = _structural_struct(batch.schema)
    except TypeError:  # a schema with an extension type that does not hash: not cached
        kind = _structural_struct.__wrapped__(batch.schema)
    batch.to_struct_array().view(kind).validate(full=True)


@lru_cache(maxsize=64)
def _structural_struct(schema: pa.Schema) -> pa.DataType:
    return pa.struct([_field(f) for f in schema])


def structural_type(kind: pa.DataType) -> pa.DataType:
    """``kind`` with the same buffer layout and no rule on values."""
    if isinstance(kind, pa.BaseExtensionType):
        return structural_type(kind.storage_type)
    plain = _PLAIN.get(kind.id)
    if plain is not None:
        return plain(kind)
    nested = _NESTED.get(kind.id)
    return kind if nested is None else nested(kind)


def _field(field: pa.Field) -> pa.Field:
    return field.with_type(structural_type(field.type))


def _fields(kind: pa.DataType) -> list[pa.Field]:
    return [_field(kind.field(i)) for i in range(kind.num_fields)]


def _union(kind: pa.DataType) -> pa.DataType:
    return pa.union(_fields(kind), kind.mode, kind.type_codes)


def _type_id(kind: pa.DataType) -> int:
    return int(kind.id)


_Twin = Callable[[Any], pa.DataType]
# Types whose full validation checks values, by type id: their layout twins without the rule.
_PLAIN: dict[int, _Twin] = {
    _type_id(pa.string()): lambda _: pa.binary(),
    _type_id(pa.large_string()): lambda _: pa.large_binary(),
    _type_id(pa.string_view()): lambda _: pa.binary_view(),
    _type_id(pa.decimal32(1)): lambda k: pa.binary(k.byte_width),
    _type_id(pa.decimal64(1)): lambda k: pa.binary(k.byte_width),
    _type_id(pa.decimal128(1)): lambda k: pa.binary(k.byte_width),
    _type_id(pa.decimal256(1)): lambda k: pa.binary(k.byte_width),
    _type_id(pa.date64()): lambda _: pa.int64(),
    _type_id(pa.time64("us")): lambda _: pa.int64(),
    _type_id(pa.time32("s")): lambda _: pa.int32(),
}
# Nested types: the same nesting over the children's twins.
_NESTED: dict[int, _Twin] = {
    _type_id(pa.list_(pa.int8())): lambda k: pa.list_(_field(k.value_field)),
    _type_id(pa.large_list(pa.int8())): lambda k: pa.large_list(_field(k.value_field)),
    _type_id(pa.list_(pa.int8(), 1)): lambda k: pa.list_(_field(k.value_field), k.list_size),
    _type_id(pa.list_view(pa.int8())): lambda k: pa.list_view(_field(k.value_field)),
    _type_id(pa.large_list_view(pa.int8())): lambda k: pa.large_list_view(_field(k.value_field)),
    _type_id(pa.map_(pa.int8(), pa.int8())): lambda k: pa.map_(
        _field(k.key_field), _field(k.item_field), k.keys_sorted
    ),
    _type_id(pa.struct([])): lambda k: pa.struct(_fields(k)),
    _type_id(pa.sparse_union([])): _union,
    _type_id(pa.dense_union([])): _union,
    _type_id(pa.dictionary(pa.int8(), pa.int8())): lambda k: pa.dictionary(
        k.index_type, structural_type(k.value_type), k.ordered
    ),
    _type_id(pa.run_end_encoded(pa.int32(), pa.int8())): lambda k: pa.run_end_encoded(
        k.run_end_type, structural_type(k.value_type)
    ),
}
