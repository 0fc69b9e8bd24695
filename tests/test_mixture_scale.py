"""A mixture of 100 sources (issue 32): exact resume at a batch chosen at random, an elastic
resume onto another number of workers, and a change of mixture that adds and removes sources,
each losing and repeating nothing; and a state that stays small."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from test_mixing import (
    _SPAN,
    assert_each_source_epoch_once,
    state_after,
    stream_batches,
    write_source,
)

from torch_dataloader_utils import CheckpointMismatchError, InvalidStateError, StructuredDataset
from torch_dataloader_utils.mixing.state import expanded

SOURCES = 100
# Sources of 20 and 40 rows weighed 1 and 2: an epoch of their 3,000 rows is 20 periods of
# the schedule, so it reads every row of every source once.
ROWS = [20 if s % 2 == 0 else 40 for s in range(SOURCES)]
KWARGS: dict[str, Any] = {"batch_size": 25, "shuffle": True, "epoch_size": sum(ROWS)}
EVERY_ROW = [s * _SPAN + r for s, n in enumerate(ROWS) for r in range(n)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hundred")
    return {f"s{s:03d}": write_source(root, f"s{s:03d}", s, n) for s, n in enumerate(ROWS)}


def weights(names: Any) -> dict[str, int]:
    return {name: ROWS[int(name[1:])] // 20 for name in names}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hundred_sources_resume_exactly_at_a_random_batch(
    paths: dict[str, str], workers: int
) -> None:
    """Checkpoint at a batch drawn at random, a fresh loader resumes batch for batch as the
    uninterrupted epoch went on; the state writes what every source shares once, within
    64 KiB, and the epoch read every row of every source once."""
    kwargs = {**KWARGS, "num_workers": workers}
    loader, _ = StructuredDataset.create_dataloader(paths, weights=weights(paths), **kwargs)
    stop = int(np.random.default_rng([32, workers]).integers(1, sum(ROWS) // 25))
    it = iter(loader)
    before = [next(it)["id"].tolist() for _ in range(stop)]
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [batch["id"].tolist() for batch in it]
    fresh, _ = StructuredDataset.create_dataloader(paths, weights=weights(paths), **kwargs)
    fresh.load_state_dict(state)
    assert [batch["id"].tolist() for batch in fresh] == expected
    assert sorted(i for batch in before + expected for i in batch) == EVERY_ROW
    assert len(json.dumps(state)) <= 64 * 1024
    assert state["source_settings"]["_format"] == "parquet"
    assert "_format" not in state["sources"]["s000"]


def test_a_state_with_every_source_whole_loads_as_before(paths: dict[str, str]) -> None:
    """A state written before ``source_settings`` (each source's state whole) resumes the
    same; one whose source lacks a shared key without it is refused naming both keys."""
    loader, _ = StructuredDataset.create_dataloader(paths, weights=weights(paths), **KWARGS)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [batch["id"].tolist() for batch in it]
    whole = {k: v for k, v in expanded(state).items() if k != "source_settings"}
    assert whole["sources"]["s001"]["_format"] == "parquet"
    fresh, _ = StructuredDataset.create_dataloader(paths, weights=weights(paths), **KWARGS)
    fresh.load_state_dict(whole)
    assert [batch["id"].tolist() for batch in fresh] == expected
    del whole["sources"]["s001"]["_shuffle"]
    with pytest.raises(
        InvalidStateError, match=r"'source_settings' is missing.*'s001'.*'_shuffle'"
    ):
        fresh.load_state_dict(whole)


def test_a_hundred_sources_resume_elastically_on_another_number_of_workers(
    paths: dict[str, str],
) -> None:
    """Two worker streams stop; three resume elastically: the epoch (half of every source's
    rows, so none starts its next epoch) reads its positions, no row twice."""
    kwargs = {**KWARGS, "epoch_size": sum(ROWS) // 2}
    old = StructuredDataset(paths, weights=weights(paths), **kwargs)
    first, state = state_after(old, 2, 17)
    new = StructuredDataset(paths, weights=weights(paths), **kwargs)
    new._loader_workers = 3
    new.load_state_dict([state], elastic=True)
    rest = new._epochs.begin(new._start, 3)
    later = [np.asarray(b["id"]) for w in range(3) for b, _ in new._reader(rest, w).batches()]
    read = np.concatenate([*first[0], *first[1], *later]).tolist()
    assert len(read) == len(set(read)) == sum(ROWS) // 2
    assert set(read) <= set(EVERY_ROW)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hundred_sources_change_ten_for_ten(paths: dict[str, str], workers: int) -> None:
    """A checkpoint of sources 0-89 loaded under sources 10-99 (``reweight=True``): each kept
    source continues where it stood, an added one from its first epoch, none repeats a row
    within a source epoch; a removed one's rows are no more read."""
    names = list(paths)
    old_names, new_names = names[:90], names[10:]
    old = StructuredDataset({n: paths[n] for n in old_names}, weights=weights(old_names), **{
        **KWARGS, "epoch_size": 1000})  # fmt: skip
    first, state = state_after(old, workers, 23)
    new = StructuredDataset({n: paths[n] for n in new_names}, weights=weights(new_names), **{
        **KWARGS, "epoch_size": 1000})  # fmt: skip
    with pytest.raises(CheckpointMismatchError, match="reweight=True"):
        new.load_state_dict(state)
    new.load_state_dict(state, reweight=True)
    rest = new._epochs.begin(new._start, workers)
    per_stream = []
    for w in range(max(1, workers)):
        later = [np.asarray(b["id"]) for b, _ in new._reader(rest, w).batches()]
        tail = np.concatenate([*later, *stream_batches(new, 1, workers)[w]])
        assert set((tail // _SPAN).tolist()) <= set(range(10, SOURCES))
        per_stream.append(np.concatenate([*first[w], tail]))
    assert_each_source_epoch_once(per_stream, ROWS)
