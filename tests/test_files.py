"""Files as real writers make them: pandas and pyarrow, tiny row groups, nulls, dictionary
encoding, and every common compression."""

from __future__ import annotations

import math
from pathlib import Path

import _harness
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torch_dataloader_utils import StructuredDataset

ROWS = 300


def _frame(start: int, rows: int) -> pd.DataFrame:
    ids = np.arange(start, start + rows)
    return pd.DataFrame(
        {
            "id": ids,
            "score": np.where(ids % 5 == 0, np.nan, ids / 4),  # nulls in a float column
            "flag": ids % 2 == 0,
            "city": pd.Categorical(np.array(["oslo", "lima", "pune"])[ids % 3]),
            "comment": [None if i % 7 == 0 else f"c{i}" for i in ids],  # nulls in strings
            "when": pd.to_datetime(ids, unit="s"),
        }
    )


def _check_rows(batches: list[dict], expected_ids: list[int]) -> None:
    ids = _harness.ids(batches)
    assert sorted(ids) == expected_ids
    for batch in batches:
        for r, i in enumerate(batch["id"][1]):
            score = batch["score"][1][r]
            assert score == ("NaN" if i % 5 == 0 else i / 4)
            assert batch["flag"][1][r] == (i % 2 == 0)
            assert batch["city"][1][r] == ["oslo", "lima", "pune"][i % 3]
            assert batch["comment"][1][r] == (None if i % 7 == 0 else f"c{i}")
            assert batch["when"][1][r] == i * 10**9 or batch["when"][1][r] == i * 10**6


@pytest.mark.parametrize("compression", ["snappy", "gzip", "zstd", "none"])
def test_pandas_files(tmp_path: Path, compression: str):
    for f in range(3):
        _frame(f * ROWS, ROWS).to_parquet(
            tmp_path / f"{f}.parquet", engine="pyarrow", compression=compression,
            row_group_size=7, index=False,
        )  # fmt: skip
    meta = pq.ParquetFile(tmp_path / "0.parquet").metadata
    assert meta.num_row_groups == math.ceil(ROWS / 7)
    assert meta.row_group(0).column(0).compression == compression.upper().replace(
        "NONE", "UNCOMPRESSED"
    )
    case = {"path": str(tmp_path), "batch_size": 32, "split_bytes": 1, "shuffle": True,
            "num_workers": 2}  # fmt: skip
    full = _harness.run_epoch(case)
    _check_rows(full, list(range(3 * ROWS)))
    assert full[0]["city"][0] == "list"
    assert full[0]["score"][0] == "torch.float64"
    _harness.assert_resume_exact(case, 11, full=full)


def test_pandas_index_column_is_a_column(tmp_path: Path):
    frame = _frame(0, 50).iloc[::-1].set_index("id")
    frame.to_parquet(tmp_path / "a.parquet", row_group_size=8, index=True)
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=50)
    (batch,) = list(loader)
    assert batch["id"].tolist() == list(range(49, -1, -1))


@pytest.mark.parametrize("compression", ["snappy", "gzip", "zstd", "none", "brotli", "lz4"])
def test_pyarrow_files_tiny_row_groups(tmp_path: Path, compression: str):
    for f in range(2):
        table = pa.Table.from_pandas(_frame(f * ROWS, ROWS), preserve_index=False)
        pq.write_table(
            table, tmp_path / f"{f}.parquet", row_group_size=3, compression=compression,
            use_dictionary=["city", "comment"], data_page_size=64,
        )  # fmt: skip
    case = {"path": str(tmp_path), "batch_size": 25, "split_bytes": 200, "num_workers": 1,
            "shuffle": True}  # fmt: skip
    full = _harness.run_epoch(case)
    _check_rows(full, list(range(2 * ROWS)))
    _harness.assert_resume_exact(case, 7, full=full)


def test_dictionary_columns_read_as_values(tmp_path: Path):
    table = pa.table(
        {
            "id": pa.array(range(40)),
            "tag": pa.array([["a", "b", None, "d"][i % 4] for i in range(40)]).dictionary_encode(),
            "code": pa.array([i % 3 for i in range(40)], pa.int16()).dictionary_encode(),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=6, use_dictionary=True)
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=40)
    (batch,) = list(loader)
    assert batch["tag"] == [["a", "b", None, "d"][i % 4] for i in range(40)]
    assert batch["code"].tolist() == [i % 3 for i in range(40)]


def test_files_with_empty_row_groups_and_an_empty_file(tmp_path: Path):
    schema = pa.schema([("id", pa.int64())])
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), tmp_path / "0-empty.parquet")
    with pq.ParquetWriter(tmp_path / "1.parquet", schema) as writer:
        writer.write_table(pa.table({"id": [0, 1, 2]}, schema=schema))
        writer.write_table(pa.table({"id": pa.array([], pa.int64())}, schema=schema))
        writer.write_table(pa.table({"id": [3, 4]}, schema=schema))
    case = {"path": str(tmp_path), "batch_size": 2, "split_bytes": 1}
    full = _harness.run_epoch(case)
    assert _harness.ids(full) == [0, 1, 2, 3, 4]
    _harness.assert_resume_exact(case, 1, full=full)


def test_wide_and_nested_columns(tmp_path: Path):
    table = pa.table(
        {
            "id": pa.array(range(30)),
            "emb": pa.FixedSizeListArray.from_arrays(
                pa.array(np.arange(30 * 8, dtype=np.float32)), 8
            ),
            "tokens": pa.array([list(range(i % 5)) for i in range(30)]),
            "meta": pa.array([{"a": i, "b": str(i)} for i in range(30)]),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=4)
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=30)
    (batch,) = list(loader)
    assert batch["emb"].shape == (30, 8)
    assert batch["emb"][3].tolist() == list(range(24, 32))
    assert batch["tokens"][7].tolist() == [0, 1]  # list<int> columns are jagged tensors
    assert batch["meta"][5] == {"a": 5, "b": "5"}
