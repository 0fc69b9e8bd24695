"""The worker -> main-process hop: batches arrive whole, with the same values as in-process."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torch_dataloader_utils import StructuredDataset

ROWS = 900


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wide")
    for f in range(2):
        ids = np.arange(f * ROWS // 2, (f + 1) * ROWS // 2)
        table = pa.table(
            {
                "id": ids,
                "f16": ids.astype(np.float16),
                "b": ids % 3 == 0,
                "vec": pa.FixedSizeListArray.from_arrays(
                    pa.array(np.repeat(ids, 4).astype(np.float32)), 4
                ),
                "s": [f"s{i}" for i in ids.tolist()],
                "lst": pa.array([[i] * (i % 3) for i in ids.tolist()], pa.list_(pa.int64())),
            }
        )
        pq.write_table(table, root / f"{f}.parquet", row_group_size=25)
    return root


def _by_id(batches: list[dict]) -> dict[int, dict]:
    rows = {}
    for batch in batches:
        for r, i in enumerate(batch["id"][1]):
            assert i not in rows
            rows[i] = {k: (dtype, values[r]) for k, (dtype, values) in batch.items()}
    return rows


@pytest.mark.parametrize("output", ["torch", "numpy"])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_workers_deliver_the_same_values_as_the_main_process(wide_dir, output, num_workers):
    case = {"path": str(wide_dir), "batch_size": 16, "split_bytes": 1, "output": output}
    local = _by_id(_harness.run_epoch(case))
    remote_batches = _harness.run_epoch({**case, "num_workers": num_workers})
    assert all(len(b["id"][1]) <= 16 for b in remote_batches)
    remote = _by_id(remote_batches)
    assert sorted(remote) == list(range(ROWS))
    assert remote == local


def test_arrow_output_values_through_workers(wide_dir: Path):
    case = {"path": str(wide_dir), "batch_size": 16, "split_bytes": 1, "output": "arrow"}
    loader, _ = _harness.make_loader({**case, "num_workers": 2})
    batches = list(loader)
    assert all(isinstance(b, pa.RecordBatch) and b.num_rows <= 16 for b in batches)
    table = pa.Table.from_batches(batches).sort_by("id")
    expected = pq.read_table(wide_dir).sort_by("id")
    assert table.column("id").to_pylist() == list(range(ROWS))
    for name in ("f16", "b", "s", "lst"):
        assert table.column(name).to_pylist() == expected.column(name).to_pylist(), name
    assert table.column("vec").to_pylist() == expected.column("vec").to_pylist()


def test_batches_from_workers_are_owned_by_the_loop(wide_dir: Path):
    """Writing into a delivered batch must not change batches delivered later."""
    loader, _ = StructuredDataset.create_dataloader(
        str(wide_dir), batch_size=16, split_bytes=1, num_workers=2
    )
    kept = []
    for batch in loader:
        assert torch.equal(batch["vec"][:, 0], batch["id"].to(torch.float32))
        kept.append((batch["id"].clone(), batch["id"]))
        batch["id"].mul_(-1)  # scribble over what we were handed
        batch["vec"].zero_()
    for original, handed in kept:
        assert torch.equal(handed, -original)  # nobody overwrote it after we did
    assert sorted(int(i) for o, _ in kept for i in o) == list(range(ROWS))


def _as_tuple(batch: dict) -> tuple:
    return (batch["id"], batch["s"])


def _ragged(batch: dict) -> dict:
    """Columns whose layout changes from batch to batch."""
    first = int(batch["id"][0])
    return (
        {"id": batch["id"], "extra": torch.zeros(first % 3 + 1)}
        if first % 2
        else {"id": batch["id"]}
    )


def test_transforms_with_any_batch_type_cross_the_process_boundary(wide_dir: Path):
    for transform in (_as_tuple, _ragged):
        loader, _ = StructuredDataset.create_dataloader(
            str(wide_dir), batch_size=16, split_bytes=1, num_workers=2, transform=transform
        )
        batches = list(loader)
        ids = [int(i) for b in batches for i in (b[0] if isinstance(b, tuple) else b["id"])]
        assert sorted(ids) == list(range(ROWS))
        if transform is _as_tuple:
            assert all(b[1] == [f"s{int(i)}" for i in b[0]] for b in batches)
        else:
            for b in batches:
                first = int(b["id"][0])
                assert ("extra" in b) == bool(first % 2)
                if first % 2:
                    assert b["extra"].shape == (first % 3 + 1,)


@pytest.mark.parametrize("stop", ["end", "break"])
def test_shared_memory_goes_with_the_iteration_not_the_collector(wide_dir: Path, stop: str):
    """A loader's slots are freed once its iteration stops its workers, and a dropped loader is
    freed at once: not at the garbage collector's next full pass, which may come after a
    small /dev/shm (a container's 64 MiB) is full of earlier loaders' slots."""
    gc.disable()
    try:
        loader, _ = StructuredDataset.create_dataloader(
            str(wide_dir), format="parquet", batch_size=50, num_workers=2
        )
        batches = iter(loader)
        first = next(batches)
        slots = weakref.ref(loader._slots)
        if stop == "end":
            rows = len(first["id"]) + sum(len(b["id"]) for b in batches)
            assert rows == ROWS
        else:
            del batches  # the training loop breaks out
        del first
        assert slots() is None
        collected = weakref.ref(loader)
        del loader
        assert collected() is None
    finally:
        gc.enable()
