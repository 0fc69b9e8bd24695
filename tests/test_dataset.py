"""StructuredDataset: exact batches, projection, transforms, epochs, every row exactly once."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import _harness
import pytest
import torch
from _data import ids_of
from conftest import TOTAL_ROWS

from torch_dataloader_utils import StructuredDataset


def _case(parquet_dir: Path, split: int, **kwargs):
    return {"path": str(parquet_dir), "batch_size": 10, "split_bytes": split, **kwargs}


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_exactly_once(parquet_dir: Path, small_split: int, num_workers, shuffle):
    case = _case(parquet_dir, small_split, batch_size=9, num_workers=num_workers,
                 shuffle=shuffle)  # fmt: skip
    loader, dataset = _harness.make_loader(case)
    batches = _harness.take(loader)
    got = _harness.ids(batches)
    assert sorted(got) == list(range(TOTAL_ROWS))
    assert len(batches) == len(dataset) == len(loader)
    sizes = [len(b["id"][1]) for b in batches]
    assert all(0 < s <= 9 for s in sizes)
    assert sum(s != 9 for s in sizes) <= max(1, num_workers)  # the last of each worker
    if not shuffle and num_workers <= 1:
        assert got == list(range(TOTAL_ROWS))
    for batch in batches:  # values follow the id
        assert batch["x"][1] == [i * 0.5 for i in batch["id"][1]]
        assert batch["label"][1] == [i % 7 for i in batch["id"][1]]
        assert batch["name"][1] == [f"r{i}" for i in batch["id"][1]]


def test_batches_span_splits_and_only_the_last_is_short(parquet_dir: Path):
    # split_bytes=1: every 16-row row group is a split; batches of 50 must span several.
    loader, dataset = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=50, split_bytes=1
    )
    sizes = [len(ids_of(b)) for b in loader]
    assert sizes == [50] * (TOTAL_ROWS // 50) + ([TOTAL_ROWS % 50] if TOTAL_ROWS % 50 else [])
    assert len(dataset) == len(sizes)


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_drop_last(parquet_dir: Path, small_split: int, num_workers: int):
    case = _case(parquet_dir, small_split, batch_size=7, drop_last=True, num_workers=num_workers,
                 shuffle=True)  # fmt: skip
    loader, dataset = _harness.make_loader(case)
    batches = _harness.take(loader)
    assert all(len(b["id"][1]) == 7 for b in batches)
    assert len(batches) == len(dataset) == len(loader)
    got = _harness.ids(batches)
    assert len(set(got)) == len(got)
    assert TOTAL_ROWS - len(got) < 7 * max(1, num_workers)


def test_columns_projection(parquet_dir: Path, small_split: int):
    loader, _ = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=100, columns=["name", "id"], split_bytes=small_split
    )
    batches = list(loader)
    assert all(list(b) == ["name", "id"] for b in batches)
    assert sorted(i for b in batches for i in ids_of(b)) == list(range(TOTAL_ROWS))
    with pytest.raises(TypeError, match="list of names"):
        StructuredDataset(str(parquet_dir), columns="id")


def test_transform_runs_on_every_batch(parquet_dir: Path, small_split: int):
    case = _case(parquet_dir, small_split, transform="add_doubled", num_workers=2)
    batches = _harness.run_epoch(case)
    for batch in batches:
        assert batch["doubled"][1] == [2 * i for i in batch["id"][1]]
    assert sorted(_harness.ids(batches)) == list(range(TOTAL_ROWS))


def test_filtering_transform_delivers_the_kept_rows(parquet_dir: Path, small_split: int):
    case = _case(parquet_dir, small_split, transform="keep_even", shuffle=True, num_workers=2)
    assert sorted(_harness.ids(_harness.run_epoch(case))) == list(range(0, TOTAL_ROWS, 2))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_changes_the_order(parquet_dir: Path, small_split: int, num_workers: int):
    case = _case(parquet_dir, small_split, shuffle=True, num_workers=num_workers)
    e0, e1, e0_again = (_harness.ids(_harness.run_epoch(case, e)) for e in (0, 1, 0))
    assert e0 == e0_again
    assert e0 != e1
    assert sorted(e0) == sorted(e1) == list(range(TOTAL_ROWS))
    seed1 = _harness.ids(_harness.run_epoch({**case, "shuffle_seed": 1}, 0))
    assert seed1 != e0


def test_epochs_on_one_loader(parquet_dir: Path, small_split: int):
    loader, dataset = _harness.make_loader(_case(parquet_dir, small_split, shuffle=True))
    first = _harness.ids(_harness.take(loader))
    again = _harness.ids(_harness.take(loader))
    assert first == again  # same epoch re-iterated: the same order
    dataset.set_epoch(1)
    assert dataset.epoch == 1
    assert _harness.ids(_harness.take(loader)) == _harness.ids(
        _harness.run_epoch(_case(parquet_dir, small_split, shuffle=True), 1)
    )


def test_set_epoch_after_load_state_dict_warns_and_restarts(parquet_dir: Path, small_split: int):
    case = _case(parquet_dir, small_split, shuffle=True)
    full = _harness.run_epoch(case)
    state, _ = _harness.checkpoint_after(case, 5)
    loader, dataset = _harness.make_loader(case)
    loader.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"set_epoch\(0\) after load_state_dict discards"):
        dataset.set_epoch(0)
    assert _harness.take(loader) == full
    # The next epoch after a resume is not a discard: no warning.
    loader.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataset.set_epoch(1)


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_plain_dataloader_yields_every_row_once(parquet_dir, small_split, num_workers):
    dataset = StructuredDataset(str(parquet_dir), batch_size=11, split_bytes=small_split,
                                shuffle=True)  # fmt: skip
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers)
    counts = Counter(i for batch in loader for i in ids_of(batch))
    assert sorted(counts) == list(range(TOTAL_ROWS))
    assert set(counts.values()) == {1}


def test_batches_larger_than_a_read_chunk(tmp_path: Path):
    from _data import write_dataset

    write_dataset(tmp_path, [20_000, 20_000], row_group_size=3000)
    case = {"path": str(tmp_path), "batch_size": 17_000, "split_bytes": 1, "shuffle": True,
            "num_workers": 2}  # fmt: skip
    full = _harness.run_epoch(case)
    sizes = sorted(len(b["id"][1]) for b in full)
    assert sizes[2:] == [17_000, 17_000] and sum(sizes) == 40_000  # one short batch per worker
    assert sorted(_harness.ids(full)) == list(range(40_000))
    _harness.assert_resume_exact(case, 1, full=full)


def test_checkpoint_iterating_the_dataset_itself(parquet_dir: Path, small_split: int):
    """No loader: the dataset's own iterator records what it yielded."""
    dataset = StructuredDataset(str(parquet_dir), batch_size=10, split_bytes=small_split,
                                shuffle=True)  # fmt: skip
    full = [ids_of(b) for b in dataset]
    dataset = StructuredDataset(str(parquet_dir), batch_size=10, split_bytes=small_split,
                                shuffle=True)  # fmt: skip
    it = iter(dataset)
    first = [ids_of(next(it)) for _ in range(13)]
    state = _harness.json_round_trip(dataset.state_dict())
    del it
    again = StructuredDataset(str(parquet_dir), batch_size=10, split_bytes=small_split,
                              shuffle=True)  # fmt: skip
    again.load_state_dict(state)
    assert first + [ids_of(b) for b in again] == full


def test_invalid_options(parquet_dir: Path):
    for kwargs, match in [
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"split_bytes": -1}, "split_bytes must be a positive int"),
        ({"columns": []}, "non-empty list"),
    ]:
        with pytest.raises(ValueError, match=match):
            StructuredDataset(str(parquet_dir), **kwargs)
    with pytest.raises(TypeError, match="transform must be callable"):
        StructuredDataset(str(parquet_dir), transform=3)
    with pytest.raises(TypeError, match="shuffle_seed"):
        StructuredDataset(str(parquet_dir), shuffle_seed="1")
    with pytest.raises(ValueError, match="rank"):
        StructuredDataset(str(parquet_dir), rank=2, world_size=2)
