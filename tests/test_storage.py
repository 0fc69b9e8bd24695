"""File discovery through fsspec: directories, globs, single files, lists; local and memory://."""

from __future__ import annotations

import logging
import pickle
import uuid
from pathlib import Path

import fsspec
import pytest
from _data import ids_of, rows_table, write_arrow, write_dataset, write_parquet

from torch_dataloader_utils import DataSourceError, StructuredDataset
from torch_dataloader_utils.storage.filesystem import Storage


def _names(entries, root: Path) -> list[str]:
    return [str(Path(e.path).relative_to(root)) for e in entries]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    table = rows_table(0, 10)
    for rel in ["b/2.parquet", "b/1.parquet", "a.parquet", "c/d/e.parquet", "c/0.parquet"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        write_parquet(tmp_path / rel, table, 5)
    for rel in ["_SUCCESS", ".part.crc", "b/_common_metadata", "_tmp/x.parquet", ".hid/y.parquet"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"not parquet")
    return tmp_path


def test_directory_is_walked_recursively_sorted_skipping_hidden(tree: Path):
    entries = Storage(str(tree)).list_files(str(tree))
    assert _names(entries, tree) == [
        "a.parquet", "b/1.parquet", "b/2.parquet", "c/0.parquet", "c/d/e.parquet",
    ]  # fmt: skip
    for entry in entries:
        assert entry.size == Path(entry.path).stat().st_size
        assert entry.version  # mtime


def test_dataset_over_a_directory_ignores_success_and_crc_files(tree: Path):
    loader, _ = StructuredDataset.create_dataloader(str(tree), batch_size=100)
    assert [len(ids_of(b)) for b in loader] == [50]


def test_glob_skips_hidden_names(tree: Path):
    entries = Storage(str(tree)).list_files(str(tree / "b" / "*"))
    assert _names(entries, tree) == ["b/1.parquet", "b/2.parquet"]
    entries = Storage(str(tree)).list_files(str(tree / "c" / "*" / "*.parquet"))
    assert _names(entries, tree) == ["c/d/e.parquet"]
    (tree / "b" / "_3.parquet").write_bytes(b"hidden")
    entries = Storage(str(tree)).list_files(str(tree / "b" / "*.parquet"))
    assert _names(entries, tree) == ["b/1.parquet", "b/2.parquet"]


def test_single_file_and_list_keep_item_order(tree: Path):
    storage = Storage(str(tree))
    assert _names(storage.list_files(str(tree / "c/0.parquet")), tree) == ["c/0.parquet"]
    got = storage.list_files([str(tree / "c"), str(tree / "a.parquet")])
    assert _names(got, tree) == ["c/0.parquet", "c/d/e.parquet", "a.parquet"]


def test_file_named_twice_is_an_error(tree: Path):
    with pytest.raises(ValueError, match=r"a\.parquet is named twice"):
        Storage(str(tree)).list_files([str(tree / "a.parquet"), str(tree)])


def test_missing_path_names_it(tmp_path: Path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        Storage(missing).list_files(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        StructuredDataset(missing)


def test_empty_directory_and_only_hidden_files(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no data files under .*empty"):
        StructuredDataset(str(tmp_path / "empty"))
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "_SUCCESS").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="ignored"):
        StructuredDataset(str(tmp_path / "hidden"))


def test_empty_list_is_an_error():
    with pytest.raises(ValueError, match="path is empty"):
        Storage("/").list_files([])


def test_storage_pickles(tmp_path: Path):
    storage = pickle.loads(pickle.dumps(Storage(str(tmp_path))))
    assert storage.is_local
    assert storage.display("/x/y") == "/x/y"


def test_open_missing_file_is_data_source_error(tmp_path: Path):
    with pytest.raises(DataSourceError, match=r"nope\.parquet"):
        Storage(str(tmp_path)).open(str(tmp_path / "nope.parquet"))


def _litdata_dir(root: Path) -> Path:
    """Parquet files as LitData / Hugging Face leave them, beside their own metadata."""
    (root / "sub").mkdir(parents=True)
    write_parquet(root / "train-0.parquet", rows_table(0, 10), 5)
    write_parquet(root / "sub" / "train-1.parq", rows_table(10, 10), 5)
    write_parquet(root / "train-2.PQ", rows_table(20, 10), 5)
    (root / "index.json").write_text('{"chunks": []}')
    (root / "README.md").write_text("# a dataset card")
    (root / "sub" / "dataset_info.json").write_text("{}")
    (root / "_SUCCESS").write_text("")
    return root


def test_directory_with_format_files_skips_other_tools_metadata(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    root = _litdata_dir(tmp_path / "lit")
    with caplog.at_level(logging.INFO, logger="torch_dataloader_utils"):
        loader, _ = StructuredDataset.create_dataloader(str(root), batch_size=100)
        assert sorted(ids_of(next(iter(loader)))) == list(range(30))
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert skipped == [
        f"{root}: reading the 3 .parquet/.parq/.pq files, skipping 3 other file(s): "
        "README.md, index.json, sub/dataset_info.json"
    ]
    listed = Storage(str(root)).list_files(str(root), extensions=(".parquet",))
    assert _names(listed, root) == ["train-0.parquet"]


def test_directory_without_format_extensions_reads_every_file(tmp_path: Path):
    for i in range(3):
        write_parquet(tmp_path / f"part-{i}", rows_table(10 * i, 10), 5)
    (tmp_path / "_SUCCESS").write_text("")
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=100)
    assert sorted(ids_of(next(iter(loader)))) == list(range(30))


def test_arrow_directory_takes_its_own_extensions(tmp_path: Path, caplog):
    write_arrow(tmp_path / "a.arrow", rows_table(0, 10), 5)
    write_arrow(tmp_path / "b.feather", rows_table(10, 10), 5)
    write_arrow(tmp_path / "c.ipc", rows_table(20, 10), 5)
    write_parquet(tmp_path / "d.parquet", rows_table(30, 10), 5)
    (tmp_path / "notes.txt").write_text("x")
    with caplog.at_level(logging.INFO, logger="torch_dataloader_utils"):
        loader, _ = StructuredDataset.create_dataloader(
            str(tmp_path), format="arrow", batch_size=100
        )
        assert sorted(ids_of(next(iter(loader)))) == list(range(30))
    assert "skipping 2 other file(s): d.parquet, notes.txt" in caplog.text


def test_explicit_file_and_glob_are_not_filtered_by_extension(tmp_path: Path):
    write_parquet(tmp_path / "a.parquet", rows_table(0, 10), 5)
    write_parquet(tmp_path / "b.data", rows_table(10, 10), 5)
    storage = Storage(str(tmp_path))
    got = storage.list_files(str(tmp_path / "b.data"), extensions=(".parquet",))
    assert _names(got, tmp_path) == ["b.data"]
    got = storage.list_files(str(tmp_path / "*"), extensions=(".parquet",))
    assert _names(got, tmp_path) == ["a.parquet", "b.data"]


# ---------------------------------------------------------------------------- memory://


@pytest.fixture
def memory_root(tmp_path: Path):
    """A unique memory:// prefix holding a copy of a small 3-file dataset."""
    local = write_dataset(tmp_path / "src", [40, 30, 50], row_group_size=8)
    fs = fsspec.filesystem("memory")
    root = f"/tdu-{uuid.uuid4().hex}"
    for path in local:
        fs.pipe(f"{root}/data/{Path(path).name}", Path(path).read_bytes())
    fs.pipe(f"{root}/data/_SUCCESS", b"")
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def test_memory_directory_glob_and_file(memory_root: str):
    storage = Storage(memory_root)
    assert not storage.is_local
    listed = [storage.display(e.path) for e in storage.list_files(f"{memory_root}/data")]
    assert listed == [f"{memory_root}/data/part-0000{i}.parquet" for i in range(3)]
    globbed = storage.list_files(f"{memory_root}/data/*.parquet")
    assert [e.path for e in globbed] == [e.path for e in storage.list_files(f"{memory_root}/data")]
    single = storage.list_files(f"{memory_root}/data/part-00001.parquet")
    assert len(single) == 1 and single[0].size > 0
    fsspec.filesystem("memory").pipe(f"{memory_root}/data/index.json", b"{}")
    filtered = storage.list_files(f"{memory_root}/data", extensions=(".parquet",))
    assert [e.path for e in filtered] == [e.path for e in globbed]


def test_memory_dataset_reads_every_row_and_resumes(memory_root: str):
    import _harness

    case = {"path": f"{memory_root}/data", "batch_size": 7, "split_bytes": 1, "shuffle": True}
    full = _harness.run_epoch(case)
    assert sorted(_harness.ids(full)) == list(range(120))
    state = _harness.assert_resume_exact(case, 5, full=full)
    assert state["files"]["root"] == f"{memory_root}/data"  # names are relative to it
    assert all(entry[3].startswith("part-0000") for entry in state["streams"])


def test_memory_missing_path(memory_root: str):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        StructuredDataset(f"{memory_root}/nothing-here")


def test_the_same_files_named_differently_resume_each_other(tmp_path, monkeypatch):
    """A checkpoint names files by content and display path; equivalent spellings agree."""
    import _harness

    root = tmp_path / "data"
    write_dataset(root, [60, 60], row_group_size=10)
    base = {"batch_size": 9, "split_bytes": 1, "shuffle": True}
    full = _harness.run_epoch({**base, "path": str(root)})
    state, _ = _harness.checkpoint_after({**base, "path": str(root)}, 5)
    monkeypatch.chdir(tmp_path)
    files = [str(root / "part-00000.parquet"), str(root / "part-00001.parquet")]
    for path in (f"file://{root}", f"{root}/", "data", "./data", files, f"{root}/*.parquet"):
        assert _harness.resume({**base, "path": path}, state) == full[5:], path


def test_remote_opens_take_sizes_from_the_listing(memory_root: str):
    storage = Storage(memory_root)
    entry = storage.list_files(f"{memory_root}/data/part-00001.parquet")[0]
    calls: list[str] = []
    fs = storage.fs
    original = fs.size
    fs.size = lambda path: calls.append(path) or original(path)
    try:
        with storage.open(entry.path) as handle:
            assert handle.size() == entry.size
            assert bytes(handle.read(4)) == b"PAR1"
    finally:
        fs.size = original
    assert calls == []  # no HEAD request per open
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.remote(entry.path).size == entry.size
