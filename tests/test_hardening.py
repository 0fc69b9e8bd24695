"""Regressions of issue 17 (review and black-box tests): each test failed before its fix."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from _data import ids_of, write_dataset

from torch_dataloader_utils import StructuredDataset


@pytest.fixture(scope="module")
def two_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """110 rows (ids 0..109) in two files of 50 and 60 rows, row groups of 10."""
    root = tmp_path_factory.mktemp("two_files")
    write_dataset(root, [50, 60], row_group_size=10)
    return root


# ----------------------------------------------------------------- 1: persistent workers


@pytest.mark.parametrize("how", ["del", "cycle"])
def test_an_older_iterator_closed_late_does_not_end_the_running_epoch(two_files: Path, how: str):
    """Closing an older iterator after a newer one began bumped the generation of the slots
    the newer one owns: ``LostBatchesError: DataLoader worker(s) [0, 1] stopped before ...``."""
    loader, dataset = StructuredDataset.create_dataloader(
        str(two_files), batch_size=8, num_workers=2, persistent_workers=True
    )
    old = iter(loader)
    next(old)
    new = iter(loader)
    got = ids_of(next(new))
    if how == "cycle":
        cycle: list[object] = [old]
        cycle.append(cycle)
        del cycle
    del old
    gc.collect()
    got += [i for batch in new for i in ids_of(batch)]
    assert sorted(got) == list(range(110))
    assert dataset.state_dict()["epoch"] == 0
    again = [i for batch in loader for i in ids_of(batch)]  # the same workers serve on
    assert sorted(again) == list(range(110))
