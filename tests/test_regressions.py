"""Regressions: each test reproduces a bug found and fixed in the package."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _data import rows_table, write_dataset, write_parquet

from torch_dataloader_utils import InvalidStateError, StructuredDataset


def test_recursive_glob_skips_hidden_and_underscore_directories(tmp_path: Path):
    (tmp_path / "data" / "_temporary" / "0").mkdir(parents=True)
    write_parquet(tmp_path / "data" / "part-0.parquet", rows_table(0, 2), 2)
    write_parquet(tmp_path / "data" / "_temporary" / "0" / "part-0.parquet", rows_table(2, 1), 1)
    loader, _ = StructuredDataset.create_dataloader(
        str(tmp_path / "data" / "**" / "*.parquet"), batch_size=10
    )
    assert [b["id"].tolist() for b in loader] == [[0, 1]]


@pytest.mark.parametrize("name", ["exp[1]", "a?b"])
def test_existing_directory_with_glob_characters_is_taken_literally(tmp_path: Path, name: str):
    write_dataset(tmp_path / name, [10], row_group_size=5)
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path / name), batch_size=100)
    assert [len(b["id"]) for b in loader] == [10]


def test_numpy_dictionary_strings_are_object_arrays(tmp_path: Path):
    table = pa.table({"s": ["a", "b"], "d": pa.array(["a", "b"]).dictionary_encode()})
    pq.write_table(table, tmp_path / "a.parquet")
    (batch,) = StructuredDataset(str(tmp_path), output="numpy")
    assert isinstance(batch["s"], np.ndarray)
    assert isinstance(batch["d"], np.ndarray) and batch["d"].dtype == object


def _cosmetic_arrow_output_schema_is_the_same_with_workers(tmp_path: Path):
    values = pa.array([[i, i] for i in range(100)], pa.list_(pa.float32(), 2))
    pq.write_table(pa.table({"id": list(range(100)), "v": values}), tmp_path / "a.parquet",
                   row_group_size=10)  # fmt: skip
    schemas = []
    for workers in (0, 2):
        loader, _ = StructuredDataset.create_dataloader(
            str(tmp_path), batch_size=10, output="arrow", num_workers=workers, split_bytes=1
        )
        schemas.append(next(iter(loader)).schema)
    assert schemas[0] == schemas[1] == pq.read_schema(tmp_path / "a.parquet")


@pytest.mark.parametrize("cursor", [5, -1, 2])
def test_corrupted_cursor_names_the_key(parquet_dir: Path, small_split: int, cursor: int):
    case = {"path": str(parquet_dir), "batch_size": 7, "split_bytes": small_split,
            "shuffle": True, "num_workers": 2}  # fmt: skip
    state, _ = _harness.checkpoint_after(case, 23)
    bad = {**copy.deepcopy(state), "cursor": cursor}
    with pytest.raises(InvalidStateError, match="cursor"):
        _harness.resume(case, bad)


def test_corrupted_num_splits_names_the_key(parquet_dir: Path, small_split: int):
    case = {"path": str(parquet_dir), "batch_size": 7, "split_bytes": small_split}
    state, _ = _harness.checkpoint_after(case, 23)
    bad = {**state, "num_splits": state["num_splits"] + 1}
    with pytest.raises(Exception, match="num_splits"):
        _harness.resume(case, bad)


def test_rewriting_a_file_in_place_after_reading_does_not_crash(tmp_path: Path):
    """Files are read, not memory-mapped: truncating one under a reader must not SIGBUS."""
    script = textwrap.dedent(
        f"""
        import time, numpy as np, pyarrow as pa, pyarrow.parquet as pq
        from torch_dataloader_utils import StructuredDataset
        path = {str(tmp_path / "a.parquet")!r}
        pq.write_table(pa.table({{"x": np.arange(400_000.0)}}), path, row_group_size=100_000,
                       compression="none")
        loader, _ = StructuredDataset.create_dataloader(path, batch_size=10)
        it = iter(loader)
        next(it)
        del it
        open(path, "wb").write(b"PAR1")
        time.sleep(0.5)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
