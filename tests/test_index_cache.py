"""The local index cache: a second build reads no footers, a changed file invalidates its entry."""

from __future__ import annotations

import json
import logging
import os
import pickle
import sqlite3
from pathlib import Path
from typing import Any

import _harness
import pytest
import torch.utils.data
from _data import rows_table, write_dataset, write_parquet

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.index import build as _build
from torch_dataloader_utils.index.cache import cache_dir
from torch_dataloader_utils.index.parsed import SerializedMetadata

ROWS = (40, 30, 50, 20)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("TDU_CACHE_DIR", str(directory))
    monkeypatch.delenv("TDU_INDEX_CACHE", raising=False)
    return directory


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths whose footers are read from storage (not the cache), in order."""
    seen: list[str] = []
    original = _build._read_metadata

    def counting(storage, fmt, entry):  # type: ignore[no-untyped-def]
        seen.append(Path(entry.path).name)
        return original(storage, fmt, entry)

    monkeypatch.setattr(_build, "_read_metadata", counting)
    return seen


@pytest.fixture
def data(tmp_path: Path) -> Path:
    write_dataset(tmp_path / "data", ROWS, row_group_size=8)
    return tmp_path / "data"


def test_location_defaults_and_can_be_disabled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("TDU_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "torch_dataloader_utils"
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    for off in ("0", "off", "false", "no"):
        monkeypatch.setenv("TDU_INDEX_CACHE", off)
        assert cache_dir() is None


def test_second_build_reads_no_footers(cache: Path, data: Path, reads: list[str]):
    first = StructuredDataset(str(data), batch_size=16)
    assert sorted(reads) == [f"part-0000{i}.parquet" for i in range(len(ROWS))]
    reads.clear()
    second = StructuredDataset(str(data), batch_size=16)
    assert reads == []
    assert second._index.digest == first._index.digest
    assert [s for s in second._index.splits] == [s for s in first._index.splits]
    assert second._index.schema.equals(first._index.schema)
    assert isinstance(second._index.files[0].metadata, SerializedMetadata)
    assert sorted(int(i) for b in second for i in b["id"]) == list(range(sum(ROWS)))


def test_changed_file_invalidates_only_its_entry(cache: Path, data: Path, reads: list[str]):
    before = StructuredDataset(str(data))
    path = data / "part-00002.parquet"
    stat = path.stat()
    # Same rows and size, another row-group layout, the old mtime put back: still a miss.
    write_parquet(path, rows_table(70, ROWS[2]), 10)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    reads.clear()
    after = StructuredDataset(str(data))
    assert reads == ["part-00002.parquet"]
    assert after._index.files[2].fingerprint != before._index.files[2].fingerprint
    assert [f.fingerprint for i, f in enumerate(after._index.files) if i != 2] == [
        f.fingerprint for i, f in enumerate(before._index.files) if i != 2
    ]
    reads.clear()
    StructuredDataset(str(data))
    assert reads == []


def test_disabled_cache_reads_every_footer(
    cache: Path, data: Path, reads: list[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TDU_INDEX_CACHE", "0")
    StructuredDataset(str(data))
    StructuredDataset(str(data))
    assert len(reads) == 2 * len(ROWS)
    assert not cache.exists()


def test_unusable_cache_warns_once_and_builds(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
):
    from torch_dataloader_utils.index import cache as _cache

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("TDU_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(_cache, "_warned", type(_cache._warned)())
    with pytest.warns(RuntimeWarning, match="index cache .* unusable"):
        dataset = StructuredDataset(str(data))
    assert len(list(dataset)) > 0


def test_cached_footers_pickle_unparsed_and_feed_workers(
    cache: Path, data: Path, monkeypatch: pytest.MonkeyPatch
):
    parsed: list[int] = []
    parse = SerializedMetadata.parse
    monkeypatch.setattr(SerializedMetadata, "parse", lambda m: parsed.append(1) or parse(m))
    StructuredDataset(str(data))
    dataset = StructuredDataset(str(data), batch_size=16, split_bytes=1)
    meta = dataset._index.files[0].metadata
    assert parsed == []  # never parsed in the main process
    copy = pickle.loads(pickle.dumps(meta))
    assert copy.footer.num_row_groups == len(meta.unit_rows)
    assert copy == meta
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    assert sorted(int(i) for b in loader for i in b["id"]) == list(range(sum(ROWS)))


def test_resume_is_exact_over_a_warm_cache(cache: Path, data: Path):
    case = {"path": str(data), "batch_size": 9, "split_bytes": 1, "shuffle": True}
    _harness.assert_resume_exact(case, 4)
    assert (cache / "index-v4.sqlite").exists()


def _rows(cache: Path, sql: str, *args: object) -> list[tuple]:
    with sqlite3.connect(cache / "index-v4.sqlite") as db:
        rows = db.execute(sql, args).fetchall()
    db.close()
    return rows


def test_cache_rows_are_data_in_a_journal_mode_safe_on_nfs(cache: Path, data: Path):
    StructuredDataset(str(data))
    (mode,) = _rows(cache, "PRAGMA journal_mode")[0]
    assert mode == "delete"  # not WAL, which needs shared memory that NFS does not provide
    entry, footer = _rows(cache, "SELECT entry, footer FROM files ORDER BY path")[0]
    fields = json.loads(entry)
    assert fields["unit_rows"] == [8, 8, 8, 8, 8]
    first = StructuredDataset(str(data))._index.files[0]
    assert fields["fingerprint"] == first.fingerprint  # the content fingerprint, kept
    assert footer[:4] == footer[-4:] == b"PAR1"  # Parquet's own Thrift footer, not a pickle


@pytest.mark.parametrize(
    "corruption",
    [
        "UPDATE files SET entry = '{not json' WHERE path LIKE '%part-00001%'",
        "UPDATE files SET footer = x'00' || footer WHERE path LIKE '%part-00001%'",
        "UPDATE files SET footer = CAST(x'00' || footer AS BLOB) WHERE path LIKE '%part-00001%'",
        """UPDATE files SET entry = replace(entry, '"unit_rows":[', '"unit_rows":[1,') """
        "WHERE path LIKE '%part-00001%'",
        """UPDATE files SET entry = replace(entry, '"unit_rows":[8', '"unit_rows":[-8') """
        "WHERE path LIKE '%part-00001%'",
        "UPDATE files SET entry = '[1, 2]' WHERE path LIKE '%part-00001%'",
        "UPDATE files SET footer = 'text' WHERE path LIKE '%part-00001%'",
        # an entry without a content fingerprint (written before fingerprints were kept)
        "UPDATE files SET entry = json_remove(entry, '$.fingerprint') "
        "WHERE path LIKE '%part-00001%'",
        "UPDATE files SET entry = json_set(entry, '$.fingerprint', 7) "
        "WHERE path LIKE '%part-00001%'",
    ],
)
def test_corrupt_row_is_logged_and_rebuilt(
    cache: Path, data: Path, reads: list[str], corruption: str, caplog: pytest.LogCaptureFixture
):
    first = StructuredDataset(str(data))
    _rows(cache, corruption)
    reads.clear()
    with caplog.at_level(logging.WARNING, logger="torch_dataloader_utils"):
        again = StructuredDataset(str(data), batch_size=16)
    assert reads == ["part-00001.parquet"]  # only the corrupt entry is read from storage
    assert "1 corrupt entries ignored" in caplog.text and "part-00001.parquet" in caplog.text
    assert again._index.digest == first._index.digest
    assert sorted(int(i) for b in again for i in b["id"]) == list(range(sum(ROWS)))
    reads.clear()
    StructuredDataset(str(data))
    assert reads == []  # rewritten


def test_corrupt_schema_row_misses_its_files_and_is_rewritten(
    cache: Path, data: Path, reads: list[str]
):
    StructuredDataset(str(data))
    _rows(cache, "UPDATE schemas SET schema = x'00' || schema")
    reads.clear()
    StructuredDataset(str(data))
    assert len(reads) == len(ROWS)
    reads.clear()
    StructuredDataset(str(data))
    assert reads == []


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def test_pickle_planted_in_the_cache_is_never_executed(
    cache: Path, data: Path, reads: list[str], tmp_path: Path
):
    StructuredDataset(str(data))
    marker = tmp_path / "executed"
    payload = pickle.dumps(_Exploit(marker))
    _rows(cache, "UPDATE files SET entry = ?, footer = ?", payload, payload)
    _rows(cache, "UPDATE schemas SET schema = ?", payload)
    reads.clear()
    dataset = StructuredDataset(str(data), batch_size=16, split_bytes=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    assert sorted(int(i) for b in loader for i in b["id"]) == list(range(sum(ROWS)))
    assert len(reads) == len(ROWS)
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: b"not a database" * 100, id="not-a-database"),
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: data[:100] + bytes(len(data) - 100), id="pages-zeroed"),
    ],
)
def test_damaged_cache_file_is_rebuilt_never_an_error(
    cache: Path, data: Path, reads: list[str], damage: Any, caplog: pytest.LogCaptureFixture
):
    StructuredDataset(str(data))
    db = cache / "index-v4.sqlite"
    db.write_bytes(damage(db.read_bytes()))
    reads.clear()
    with caplog.at_level(logging.WARNING, logger="torch_dataloader_utils"):
        dataset = StructuredDataset(str(data), batch_size=16)
    assert sorted(int(i) for b in dataset for i in b["id"]) == list(range(sum(ROWS)))
    assert len(reads) == len(ROWS)
    assert f"index cache {db} is damaged" in caplog.text and "building it anew" in caplog.text
    caplog.clear()
    reads.clear()
    with caplog.at_level(logging.WARNING, logger="torch_dataloader_utils"):
        StructuredDataset(str(data))
    assert reads == [] and caplog.text == ""  # rebuilt, and trusted again


def test_locked_cache_is_bypassed_with_a_warning(
    cache: Path, data: Path, reads: list[str], monkeypatch: pytest.MonkeyPatch
):
    from torch_dataloader_utils.index import cache as _cache

    StructuredDataset(str(data))
    monkeypatch.setattr(_cache, "_BUSY_SECONDS", 0.05)
    monkeypatch.setattr(_cache, "_warned", type(_cache._warned)())
    holder = sqlite3.connect(cache / "index-v4.sqlite", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process in the middle of a write
    reads.clear()
    try:
        with pytest.warns(
            RuntimeWarning, match=r"index cache .* \(database is locked\); indexing without it"
        ):
            dataset = StructuredDataset(str(data), batch_size=16)
    finally:
        holder.close()
    assert len(reads) == len(ROWS)
    assert sorted(int(i) for b in dataset for i in b["id"]) == list(range(sum(ROWS)))
    reads.clear()
    StructuredDataset(str(data))
    assert reads == []  # the cache was left as it was
