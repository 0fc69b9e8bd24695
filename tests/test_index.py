"""The dataset index: footers, fingerprints, digests and the splits cut from real files."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
from _data import rows_table, write_dataset, write_parquet

from torch_dataloader_utils import SchemaMismatchError
from torch_dataloader_utils._formats import get_format
from torch_dataloader_utils._index import MAX_FILE_GROUPS, build_index
from torch_dataloader_utils._storage import Storage


def _index(path: Path | list[str], split_bytes: int = 2**30, columns=None):
    first = str(path) if isinstance(path, Path) else path[0]
    return build_index(
        Storage(first), get_format("parquet"),
        str(path) if isinstance(path, Path) else path, columns, split_bytes,
    )  # fmt: skip


def test_index_reads_footers_and_cuts_splits(tmp_path: Path):
    write_dataset(tmp_path, [100, 45], row_group_size=20)
    index = _index(tmp_path, split_bytes=1)
    assert [f.metadata.unit_rows for f in index.files] == [(20,) * 5, (20, 20, 5)]
    assert len(index.splits) == 8  # split_bytes=1: every row group on its own
    assert index.describe(5) == f"{tmp_path}/part-00001.parquet rows [0, 20)"
    assert index.schema.names == ["id", "x", "label", "name"]
    whole = _index(tmp_path)
    assert [(s.file, s.row_offset, s.row_length) for s in whole.splits] == [(0, 0, 100), (1, 0, 45)]


def test_split_bytes_bound_compressed_row_group_bytes(tmp_path: Path):
    write_dataset(tmp_path, [400], row_group_size=10)
    index = _index(tmp_path)
    sizes = index.files[0].metadata.unit_bytes
    bound = 3 * max(sizes)
    for split in _index(tmp_path, split_bytes=bound).splits:
        assert sum(sizes[u] for u in split.units) <= bound
        assert split.row_length == 10 * len(split.units)


def test_columns_project_the_schema(tmp_path: Path):
    write_dataset(tmp_path, [10], row_group_size=5)
    assert _index(tmp_path, columns=["name", "id"]).schema.names == ["name", "id"]
    with pytest.raises(SchemaMismatchError, match=r"no column\(s\) \['nope'\]"):
        _index(tmp_path, columns=["id", "nope"])


def test_fingerprint_is_stable_and_tracks_content(tmp_path: Path):
    write_dataset(tmp_path, [30, 30], row_group_size=10)
    a, b = _index(tmp_path), _index(tmp_path)
    assert [f.fingerprint for f in a.files] == [f.fingerprint for f in b.files]
    assert a.digest == b.digest
    # Same size, same layout, different mtime: a different fingerprint.
    path = tmp_path / "part-00001.parquet"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    c = _index(tmp_path)
    assert c.files[0].fingerprint == a.files[0].fingerprint
    assert c.files[1].fingerprint != a.files[1].fingerprint
    assert c.digest != a.digest


def test_fingerprint_includes_the_row_group_layout(tmp_path: Path):
    path = tmp_path / "a.parquet"
    write_parquet(path, rows_table(0, 60), 20)
    stat = path.stat()
    first = _index(tmp_path).files[0].fingerprint
    write_parquet(path, rows_table(0, 60), 30)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _index(tmp_path).files[0].fingerprint != first


def test_file_groups_are_bounded(tmp_path: Path):
    table = rows_table(0, 1)
    for i in range(MAX_FILE_GROUPS + 40):
        write_parquet(tmp_path / f"f{i:04d}.parquet", table, 1)
    index = _index(tmp_path)
    groups = index.file_groups()
    assert len(groups) <= MAX_FILE_GROUPS
    assert sum(g[2] for g in groups) == len(index.files)
    assert groups[0][0] == index.files[0].display
    assert groups[-1][1] == index.files[-1].display


def test_index_pickles_for_workers(tmp_path: Path):
    import pickle

    write_dataset(tmp_path, [30], row_group_size=10)
    index = _index(tmp_path, split_bytes=1)
    again = pickle.loads(pickle.dumps(index))
    assert again.digest == index.digest
    assert again.splits == index.splits
    assert isinstance(again.schema, pa.Schema)


def test_index_cache_on_and_off_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A checkpoint taken with a warm index cache resumes without it, and the other way round."""
    import _harness

    write_dataset(tmp_path / "data", [120, 80], row_group_size=10)
    case = {"path": str(tmp_path / "data"), "batch_size": 9, "split_bytes": 1, "shuffle": True}
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "cache"))
    cold, warm = _index(tmp_path / "data"), _index(tmp_path / "data")
    full = _harness.run_epoch(case)
    state, _ = _harness.checkpoint_after(case, 6)
    monkeypatch.setenv("TDU_INDEX_CACHE", "0")
    off = _index(tmp_path / "data")
    assert cold.digest == warm.digest == off.digest
    assert cold.splits == warm.splits == off.splits
    assert _harness.resume(case, state) == full[6:]
