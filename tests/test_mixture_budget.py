"""One shuffle budget for a mixture's stream (issue 32): the sources without a budget of their
own share ``shuffle_memory_bytes`` equally, and each keeps its share, so its order, when a
``reweight=True`` load adds or removes sources; a state saved after such a load loads as saved."""

from __future__ import annotations

import json
from pathlib import Path
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

from torch_dataloader_utils import CheckpointMismatchError, Source, StructuredDataset
from torch_dataloader_utils.mixing.state import encode_mixture, expanded

ROWS = 600
BUDGET = 4 * 8192  # four sources: 8,192 bytes each, windows of ~200 of a source's 600 rows
KWARGS: dict[str, Any] = {"batch_size": 20, "shuffle": True, "shuffle_memory_bytes": BUDGET}


def budgets(state: dict[str, Any]) -> dict[str, int]:
    """Each source's shuffle memory as ``state`` records it."""
    return {n: s["_shuffle_memory_bytes"] for n, s in expanded(state)["sources"].items()}


def of_source(batches: list[np.ndarray], source: int) -> list[int]:
    ids = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
    return ids[ids // _SPAN == source].tolist()


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("budget")
    return {f"s{s}": write_source(root, f"s{s}", s, ROWS, files=3) for s in range(6)}


def test_the_sources_share_the_budget_and_a_source_may_have_its_own(
    paths: dict[str, str],
) -> None:
    """Four sources: a quarter of the budget each; with one of its own, the other three share
    the budget in thirds, and that one's windows are its own."""
    four = {n: paths[n] for n in ("s0", "s1", "s2", "s3")}
    ds = StructuredDataset(four, weights=dict.fromkeys(four, 1), **KWARGS)
    _, state = state_after(ds, 0, 1)
    assert budgets(state) == dict.fromkeys(four, BUDGET // 4)
    assert state["_mixture"]["shuffle_memory_bytes"] == BUDGET
    own = {**four, "s0": Source(path=paths["s0"], shuffle_memory_bytes=2 * BUDGET)}
    ds = StructuredDataset(own, weights=dict.fromkeys(four, 1), **KWARGS)
    _, state = state_after(ds, 0, 1)
    assert budgets(state) == {"s0": 2 * BUDGET, **dict.fromkeys(("s1", "s2", "s3"), BUDGET // 3)}
    windows = {n: s["_shuffle_window_rows"] for n, s in expanded(state)["sources"].items()}
    assert windows["s0"] == 6 * windows["s1"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reweight_that_adds_and_removes_sources_keeps_each_kept_sources_order(
    paths: dict[str, str], workers: int
) -> None:
    """Sources 0-3 (a quarter of the budget each) checkpointed, loaded as sources 1-5
    (``reweight=True``: one removed, two added): each kept source keeps its share, so its
    windows, and goes on in the order of the uninterrupted run, no row lost or read twice;
    the added ones share the budget of the mixture as built, in fifths."""
    old_names, new_names = ["s0", "s1", "s2", "s3"], ["s1", "s2", "s3", "s4", "s5"]
    old = StructuredDataset({n: paths[n] for n in old_names}, weights=dict.fromkeys(old_names, 1),
                            **KWARGS)  # fmt: skip
    whole = stream_batches(old, 0, workers)
    first, state = state_after(old, workers, 37)
    new = StructuredDataset({n: paths[n] for n in new_names}, weights=dict.fromkeys(new_names, 1),
                            **KWARGS)  # fmt: skip
    new.load_state_dict(state, reweight=True)
    mix = new._epochs
    windows = {n: e.window_rows for n, e in zip(mix.names, mix.sources, strict=True)}
    assert windows["s1"] == windows["s3"] > windows["s4"] == windows["s5"]
    rest = new._epochs.begin(new._start, workers)
    per_stream = []
    for w in range(max(1, workers)):
        tail = [np.asarray(b["id"]) for b, _ in new._reader(rest, w).batches()]
        for s in (1, 2, 3):
            went_on, uninterrupted = of_source(first[w] + tail, s), of_source(whole[w], s)
            # read on after the checkpoint, into its next epoch
            assert len(went_on) > len(uninterrupted) > len(of_source(first[w], s))
            assert went_on[: len(uninterrupted)] == uninterrupted, (w, s)
        per_stream.append(np.concatenate([*first[w], *tail]))
    assert_each_source_epoch_once(per_stream, [ROWS] * 6)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_a_reweight_loads_as_saved(paths: dict[str, str], workers: int) -> None:
    """After a reweight the kept sources shuffle within the shares the checkpoint recorded:
    the state saved then records them, and a fresh loader of the same sources loads it without
    ``reweight`` and goes on batch for batch; under another stream budget it is refused."""
    old_names, new_names = ["s0", "s1", "s2", "s3"], ["s1", "s2", "s3", "s4", "s5"]
    kwargs = {**KWARGS, "num_workers": workers}
    old = StructuredDataset({n: paths[n] for n in old_names}, weights=dict.fromkeys(old_names, 1),
                            **KWARGS)  # fmt: skip
    _, state = state_after(old, workers, 11)

    def loader(**changed: Any) -> Any:
        return StructuredDataset.create_dataloader(
            {n: paths[n] for n in new_names}, weights=dict.fromkeys(new_names, 1),
            **{**kwargs, **changed},
        )[0]  # fmt: skip

    reweighted = loader()
    reweighted.load_state_dict(state, reweight=True)
    it = iter(reweighted)
    for _ in range(9):
        next(it)
    saved = json.loads(json.dumps(reweighted.state_dict()))
    expected = [batch["id"].tolist() for batch in it]
    assert budgets(saved) == {**dict.fromkeys(new_names[:3], BUDGET // 4),
                              **dict.fromkeys(new_names[3:], BUDGET // 5)}  # fmt: skip
    again = loader()
    again.load_state_dict(saved)
    assert [batch["id"].tolist() for batch in again] == expected
    with pytest.raises(CheckpointMismatchError, match=r"source 's1'.*shuffle_memory_bytes"):
        loader(shuffle_memory_bytes=2 * BUDGET).load_state_dict(saved)


def test_a_state_of_sources_with_the_whole_budget_each_loads_as_saved(
    paths: dict[str, str], tmp_path: Path
) -> None:
    """A state saved before the sources shared the budget (each had all of it, and the
    mixture's budget was not written) resumes with those windows, batch for batch."""
    two = {n: paths[n] for n in ("s0", "s1")}
    whole = {n: Source(path=p, shuffle_memory_bytes=BUDGET) for n, p in two.items()}
    ds = StructuredDataset(whole, weights=dict.fromkeys(two, 1), **KWARGS)
    _, state = state_after(ds, 0, 13)
    del state["_mixture"]["shuffle_memory_bytes"]
    expected = [b.tolist() for b in stream_batches(ds, 0, 0)[0][13:]]
    shared = StructuredDataset(two, weights=dict.fromkeys(two, 1), **KWARGS)
    shared.load_state_dict(state)
    rest = shared._epochs.begin(shared._start, 0)
    assert [np.asarray(b["id"]).tolist() for b, _ in shared._reader(rest, 0).batches()] == expected


def test_an_epoch_restarted_after_a_reweight_is_the_mixture_as_built(
    paths: dict[str, str],
) -> None:
    """``set_epoch(dataset.epoch)`` after a reweight that kept some sources' shares restarts
    the epoch under the mixture as built, its shares too: what a loader that never loaded the
    state reads, that epoch and the next."""
    old_names, new_names = ["s0", "s1", "s2", "s3"], ["s1", "s2", "s3", "s4", "s5"]
    old = StructuredDataset({n: paths[n] for n in old_names}, weights=dict.fromkeys(old_names, 1),
                            **KWARGS)  # fmt: skip
    _, state = state_after(old, 0, 11)

    def loader() -> Any:
        return StructuredDataset.create_dataloader(
            {n: paths[n] for n in new_names}, weights=dict.fromkeys(new_names, 1), **KWARGS
        )

    def epoch(loader: Any) -> list[int]:
        return np.concatenate([batch["id"].numpy() for batch in loader]).tolist()

    fresh, fresh_ds = loader()
    expected = [epoch(fresh)]
    fresh_ds.set_epoch(1)
    expected.append(epoch(fresh))
    reweighted, ds = loader()
    reweighted.load_state_dict(state, reweight=True)
    with pytest.warns(UserWarning, match="discards the checkpoint's progress in epoch 0"):
        ds.set_epoch(0)
    assert epoch(reweighted) == expected[0]
    ds.set_epoch(1)
    assert epoch(reweighted) == expected[1]


def test_an_elastic_resume_after_a_reweight_keeps_the_shares(paths: dict[str, str]) -> None:
    """Reweighted (a source added: the kept sources at a quarter, the new one at a fifth),
    saved by two worker streams, resumed elastically by three: each source's rows of the epoch
    once, none twice (the orders the state's places name are the kept shares')."""
    old_names, new_names = ["s0", "s1", "s2", "s3"], ["s0", "s1", "s2", "s3", "s4"]
    kwargs = {**KWARGS, "epoch_size": 1500}
    old = StructuredDataset({n: paths[n] for n in old_names}, weights=dict.fromkeys(old_names, 1),
                            **kwargs)  # fmt: skip
    first, state = state_after(old, 2, 8)
    mid = StructuredDataset({n: paths[n] for n in new_names}, weights=dict.fromkeys(new_names, 1),
                            **kwargs)  # fmt: skip
    mid.load_state_dict(state, reweight=True)
    progress = mid._epochs.begin(mid._start, 2)
    readers = [mid._reader(progress, w).batches() for w in range(2)]
    for step in range(10):
        batch, position = next(readers[step % 2])
        first[step % 2].append(np.asarray(batch["id"]))
        progress.record(step % 2, position, (step + 1) % 2)
    saved = json.loads(json.dumps(encode_mixture(mid._epochs, progress)))
    assert budgets(saved) == {**dict.fromkeys(old_names, BUDGET // 4), "s4": BUDGET // 5}
    new = StructuredDataset({n: paths[n] for n in new_names}, weights=dict.fromkeys(new_names, 1),
                            **kwargs)  # fmt: skip
    new._loader_workers = 3
    new.load_state_dict([saved], elastic=True)
    rest = new._epochs.begin(new._start, 3)
    later = [np.asarray(b["id"]) for w in range(3) for b, _ in new._reader(rest, w).batches()]
    read = np.concatenate([*first[0], *first[1], *later])
    assert len(read) == len(np.unique(read)) == 1500
