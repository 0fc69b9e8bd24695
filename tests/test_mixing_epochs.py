"""A mixture's epochs across the operations of a training script (issue 27): a change of
mixture into a shorter epoch, a packed epoch iterated again, ``set_epoch`` of a loaded
state's own epoch, ``drop_last``, ``len()`` after a change, and what ``docs/mixing.md`` says."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_mixing import (
    _SPAN,
    assert_each_source_epoch_once,
    documents_started,
    state_after,
    stream_batches,
    write_documents,
    write_source,
)

from torch_dataloader_utils import DataLoaderUtilsError, StructuredDataset, TokenPacking
from torch_dataloader_utils.base.errors import EpochStartError
from torch_dataloader_utils.mixing.state import encode_mixture

_DOCS = Path(__file__).resolve().parents[1] / "docs" / "mixing.md"


def ids_of(batches: Iterable[Any]) -> list[np.ndarray]:
    return [np.asarray(b["id"]) for b in batches]


def per_stream(batches: list[np.ndarray], streams: int) -> list[list[np.ndarray]]:
    """Batches dealt back to the worker streams that made them: the loader hands them out in
    strict round robin (from cursor 0, each stream with whole batches)."""
    return [batches[g::streams] for g in range(streams)]


def joined(parts: Iterable[np.ndarray]) -> np.ndarray:
    parts = list(parts)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def epochs_read(paths: dict[str, str], kwargs: dict[str, Any], epochs: range) -> list[np.ndarray]:
    """The ids each of ``epochs`` delivers, of a loader that never loaded a state."""
    loader, ds = StructuredDataset.create_dataloader(paths, **kwargs)
    out = []
    for epoch in epochs:
        ds.set_epoch(epoch)
        out.append(joined(ids_of(loader)))
    return out


def saved_after(loader: Any, batches: int) -> tuple[list[np.ndarray], dict[str, Any]]:
    """The first ``batches`` batches of ``loader``'s epoch, and its state then (as JSON)."""
    it = iter(loader)
    taken = [np.asarray(next(it)["id"]) for _ in range(batches)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return taken, state


# ------------------------------------------------------------------ a change into a shorter epoch


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("change", ["source removed", "smaller epoch_size"])
def test_a_change_into_a_shorter_epoch_ends_it_where_it_stands(
    tmp_path: Path, workers: int, change: str
) -> None:
    """300 positions read, the new epoch 200: the epoch in progress ends there (its rest is
    empty, ``len()`` counts its 30 batches), every state the loader saves loads, and the next
    epochs read 200 positions each, every source on from where it stood."""
    paths = {"a": write_source(tmp_path, "a", 0, 200), "b": write_source(tmp_path, "b", 1, 200)}
    kwargs = {"batch_size": 10, "num_workers": workers}
    loader, _ = StructuredDataset.create_dataloader(paths, weights={"a": 1, "b": 1}, **kwargs)
    before, state = saved_after(loader, 30)
    assert sum(state["streams"]) == 300
    if change == "source removed":  # epoch_size at its default: the rows of the sources, 200
        new, weights = {"a": paths["a"]}, {"a": 1}
    else:
        new, weights = paths, {"a": 1, "b": 1}
        kwargs["epoch_size"] = 200
    loader, ds = StructuredDataset.create_dataloader(new, weights=weights, **kwargs)
    loader.load_state_dict(state, reweight=True)
    assert len(loader) == 30  # the epoch's batches: it ends where it stood
    assert ids_of(loader) == []
    saved = json.loads(json.dumps(loader.state_dict()))
    assert saved["epoch"] == 0 and saved["streams"] == state["streams"]
    again, _ = StructuredDataset.create_dataloader(new, weights=weights, **kwargs)
    again.load_state_dict(saved)  # the loader's own state loads
    assert ids_of(again) == []
    later = []
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        assert len(loader) == 20
        later += ids_of(loader)
    assert len(later) == 40
    streams = max(1, workers)
    whole = [
        joined([*mine, *rest])
        for mine, rest in zip(per_stream(before, streams), per_stream(later, streams), strict=True)
    ]
    assert_each_source_epoch_once(whole, [200, 200])
    if change == "source removed":
        assert all((joined(per_stream(later, streams)[g]) < _SPAN).all() for g in range(streams))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packed_change_into_a_shorter_epoch_ends_it_where_it_stands(
    tmp_path: Path, workers: int
) -> None:
    paths = {"a": write_documents(tmp_path, "a", 0, 40), "b": write_documents(tmp_path, "b", 1, 40)}
    kwargs = {"weights": {"a": 1, "b": 1}, "batch_size": 2, "num_workers": workers,
              "packing": TokenPacking("tokens", seq_len=8)}  # fmt: skip
    loader, _ = StructuredDataset.create_dataloader(paths, epoch_size=40, **kwargs)
    it = iter(loader)
    before = [next(it) for _ in range(15)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    loader, ds = StructuredDataset.create_dataloader(paths, epoch_size=20, **kwargs)
    loader.load_state_dict(state, reweight=True)
    assert len(loader) == 15
    assert list(loader) == []
    saved = json.loads(json.dumps(loader.state_dict()))
    again, _ = StructuredDataset.create_dataloader(paths, epoch_size=20, **kwargs)
    again.load_state_dict(saved)
    assert list(again) == []
    later = []
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == 10
        later += batches
    streams = max(1, workers)
    whole = [documents_started([*before[g::streams], *later[g::streams]]) for g in range(streams)]
    assert_each_source_epoch_once(whole, [40, 40])


# ------------------------------------------------------------------ a packed epoch again


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packed_epoch_after_the_first_iterates_again(tmp_path: Path, workers: int) -> None:
    """``set_epoch(1)`` twice, or one batch and then the whole loop: epoch 1 again, from where
    it began, as one packed dataset replays its epoch."""
    paths = {"a": write_documents(tmp_path, "a", 0, 30), "b": write_documents(tmp_path, "b", 1, 30)}
    loader, ds = StructuredDataset.create_dataloader(
        paths, weights={"a": 2, "b": 1}, packing=TokenPacking("tokens", seq_len=8),
        epoch_size=24, batch_size=2, num_workers=workers,
    )  # fmt: skip
    list(loader)
    ds.set_epoch(1)
    first = [b["input_ids"].tolist() for b in loader]
    assert len(first) == 12
    ds.set_epoch(1)
    ds.set_epoch(1)
    assert next(iter(loader))["input_ids"].tolist() == first[0]
    assert [b["input_ids"].tolist() for b in loader] == first
    ds.set_epoch(2)
    assert len(list(loader)) == 12


def test_set_epoch_of_a_packed_mixture_raises_where_it_cannot_start(tmp_path: Path) -> None:
    """Where a packed epoch after the first begins is known by reading the one before it:
    ``set_epoch`` says so at once, and leaves the dataset as it was. The refusal is a library
    error that is also the documented ``ValueError``."""
    assert issubclass(EpochStartError, ValueError)
    assert issubclass(EpochStartError, DataLoaderUtilsError)
    paths = {"a": write_documents(tmp_path, "a", 0, 30), "b": write_documents(tmp_path, "b", 1, 30)}
    loader, ds = StructuredDataset.create_dataloader(
        paths, weights={"a": 1, "b": 1}, packing=TokenPacking("tokens", seq_len=8),
        epoch_size=10, batch_size=2,
    )  # fmt: skip
    with pytest.raises(
        EpochStartError, match="epoch 2 continues each source where the epoch before"
    ):
        ds.set_epoch(2)
    assert ds.epoch == 0 and len(list(loader)) == 5
    ds.set_epoch(1)
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    loader, ds = StructuredDataset.create_dataloader(
        paths, weights={"a": 1, "b": 1}, packing=TokenPacking("tokens", seq_len=8),
        epoch_size=10, batch_size=2,
    )  # fmt: skip
    loader.load_state_dict(state)
    assert len(list(loader)) == 4
    with pytest.raises(EpochStartError, match="epoch 1 continues each source"):
        next(iter(loader))  # where epoch 1 began is not in the state
    loader.load_state_dict(state)
    with pytest.raises(EpochStartError, match="epoch 1 continues each source"):
        ds.set_epoch(1)
    # at its start, but dealt by an elastic resume: its rest reads, a restart is refused
    ds.set_epoch(0)
    list(loader)
    ds.set_epoch(1)
    start = json.loads(json.dumps(loader.state_dict()))
    loader.load_state_dict([start], elastic=True)
    assert len(list(loader)) == 5
    with pytest.raises(EpochStartError, match="epoch 1 continues each source"):
        ds.set_epoch(1)


# ------------------------------------------------------------------ restarting a loaded epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_of_a_reweighted_state_restarts_its_epoch(tmp_path: Path, workers: int) -> None:
    """After ``load_state_dict(reweight=True)``, ``set_epoch(dataset.epoch)`` restarts that
    epoch from its beginning, under the current mixture: what a loader that never loaded the
    state reads; a state saved in the restarted epoch resumes exactly, into the next epoch."""
    paths = {"a": write_source(tmp_path, "a", 0, 120), "b": write_source(tmp_path, "b", 1, 90)}
    kwargs = {"batch_size": 10, "num_workers": workers, "shuffle": True}
    loader, ds = StructuredDataset.create_dataloader(paths, weights={"a": 1, "b": 1}, **kwargs)
    ds.set_epoch(1)
    _, state = saved_after(loader, 6)
    new = {"weights": {"a": 3, "b": 1}, **kwargs}
    expected = epochs_read(paths, new, range(1, 3))
    loader, ds = StructuredDataset.create_dataloader(paths, **new)
    loader.load_state_dict(state, reweight=True)
    with pytest.warns(UserWarning, match="discards the checkpoint's progress in epoch 1"):
        ds.set_epoch(ds.epoch)
    assert len(loader) == len(StructuredDataset.create_dataloader(paths, **new)[0])
    assert np.array_equal(joined(ids_of(loader)), expected[0])
    assert np.array_equal(joined(ids_of(loader)), expected[0])  # again: a replay
    ds.set_epoch(2)
    assert np.array_equal(joined(ids_of(loader)), expected[1])
    # a state saved in the restarted epoch resumes it, and the next epoch, exactly
    loader, ds = StructuredDataset.create_dataloader(paths, **new)
    loader.load_state_dict(state, reweight=True)
    with pytest.warns(UserWarning, match="discards the checkpoint's progress in epoch 1"):
        ds.set_epoch(1)
    taken, saved = saved_after(loader, 4)
    resumed, resumed_ds = StructuredDataset.create_dataloader(paths, **new)
    resumed.load_state_dict(saved)
    assert np.array_equal(joined([*taken, *ids_of(resumed)]), expected[0])
    resumed_ds.set_epoch(2)
    assert np.array_equal(joined(ids_of(resumed)), expected[1])


def test_persistent_workers_restart_a_reweighted_epoch_with_the_main_process(
    tmp_path: Path,
) -> None:
    """Workers kept from the resumed rest (which read the loaded schedule) restart the
    epoch, and go on to the next, as the main process records them."""
    paths = {"a": write_source(tmp_path, "a", 0, 80), "b": write_source(tmp_path, "b", 1, 60)}
    kwargs = {"batch_size": 5, "num_workers": 2, "persistent_workers": True}
    loader, _ = StructuredDataset.create_dataloader(paths, weights={"a": 1, "b": 1}, **kwargs)
    _, state = saved_after(loader, 5)
    new = {"weights": {"a": 1, "b": 2}, **kwargs}
    expected = epochs_read(paths, new, range(2))
    loader, ds = StructuredDataset.create_dataloader(paths, **new)
    loader.load_state_dict(state, reweight=True)
    assert len(ids_of(loader)) == 28 - 5
    ds.set_epoch(0)
    it = iter(loader)
    taken = [np.asarray(next(it)["id"]) for _ in range(3)]
    saved = json.loads(json.dumps(loader.state_dict()))
    taken += ids_of(it)
    assert np.array_equal(joined(taken), expected[0])
    ds.set_epoch(1)
    assert np.array_equal(joined(ids_of(loader)), expected[1])
    resumed, resumed_ds = StructuredDataset.create_dataloader(paths, **new)
    resumed.load_state_dict(saved)
    assert np.array_equal(joined([*taken[:3], *ids_of(resumed)]), expected[0])
    resumed_ds.set_epoch(1)
    assert np.array_equal(joined(ids_of(resumed)), expected[1])


def test_iterating_a_reweighted_epoch_again_replays_it_from_its_beginning(
    tmp_path: Path,
) -> None:
    """The rest of a reweighted epoch, then the loop again without ``set_epoch``: the epoch
    from its beginning (as one dataset replays), not an error; ``set_epoch`` then goes on."""
    paths = {"a": write_source(tmp_path, "a", 0, 60), "b": write_source(tmp_path, "b", 1, 60)}
    loader, _ = StructuredDataset.create_dataloader(paths, weights={"a": 1, "b": 1}, batch_size=8)
    _, state = saved_after(loader, 3)
    loader, ds = StructuredDataset.create_dataloader(paths, weights={"a": 2, "b": 1}, batch_size=8)
    fresh, _ = StructuredDataset.create_dataloader(paths, weights={"a": 2, "b": 1}, batch_size=8)
    loader.load_state_dict(state, reweight=True)
    assert len(ids_of(loader)) == 12
    assert np.array_equal(joined(ids_of(loader)), joined(ids_of(fresh)))
    ds.set_epoch(1)
    assert len(ids_of(loader)) == 15


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_after_an_elastic_load_restarts_the_epoch(tmp_path: Path, workers: int) -> None:
    """As one dataset: after an elastic load, ``set_epoch(dataset.epoch)`` is the whole epoch
    on the new world (not the re-dealt rest of it), as a loader that loaded nothing reads."""
    paths = {"a": write_source(tmp_path, "a", 0, 100), "b": write_source(tmp_path, "b", 1, 70)}
    kwargs = {"weights": {"a": 3, "b": 2}, "batch_size": 5, "shuffle": True}
    loader, ds = StructuredDataset.create_dataloader(paths, num_workers=1, **kwargs)
    _, state = saved_after(loader, 7)
    loader, ds = StructuredDataset.create_dataloader(paths, num_workers=workers, **kwargs)
    fresh, _ = StructuredDataset.create_dataloader(paths, num_workers=workers, **kwargs)
    expected = ids_of(fresh)
    rest, _ = StructuredDataset.create_dataloader(paths, num_workers=workers, **kwargs)
    rest.load_state_dict([state], elastic=True)
    left = ids_of(rest)
    assert sum(map(len, left)) == 170 - 7 * 5
    loader.load_state_dict([state], elastic=True)
    assert len(loader) == len(left)  # the re-dealt rest's batches
    with pytest.warns(UserWarning, match="discards the checkpoint's progress"):
        ds.set_epoch(0)
    assert len(loader) == len(expected)
    assert np.array_equal(joined(ids_of(loader)), joined(expected))


# ------------------------------------------------------------------ drop_last


@pytest.mark.parametrize("workers", [0, 2])
def test_drop_last_skips_no_row_of_a_source(tmp_path: Path, workers: int) -> None:
    """With ``drop_last`` a stream's epoch is whole batches: the positions a last, partial
    batch would have held open the next epoch, so each source's rows still come once per
    source epoch (before, they were skipped: rows 12-14 of ``a`` never came)."""
    paths = {"a": write_source(tmp_path, "a", 0, 30), "b": write_source(tmp_path, "b", 1, 30)}
    loader, ds = StructuredDataset.create_dataloader(
        paths, weights={"a": 1, "b": 1}, batch_size=4, drop_last=True, epoch_size=30,
        num_workers=workers,
    )  # fmt: skip
    streams = max(1, workers)
    batches: list[np.ndarray] = []
    for epoch in range(4):
        ds.set_epoch(epoch)
        got = ids_of(loader)
        assert len(got) == len(loader) == (30 // streams) // 4 * streams
        assert all(len(b) == 4 for b in got)
        batches += got
    whole = [joined(mine) for mine in per_stream(batches, streams)]
    assert_each_source_epoch_once(whole, [30, 30])
    if workers == 0:  # a's first source epoch: every row (rows 12-14 were missing)
        a = joined(batches)[joined(batches) < _SPAN]
        assert sorted(a[:30].tolist()) == list(range(30))


# ------------------------------------------------------------------ what docs/mixing.md says


def test_the_documented_period_is_what_the_loader_delivers(tmp_path: Path) -> None:
    text = _DOCS.read_text()
    found = re.search(r"With weights 6 : 3 : 1 the period is `([a-z ]+)`", text)
    assert found is not None
    names = ("web", "code", "math")
    paths = {name: write_source(tmp_path, name, s, 40) for s, name in enumerate(names)}
    loader, _ = StructuredDataset.create_dataloader(
        paths, weights={"web": 6, "code": 3, "math": 1}, batch_size=10
    )
    delivered = [names[s] for s in next(iter(loader))["source"].tolist()]
    assert " ".join(delivered) == found.group(1)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_change_at_the_end_of_an_epoch_keeps_it_ended(tmp_path: Path, workers: int) -> None:
    """A source added at a checkpoint after an epoch's last batch (``epoch_size`` at its
    default: the epoch grows): the epoch stays ended, and the next one reads every source on
    from where it stood (before, the positions the epoch grew by were skipped, their rows with
    them)."""
    paths = {
        "a": write_source(tmp_path, "a", 0, 60),
        "b": write_source(tmp_path, "b", 1, 40),
        "c": write_source(tmp_path, "c", 2, 40),
    }
    kwargs = {"batch_size": 10, "num_workers": workers}
    two = {"a": paths["a"], "b": paths["b"]}
    loader, _ = StructuredDataset.create_dataloader(two, weights={"a": 1, "b": 1}, **kwargs)
    before = ids_of(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    loader, ds = StructuredDataset.create_dataloader(
        paths, weights={"a": 1, "b": 1, "c": 1}, **kwargs
    )
    loader.load_state_dict(state, reweight=True)
    assert len(loader) == len(before) and ids_of(loader) == []
    again, _ = StructuredDataset.create_dataloader(
        paths, weights={"a": 1, "b": 1, "c": 1}, **kwargs
    )
    again.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert ids_of(again) == []
    later = []
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        later += ids_of(loader)
    streams = max(1, workers)
    whole = [
        joined([*mine, *rest])
        for mine, rest in zip(per_stream(before, streams), per_stream(later, streams), strict=True)
    ]
    assert_each_source_epoch_once(whole, [60, 40, 40])


def test_an_elastic_rest_changed_into_a_shorter_epoch_loads(tmp_path: Path) -> None:
    """An elastic resume's rest (135 positions), then a change to ``epoch_size=50``: the rest
    goes on to the new epoch's end, and the loader's state loads (before: refused, "gives
    worker 0 135 positions in epoch 0, more than an epoch's 50")."""
    paths = {"a": write_source(tmp_path, "a", 0, 100), "b": write_source(tmp_path, "b", 1, 70)}
    kwargs = {"weights": {"a": 3, "b": 2}, "batch_size": 5}
    loader, _ = StructuredDataset.create_dataloader(paths, num_workers=1, **kwargs)
    _, state = saved_after(loader, 7)
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    loader.load_state_dict([state], elastic=True)
    dealt = json.loads(json.dumps(loader.state_dict()))
    assert dealt["_mixture"]["segment"][3] == [135]
    loader, ds = StructuredDataset.create_dataloader(paths, epoch_size=50, **kwargs)
    loader.load_state_dict(dealt, reweight=True)
    saved = json.loads(json.dumps(loader.state_dict()))
    assert len(ids_of(loader)) == len(loader) == 10
    again, _ = StructuredDataset.create_dataloader(paths, epoch_size=50, **kwargs)
    again.load_state_dict(saved)
    assert len(ids_of(again)) == 10
    ds.set_epoch(1)
    assert len(ids_of(loader)) == 10


@given(
    before=st.lists(st.integers(1, 5), min_size=2, max_size=2),
    after=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    sizes=st.tuples(st.sampled_from([None, 40, 90]), st.sampled_from([None, 20, 60, 130])),
    stop=st.integers(0, 30),
    workers=st.integers(0, 2),
)
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_change_of_epoch_size_loses_and_repeats_nothing(
    tmp_path_factory: pytest.TempPathFactory,
    before: list[int],
    after: list[int],
    sizes: tuple[int | None, int | None],
    stop: int,
    workers: int,
) -> None:
    """Weights, sources and ``epoch_size`` changed at any batch (the new epoch shorter or
    longer than what was read): the state after the change loads, and the rest of the epoch
    then the next two read every source on where it stood, each row once per source epoch."""
    root = tmp_path_factory.mktemp("mix")
    rows = [50, 30, 20]
    paths = {f"s{i}": write_source(root, f"s{i}", i, n) for i, n in enumerate(rows)}
    two = {k: paths[k] for k in ("s0", "s1")}
    old = StructuredDataset(two, weights=dict(zip(two, before, strict=True)), batch_size=5,
                            epoch_size=sizes[0])  # fmt: skip
    first, state = state_after(old, workers, stop)
    names = list(paths)[: len(after)]
    kwargs = {"weights": dict(zip(names, after, strict=True)), "batch_size": 5,
              "epoch_size": sizes[1]}  # fmt: skip
    new = StructuredDataset({n: paths[n] for n in names}, **kwargs)
    new.load_state_dict(state, reweight=True)
    rest = new._epochs.begin(new._start, workers)
    saved = json.loads(json.dumps(encode_mixture(rest.mix, rest)))
    StructuredDataset({n: paths[n] for n in names}, **kwargs).load_state_dict(saved)
    per_stream = []
    for w in range(max(1, workers)):
        later = [np.asarray(b["id"]) for b, _ in new._reader(rest, w).batches()]
        for epoch in (1, 2):
            later += stream_batches(new, epoch, workers)[w]
        per_stream.append(joined([*first[w], *later]))
    assert_each_source_epoch_once(per_stream, rows)
