"""The checkpoint state: schema, builtin types, content addressing, round trips and size."""

from __future__ import annotations

import base64
import io
import json
import pickle
import uuid
import zlib
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pytest
import torch
from _data import write_dataset
from hypothesis import given
from hypothesis import strategies as st

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils._config import DatasetConfig
from torch_dataloader_utils._epoch import Epochs, Progress, Start
from torch_dataloader_utils._errors import CheckpointMismatchError, InvalidStateError
from torch_dataloader_utils._formats import FileMetadata
from torch_dataloader_utils._index import DatasetIndex, IndexedFile
from torch_dataloader_utils._plan import Consumed, Split
from torch_dataloader_utils._state import STATE_VERSION, Settings, decode, encode

KEYS = {
    "version", "epoch", "_num_workers", "_shuffle_seed", "_shuffle", "_split_bytes", "_rank",
    "_world_size", "_format", "_even_batches", "_shuffle_window", "files", "num_splits", "done",
    "partial", "base", "cursor", "_packing", "tokens",
}  # fmt: skip


def _builtin_only(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _builtin_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_builtin_only(v) for v in value)
    return value is None or type(value) in (int, float, str, bool)


def _assert_delivered_bounds(bounds: list[int], length: int) -> None:
    """``[lo, hi, lo, hi, ...]``: sorted, disjoint, not touching, within, not all rows."""
    assert bounds and len(bounds) % 2 == 0, bounds
    assert all(type(v) is int for v in bounds)
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), bounds
    assert bounds[0] >= 0 and bounds[-1] <= length
    assert bounds != [0, length]


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
    assert state["version"] == STATE_VERSION == 3
    assert state["_packing"] is None and state["tokens"] == []  # no token packing
    assert (state["epoch"], state["_num_workers"], state["_shuffle_seed"]) == (0, 2, 5)
    assert (state["_shuffle"], state["_split_bytes"]) == (True, small_split)
    assert (state["_rank"], state["_world_size"], state["_format"]) == (0, 1, "parquet")
    assert state["_shuffle_window"] == 32  # the default window
    assert state["_even_batches"] is False
    assert state["files"]["count"] == 3
    assert state["files"]["root"] == str(parquet_dir)  # names are relative to it
    assert state["num_splits"] == len(dataset._index.splits)
    assert state["base"] is None
    assert state["cursor"] == 1  # 7 batches over 2 workers: worker 1 is next
    # Partial entries name the split by content: name, row range, fingerprint, and the rows
    # delivered as [lo, hi, ...] relative to row_offset. With shuffle, a window of splits is
    # open per worker: many partial splits, 70 rows delivered in all.
    assert state["partial"]
    delivered = 0
    for path, offset, length, fingerprint, bounds in state["partial"]:
        assert (parquet_dir / path).is_file() and path.endswith(".parquet")
        assert offset >= 0 and length > 0
        _assert_delivered_bounds(bounds, length)
        assert fingerprint in {f.fingerprint for f in dataset._index.files}
        delivered += sum(b - a for a, b in zip(bounds[::2], bounds[1::2], strict=True))
    assert delivered == 70 - sum(
        s.row_length for s, d in zip(dataset._index.splits, _done_bits(state), strict=True) if d
    )
    assert json.loads(json.dumps(state)) == state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


def _done_bits(state: dict) -> list[bool]:
    raw = zlib.decompress(base64.b64decode(state["done"]))
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[: state["num_splits"]].tolist()


def test_state_before_iteration_and_after_set_epoch(parquet_dir: Path):
    loader, dataset = StructuredDataset.create_dataloader(str(parquet_dir), batch_size=10)
    state = dataset.state_dict()
    assert state["epoch"] == 0 and state["partial"] == [] and state["cursor"] == 0
    assert state["_shuffle_window"] == 1  # no shuffle: splits are read one at a time
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
        IndexedFile(
            path=f"/data/f{i:05d}.parquet",
            display=f"/data/f{i:05d}.parquet",
            name=f"f{i:05d}.parquet",
            fingerprint=f"fp{i}",
            metadata=meta,
        )
        for i in range(num_files)
    )
    splits = tuple(
        Split(f, range(u, u + 1), u * rows, rows)
        for f in range(num_files)
        for u in range(splits_per_file)
    )
    return DatasetIndex(files, splits, schema)


def _epochs(
    index: DatasetIndex,
    *,
    shuffle: bool = True,
    window: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    even: bool = False,
    seed: int = 0,
) -> Epochs:
    config = DatasetConfig(shuffle=shuffle, shuffle_seed=seed, shuffle_window=window, split_bytes=1)
    return Epochs(index=index, config=config, rank=rank, world_size=world_size, even_batches=even)


def _settings(**changes: object) -> Settings:
    values: dict = {
        "format": "parquet", "split_bytes": 1, "shuffle": False, "shuffle_seed": 0,
        "window": 1, "rank": 0, "world_size": 1, "num_workers": 0,
    }  # fmt: skip
    return Settings(**{**values, **changes})


def _half_delivered(epochs: Epochs, workers: int) -> Progress:
    """Every worker stream has delivered half its share; worker ``streams - 1`` is next."""
    progress = epochs.begin(Start.fresh(0, len(epochs.index.splits)), workers)
    for worker, pieces in progress.shares.items():
        progress.positions[worker] = int(pieces.rows.sum()) // 2
    progress.cursor = max(1, workers) - 1
    return progress


def _same(a: Consumed, b: Consumed) -> bool:
    return bool(np.array_equal(a.done, b.done)) and dict(a.partial) == dict(b.partial)


def _reloaded(epochs: Epochs, state: dict, workers: int) -> Progress:
    """JSON round trip, ``load``, ``begin``: the progress a resumed iteration starts from."""
    return epochs.begin(epochs.load(json.loads(json.dumps(state)), workers), workers)


@pytest.mark.parametrize(("shuffle", "window"), [(False, None), (True, None), (True, 1)])
def test_state_size_100k_splits_half_delivered_8_workers(shuffle: bool, window: int | None):
    index = _fake_index(num_files=1000, splits_per_file=100)
    assert len(index.splits) == 100_000
    epochs = _epochs(index, shuffle=shuffle, window=window)
    progress = _half_delivered(epochs, workers=8)
    delivered = progress.delivered(index.split_rows)
    rows = int(delivered.done.sum()) * 20 + sum(
        b - a for ranges in delivered.partial.values() for a, b in ranges
    )
    assert rows == 1_000_000  # half of 2,000,000 rows
    if epochs.config.window == 32:
        assert 8 < len(delivered.partial) <= 8 * 32  # a window open per worker
    else:
        assert len(delivered.partial) <= 8
    state = epochs.encode(progress)
    assert state["_shuffle_window"] == epochs.config.window
    size = len(pickle.dumps(state))
    print(f"\nstate at 100,000 splits, 50 %, 8 workers, window {epochs.config.window}: {size} B")
    assert size <= 64 * 1024, f"state is {size} bytes pickled"
    # ... and it decodes back to the same progress.
    done, base = decode(json.loads(json.dumps(state)), index=index, settings=epochs.settings(8))
    assert _same(done, delivered)
    assert base.is_empty()
    resumed = _reloaded(epochs, state, 8)
    assert resumed.positions == progress.positions
    assert resumed.cursor == 7


@given(
    workers=st.integers(0, 3),
    world=st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))),
    shuffle=st.booleans(),
    window=st.integers(1, 5),
    even=st.booleans(),
    fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3),
)
def test_any_position_round_trips_through_the_state(workers, world, shuffle, window, even,
                                                    fractions):  # fmt: skip
    """encode -> JSON -> load -> begin gives back every worker's position, window or not."""
    world_size, rank = world
    index = _fake_index(num_files=7, splits_per_file=5, rows=9)
    epochs = _epochs(
        index, shuffle=shuffle, window=window if shuffle else None, rank=rank,
        world_size=world_size, even=even, seed=3,
    )  # fmt: skip
    progress = epochs.begin(Start.fresh(2, len(index.splits)), workers)
    for worker, pieces in progress.shares.items():
        progress.positions[worker] = round(int(pieces.rows.sum()) * fractions[worker])
    state = epochs.encode(progress)
    assert state["epoch"] == 2 and state["_num_workers"] == workers
    assert state["_shuffle_window"] == (window if shuffle else 1)
    resumed = _reloaded(epochs, state, workers)
    assert resumed.positions == progress.positions
    assert _same(resumed.delivered(index.split_rows), progress.delivered(index.split_rows))


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_encode_decode_round_trip(workers: int, shuffle: bool):
    index = _fake_index(num_files=7, splits_per_file=13)
    epochs = _epochs(index, shuffle=shuffle, window=4 if shuffle else None)
    progress = _half_delivered(epochs, workers)
    delivered = progress.delivered(index.split_rows)
    state = encode(
        epoch=2, delivered=delivered, base=progress.plan.base, cursor=progress.cursor,
        index=index, settings=progress.settings,
    )  # fmt: skip
    assert state["epoch"] == 2 and state["cursor"] == max(1, workers) - 1
    assert state["_num_workers"] == workers
    done, base = decode(
        json.loads(json.dumps(state)), index=index, settings=epochs.settings(workers)
    )
    assert _same(done, delivered) and base.is_empty()
    assert _reloaded(epochs, epochs.encode(progress), workers).positions == progress.positions


def test_state_with_base_round_trips():
    index = _fake_index(num_files=2, splits_per_file=8)
    base_done = np.zeros(16, dtype=bool)
    base_done[[1, 2, 9]] = True
    base = Consumed(base_done, {4: ((0, 5), (12, 13)), 11: ((3, 20),)})
    settings = _settings()
    state = encode(epoch=0, delivered=base, base=base, cursor=0, index=index, settings=settings)
    assert state["base"] is not None and state["base"]["partial"] == [
        ["f00000.parquet", 80, 20, "fp0", [0, 5, 12, 13]],
        ["f00001.parquet", 60, 20, "fp1", [3, 20]],
    ]
    assert state["partial"] == state["base"]["partial"]
    done, got_base = decode(json.loads(json.dumps(state)), index=index, settings=settings)
    assert np.array_equal(got_base.done, base_done)
    assert got_base.partial == {4: ((0, 5), (12, 13)), 11: ((3, 20),)}
    assert _same(done, base)


def test_an_elastic_start_is_dealt_from_its_base():
    """``load_elastic`` starts from the union of the old ranks' progress: it is the base."""
    index = _fake_index(num_files=3, splits_per_file=4)
    old = [_epochs(index, window=3, rank=r, world_size=2, even=True) for r in range(2)]
    states = [json.loads(json.dumps(e.encode(_half_delivered(e, 2)))) for e in old]
    new = _epochs(index, window=3)
    start = new.load_elastic(states, 3)
    progress = new.begin(start, 3)
    assert progress.positions == {0: 0, 1: 0, 2: 0}
    # What is dealt now is exactly what the old ranks had not delivered.
    before = Consumed.nothing(12)
    for e, s in zip(old, states, strict=True):
        before = before.union(e.load(s, 2).delivered, index.split_rows)
    assert _same(progress.plan.base, before)
    dealt = int(progress.plan.deal.shares.sum())
    assert dealt == 12 * 20 - int(before.done.sum()) * 20 - sum(
        b - a for ranges in before.partial.values() for a, b in ranges
    )
    state = new.encode(progress)
    assert state["base"] is not None
    assert _reloaded(new, state, 3).plan.deal.bounds.tolist() == (
        progress.plan.deal.bounds.tolist()
    )


def test_bitmap_is_compact():
    index = _fake_index(num_files=10, splits_per_file=1000)
    done = np.zeros(10_000, dtype=bool)
    done[:5000] = True  # without shuffle a half-done epoch is one run: compresses to nothing
    state = encode(
        epoch=0, delivered=Consumed(done, {}), base=Consumed.nothing(10_000), cursor=0,
        index=index, settings=_settings(),
    )  # fmt: skip
    assert len(state["done"]) < 100


# ---------------------------------------------------------------------------- validation


def _small_state(**settings: object) -> tuple[DatasetIndex, dict, Settings]:
    index = _fake_index(num_files=2, splits_per_file=8)
    chosen = _settings(**settings)
    delivered = Consumed(np.zeros(16, dtype=bool), {4: ((0, 5),)})
    state = encode(
        epoch=1, delivered=delivered, base=Consumed.nothing(16), cursor=0, index=index,
        settings=chosen,
    )  # fmt: skip
    return index, json.loads(json.dumps(state)), chosen


@pytest.mark.parametrize(("version", "why"), [(1, "row by row"), (2, "mtime or ETag")])
def test_old_version_states_are_refused_with_what_to_do(version: int, why: str):
    index, state, settings = _small_state()
    state["version"] = version
    with pytest.raises(InvalidStateError) as info:
        decode(state, index=index, settings=settings)
    message = str(info.value)
    assert f"version {version}," in message and f"version {STATE_VERSION}" in message
    assert why in message
    assert "set_epoch" in message  # what to do: restart the checkpoint's epoch
    with pytest.raises(InvalidStateError, match=f"version {version}"):
        _epochs(index, shuffle=False).load(state, 0)
    state["version"] = 99
    with pytest.raises(InvalidStateError, match="unknown state version 99"):
        decode(state, index=index, settings=settings)


def test_negative_shuffle_seed_is_accepted_other_negatives_are_not():
    index, state, settings = _small_state(shuffle_seed=-5, shuffle=True, window=4)
    assert state["_shuffle_seed"] == -5
    done, _ = decode(state, index=index, settings=settings)
    assert done.partial == {4: ((0, 5),)}
    state["epoch"] = -1
    with pytest.raises(InvalidStateError, match="'epoch' must be >= 0"):
        decode(state, index=index, settings=settings)


@pytest.mark.parametrize("key", ["_shuffle_window", "partial", "version"])
def test_missing_key_is_named(key: str):
    index, state, settings = _small_state()
    del state[key]
    with pytest.raises(InvalidStateError, match=key if key != "version" else "version None"):
        decode(state, index=index, settings=settings)


@pytest.mark.parametrize(
    "bounds",
    [[], [3], [5, 2], [0, 5, 3, 8], [0, 5, 5, 8], [0, 21], [-1, 3], [0, 20], [4, 4], "0-5"],
)
def test_malformed_delivered_rows_are_refused(bounds: object):
    index, state, settings = _small_state()
    state["partial"][0][4] = bounds
    with pytest.raises(InvalidStateError, match="state key 'partial': entry"):
        decode(state, index=index, settings=settings)


def test_a_split_both_done_and_partial_is_refused():
    index, state, settings = _small_state()
    state["done"] = encode(
        epoch=1, delivered=Consumed(np.eye(1, 16, 4, dtype=bool)[0], {}),
        base=Consumed.nothing(16), cursor=0, index=index, settings=settings,
    )["done"]  # fmt: skip
    with pytest.raises(InvalidStateError, match="out of range"):
        decode(state, index=index, settings=settings)


def test_shuffle_window_change_is_a_mismatch():
    index, state, _ = _small_state(shuffle=True, window=4)
    with pytest.raises(CheckpointMismatchError) as info:
        decode(state, index=index, settings=_settings(shuffle=True, window=8))
    assert info.value.field == "shuffle_window"
    assert (info.value.expected, info.value.found) == (4, 8)
    assert "shuffle_window changed: checkpoint=4, current=8" in str(info.value)


def test_progress_that_is_no_position_of_a_stream_is_refused():
    """A window's delivered rows must be where the mixing order puts them after some batch."""
    index = _fake_index(num_files=3, splits_per_file=4)
    epochs = _epochs(index, window=4)
    progress = epochs.begin(Start.fresh(0, 12), 0)
    progress.positions[0] = 10  # inside the first window of 4 splits: 2-3 rows of each
    state = epochs.encode(progress)
    bounds = state["partial"][0][4]
    assert bounds[0] == 0 and len(bounds) == 2
    for edited in ([0, bounds[1] + 5], [1, bounds[1]]):  # equal splits advance together;
        state["partial"][0][4] = edited  # and a split is read from its first row
        with pytest.raises(CheckpointMismatchError, match="out of order"):
            _reloaded(epochs, state, 0)
