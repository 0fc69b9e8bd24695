"""Bad input never passes silently: clear errors naming the file, key or setting."""

from __future__ import annotations

import base64
import copy
import os
import zlib
from pathlib import Path

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _data import replace_parquet, rows_table, write_dataset, write_parquet

from torch_dataloader_utils import (
    CheckpointMismatchError,
    DataSourceError,
    InvalidStateError,
    SchemaMismatchError,
    StructuredDataset,
)
from torch_dataloader_utils._plan import epoch_order

# ---------------------------------------------------------------------------- files


def test_missing_path_and_empty_directory(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        StructuredDataset.create_dataloader(str(tmp_path / "does-not-exist"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        StructuredDataset.create_dataloader(str(tmp_path / "empty"))


def test_truncated_file_names_the_file(tmp_path: Path):
    write_dataset(tmp_path, [50, 50], row_group_size=10)
    path = tmp_path / "part-00001.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataSourceError, match=r"part-00001\.parquet") as info:
        StructuredDataset(str(tmp_path))
    assert isinstance(info.value, OSError)


def test_not_a_parquet_file_names_the_file(tmp_path: Path):
    write_dataset(tmp_path, [10], row_group_size=5)
    (tmp_path / "notes.parquet").write_text("hello, I am not parquet\n" * 10)
    with pytest.raises(DataSourceError, match=r"notes\.parquet as parquet"):
        StructuredDataset(str(tmp_path))


def test_corrupted_row_group_raises_naming_the_split(tmp_path: Path):
    """A readable footer over corrupted data: an error at read time, never garbage rows."""
    path = tmp_path / "a.parquet"
    write_parquet(path, rows_table(0, 200), 50, compression="zstd")
    column = pq.ParquetFile(path).metadata.row_group(2).column(1)  # x, third row group
    start, size = column.data_page_offset, column.total_compressed_size
    data = bytearray(path.read_bytes())
    data[start + 20 : start + size - 4] = b"\xff" * (size - 24)
    path.write_bytes(bytes(data))
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=50, split_bytes=1)
    delivered = []
    with pytest.raises(DataSourceError, match=r"a\.parquet rows \[100, 150\)"):
        for batch in loader:
            delivered.append(batch["id"].tolist())
    assert delivered == [list(range(0, 50)), list(range(50, 100))]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_file_replaced_after_indexing_names_the_file(tmp_path: Path, num_workers: int):
    write_dataset(tmp_path, [200, 200], row_group_size=20)
    loader, _ = StructuredDataset.create_dataloader(
        str(tmp_path), batch_size=50, split_bytes=1, num_workers=num_workers
    )
    replace_parquet(tmp_path / "part-00001.parquet", rows_table(1000, 150), 7)
    with pytest.raises(DataSourceError, match=r"part-00001\.parquet"):
        list(loader)


def test_schema_mismatch_names_both_files_and_the_field(tmp_path: Path):
    write_parquet(tmp_path / "a.parquet", rows_table(0, 10), 5)
    other = rows_table(10, 10).set_column(1, "x", pa.array([str(i) for i in range(10)]))
    write_parquet(tmp_path / "b.parquet", other, 5)
    with pytest.raises(SchemaMismatchError) as info:
        StructuredDataset(str(tmp_path))
    message = str(info.value)
    assert "a.parquet" in message and "b.parquet" in message
    assert "field 'x': double vs string" in message
    # A projection that leaves the differing column out reads fine.
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), columns=["id"], batch_size=30)
    assert [b["id"].tolist() for b in loader] == [list(range(20))]


def test_missing_column_names_file_and_column(tmp_path: Path):
    write_parquet(tmp_path / "a.parquet", rows_table(0, 10), 5)
    write_parquet(tmp_path / "b.parquet", rows_table(10, 10).drop_columns(["name"]), 5)
    with pytest.raises(SchemaMismatchError, match=r"b\.parquet.*field 'name'"):
        StructuredDataset(str(tmp_path))


# ---------------------------------------------------------------------------- states


@pytest.fixture
def mid_state(parquet_dir: Path, small_split: int):
    case = {"path": str(parquet_dir), "batch_size": 10, "split_bytes": small_split,
            "shuffle": True, "shuffle_seed": 4, "num_workers": 2}  # fmt: skip
    state, _ = _harness.checkpoint_after(case, 7)
    assert state["partial"], "the fixture needs a split in progress"
    return case, state


def _load(case, state):
    loader, _ = _harness.make_loader(case)
    loader.load_state_dict(state)
    return loader


def _with_done(state, bits: np.ndarray) -> dict:
    packed = base64.b64encode(zlib.compress(np.packbits(bits).tobytes())).decode()
    return {**state, "done": packed}


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.update(version=99), r"unknown state version 99"),
        (lambda s: s.pop("version"), r"unknown state version None"),
        (lambda s: s.pop("done"), r"state has no key 'done'"),
        (lambda s: s.pop("_num_workers"), r"state has no key '_num_workers'"),
        (lambda s: s.update(epoch="0"), r"state key 'epoch' must be int, got str"),
        (lambda s: s.update(epoch=True), r"state key 'epoch' must be int, got bool"),
        (lambda s: s.update(done="!!not base64!!"), r"state key 'done' is corrupted"),
        (lambda s: s.update(done="AAAA"), r"state key 'done' is corrupted"),
        (lambda s: s.update(done=s["done"][:-8] + "AAAAAA=="), r"state key 'done' is corrupted"),
        (lambda s: s["partial"].append([1, 2]), r"state key 'partial': entry \[1, 2\]"),
        (lambda s: s["partial"][0].__setitem__(4, [0, 0]), r"delivered rows out of range"),
        (lambda s: s.update(base={"done": ""}), r"state key 'base'"),
    ],
)
def test_corrupted_state_names_the_key(mid_state, edit, match):
    case, state = mid_state
    bad = copy.deepcopy(state)
    edit(bad)
    with pytest.raises(InvalidStateError, match=match):
        _load(case, bad)
    assert _harness.resume(case, state)  # the good state still loads


def test_bitmap_of_the_wrong_length_is_corrupted(mid_state):
    case, state = mid_state
    with pytest.raises(InvalidStateError, match=r"'done' is corrupted: expected \d+ split bits"):
        _load(case, _with_done(state, np.zeros(state["num_splits"] + 9, dtype=bool)))


def test_a_list_or_non_dict_is_not_a_state(mid_state):
    case, state = mid_state
    with pytest.raises((InvalidStateError, TypeError)):
        _load(case, "state")
    with pytest.raises(TypeError, match="elastic=True"):
        _load(case, [state])


def _mismatch(case, state, **changes) -> CheckpointMismatchError:
    with pytest.raises(CheckpointMismatchError) as info:
        _load({**case, **changes}, state)
    assert "Likely cause:" in str(info.value)
    assert isinstance(info.value, ValueError)
    return info.value


@pytest.mark.parametrize(
    ("field", "new"),
    [("shuffle_seed", 1), ("split_bytes", 10**6), ("shuffle", False), ("num_workers", 3)],
)
def test_changed_setting_is_named_with_both_values(mid_state, field, new):
    case, state = mid_state
    old = case[field]
    error = _mismatch(case, state, **{field: new})
    assert f"{field} changed: checkpoint={old!r}, current={new!r}" in str(error)
    assert (error.field, error.expected, error.found) == (field, old, new)
    name, offset, length = state["partial"][0][:3]  # a name below the dataset root
    assert error.split == f"{state['files']['root']}/{name} rows [{offset}, {offset + length})"
    assert error.split in str(error)


def test_num_workers_two_vs_three_message(mid_state):
    case, state = mid_state
    error = _mismatch(case, state, num_workers=3)
    assert "num_workers changed: checkpoint=2, current=3" in str(error)


def test_zero_and_one_workers_resume_into_each_other(parquet_dir: Path, small_split: int):
    case = {"path": str(parquet_dir), "batch_size": 10, "split_bytes": small_split,
            "shuffle": True, "num_workers": 0}  # fmt: skip
    full = _harness.run_epoch(case)
    state, _ = _harness.checkpoint_after(case, 5)
    assert _harness.resume({**case, "num_workers": 1}, state) == full[5:]


def test_world_size_and_rank_changes(parquet_dir: Path, small_split: int):
    case = {"path": str(parquet_dir), "batch_size": 10, "split_bytes": small_split,
            "rank": 1, "world_size": 2}  # fmt: skip
    state, _ = _harness.checkpoint_after(case, 4)
    error = _mismatch(case, state, world_size=3)
    assert "world_size changed: checkpoint=2, current=3" in str(error)
    assert (error.field, error.expected, error.found) == ("world_size", 2, 3)
    error = _mismatch(case, state, rank=0)
    assert "rank changed: checkpoint=1, current=0" in str(error)
    assert (error.field, error.expected, error.found) == ("rank", 1, 0)
    assert "elastic=True" in str(error)


def test_changed_file_content_is_drift(tmp_path: Path):
    root = tmp_path / "data"
    write_dataset(root, [100, 100], row_group_size=10)
    case = {"path": str(root), "batch_size": 10, "split_bytes": 1, "shuffle": True}
    state, _ = _harness.checkpoint_after(case, 5)
    # Rewrite one file: different values, same rows and row groups.
    table = rows_table(100, 100).set_column(1, "x", pa.array([-1.0] * 100))
    replace_parquet(root / "part-00001.parquet", table, 10)
    error = _mismatch(case, state)
    assert error.field == "files"
    assert "part-00001.parquet" in str(error)
    assert "Likely cause: files changed" in str(error)
    assert error.expected != error.found


def test_renamed_file_is_drift(tmp_path: Path):
    root = tmp_path / "data"
    write_dataset(root, [100, 100], row_group_size=10)
    case = {"path": str(root), "batch_size": 10, "split_bytes": 1}
    state, _ = _harness.checkpoint_after(case, 5)
    os.rename(root / "part-00001.parquet", root / "part-00009.parquet")
    error = _mismatch(case, state)
    assert error.field == "files"
    assert "part-00001.parquet" in str(error) and "part-00009.parquet" in str(error)


def test_added_file_is_drift(tmp_path: Path):
    root = tmp_path / "data"
    write_dataset(root, [100], row_group_size=10)
    case = {"path": str(root), "batch_size": 10, "split_bytes": 1}
    state, _ = _harness.checkpoint_after(case, 5)
    write_parquet(root / "part-00001.parquet", rows_table(100, 10), 10)
    error = _mismatch(case, state)
    assert error.field == "files" and "Likely cause: files changed (added)" in str(error)
    (root / "part-00001.parquet").unlink()
    (root / "part-00000.parquet").rename(root / "part-00002.parquet")
    assert "Likely cause: files changed (renamed)" in str(_mismatch(case, state))


def test_removed_file_is_drift(tmp_path: Path):
    root = tmp_path / "data"
    write_dataset(root, [100, 100], row_group_size=10)
    case = {"path": str(root), "batch_size": 10, "split_bytes": 1}
    state, _ = _harness.checkpoint_after(case, 5)
    (root / "part-00001.parquet").unlink()
    assert "Likely cause: files changed (removed)" in str(_mismatch(case, state))


def test_edited_progress_out_of_order_is_refused(mid_state):
    """A done bitmap that skips a worker's first pieces is refused, never trusted."""
    case, state = mid_state
    order = epoch_order(state["num_splits"], case["shuffle_seed"], 0, True)
    bits = np.zeros(state["num_splits"], dtype=bool)
    bits[int(order[-1])] = True  # the last piece dealt done, nothing before it
    with pytest.raises(CheckpointMismatchError, match="out of order") as info:
        loader = _load(case, {**_with_done(state, bits), "partial": []})
        _harness.take(loader)
    assert "Likely cause:" in str(info.value)


# ---------------------------------------------------------------------------- errors mid-epoch


def _fail_on_333(batch):
    if 333 in batch["id"].tolist():
        raise RuntimeError("transform failed on row 333")
    return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_loses_and_repeats_nothing(parquet_dir, small_split, num_workers):
    """After a failing batch, the state covers exactly what was handed out: a resume (with
    the bug fixed) continues with the failed batch."""
    case = {"path": str(parquet_dir), "batch_size": 10, "split_bytes": small_split,
            "shuffle": True, "num_workers": num_workers}  # fmt: skip
    full = _harness.run_epoch(case)
    failing = next(k for k, b in enumerate(full) if 333 in b["id"][1])
    loader, _ = _harness.make_loader({**case, "transform": _fail_on_333})
    got = []
    with pytest.raises(RuntimeError, match="row 333"):
        for batch in loader:
            got.append(_harness.canonical(batch))
    state = _harness.json_round_trip(loader.state_dict())
    assert len(got) <= failing and got == full[: len(got)]
    assert _harness.resume(case, state) == full[len(got) :]
