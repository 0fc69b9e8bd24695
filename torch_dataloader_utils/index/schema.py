"""The schema rule of a dataset's files: every file holds the projected columns, and all agree
column for column (``column_differences``, which a mixture's sources share).
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from ..base.errors import SchemaMismatchError
from .index import IndexedFile

__all__ = ["column_differences", "common_schema"]


def common_schema(files: Sequence[IndexedFile], columns: Sequence[str] | None) -> pa.Schema:
    """The projected schema shared by all files; names both files and fields when they differ."""
    first = files[0]
    reference = _project(first, columns)
    for other in files[1:]:
        schema = _project(other, columns)
        if not schema.equals(reference):
            raise SchemaMismatchError(
                f"schema of {other.display} differs from {first.display}: "
                f"{_schema_diff(reference, schema)}"
            )
    return reference


def _project(file: IndexedFile, columns: Sequence[str] | None) -> pa.Schema:
    schema = file.metadata.schema.remove_metadata()
    if columns is None:
        return schema
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise SchemaMismatchError(
            f"{file.display} has no column(s) {missing}; its columns are {schema.names}"
        )
    twice = [c for c in columns if schema.names.count(c) > 1]
    if twice:
        raise SchemaMismatchError(
            f"{file.display} has more than one column named {twice[0]!r}, so columns= cannot "
            f"select it; rename the columns in the data, or read all with columns=None and "
            f"output='arrow'"
        )
    return pa.schema([schema.field(c) for c in columns])


def _schema_diff(expected: pa.Schema, found: pa.Schema) -> str:
    diffs = [f"field {name!r}: {a} vs {b}" for name, a, b in column_differences(expected, found)]
    return "; ".join(diffs) or "field order differs"


def column_differences(expected: pa.Schema, found: pa.Schema) -> list[tuple[str, str, str]]:
    """The columns, by name, in which two schemas differ: a type, a nullability, or a column
    one of them lacks (or holds twice); each as ``(name, in expected, in found)``. Empty when
    they hold the same columns, whatever their order."""
    diffs = []
    for name in dict.fromkeys(expected.names + found.names):
        a, b = (_named(schema, name) for schema in (expected, found))
        if len(a) != len(b) or not all(x.equals(y) for x, y in zip(a, b, strict=True)):
            diffs.append((name, _kind(a), _kind(b)))
    return diffs


def _named(schema: pa.Schema, name: str) -> list[pa.Field]:
    return [schema.field(i) for i in schema.get_all_field_indices(name)]


def _kind(fields: list[pa.Field]) -> str:
    """A column as a schema difference names it: its type, and ``not null``."""
    if len(fields) != 1:
        return "missing" if not fields else f"{len(fields)} columns of that name"
    field = fields[0]
    return f"{field.type}" if field.nullable else f"{field.type} not null"
