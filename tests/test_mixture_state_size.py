"""A mixture's state of many sources of one file (issue 32: 1,000 sources within 256 KiB): its
bytes per source, and its compact form (``mixing.compact``) through JSON: made whole as the
format always was, loaded exactly, and as strict as ever about a changed seed or file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_mixing import state_after, stream_batches, write_source

from torch_dataloader_utils import CheckpointMismatchError, InvalidStateError, StructuredDataset
from torch_dataloader_utils.mixing.compact import SHARED_KEYS, source_seed
from torch_dataloader_utils.mixing.state import expanded

SOURCES, ROWS, WORKERS, STOP = 200, 10, 2, 30
KWARGS: dict[str, Any] = {"batch_size": 20, "shuffle": True}
# bytes of JSON a source of one file adds to a state with 2 worker streams (its weight too):
# 1,000 of them within 256 KiB, with room for the rest of the state
SOURCE_BYTES = 220


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("one-file-sources")
    return {f"s{s:03d}": write_source(root, f"s{s:03d}", s, ROWS, files=1) for s in range(SOURCES)}


def dataset(paths: dict[str, str], **kwargs: Any) -> StructuredDataset:
    return StructuredDataset(paths, weights=dict.fromkeys(paths, 1), **KWARGS | kwargs)


def rest_of_epoch(ds: StructuredDataset, state: dict[str, Any]) -> list[list[int]]:
    ds.load_state_dict(state)
    progress = ds._epochs.begin(ds._start, WORKERS)
    return [
        [i for batch, _ in ds._reader(progress, w).batches() for i in batch["id"].tolist()]
        for w in range(WORKERS)
    ]


def test_a_source_of_one_file_adds_at_most_220_bytes(paths: dict[str, str]) -> None:
    """200 sources of one file, 2 worker streams, mid-epoch: each source (its state and its
    weight) adds at most ``SOURCE_BYTES`` to the state's JSON (194; before: 452)."""
    _, state = state_after(dataset(paths), WORKERS, STOP)
    rest = {k: v for k, v in state.items() if k != "sources"}
    rest["_mixture"] = {k: v for k, v in state["_mixture"].items() if k != "weights"}
    per_source = (len(json.dumps(state)) - len(json.dumps(rest))) / SOURCES
    assert per_source <= SOURCE_BYTES, per_source
    assert all(s["streams"] for s in state["sources"].values())


def test_a_compact_state_is_whole_when_read_and_loads_exactly(paths: dict[str, str]) -> None:
    """Through JSON, the compact state resumes as the uninterrupted epoch goes on; made whole,
    each source's state is the one a dataset of its own writes: its seed, its files' count,
    digest and group, a split per file, each stream's next split by name and fingerprint."""
    ds = dataset(paths)
    first, state = state_after(ds, WORKERS, STOP)
    whole = expanded(state)
    for name, sub in whole["sources"].items():
        index = ds._epochs.sources[list(paths).index(name)].index
        (file,) = index.files
        assert sub["_shuffle_seed"] == source_seed(0, name)
        assert sub["files"] == {
            "count": 1, "digest": index.digest, "groups": index.file_groups(1),
            "root": index.root,
        }  # fmt: skip
        assert sub["num_splits"] == len(index.splits) == 1
        assert [e[3] for e in sub["streams"]] == [file.name] * WORKERS
        assert [e[6] for e in sub["streams"]] == [file.fingerprint] * WORKERS
        assert (sub["rests"], sub["fresh"], sub["epochs"]) == ([], 0, [0] * WORKERS)
        assert sub["_format"] == "parquet" and "source_settings" not in whole
    everything = stream_batches(dataset(paths), 0, WORKERS)
    expected = [
        [i for batch in stream[len(done) :] for i in batch.tolist()]
        for stream, done in zip(everything, first, strict=True)
    ]
    assert rest_of_epoch(dataset(paths), state) == expected
    # the same state as the format wrote it before (every source's own keys in full)
    shared = {k: v for k, v in state["source_settings"].items() if k in SHARED_KEYS}
    own = {n: {k: v for k, v in s.items() if k not in shared} for n, s in whole["sources"].items()}
    old = whole | {"source_settings": shared, "sources": own}
    assert rest_of_epoch(dataset(paths), old) == expected


def test_a_compact_state_still_names_a_changed_seed_or_file(
    paths: dict[str, str], tmp_path: Path
) -> None:
    """A seed the state leaves out (the mixture's seed gives it) is compared all the same; so
    is a file whose name and fingerprint are all its source's files write. ``rests`` and
    ``fresh`` are left out together: one of them alone is refused."""
    _, state = state_after(dataset(paths), WORKERS, STOP)
    with pytest.raises(CheckpointMismatchError, match=r"source 's000': .*shuffle_seed") as seed:
        dataset(paths, shuffle_seed=1).load_state_dict(state)
    assert "Likely cause: shuffle_seed changed" in str(seed.value)
    moved = {**paths, "s007": write_source(tmp_path, "s007", 7, ROWS + 1, files=1)}
    with pytest.raises(
        CheckpointMismatchError, match=r"source 's007': checkpoint does not"
    ) as file:
        dataset(moved).load_state_dict(state)
    assert "Likely cause: files changed (content changed (size or footer))" in str(file.value)
    state["sources"]["s003"]["fresh"] = 0
    with pytest.raises(InvalidStateError, match=r"'sources.s003.rests' and '.fresh' must be"):
        dataset(paths).load_state_dict(state)


def test_a_state_is_the_callers_to_edit(tmp_path: Path) -> None:
    """A state's places are copies: editing one leaves the next state as it was (the places
    are kept for the next state, a source's while it does not move; on eaf0c3e the edit
    showed in the next state taken at the same position)."""
    paths = {n: write_source(tmp_path, n, s, 30) for s, n in enumerate(("a", "b"))}
    loader, _ = StructuredDataset.create_dataloader(paths, weights={"a": 1, "b": 1}, **KWARGS)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    before = json.loads(json.dumps(state))
    state["sources"]["a"]["streams"][0][0] = 999
    assert loader.state_dict() == before
