"""Parquet row groups and Arrow IPC / Feather v2 record batches read as the same rows."""

from __future__ import annotations

from pathlib import Path

import _harness
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest
from _data import rows_table, write_arrow, write_parquet

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.formats import get_format


def _meta(fmt: str, path: Path):
    return get_format(fmt).read_metadata(pa.memory_map(str(path)))


def test_parquet_units_are_row_groups(tmp_path: Path):
    path = write_parquet(tmp_path / "a.parquet", rows_table(0, 100), 30)
    meta = _meta("parquet", Path(path))
    assert meta.unit_rows == (30, 30, 30, 10)
    assert meta.num_rows == 100
    footer = pq.ParquetFile(path).metadata
    for i, size in enumerate(meta.unit_bytes):
        group = footer.row_group(i)
        assert size == sum(group.column(c).total_compressed_size for c in range(group.num_columns))
    assert meta.schema.names == ["id", "x", "label", "name"]


def test_arrow_units_are_record_batches(tmp_path: Path):
    path = write_arrow(tmp_path / "a.arrow", rows_table(0, 100), 30)
    meta = _meta("arrow", Path(path))
    assert meta.unit_rows == (30, 30, 30, 10)
    assert all(size > 0 for size in meta.unit_bytes)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_read_units_from_the_middle_with_projection(tmp_path: Path, fmt: str):
    path = tmp_path / f"a.{fmt}"
    table = rows_table(0, 100)
    write_parquet(path, table, 30) if fmt == "parquet" else write_arrow(path, table, 30)
    meta = _meta(fmt, path)
    batches = list(
        get_format(fmt).read_units(pa.memory_map(str(path)), meta, range(1, 3), ["name", "id"], 7)
    )
    assert all(b.num_rows <= 7 for b in batches)
    got = pa.Table.from_batches(batches)
    assert got.column_names == ["name", "id"]
    assert got.column("id").to_pylist() == list(range(30, 90))


def _write_ipc(path: Path, table: pa.Table, chunk: int) -> None:
    with pa.OSFile(str(path), "wb") as sink, pyarrow.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=chunk):
            writer.write_batch(batch)


@pytest.mark.parametrize("shuffle", [False, True])
def test_parquet_and_arrow_give_the_same_rows(tmp_path: Path, shuffle: bool):
    for name in ("pq", "feather", "ipc"):
        (tmp_path / name).mkdir()
    for i, rows in enumerate([50, 70]):
        table = rows_table(100 * i, rows)
        write_parquet(tmp_path / "pq" / f"{i}.parquet", table, 9)
        write_arrow(tmp_path / "feather" / f"{i}.arrow", table, 9)
        _write_ipc(tmp_path / "ipc" / f"{i}.arrow", table, 9)
    # Same units (9 rows) in both formats; split_bytes=1 makes every unit a split, so even the
    # shuffled order is the same.
    runs = {
        name: _harness.run_epoch(
            {"path": str(tmp_path / name), "format": fmt, "batch_size": 8, "split_bytes": 1,
             "shuffle": shuffle}
        )
        for name, fmt in [("pq", "parquet"), ("feather", "arrow"), ("ipc", "arrow")]
    }  # fmt: skip
    assert runs["pq"] == runs["feather"] == runs["ipc"]
    assert sorted(_harness.ids(runs["pq"])) == list(range(50)) + list(range(100, 170))
    first = runs["pq"][0]
    assert first["x"] == ("torch.float64", [i * 0.5 for i in first["id"][1]])
    assert first["name"] == ("list", [f"r{i}" for i in first["id"][1]])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_arrow_resume_is_exact(arrow_dir: Path, num_workers: int):
    case = {"path": str(arrow_dir), "format": "arrow", "batch_size": 13, "split_bytes": 3000,
            "shuffle": True, "num_workers": num_workers}  # fmt: skip
    full = _harness.run_epoch(case)
    assert sorted(_harness.ids(full)) == list(range(700))
    for k in (0, 9, len(full) - 1):
        _harness.assert_resume_exact(case, k, full=full)


def test_unknown_format_lists_supported(tmp_path: Path):
    with pytest.raises(ValueError, match=r"unknown format 'csv'.*'arrow', 'parquet'"):
        get_format("csv")
    write_parquet(tmp_path / "a.parquet", rows_table(0, 3), 3)
    with pytest.raises(ValueError, match=r"supported formats: 'arrow', 'parquet'"):
        StructuredDataset(str(tmp_path), format="csv")


def test_parquet_read_as_arrow_names_the_file(tmp_path: Path):
    from torch_dataloader_utils import DataSourceError

    path = write_parquet(tmp_path / "a.parquet", rows_table(0, 3), 3)
    with pytest.raises(DataSourceError, match=r"a\.parquet as arrow"):
        StructuredDataset(path, format="arrow")


# ---------------------------------------------------------------------------- layouts


def _nested_ipc(compression: str | None = None) -> bytes:
    """Record batches of flat, string, list, struct and dictionary columns (nulls included)."""
    n = 600
    table = pa.table(
        {
            "a": pa.array([i if i % 7 else None for i in range(n)], pa.int64()),
            "s": [f"s{i}" * (i % 5) for i in range(n)],
            "l": [[i, i + 1][: i % 3] for i in range(n)],
            "st": [{"x": i, "y": f"y{i}"} for i in range(n)],
            "d": pa.array([f"k{i % 4}" for i in range(n)]).dictionary_encode(),
            "b": pa.array([i * 0.5 for i in range(n)]),
        }
    )
    sink = pa.BufferOutputStream()
    options = pyarrow.ipc.IpcWriteOptions(compression=compression)
    with pyarrow.ipc.new_file(sink, table.schema, options=options) as writer:
        for batch in table.to_batches(max_chunksize=200):
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("columns", [["s"], ["l", "a"], ["st"], ["b", "s", "a"], None])
def test_arrow_projected_reads_touch_only_their_spans(compression: str | None, columns: list):
    from torch_dataloader_utils.storage.remote import RemoteFile, RemoteObject

    data = _nested_ipc(compression)
    fmt = get_format("arrow")
    meta = fmt.read_metadata(pa.BufferReader(data))
    units = range(1, 3)
    spans = fmt.unit_spans(meta, units, columns)
    assert spans is not None and len(spans) == 2
    allowed = [span for unit in spans for span in unit]
    if columns is not None:  # a projection reads less than the batches' bytes
        assert sum(b - a for a, b in allowed) < sum(meta.unit_bytes[u] for u in units)
    outside: list[tuple[int, int]] = []

    def fetch(start: int, stop: int) -> bytes:
        if not any(a <= start and stop <= b for a, b in allowed):
            outside.append((start, stop))
        return data[start:stop]

    known = fmt.known_bytes(meta)
    source = RemoteFile(RemoteObject(fetch, len(data), "mem://n.arrow"), known=known)
    got = pa.Table.from_batches(list(fmt.read_units(source, meta, units, columns, 1000)))
    whole = pyarrow.ipc.open_file(pa.BufferReader(data)).read_all().slice(200, 400)
    expected = whole if columns is None else whole.select(columns)
    assert got.equals(expected)
    assert outside == []  # never the footer, never another column's buffers


def test_arrow_footer_round_trips_through_its_ipc_bytes():
    fmt = get_format("arrow")
    meta = fmt.read_metadata(pa.BufferReader(_nested_ipc()))
    dumped = fmt.dump_footer(meta.footer)
    loaded = fmt.load_footer(dumped)
    assert loaded == meta.footer and loaded.blocks == meta.footer.blocks
    assert [b.rows for b in loaded.blocks] == [200, 200, 200]
    with pytest.raises(ValueError, match="corrupt cached Arrow IPC footer"):
        fmt.load_footer(dumped[:-1])
    with pytest.raises(ValueError, match="corrupt cached Arrow IPC footer"):
        fmt.load_footer(dumped + b"\0")


def test_parquet_unit_spans_are_the_projected_column_chunks(tmp_path: Path):
    path = write_parquet(tmp_path / "a.parquet", rows_table(0, 100), 30)
    fmt = get_format("parquet")
    meta = _meta("parquet", Path(path))
    footer = pq.ParquetFile(path).metadata
    spans = fmt.unit_spans(meta, range(1, 3), ["name", "id"])
    assert spans is not None and len(spans) == 2
    for unit, unit_spans in zip(range(1, 3), spans, strict=True):
        group = footer.row_group(unit)
        chunks = [group.column(c) for c in (0, 3)]  # id, name
        assert sum(b - a for a, b in unit_spans) == sum(c.total_compressed_size for c in chunks)
