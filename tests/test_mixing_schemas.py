"""A mixture's sources join their columns by name (the first source's order), with the rule of
one dataset's files for types and nullability: every path (in order, shuffled, packed, 0 and
2 workers, ``columns=``) delivers each value under its own column, or the mixture is refused
naming both sources and the column."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torch_dataloader_utils import SchemaMismatchError, StructuredDataset, TokenPacking
from torch_dataloader_utils.mixing import stream as _mix_stream

# Source s holds ids s * _SPAN + [0, rows): a row's id tells its source and row.
_SPAN = 1_000_000
_ORDER = ["id", "label", "text", "maybe"]


def rows(number: int, count: int) -> pa.Table:
    """``count`` rows of source ``number``; every column a function of ``id``: a number, a
    string and a float with nulls (scattered, gathered, gathered with nulls)."""
    ids = np.arange(count, dtype=np.int64) + number * _SPAN
    return pa.table({
        "id": ids,
        "label": ids * 3,
        "text": pa.array([f"row {i}" for i in ids.tolist()]),
        "maybe": pa.array([None if i % 5 == 0 else i / 2 for i in ids.tolist()], pa.float64()),
    })  # fmt: skip


def write(root: Path, name: str, table: pa.Table, files: int = 2) -> str:
    folder = root / name
    folder.mkdir()
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    for f in range(files):
        part = table.slice(bounds[f], bounds[f + 1] - bounds[f])
        pq.write_table(part, folder / f"part-{f}.parquet", row_group_size=7)
    return str(folder)


def assert_rows_whole(batch: dict[str, Any]) -> list[int]:
    """Every value of ``batch`` is its row's (a function of its id); the ids."""
    ids = np.asarray(batch["id"]).tolist()
    if "label" in batch:
        assert np.asarray(batch["label"]).tolist() == [3 * i for i in ids]
    if "text" in batch:
        assert list(batch["text"]) == [f"row {i}" for i in ids]
    if "maybe" in batch:
        expected = [np.nan if i % 5 == 0 else i / 2 for i in ids]
        np.testing.assert_array_equal(batch["maybe"], expected)
    assert np.asarray(batch["source"]).tolist() == [i // _SPAN for i in ids]
    return ids


@pytest.fixture(scope="module")
def reordered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three sources of one schema, each with its columns in another order."""
    root = tmp_path_factory.mktemp("reordered")
    return {
        "a": write(root, "a", rows(0, 10)),
        "b": write(root, "b", rows(1, 60).select(["maybe", "text", "label", "id"])),
        "c": write(root, "c", rows(2, 30).select(["label", "id", "maybe", "text"])),
    }


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("mix_rows", [1, 65_536])
def test_sources_are_joined_by_column_name(
    reordered: dict[str, str], workers: int, shuffle: bool, mix_rows: int
) -> None:
    """Regression: ``b``'s and ``c``'s columns were joined by place, ``label`` under ``id``.
    Mixed 5 positions at a time, chunks hold one source's rows alone, or several."""
    with mock.patch.object(_mix_stream, "_MIX_ROWS", mix_rows):
        loader, _ = StructuredDataset.create_dataloader(
            reordered, weights={"a": 1, "b": 6, "c": 3}, batch_size=5, shuffle=shuffle,
            shuffle_memory_bytes=4096, num_workers=workers, output="numpy",
        )  # fmt: skip
        seen = []
        for batch in loader:
            assert list(batch) == [*_ORDER, "source"]
            seen += assert_rows_whole(batch)
    expected = [*range(10), *range(_SPAN, _SPAN + 60), *range(2 * _SPAN, 2 * _SPAN + 30)]
    assert sorted(seen) == expected
    if not workers:
        of_b = [i for i in seen if i // _SPAN == 1]
        assert (of_b != sorted(of_b)) == shuffle


@pytest.mark.parametrize("workers", [0, 2])
def test_columns_selects_by_name_in_its_own_order(reordered: dict[str, str], workers: int):
    loader, _ = StructuredDataset.create_dataloader(
        reordered, weights={"a": 1, "b": 6, "c": 3}, batch_size=7, columns=["maybe", "id"],
        num_workers=workers, output="numpy", source_column="from",
    )  # fmt: skip
    seen = []
    for batch in loader:
        assert list(batch) == ["maybe", "id", "from"]
        seen += assert_rows_whole({**batch, "source": batch["from"]})
    assert len(seen) == 100 and len(set(seen)) == 100


def test_the_same_columns_of_other_types_in_another_order(tmp_path: Path) -> None:
    """Regression: ``(id: int64, x: float64)`` and ``(x, id)`` cast ``b``'s ``x`` into ``id``."""
    ids = np.arange(6, dtype=np.int64)
    a = write(tmp_path, "a", pa.table({"id": ids, "x": ids + 0.5}), files=1)
    b = write(tmp_path, "b", pa.table({"x": ids + 1000.5, "id": ids + 1000}), files=1)
    loader, _ = StructuredDataset.create_dataloader(
        {"a": a, "b": b}, weights={"a": 1, "b": 1}, batch_size=4, output="numpy"
    )
    batch = next(iter(loader))
    assert batch["id"].tolist() == [0, 1000, 1, 1001]
    assert batch["x"].tolist() == [0.5, 1000.5, 1.5, 1001.5]


@pytest.mark.parametrize(
    ("b_schema", "column", "in_a", "in_b"),
    [
        (pa.schema([("x", pa.float32()), ("id", pa.int64())]), "x", "double", "float"),
        # item 12 of issue 27: nullability was ignored (confirmed; refused since)
        (pa.schema([("x", pa.float64()), pa.field("id", pa.int64(), nullable=False)]), "id",
         "int64", "int64 not null"),
        (pa.schema([("x", pa.float64())]), "id", "int64", "missing"),
        (pa.schema([("x", pa.float64()), ("id", pa.int64()), ("y", pa.int8())]), "y", "missing",
         "int8"),
        (pa.schema([("id", pa.int64()), ("x", pa.string())]), "x", "double", "string"),
    ],
)  # fmt: skip
def test_a_differing_column_is_refused_naming_both_sources(
    tmp_path: Path, b_schema: pa.Schema, column: str, in_a: str, in_b: str
) -> None:
    ids = np.arange(6, dtype=np.int64)
    a = write(tmp_path, "a", pa.table({"id": ids, "x": ids + 0.5}), files=1)
    values = {"id": ids, "x": ids + 0.5, "y": ids}
    b_columns = [pa.array(values[f.name]).cast(f.type) for f in b_schema]
    b = write(tmp_path, "b", pa.Table.from_arrays(b_columns, schema=b_schema), files=1)
    with pytest.raises(SchemaMismatchError) as info:
        StructuredDataset({"a": a, "b": b}, weights={"a": 1, "b": 1})
    assert str(info.value).startswith(
        f"sources 'a' and 'b' differ in column {column!r}: {in_a} in 'a', {in_b} in 'b'; "
    ), str(info.value)


def test_a_column_of_one_name_twice_is_joined_only_in_one_order(tmp_path: Path) -> None:
    ids = np.arange(4, dtype=np.int64)
    twice = pa.Table.from_arrays([ids, ids, ids], names=["x", "id", "x"])
    a = write(tmp_path, "a", twice, files=1)
    b = write(tmp_path, "b", twice, files=1)
    loader, _ = StructuredDataset.create_dataloader(
        {"a": a, "b": b}, weights={"a": 1, "b": 1}, batch_size=4, output="arrow"
    )
    assert next(iter(loader)).schema.names == ["x", "id", "x", "source"]
    c = write(tmp_path, "c", twice.select([1, 0, 2]), files=1)
    with pytest.raises(SchemaMismatchError, match="different orders and two columns named 'x'"):
        StructuredDataset({"a": a, "c": c}, weights={"a": 1, "c": 1})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packed_mixture_reads_its_token_column_by_name(tmp_path: Path, workers: int) -> None:
    """Each token names its source: ``(source + 1) * 1000 + document``, the sources' files
    holding their columns in different orders."""
    paths = {}
    for s, order in enumerate([["tokens", "id"], ["id", "tokens"]]):
        docs = np.arange(40, dtype=np.int64)
        tokens = [[(s + 1) * 1000 + d] * (1 + d % 5) for d in docs.tolist()]
        table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int64())), "id": docs})
        paths[f"s{s}"] = write(tmp_path, f"s{s}", table.select(order))
    loader, _ = StructuredDataset.create_dataloader(
        paths, weights={"s0": 1, "s1": 2}, batch_size=3, epoch_size=30, num_workers=workers,
        packing=TokenPacking("tokens", seq_len=6), output="numpy",
    )  # fmt: skip
    batches = 0
    for batch in loader:
        tokens = batch["input_ids"]
        sources = np.broadcast_to(batch["source"][:, None] + 1, tokens.shape)
        real = tokens.ravel()[: batch["num_tokens"]]
        assert (real // 1000 == sources.ravel()[: len(real)]).all()
        batches += 1
    assert batches == 10


def test_the_rule_of_one_dataset_names_nullability_and_columns_held_twice(tmp_path: Path):
    """The rule the mixture shares (``index.schema.column_differences``), on one dataset's files:
    a column of one name held twice raised pyarrow's ``KeyError`` before, and a nullability
    read 'field order or nullability differs'."""
    ids = pa.array(np.arange(3))
    pq.write_table(pa.Table.from_arrays([ids, ids], names=["x", "x"]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_arrays([ids, ids], names=["x", "y"]), tmp_path / "b.parquet")
    with pytest.raises(SchemaMismatchError, match="field 'x': 2 columns of that name vs int64"):
        StructuredDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    strict = pa.schema([pa.field("x", pa.int64(), nullable=False), ("y", pa.int64())])
    pq.write_table(pa.Table.from_arrays([ids, ids], schema=strict), tmp_path / "c.parquet")
    with pytest.raises(SchemaMismatchError, match=r"field 'x': int64 vs int64 not null$"):
        StructuredDataset([str(tmp_path / "b.parquet"), str(tmp_path / "c.parquet")])
