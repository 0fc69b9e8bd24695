"""Exact resume: checkpoint after batch k -> new loader (or process) -> batches k+1.. exactly."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import _harness
import pytest
from _data import write_dataset
from conftest import TOTAL_ROWS
from hypothesis import given, settings
from hypothesis import strategies as st


def _case(parquet_dir: Path, split: int, **kwargs):
    return {"path": str(parquet_dir), "batch_size": 10, "split_bytes": split, **kwargs}


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_at_start_middle_and_end(parquet_dir, small_split, num_workers, shuffle):
    case = _case(parquet_dir, small_split, num_workers=num_workers, shuffle=shuffle,
                 shuffle_seed=3)  # fmt: skip
    full = _harness.run_epoch(case)
    assert sorted(_harness.ids(full)) == list(range(TOTAL_ROWS))
    for k in (0, 1, len(full) // 2 + 1, len(full) - 1, len(full)):
        _harness.assert_resume_exact(case, k, full=full)


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_checkpoint_at_the_end_resumes_empty_then_next_epoch(
    parquet_dir, small_split, num_workers, drop_last
):
    case = _case(parquet_dir, small_split, num_workers=num_workers, shuffle=True,
                 drop_last=drop_last, batch_size=7)  # fmt: skip
    full = _harness.run_epoch(case, 0)
    state, _ = _harness.checkpoint_after(case, len(full))
    assert state["epoch"] == 0
    loader, dataset = _harness.make_loader(case)
    loader.load_state_dict(state)
    assert _harness.take(loader) == []
    dataset.set_epoch(1)
    assert _harness.take(loader) == _harness.run_epoch(case, 1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_in_epoch_two(parquet_dir, small_split, num_workers):
    case = _case(parquet_dir, small_split, num_workers=num_workers, shuffle=True)
    full = _harness.run_epoch(case, 2)
    assert full != _harness.run_epoch(case, 0)
    state = _harness.assert_resume_exact(case, 17, epoch=2, full=full)
    assert state["epoch"] == 2


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_resume_from_a_resume(parquet_dir, small_split, num_workers):
    case = _case(parquet_dir, small_split, num_workers=num_workers, shuffle=True)
    full = _harness.run_epoch(case)
    first, got1 = _harness.checkpoint_after(case, 9)
    second, got2 = _harness.checkpoint_after(case, 13, state=first)
    assert got1 + got2 == full[:22]
    third, got3 = _harness.checkpoint_after(case, 0, state=second)
    assert got3 == [] and third == second
    assert _harness.resume(case, second) == full[22:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_in_a_new_process(parquet_dir, small_split, num_workers, tmp_path):
    case = _case(parquet_dir, small_split, num_workers=num_workers, shuffle=True)
    full = _harness.run_epoch(case)
    state, _ = _harness.checkpoint_after(case, 23)
    assert _harness.resume_in_subprocess(case, state, tmp_path) == full[23:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_filtering_transform_resumes_exactly(parquet_dir, small_split, num_workers, tmp_path):
    case = _case(parquet_dir, small_split, num_workers=num_workers, shuffle=True,
                 transform="keep_even")  # fmt: skip
    full = _harness.run_epoch(case)
    assert sorted(_harness.ids(full)) == list(range(0, TOTAL_ROWS, 2))
    assert any(len(b["id"][1]) < 10 for b in full[:-2])  # the filter really shrank batches
    for k in (3, len(full) // 2):
        _harness.assert_resume_exact(case, k, full=full)
    state, _ = _harness.checkpoint_after(case, 8)
    assert _harness.resume_in_subprocess(case, state, tmp_path) == full[8:]


@pytest.mark.parametrize("output", ["numpy", "arrow"])
def test_resume_other_outputs(parquet_dir, small_split, output):
    case = _case(parquet_dir, small_split, num_workers=2, shuffle=True, output=output)
    _harness.assert_resume_exact(case, 12)


def test_resume_with_drop_last_and_projection(parquet_dir, small_split):
    case = _case(parquet_dir, small_split, num_workers=2, shuffle=True, drop_last=True,
                 batch_size=7, columns=["id", "name"])  # fmt: skip
    full = _harness.run_epoch(case)
    assert all(list(b) == ["id", "name"] for b in full)
    _harness.assert_resume_exact(case, 20, full=full)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_per_rank(parquet_dir, small_split, num_workers):
    seen: list[int] = []
    for rank in range(2):
        # even_batches=False: every row of the epoch, ranks of different lengths.
        case = _case(parquet_dir, small_split, num_workers=num_workers, shuffle=True, rank=rank,
                     world_size=2, even_batches=False)  # fmt: skip
        full = _harness.run_epoch(case)
        state = _harness.assert_resume_exact(case, len(full) // 3, full=full)
        assert (state["_rank"], state["_world_size"]) == (rank, 2)
        seen += _harness.ids(full)
    assert sorted(seen) == list(range(TOTAL_ROWS))  # ranks are disjoint and complete


def test_resume_per_rank_with_even_batches(parquet_dir, small_split):
    lengths = []
    for rank in range(2):
        case = _case(parquet_dir, small_split, num_workers=2, shuffle=True, rank=rank,
                     world_size=2)  # fmt: skip
        full = _harness.run_epoch(case)
        lengths.append(len(full))
        _harness.assert_resume_exact(case, len(full) // 2, full=full)
    assert lengths[0] == lengths[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_after_load_is_the_loaded_state(parquet_dir, small_split, num_workers):
    case = _case(parquet_dir, small_split, num_workers=num_workers, shuffle=True)
    state, _ = _harness.checkpoint_after(case, 9)
    loader, dataset = _harness.make_loader(case)
    loader.load_state_dict(state)
    assert _harness.json_round_trip(loader.state_dict()) == state
    it = iter(loader)  # workers started, nothing handed out yet
    assert _harness.json_round_trip(dataset.state_dict()) == state
    del it


def test_batch_size_one_and_batch_larger_than_the_dataset(parquet_dir, small_split):
    tiny = _case(parquet_dir, small_split, batch_size=1, shuffle=True)
    full = _harness.run_epoch(tiny)
    assert len(full) == TOTAL_ROWS
    _harness.assert_resume_exact(tiny, 333, full=full)
    huge = _case(parquet_dir, small_split, batch_size=10 * TOTAL_ROWS, shuffle=True)
    full = _harness.run_epoch(huge)
    assert len(full) == 1
    _harness.assert_resume_exact(huge, 1, full=full)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 0), (0, 2)])
def test_elastic_resume_with_other_num_workers(parquet_dir, small_split, before, after):
    """elastic=True re-deals the rest of the epoch to the new workers: every row once; a
    checkpoint taken after the elastic resume resumes exactly."""
    from torch_dataloader_utils import CheckpointMismatchError

    case = _case(parquet_dir, small_split, num_workers=before, shuffle=True, batch_size=7)
    state, first = _harness.checkpoint_after(case, 23)
    moved = {**case, "num_workers": after}
    loader, _ = _harness.make_loader(moved)
    loader.load_state_dict([state], elastic=True)
    rest = _harness.take(loader)
    delivered = _harness.ids(first) + _harness.ids(rest)
    assert sorted(delivered) == list(range(TOTAL_ROWS))

    loader, _ = _harness.make_loader(moved)
    loader.load_state_dict([state], elastic=True)
    it = iter(loader)
    middle = [_harness.canonical(next(it)) for _ in range(11)]
    again = _harness.json_round_trip(loader.state_dict())
    del it
    assert middle == rest[:11]
    assert again["generations"]
    assert _harness.resume(moved, again) == rest[11:]

    loader, _ = _harness.make_loader({**moved, "shuffle_seed": 99})
    with pytest.raises(CheckpointMismatchError, match="shuffle_seed changed"):
        loader.load_state_dict([state], elastic=True)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_resume_rereads_at_most_one_unit(tmp_path, monkeypatch, fmt):
    """O(1) resume: completed splits are not read; the split in progress is re-entered at the
    row group / record batch holding its next row."""
    write_dataset(tmp_path, [230, 170, 300], row_group_size=16, format=fmt)
    case = {
        "path": str(tmp_path),
        "format": fmt,
        "batch_size": 10,
        "split_bytes": 10**9,
        "shuffle": False,
    }  # one split per file: the split in progress is mid-file
    full = _harness.run_epoch(case)
    state, _ = _harness.checkpoint_after(case, 45)  # row 450: file 2, row 50 (unit 3)
    (entry,) = state["streams"]  # 450 rows handed out; next: row 50 of the third file
    assert entry[:3] == [450, 0, 700] and entry[4:6] == [0, 300] and entry[7] == 50

    read = _harness.count_decoded_rows(monkeypatch, fmt)  # (first unit, rows) per read
    assert _harness.resume(case, state) == full[45:]
    assert read[0][0] == 3  # unit 3 holds row 50 of the file
    assert sum(rows for _, rows in read) - (700 - 450) < 16  # re-read less than one unit


# ---------------------------------------------------------------------------- property


@st.composite
def shapes(draw):
    return {
        "rows": draw(st.lists(st.integers(1, 120), min_size=1, max_size=3)),
        "row_group": draw(st.integers(1, 40)),
        "batch_size": draw(st.integers(1, 50)),
        "num_workers": draw(st.integers(0, 3)),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
        "split_bytes": draw(st.sampled_from([1, 600, 3000, 2**30])),
        "drop_last": draw(st.booleans()),
        "point": draw(st.floats(0, 1)),
        "world": draw(st.sampled_from([(0, 1), (0, 1), (0, 2), (1, 2), (2, 3)])),
        "even_batches": draw(st.booleans()),
        "format": draw(st.sampled_from(["parquet", "parquet", "arrow"])),
    }


@settings(max_examples=20, deadline=None)
@given(shapes())
def test_property_resume_is_the_uninterrupted_continuation(shape):
    root = Path(tempfile.mkdtemp(prefix="tdu-prop-"))
    try:
        write_dataset(root, shape["rows"], row_group_size=shape["row_group"],
                      format=shape["format"])  # fmt: skip
        case = {
            "path": str(root), "format": shape["format"], "batch_size": shape["batch_size"],
            "num_workers": shape["num_workers"], "shuffle": shape["shuffle"],
            "shuffle_seed": shape["seed"], "split_bytes": shape["split_bytes"],
            "drop_last": shape["drop_last"], "rank": shape["world"][0],
            "world_size": shape["world"][1], "even_batches": shape["even_batches"],
        }  # fmt: skip
        full = _harness.run_epoch(case)
        k = round(shape["point"] * len(full))
        state, first = _harness.checkpoint_after(case, k)
        rest = _harness.resume(case, state)
        assert first + rest == full
        delivered = _harness.ids(first) + _harness.ids(rest)
        assert len(delivered) == len(set(delivered))  # no row twice
        if not shape["drop_last"] and case["world_size"] == 1:
            assert sorted(delivered) == list(range(sum(shape["rows"])))  # none lost
    finally:
        shutil.rmtree(root)
