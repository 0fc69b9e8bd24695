"""The checkpoint state: schema, builtin types, content addressing, round trips and size."""

from __future__ import annotations

import io
import json
import pickle
import uuid
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest
import torch
from _data import write_dataset
from hypothesis import given
from hypothesis import strategies as st

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.base.errors import CheckpointMismatchError, InvalidStateError
from torch_dataloader_utils.checkpoint.schema import STATE_VERSION, Settings, StreamEntry
from torch_dataloader_utils.checkpoint.state import decode, encode
from torch_dataloader_utils.formats import FileMetadata
from torch_dataloader_utils.index.index import DatasetIndex, IndexedFile
from torch_dataloader_utils.index.splits import Split
from torch_dataloader_utils.planning.config import DatasetConfig
from torch_dataloader_utils.planning.epochs import Epochs, Progress, Start

KEYS = {
    "version", "epoch", "_num_workers", "_shuffle_seed", "_shuffle", "_split_bytes", "_rank",
    "_world_size", "_format", "_even_batches", "_shuffle_memory_bytes", "_shuffle_window_rows",
    "files", "num_splits", "streams", "generations", "cursor", "_packing",
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
    assert state["version"] == STATE_VERSION == 6
    assert state["_packing"] is None  # no token packing
    assert (state["epoch"], state["_num_workers"], state["_shuffle_seed"]) == (0, 2, 5)
    assert (state["_shuffle"], state["_split_bytes"]) == (True, small_split)
    assert (state["_rank"], state["_world_size"], state["_format"]) == (0, 1, "parquet")
    assert state["_shuffle_memory_bytes"] == 256 * 2**20  # the default budget
    assert state["_shuffle_window_rows"] == dataset._epochs.window_rows > 0
    assert state["_even_batches"] is False
    assert state["files"]["count"] == 3
    assert state["files"]["root"] == str(parquet_dir)  # names are relative to it
    assert state["num_splits"] == len(dataset._index.splits)
    assert state["generations"] == []
    assert state["cursor"] == 1  # 7 batches over 2 workers: worker 1 is next
    # One entry per worker stream: rows handed out, tokens, its rows, and by content the split
    # its window starts with: name, row range, fingerprint. 7 batches of 10 rows: 40 + 30.
    assert [entry[:2] for entry in state["streams"]] == [[40, 0], [30, 0]]
    for position, _, rows, path, offset, length, fingerprint, row in state["streams"]:
        assert (parquet_dir / path).is_file() and path.endswith(".parquet")
        assert offset >= 0 and 0 <= row < length and rows > position
        assert fingerprint in {f.fingerprint for f in dataset._index.files}
    assert json.loads(json.dumps(state)) == state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


def test_state_before_iteration_and_after_set_epoch(parquet_dir: Path):
    loader, dataset = StructuredDataset.create_dataloader(str(parquet_dir), batch_size=10)
    state = dataset.state_dict()
    assert state["epoch"] == 0 and state["cursor"] == 0
    assert [entry[:2] for entry in state["streams"]] == [[0, 0]]
    assert state["streams"][0][3:] == [*state["streams"][0][3:7], 0]  # its first row next
    assert state["_shuffle_window_rows"] == 0  # no shuffle: splits are read in order
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
    memory: int = 2**20,
    rank: int = 0,
    world_size: int = 1,
    even: bool = False,
    seed: int = 0,
) -> Epochs:
    config = DatasetConfig(
        shuffle=shuffle, shuffle_seed=seed, shuffle_memory_bytes=memory, split_bytes=1
    )
    return Epochs(index=index, config=config, rank=rank, world_size=world_size, even_batches=even)


def _settings(**changes: object) -> Settings:
    values: dict = {
        "format": "parquet", "split_bytes": 1, "shuffle": False, "shuffle_seed": 0,
        "memory_bytes": 2**20, "window_rows": 0, "rank": 0, "world_size": 1, "num_workers": 0,
    }  # fmt: skip
    return Settings(**{**values, **changes})


def _half_delivered(epochs: Epochs, workers: int) -> Progress:
    """Every worker stream has delivered half its share; worker ``streams - 1`` is next."""
    progress = epochs.begin(Start.fresh(0), workers)
    for worker, order in progress.orders.items():
        progress.record(worker, order.total // 2, cursor=max(1, workers) - 1)
    return progress


def _reloaded(epochs: Epochs, state: dict, workers: int) -> Progress:
    """JSON round trip, ``load``, ``begin``: the progress a resumed iteration starts from."""
    return epochs.begin(epochs.load(json.loads(json.dumps(state)), workers), workers)


@pytest.mark.parametrize("shuffle", [False, True])
def test_state_size_100k_splits_half_delivered_8_workers(shuffle: bool):
    index = _fake_index(num_files=1000, splits_per_file=100)
    assert len(index.splits) == 100_000
    epochs = _epochs(index, shuffle=shuffle, memory=256 * 2**20)
    progress = _half_delivered(epochs, workers=8)
    state = epochs.encode(progress)
    size = len(pickle.dumps(state))
    print(f"\nstate at 100,000 splits, 50 %, 8 workers, shuffle={shuffle}: {size} B")
    assert size <= 64 * 1024, f"state is {size} bytes pickled"
    assert sum(entry[0] for entry in state["streams"]) == 1_000_000  # half of 2,000,000 rows
    resumed = _reloaded(epochs, state, 8)
    assert resumed.positions == progress.positions
    assert resumed.cursor == 7


@given(
    workers=st.integers(0, 3),
    world=st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))),
    shuffle=st.booleans(),
    even=st.booleans(),
    fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3),
)
def test_any_position_round_trips_through_the_state(workers, world, shuffle, even, fractions):
    """encode -> JSON -> load -> begin gives back every worker's position."""
    world_size, rank = world
    index = _fake_index(num_files=7, splits_per_file=5, rows=9)
    epochs = _epochs(index, shuffle=shuffle, rank=rank, world_size=world_size, even=even, seed=3)
    progress = epochs.begin(Start.fresh(2), workers)
    for worker, order in progress.orders.items():
        progress.record(worker, round(order.total * fractions[worker]), cursor=0)
    state = epochs.encode(progress)
    assert state["epoch"] == 2 and state["_num_workers"] == workers
    resumed = _reloaded(epochs, state, workers)
    assert resumed.positions == progress.positions


def test_an_elastic_start_deals_the_rest_of_every_old_stream():
    """``load_elastic`` adds a generation: every old stream's position; what is dealt now is
    exactly the rows the old streams had not handed out (and their left-out rows)."""
    index = _fake_index(num_files=3, splits_per_file=4)
    old = [_epochs(index, rank=r, world_size=2, even=True) for r in range(2)]
    states = [json.loads(json.dumps(e.encode(_half_delivered(e, 2)))) for e in old]
    new = _epochs(index)
    start = new.load_elastic(states, 3)
    (generation,) = start.generations
    assert (generation.world_size, generation.num_workers, generation.even) == (2, 2, True)
    assert generation.positions.tolist() == [30, 30, 30, 30]  # 240 rows: 60 per stream
    progress = new.begin(start, 3)
    assert progress.positions == {0: 0, 1: 0, 2: 0}
    assert int(progress.plan.deal.shares.sum()) == 240 - 4 * 30
    state = new.encode(progress)
    assert len(state["generations"]) == 1
    assert _reloaded(new, state, 3).plan.deal.bounds.tolist() == (
        progress.plan.deal.bounds.tolist()
    )


# ---------------------------------------------------------------------------- validation


def _small_state(**settings: object) -> tuple[DatasetIndex, dict, Settings]:
    index = _fake_index(num_files=2, splits_per_file=8)
    chosen = _settings(**settings)
    state = encode(
        epoch=1, streams=[StreamEntry(5, 0, 320, (0, 5))], generations=[], cursor=0, index=index,
        settings=chosen,
    )  # fmt: skip
    return index, json.loads(json.dumps(state)), chosen


@pytest.mark.parametrize(
    ("version", "why"),
    [
        (1, "row by row"),
        (2, "mtime or ETag"),
        (3, "random order"),
        (4, "consecutive windows"),
        (5, "whole splits"),
    ],
)
def test_old_version_states_are_refused_with_what_to_do(version: int, why: str):
    index, state, settings = _small_state(shuffle=True, window_rows=40)
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


@pytest.mark.parametrize("version", [4, 5])
def test_an_unshuffled_state_of_version_4_or_5_still_loads(version: int):
    """Versions 5 and 6 changed the shuffled order only: an unshuffled position of version 4
    or 5 means the same rows, a shuffled one does not."""
    index, state, settings = _small_state(shuffle=False)
    state["version"] = version
    assert (
        decode(state, index=index, settings=settings).streams
        == decode({**state, "version": STATE_VERSION}, index=index, settings=settings).streams
    )


def test_negative_shuffle_seed_is_accepted_other_negatives_are_not():
    index, state, settings = _small_state(shuffle_seed=-5, shuffle=True, window_rows=40)
    assert state["_shuffle_seed"] == -5
    assert decode(state, index=index, settings=settings).streams == (
        StreamEntry(5, 0, 320, (0, 5)),
    )
    state["epoch"] = -1
    with pytest.raises(InvalidStateError, match="'epoch' must be >= 0"):
        decode(state, index=index, settings=settings)


@pytest.mark.parametrize("key", ["_shuffle_window_rows", "streams", "generations", "version"])
def test_missing_key_is_named(key: str):
    index, state, settings = _small_state()
    del state[key]
    with pytest.raises(InvalidStateError, match=key if key != "version" else "version None"):
        decode(state, index=index, settings=settings)


@pytest.mark.parametrize(
    "entry",
    [[], [3], [5, 0], [21, 0, 20], [-1, 0, 20], [5, 2, 5], ["5", 0, 20], [5, 0, 20, "x"],
     [5, 0, 20, "f00000.parquet", 0, 20], [20, 0, 20, "f00000.parquet", 0, 20, "fp0", 3],
     [5, 0, 20, "f00000.parquet", 0, 20, "fp0", 20], [5, 0, 20, "f00000.parquet", 0, 20, 1, 3]],
)  # fmt: skip
def test_malformed_stream_entries_are_refused(entry: object):
    index, state, settings = _small_state()
    state["streams"][0] = entry
    with pytest.raises(InvalidStateError, match=r"streams\[0\]"):
        decode(state, index=index, settings=settings)


@pytest.mark.parametrize(
    "generation",
    [[], [0, 1, False, "", ""], [1, 1, "no", "", ""], [2, 1, False, "!!", ""],
     [1, 1, False, "eJwDAAAAAAE=", "eJwDAAAAAAE="]],
)  # fmt: skip
def test_malformed_generations_are_refused(generation: object):
    index, state, settings = _small_state()
    state["generations"] = [generation]
    with pytest.raises(InvalidStateError, match=r"generations\[0\]"):
        decode(state, index=index, settings=settings)


def test_a_changed_budget_or_row_width_is_a_mismatch():
    index, state, _ = _small_state(shuffle=True, window_rows=40)
    with pytest.raises(CheckpointMismatchError) as info:
        decode(state, index=index, settings=_settings(shuffle=True, window_rows=40,
                                                       memory_bytes=2**21))  # fmt: skip
    assert info.value.field == "shuffle_memory_bytes"
    assert "shuffle_memory_bytes changed: checkpoint=1048576, current=2097152" in str(info.value)
    with pytest.raises(CheckpointMismatchError, match="shuffle_window_rows") as info:
        decode(state, index=index, settings=_settings(shuffle=True, window_rows=80))
    assert (info.value.expected, info.value.found) == (40, 80)


def test_a_position_the_plan_does_not_have_is_refused():
    """A stream's rows and the split at its position must be the plan's."""
    index = _fake_index(num_files=3, splits_per_file=4)
    epochs = _epochs(index, memory=2**20)
    progress = epochs.begin(Start.fresh(0), 0)
    progress.record(0, 10, cursor=0)
    state = json.loads(json.dumps(epochs.encode(progress)))
    entry = state["streams"][0]
    other = next(s for s in range(12) if s != index.split_at(*entry[3:6]))
    edited = [dict(state), dict(state), dict(state)]
    edited[0]["streams"] = [[10, 0, 239, *entry[3:]]]
    split = index.splits[other]
    key = [index.files[split.file].name, split.row_offset, split.row_length, f"fp{split.file}"]
    edited[1]["streams"] = [[10, 0, 240, *key, entry[7]]]
    edited[2]["streams"] = [[10, 0, 240, *entry[3:7], (entry[7] + 1) % 20]]
    for changed in edited:
        with pytest.raises(CheckpointMismatchError, match="not a position of that"):
            _reloaded(epochs, changed, 0)
