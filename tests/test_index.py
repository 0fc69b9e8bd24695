"""The dataset index: footers, fingerprints, digests and the splits cut from real files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from _data import rows_table, write_arrow, write_dataset, write_parquet
from hypothesis import given
from hypothesis import strategies as st

from torch_dataloader_utils import SchemaMismatchError
from torch_dataloader_utils.formats import get_format
from torch_dataloader_utils.index.build import _root, build_index
from torch_dataloader_utils.index.footers import TAIL, TailFile
from torch_dataloader_utils.index.index import MAX_FILE_GROUPS
from torch_dataloader_utils.storage.filesystem import Storage


def _index(path: Path | str | list[str], split_bytes: int = 2**30, columns=None, fmt="parquet"):
    paths = str(path) if isinstance(path, Path) else path
    first = paths if isinstance(paths, str) else paths[0]
    return build_index(Storage(first), get_format(fmt), paths, columns, split_bytes)


def test_index_reads_footers_and_cuts_splits(tmp_path: Path):
    write_dataset(tmp_path, [100, 45], row_group_size=20)
    index = _index(tmp_path, split_bytes=1)
    assert [f.metadata.unit_rows for f in index.files] == [(20,) * 5, (20, 20, 5)]
    assert len(index.splits) == 8  # split_bytes=1: every row group on its own
    assert index.describe(5) == f"{tmp_path}/part-00001.parquet rows [0, 20)"
    assert index.schema.names == ["id", "x", "label", "name"]
    whole = _index(tmp_path)
    assert [(s.file, s.row_offset, s.row_length) for s in whole.splits] == [(0, 0, 100), (1, 0, 45)]


def test_a_split_is_found_by_its_name_and_rows(tmp_path: Path):
    write_dataset(tmp_path / "a", [100, 45], row_group_size=20)
    write_dataset(tmp_path / "b", [60], row_group_size=7)
    index = _index([str(p) for p in sorted(tmp_path.glob("*/*.parquet"))], split_bytes=1)
    for number, split in enumerate(index.splits):
        name = index.files[split.file].name
        assert index.split_at(name, split.row_offset, split.row_length) == number
        assert index.split_at(name, split.row_offset, split.row_length + 1) is None
        assert index.split_at(name, split.row_offset + 1, split.row_length) is None
    assert index.split_at("no/such.parquet", 0, 20) is None
    assert index.split_at(index.files[0].name, 10**9, 20) is None


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


def test_fingerprint_names_content_not_the_copy(tmp_path: Path):
    write_dataset(tmp_path / "a", [30, 30], row_group_size=10)
    a, b = _index(tmp_path / "a"), _index(tmp_path / "a")
    assert [f.fingerprint for f in a.files] == [f.fingerprint for f in b.files]
    assert a.digest == b.digest
    # Another mtime, or a copy elsewhere: the same content, so the same fingerprints and names.
    path = tmp_path / "a" / "part-00001.parquet"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    shutil.copytree(tmp_path / "a", tmp_path / "copy" / "deeper", copy_function=shutil.copyfile)
    for again in (_index(tmp_path / "a"), _index(tmp_path / "copy")):
        assert [f.fingerprint for f in again.files] == [f.fingerprint for f in a.files]
        assert [f.name for f in again.files] == ["part-00000.parquet", "part-00001.parquet"]
        assert again.digest == a.digest
    assert _index(tmp_path / "copy").root == str(tmp_path / "copy" / "deeper")
    # Other values, same row counts: the footer's statistics and sizes differ.
    write_parquet(path, rows_table(100, 30), 10)
    changed = _index(tmp_path / "a")
    assert changed.files[0].fingerprint == a.files[0].fingerprint
    assert changed.files[1].fingerprint != a.files[1].fingerprint
    assert changed.digest != a.digest


def test_names_are_relative_to_the_deepest_common_directory(tmp_path: Path):
    for sub in ("x", "y/z"):
        write_dataset(tmp_path / "d" / sub, [10], row_group_size=10)
    spellings = [
        [str(tmp_path / "d")],
        [str(tmp_path / "d" / "x"), str(tmp_path / "d" / "y")],
        [str(tmp_path / "d" / "*" / "part-00000.parquet"), str(tmp_path / "d/y/z")],
    ]
    for paths in spellings:
        index = _index(paths)
        assert [f.name for f in index.files] == ["x/part-00000.parquet", "y/z/part-00000.parquet"]
        assert index.root == str(tmp_path / "d")
    single = _index([str(tmp_path / "d" / "y" / "z" / "part-00000.parquet")])
    assert [f.name for f in single.files] == ["part-00000.parquet"]


def test_a_footer_larger_than_the_tail_is_fetched_in_one_more_read(tmp_path: Path):
    path = tmp_path / "wide.parquet"
    wide = pa.table({f"column_{i:04d}": [i] for i in range(600)})
    write_parquet(path, wide, 1)
    size = path.stat().st_size
    footer = int.from_bytes(path.read_bytes()[-8:-4], "little")
    assert footer + 8 > TAIL
    reads: list[tuple[int, int]] = []
    source = pa.OSFile(str(path))

    class Recorder:  # a Python file that records every read
        at = 0

        def seek(self, offset: int) -> None:
            self.at = offset

        def read(self, n: int) -> bytes:
            reads.append((self.at, n))
            return bytes(source.read_at(n, self.at))

    tail = TailFile(Recorder(), size, get_format("parquet"))
    assert reads == [(size - TAIL, TAIL), (size - footer - 8, footer + 8 - TAIL)]
    meta = get_format("parquet").read_metadata(tail)
    assert len(reads) == 2  # pyarrow's footer reads were served from memory
    assert meta.schema.names == wide.column_names
    assert tail.footer == path.read_bytes()[-footer - 8 :]


def test_arrow_fingerprint_tracks_record_batches(tmp_path: Path):
    write_arrow(tmp_path / "a.arrow", rows_table(0, 40), 10)
    first = _index(str(tmp_path), fmt="arrow").files[0]
    shutil.copyfile(tmp_path / "a.arrow", tmp_path / "b.arrow")
    (tmp_path / "a.arrow").unlink()
    assert _index(str(tmp_path), fmt="arrow").files[0].fingerprint == first.fingerprint
    write_arrow(tmp_path / "b.arrow", rows_table(0, 40), 20)
    assert _index(str(tmp_path), fmt="arrow").files[0].fingerprint != first.fingerprint


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
    assert groups[0][0] == index.files[0].name == "f0000.parquet"
    assert groups[-1][1] == index.files[-1].name


def test_index_pickles_for_workers(tmp_path: Path):
    import pickle

    write_dataset(tmp_path, [30, 20, 10], row_group_size=10)
    index = _index(tmp_path, split_bytes=1)
    # Equal schemas are one object, pickled once (not once per file).
    assert len({id(f.metadata.schema) for f in index.files}) == 1
    again = pickle.loads(pickle.dumps(index))
    assert len({id(f.metadata.schema) for f in again.files}) == 1
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


_PART = st.text(alphabet="abc-_.0", min_size=1, max_size=4).filter(lambda p: p not in (".", ".."))


@given(
    layout=st.lists(
        st.lists(_PART, min_size=1, max_size=4), min_size=1, max_size=6, unique_by=tuple
    ),
    old=st.lists(_PART, max_size=3),
    new=st.lists(_PART, max_size=3),
)
def test_names_do_not_depend_on_where_the_files_are(
    layout: list[list[str]], old: list[str], new: list[str]
):
    """The same files below two roots get the same names; a name below its root is the path."""
    if any(a[: len(b)] == b and len(a) > len(b) for a in layout for b in layout):
        return  # a file cannot also be a directory
    names = []
    for prefix in (["", "bucket", *old], ["", "nvme", *new]):
        paths = ["/".join(prefix + parts) for parts in layout]
        root = _root(paths)
        names.append([p[len(root) :].lstrip("/") for p in paths])
        assert all(p == f"{root}/{n}" for p, n in zip(paths, names[-1], strict=True))
    assert names[0] == names[1]
