"""Portable checkpoints: a state taken on one copy of the data resumes on another.

A copy made with ``shutil.copyfile`` has new mtimes (and inodes, and another directory); its
content is the same, so the resume is exact. A file whose content changed still raises
``CheckpointMismatchError`` naming it, with a ``Likely cause``. ``memory://`` and moto S3
stand in for object storage copied to a local disk.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _harness
import fsspec
import pytest
from _data import rows_table, write_dataset, write_parquet
from _s3server import S3Env, s3_fixture, s3_server_fixture  # noqa: F401

from torch_dataloader_utils import CheckpointMismatchError

ROWS = (70, 50, 90)


@pytest.fixture(autouse=True)
def _private_index_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "index-cache"))


def _copy(source: Path, target: Path) -> None:
    """Content only (``copyfile``), and mtimes moved an hour back to be sure they differ."""
    for path in sorted(source.rglob("*.parquet")):
        copy = target / path.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        os.utime(copy, (path.stat().st_atime - 3600, path.stat().st_mtime - 3600))


@pytest.mark.parametrize(
    ("options", "k"),
    [
        ({"shuffle": True, "num_workers": 0}, 5),
        ({"shuffle": True, "num_workers": 2}, 7),
        ({"shuffle": False, "num_workers": 2}, 9),
    ],
)
def test_copied_dataset_resumes_exactly(tmp_path: Path, options: dict[str, Any], k: int):
    write_dataset(tmp_path / "src" / "train", ROWS, row_group_size=10)
    case = {"batch_size": 16, "split_bytes": 1, "shuffle_seed": 4, **options}
    full = _harness.run_epoch({**case, "path": str(tmp_path / "src" / "train")})
    state, first = _harness.checkpoint_after({**case, "path": str(tmp_path / "src" / "train")}, k)
    assert first == full[:k]
    _copy(tmp_path / "src", tmp_path / "nvme" / "cache")
    shutil.rmtree(tmp_path / "src")  # the original is gone: nothing can be read from it
    moved = {**case, "path": str(tmp_path / "nvme" / "cache" / "train")}
    assert _harness.resume(moved, state) == full[k:]
    assert _harness.resume(moved, _harness.torch_round_trip(state)) == full[k:]


def test_copy_spelled_as_a_glob_or_file_list_resumes(tmp_path: Path):
    write_dataset(tmp_path / "a", ROWS, row_group_size=10)
    case = {"batch_size": 16, "split_bytes": 1, "shuffle": True}
    full = _harness.run_epoch({**case, "path": str(tmp_path / "a")})
    state, _ = _harness.checkpoint_after({**case, "path": str(tmp_path / "a")}, 6)
    _copy(tmp_path / "a", tmp_path / "b")
    files = [str(p) for p in sorted((tmp_path / "b").glob("*.parquet"))]
    for path in (f"{tmp_path}/b/*.parquet", files):
        assert _harness.resume({**case, "path": path}, state) == full[6:], path


def test_changed_content_in_the_copy_still_raises(tmp_path: Path):
    write_dataset(tmp_path / "a", ROWS, row_group_size=10)
    case = {"batch_size": 16, "split_bytes": 1, "shuffle": True}
    state, _ = _harness.checkpoint_after({**case, "path": str(tmp_path / "a")}, 6)
    _copy(tmp_path / "a", tmp_path / "b")
    # The same row count and row groups, other values: only the footer can tell.
    write_parquet(tmp_path / "b" / "part-00001.parquet", rows_table(1000, ROWS[1]), 10)
    with pytest.raises(CheckpointMismatchError) as info:
        _harness.resume({**case, "path": str(tmp_path / "b")}, state)
    message = str(info.value)
    assert f"stored {tmp_path}/a/part-00001.parquet (full file" in message
    assert f"compared against current {tmp_path}/b/part-00001.parquet" in message
    assert "Likely cause: files changed (content changed (size or footer))" in message
    assert info.value.field == "files"


def test_a_copy_with_another_layout_below_the_root_is_refused(tmp_path: Path):
    write_dataset(tmp_path / "a", ROWS, row_group_size=10)
    case = {"batch_size": 16, "split_bytes": 1}
    state, _ = _harness.checkpoint_after({**case, "path": str(tmp_path / "a")}, 3)
    _copy(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "part-00002.parquet").rename(tmp_path / "b" / "part-00009.parquet")
    with pytest.raises(CheckpointMismatchError, match="renamed"):
        _harness.resume({**case, "path": str(tmp_path / "b")}, state)


def test_elastic_resume_of_two_ranks_on_a_copy_delivers_the_rest_once(tmp_path: Path):
    write_dataset(tmp_path / "a", ROWS, row_group_size=10)
    case = {"batch_size": 16, "split_bytes": 1, "shuffle": True, "even_batches": False}
    states, seen = [], []
    for rank, k in ((0, 3), (1, 5)):
        ranked = {**case, "path": str(tmp_path / "a"), "rank": rank, "world_size": 2}
        state, batches = _harness.checkpoint_after(ranked, k)
        states.append(state)
        seen += _harness.ids(batches)
    _copy(tmp_path / "a", tmp_path / "b")
    loader, _ = _harness.make_loader({**case, "path": str(tmp_path / "b"), "num_workers": 2})
    loader.load_state_dict(states, elastic=True)
    rest = _harness.ids(_harness.take(loader))
    assert sorted(seen + rest) == list(range(sum(ROWS)))


@pytest.fixture
def memory_dataset(tmp_path: Path) -> Iterator[str]:
    """``memory://<unique>/train`` holding the dataset, removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/{uuid.uuid4().hex}"
    for path in write_dataset(tmp_path / "memsrc", ROWS, row_group_size=10):
        fs.pipe_file(f"{root}/train/{Path(path).name}", Path(path).read_bytes())
    yield f"memory://{root}/train"
    fs.rm(root, recursive=True)


def test_memory_checkpoint_resumes_on_a_local_copy(memory_dataset: str, tmp_path: Path):
    case = {"batch_size": 16, "split_bytes": 1, "shuffle": True, "num_workers": 2}
    full = _harness.run_epoch({**case, "path": memory_dataset})
    state, _ = _harness.checkpoint_after({**case, "path": memory_dataset}, 5)
    fs = fsspec.filesystem("memory")
    (tmp_path / "local").mkdir()
    for path in fs.find(memory_dataset):
        (tmp_path / "local" / Path(path).name).write_bytes(fs.cat_file(path))
    assert _harness.resume({**case, "path": str(tmp_path / "local")}, state) == full[5:]


@pytest.mark.s3
def test_s3_checkpoint_resumes_on_a_local_copy(s3: S3Env, tmp_path: Path):
    for path in write_dataset(tmp_path / "src", ROWS, row_group_size=10):
        s3.put_bytes(f"prefix/train/{Path(path).name}", Path(path).read_bytes())
    case = {"batch_size": 16, "split_bytes": 1, "shuffle": True, "storage_options": s3.options}
    url = s3.url("prefix/train/")
    full = _harness.run_epoch({**case, "path": url})
    state, _ = _harness.checkpoint_after({**case, "path": url}, 5)
    assert state["files"]["root"] == "s3://tdu-test/prefix/train"
    assert {entry[3] for entry in state["streams"]} <= {f"part-0000{i}.parquet" for i in range(3)}
    s3.fs().get(url, str(tmp_path / "nvme") + "/", recursive=True)
    local = {**case, "path": str(tmp_path / "nvme"), "storage_options": None}
    assert _harness.resume(local, state) == full[5:]
