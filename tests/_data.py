"""Small datasets for the tests: every row carries a globally unique ``id``.

Rows are a pure function of their id, so any test can check values, not just counts:
``x = id * 0.5`` (float64), ``label = id % 7`` (int32), ``name = f"r{id}"`` (string).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq

__all__ = [
    "SCHEMA",
    "ids_of",
    "replace_parquet",
    "rows_table",
    "write_arrow",
    "write_dataset",
    "write_parquet",
    "write_token_documents",
]

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("x", pa.float64()),
        ("label", pa.int32()),
        ("name", pa.string()),
    ]
)


def rows_table(start: int, count: int) -> pa.Table:
    """Rows with ids ``start .. start + count - 1``."""
    ids = np.arange(start, start + count, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "x": ids * 0.5,
            "label": (ids % 7).astype(np.int32),
            "name": [f"r{i}" for i in ids.tolist()],
        },
        schema=SCHEMA,
    )


def write_parquet(
    path: str | os.PathLike[str],
    table: pa.Table,
    row_group_size: int,
    **kwargs: object,
) -> str:
    pq.write_table(table, str(path), row_group_size=row_group_size, **kwargs)
    return str(path)


def replace_parquet(
    path: str | os.PathLike[str], table: pa.Table, row_group_size: int, **kwargs: object
) -> str:
    """Rewrite ``path`` as writers should: a new file renamed over the old one.

    Never rewrite a data file in place while a reader may still hold it: local files are
    memory-mapped, and truncating a mapped file kills the reading process with SIGBUS.
    """
    path = Path(path)
    tmp = path.with_name(f"_{path.name}.tmp")
    write_parquet(tmp, table, row_group_size, **kwargs)
    os.replace(tmp, path)
    return str(path)


def write_arrow(path: str | os.PathLike[str], table: pa.Table, chunk_size: int) -> str:
    """Feather v2 / Arrow IPC file with record batches of ``chunk_size`` rows."""
    feather.write_feather(table, str(path), chunksize=chunk_size, compression="uncompressed")
    return str(path)


def write_dataset(
    root: str | os.PathLike[str],
    rows_per_file: Sequence[int],
    row_group_size: int = 16,
    *,
    format: str = "parquet",
    start: int = 0,
    **kwargs: object,
) -> list[str]:
    """Files ``part-00000.<ext>`` ... under ``root`` with consecutive ids from ``start``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    next_id = start
    ext = "parquet" if format == "parquet" else "arrow"
    for number, rows in enumerate(rows_per_file):
        table = rows_table(next_id, rows)
        path = root / f"part-{number:05d}.{ext}"
        if format == "parquet":
            paths.append(write_parquet(path, table, row_group_size, **kwargs))
        else:
            paths.append(write_arrow(path, table, row_group_size))
        next_id += rows
    return paths


def ids_of(batch: object) -> list[int]:
    """The ``id`` column of a batch in any output type."""
    if isinstance(batch, pa.RecordBatch):
        return batch.column("id").to_pylist()
    assert isinstance(batch, dict), type(batch)
    return [int(i) for i in batch["id"].tolist()]


def write_token_documents(root: str | os.PathLike[str], docs: int = 150, files: int = 3) -> Path:
    """``docs`` documents of 0-30 tokens (``list<int64>`` column ``tokens``) in ``files``
    Parquet files; token ``t`` of document ``d`` is ``d * 1000 + t``, so every token is unique."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    per_file = -(-docs // files)
    for part in range(files):
        numbers = range(part * per_file, min(docs, (part + 1) * per_file))
        tokens = [list(range(d * 1000, d * 1000 + d % 31)) for d in numbers]
        table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int64()))})
        pq.write_table(table, root / f"part-{part}.parquet", row_group_size=9)
    return root
