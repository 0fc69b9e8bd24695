"""The checkpoint state: schema, builtin types, content addressing, round trips and size."""

from __future__ import annotations

import io
import json
import pickle
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pytest
import torch
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils._formats import FileMetadata
from torch_dataloader_utils._index import DatasetIndex, IndexedFile
from torch_dataloader_utils._plan import Consumed, EpochPlan, Split, epoch_order
from torch_dataloader_utils._state import (
    STATE_VERSION,
    Progress,
    Settings,
    decode_consumed,
    encode,
    positions_of,
)

KEYS = {
    "version", "epoch", "_num_workers", "_shuffle_seed", "_shuffle", "_split_bytes", "_rank",
    "_world_size", "_format", "_even_batches", "files", "num_splits", "done", "partial", "base",
    "cursor",
}  # fmt: skip


def _builtin_only(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _builtin_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_builtin_only(v) for v in value)
    return value is None or type(value) in (int, float, str, bool)


def test_state_schema_mid_epoch(parquet_dir: Path, small_split: int):
    loader, dataset = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=10, split_bytes=small_split, num_workers=2, shuffle=True,
        shuffle_seed=5,
    )  # fmt: skip
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    del it
    assert set(state) == KEYS
    assert _builtin_only(state)
    assert state["version"] == STATE_VERSION
    assert (state["epoch"], state["_num_workers"], state["_shuffle_seed"]) == (0, 2, 5)
    assert (state["_shuffle"], state["_split_bytes"]) == (True, small_split)
    assert (state["_rank"], state["_world_size"], state["_format"]) == (0, 1, "parquet")
    assert state["files"]["count"] == 3
    assert state["num_splits"] == len(dataset._index.splits)
    assert state["base"] is None
    assert state["cursor"] == 1  # 7 batches over 2 workers: worker 1 is next
    # Partial entries name the split by content: path, row range, fingerprint, rows delivered.
    for path, offset, length, fingerprint, delivered in state["partial"]:
        assert path.startswith(str(parquet_dir)) and path.endswith(".parquet")
        assert 0 < delivered < length and offset >= 0
        assert fingerprint in {f.fingerprint for f in dataset._index.files}
    assert json.loads(json.dumps(state)) == state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


def test_state_before_iteration_and_after_set_epoch(parquet_dir: Path):
    loader, dataset = StructuredDataset.create_dataloader(str(parquet_dir), batch_size=10)
    state = dataset.state_dict()
    assert state["epoch"] == 0 and state["partial"] == [] and state["cursor"] == 0
    dataset.set_epoch(3)
    assert loader.state_dict()["epoch"] == 3


def test_state_never_holds_credentials(tmp_path: Path):
    local = write_dataset(tmp_path, [20], row_group_size=5)
    root = f"/tdu-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{root}/a.parquet", Path(local[0]).read_bytes())
    try:
        loader, _ = StructuredDataset.create_dataloader(
            f"memory://{root}", batch_size=3, storage_options={"secret_token": "hunter2-secret"}
        )
        it = iter(loader)
        next(it)
        text = json.dumps(loader.state_dict())
        del it
        assert "hunter2" not in text and "secret_token" not in text
    finally:
        fs.rm(root, recursive=True)


# ---------------------------------------------------------------------------- without files


def _fake_index(num_files: int, splits_per_file: int, rows: int = 20) -> DatasetIndex:
    schema = pa.schema([("id", pa.int64())])
    meta = FileMetadata(schema, (rows,) * splits_per_file, (100,) * splits_per_file)
    files = tuple(
        IndexedFile(f"/data/f{i:05d}.parquet", f"/data/f{i:05d}.parquet", f"fp{i}", meta)
        for i in range(num_files)
    )
    splits = tuple(
        Split(f, range(u, u + 1), u * rows, rows)
        for f in range(num_files)
        for u in range(splits_per_file)
    )
    return DatasetIndex(files, splits, schema)


def _half_delivered(index: DatasetIndex, workers: int, shuffle: bool = True):
    n = len(index.splits)
    settings = Settings("parquet", 1, shuffle, 0, 0, 1, workers)
    plan = EpochPlan(0, epoch_order(n, 0, 0, shuffle), Consumed.nothing(n))
    positions = {
        w: (len(plan.stream(settings.world(w))) // 2, 3 + w) for w in range(max(1, workers))
    }
    return Progress(plan, settings, positions, cursor=3), settings


def test_state_size_100k_splits_half_delivered_8_workers():
    index = _fake_index(num_files=1000, splits_per_file=100)
    assert len(index.splits) == 100_000
    progress, settings = _half_delivered(index, workers=8)
    delivered = progress.delivered()
    assert int(delivered.done.sum()) == 50_000 and len(delivered.partial) == 8
    state = encode(0, delivered, progress.plan.base, progress.cursor, index, settings)
    size = len(pickle.dumps(state))
    assert size <= 64 * 1024, f"state is {size} bytes pickled"
    # ... and it decodes back to the same progress.
    done, base = decode_consumed(json.loads(json.dumps(state)), index, settings)
    assert np.array_equal(done.done, delivered.done)
    assert done.partial == delivered.partial
    assert not base.done.any()
    assert positions_of(progress.plan, done, settings, range(8), index) == progress.positions


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_encode_decode_round_trip(workers: int, shuffle: bool):
    index = _fake_index(num_files=7, splits_per_file=13)
    progress, settings = _half_delivered(index, workers, shuffle)
    delivered = progress.delivered()
    state = encode(2, delivered, progress.plan.base, progress.cursor, index, settings)
    assert state["epoch"] == 2 and state["cursor"] == 3 and state["_num_workers"] == workers
    done, _ = decode_consumed(state, index, settings)
    assert np.array_equal(done.done, delivered.done) and done.partial == delivered.partial
    assert positions_of(progress.plan, done, settings, range(max(1, workers)), index) == (
        progress.positions
    )


def test_state_with_base_round_trips():
    index = _fake_index(num_files=2, splits_per_file=8)
    base_done = np.zeros(16, dtype=bool)
    base_done[[1, 2, 9]] = True
    base = Consumed(base_done, {4: 5})
    settings = Settings("parquet", 1, False, 0, 0, 1, 0)
    state = encode(0, base, base, 0, index, settings)
    assert state["base"] is not None and state["base"]["partial"] == [
        ["/data/f00000.parquet", 80, 20, "fp0", 5]
    ]
    done, got_base = decode_consumed(state, index, settings)
    assert np.array_equal(got_base.done, base_done) and got_base.partial == {4: 5}
    assert done.partial == {4: 5}


def test_bitmap_is_compact():
    index = _fake_index(num_files=10, splits_per_file=1000)
    settings = Settings("parquet", 1, False, 0, 0, 1, 0)
    done = np.zeros(10_000, dtype=bool)
    done[:5000] = True  # without shuffle a half-done epoch is one run: compresses to nothing
    state = encode(0, Consumed(done, {}), Consumed.nothing(10_000), 0, index, settings)
    assert len(state["done"]) < 100
