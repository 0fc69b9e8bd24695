"""Weighted mixing (SPEC semantics 11): the schedule's bound, every row of a source once per
source epoch, exact resume, a change of weights or sources that loses and repeats nothing, and
the errors a wrong mixture or state gets."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _harness import mixture_elastic_batches, torch_round_trip
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_fuzz import mutate

from torch_dataloader_utils import (
    CheckpointMismatchError,
    InvalidStateError,
    SchemaMismatchError,
    Source,
    StructuredDataset,
    TokenPacking,
)
from torch_dataloader_utils.mixing import stream as _mix_stream
from torch_dataloader_utils.mixing.assemble import interleaved
from torch_dataloader_utils.mixing.phases import phase_interleave, phase_sources, phases, stream_end
from torch_dataloader_utils.mixing.schedule import MAX_PERIOD, Interleave, Schedule
from torch_dataloader_utils.mixing.state import encode_mixture
from torch_dataloader_utils.planning.epochs import Start

# Source s holds ids s * _SPAN + [0, rows): a row's id tells its source and row.
_SPAN = 1_000_000


def write_source(root: Path, name: str, number: int, rows: int, files: int = 2) -> str:
    """``rows`` rows over ``files`` Parquet files (row groups of 7) under ``root/name``."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for f in range(files):
        ids = np.arange(bounds[f], bounds[f + 1], dtype=np.int64) + number * _SPAN
        table = pa.table({"id": ids, "x": ids.astype(np.float32)})
        pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=7)
    return str(folder)


def shares(rows: int, streams: int) -> list[int]:
    """Rows of one epoch each stream reads: the larger shares first."""
    quota, extra = divmod(rows, streams)
    return [quota + (g < extra) for g in range(streams)]


def stream_batches(ds: StructuredDataset, epoch: int, workers: int) -> list[list[np.ndarray]]:
    """Every worker stream's batches of ``epoch`` on this rank, read in this process."""
    progress = ds._epochs.begin(Start.fresh(epoch), workers)
    return [
        [np.asarray(batch["id"]) for batch, _ in ds._reader(progress, w).batches()]
        for w in range(max(1, workers))
    ]


def state_after(
    ds: StructuredDataset, workers: int, stop: int
) -> tuple[list[list[np.ndarray]], dict[str, Any]]:
    """Epoch 0's first ``stop`` batches (or all), handed out in round robin over the worker
    streams as the loader does: each stream's ids, and the state then (through JSON)."""
    progress = ds._epochs.begin(Start.fresh(0), workers)
    readers = [ds._reader(progress, w).batches() for w in range(max(1, workers))]
    first: list[list[np.ndarray]] = [[] for _ in readers]
    for step in range(stop):
        w = step % len(readers)
        batch, position = next(readers[w], (None, None))
        if batch is None:
            break
        first[w].append(np.asarray(batch["id"]))
        progress.record(w, position, (w + 1) % len(readers))
    return first, json.loads(json.dumps(encode_mixture(ds._epochs, progress)))


def assert_each_source_epoch_once(per_stream: Sequence[np.ndarray], sizes: Sequence[int]) -> None:
    """``per_stream[g]``: ids stream ``g`` delivered in order. Each source's ids of a stream,
    cut into that stream's shares of successive source epochs: every epoch all streams
    finished holds each row of the source once; a started one holds no row twice."""
    streams = len(per_stream)
    for s, rows in enumerate(sizes):
        quota = shares(rows, streams)
        epochs: list[list[np.ndarray]] = []
        for g, ids in enumerate(per_stream):
            mine = ids[ids // _SPAN == s] - s * _SPAN
            cut = [mine[i : i + quota[g]] for i in range(0, len(mine), quota[g])]
            for e, part in enumerate(cut):
                assert len(np.unique(part)) == len(part), (s, g, e)
                if len(epochs) <= e:
                    epochs.append([])
                epochs[e].append(part)
        for e, parts in enumerate(epochs):
            joined = np.concatenate(parts)
            assert len(np.unique(joined)) == len(joined), (s, e)
            if len(parts) == streams and all(
                len(p) == q for p, q in zip(parts, quota, strict=True)
            ):
                assert np.array_equal(np.sort(joined), np.arange(rows)), (s, e)


def assert_within_one(ids: np.ndarray, weights: Sequence[int], every: int) -> None:
    """After every ``every`` positions each source's count is within 1 of k * w / W."""
    total = sum(weights)
    sources = ids // _SPAN
    for k in range(every, len(ids) + 1, every):
        counts = np.bincount(sources[:k], minlength=len(weights))
        assert (np.abs(counts * total - k * np.array(weights)) < total).all(), (k, counts)


# ----------------------------------------------------------------------------- the schedule


@given(st.lists(st.integers(1, 60), min_size=1, max_size=12))
@settings(max_examples=150, deadline=None)
def test_schedule_keeps_every_source_within_one_of_its_share(weights: list[int]) -> None:
    schedule = Schedule(tuple(weights))
    reduced = np.array(schedule.reduced)
    period = schedule.period_length
    positions = np.arange(0, 2 * period + 3)
    sources = schedule.sources(0, len(positions))
    counts = np.zeros(len(weights), dtype=np.int64)
    for k in positions.tolist():
        assert np.array_equal(schedule.counts(k), counts)
        assert (np.abs(counts * period - k * reduced) < period).all()
        if k < len(sources):
            counts[sources[k]] += 1


def test_schedule_is_pinned() -> None:
    """The order of sources is part of what a checkpoint's position means."""
    assert Schedule((7, 3)).period.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    assert Schedule((5, 3, 2)).period.tolist() == [0, 1, 0, 2, 0, 1, 0, 2, 1, 0]
    assert Schedule((14, 6)).period.tolist() == Schedule((7, 3)).period.tolist()


def test_schedule_refuses_weights_it_cannot_schedule() -> None:
    with pytest.raises(ValueError, match="positive integers"):
        Schedule((3, 0))
    with pytest.raises(ValueError, match="round them"):
        Schedule((MAX_PERIOD, 1))


# ----------------------------------------------------------------------------- delivery


@st.composite
def mixtures(draw: Any) -> dict[str, Any]:
    count = draw(st.integers(1, 3))
    return {
        "rows": [draw(st.integers(12, 160)) for _ in range(count)],
        "weights": [draw(st.integers(1, 9)) for _ in range(count)],
        "world_size": draw(st.integers(1, 3)),
        "workers": draw(st.integers(0, 2)),
        "batch_size": draw(st.integers(1, 17)),
        "shuffle": draw(st.booleans()),
        "per_epoch": draw(st.one_of(st.none(), st.integers(12, 200))),
        # positions mixed at a time (at least a batch): small, so an epoch crosses chunks
        "mix_rows": draw(st.integers(1, 64)),
    }


@given(case=mixtures())
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_every_row_of_a_source_once_per_source_epoch(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    root = tmp_path_factory.mktemp("mix")
    paths = {f"s{i}": write_source(root, f"s{i}", i, n) for i, n in enumerate(case["rows"])}
    weights = dict(zip(paths, case["weights"], strict=True))
    per_stream: list[list[np.ndarray]] = []
    batches_per_rank = []
    with mock.patch.object(_mix_stream, "_MIX_ROWS", case["mix_rows"]):
        for rank in range(case["world_size"]):
            ds = StructuredDataset(
                paths, weights=weights, batch_size=case["batch_size"], shuffle=case["shuffle"],
                rank=rank, world_size=case["world_size"], epoch_size=case["per_epoch"],
            )  # fmt: skip
            epochs = [stream_batches(ds, e, case["workers"]) for e in range(3)]
            batches_per_rank.append(sum(len(b) for b in epochs[0]))
            for w in range(max(1, case["workers"])):
                ids = np.concatenate([b for epoch in epochs for b in epoch[w]])
                assert_within_one(ids, case["weights"], case["batch_size"])
                per_stream.append(ids)
    assert_each_source_epoch_once(per_stream, case["rows"])
    assert len(set(batches_per_rank)) == 1  # even_batches: DDP steps alike on every rank


@given(case=mixtures(), stop=st.integers(0, 40), data=st.data())
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_resume_is_exact_at_any_batch(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any], stop: int, data: Any
) -> None:
    """A checkpoint after any batch of epoch 0 or 1, through JSON, continues the same batches
    (the last source of two or more may have a maximum number of epochs)."""
    root = tmp_path_factory.mktemp("mix")
    paths: dict[str, Any] = {
        f"s{i}": write_source(root, f"s{i}", i, n) for i, n in enumerate(case["rows"])
    }
    limit = data.draw(st.one_of(st.none(), st.integers(1, 2)))
    if len(paths) > 1 and limit is not None:
        paths[f"s{len(paths) - 1}"] = Source(path=paths[f"s{len(paths) - 1}"], max_epochs=limit)
    kwargs = {
        "weights": dict(zip(paths, case["weights"], strict=True)),
        "batch_size": case["batch_size"], "shuffle": case["shuffle"],
        "epoch_size": case["per_epoch"],
    }  # fmt: skip
    epoch = data.draw(st.integers(0, 1))
    with mock.patch.object(_mix_stream, "_MIX_ROWS", case["mix_rows"]):
        loader, ds = StructuredDataset.create_dataloader(paths, **kwargs)
        ds.set_epoch(epoch)
        full = [b["id"].tolist() for b in loader]
        loader, ds = StructuredDataset.create_dataloader(paths, **kwargs)
        ds.set_epoch(epoch)
        it = iter(loader)
        first = [next(it)["id"].tolist() for _ in range(min(stop, len(full)))]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
        loader.load_state_dict(state)
        assert first + [b["id"].tolist() for b in loader] == full


@pytest.mark.parametrize("workers", [2])
def test_resume_with_workers_is_exact(tmp_path: Path, workers: int) -> None:
    paths = {n: write_source(tmp_path, n, i, r, 3) for i, (n, r) in enumerate(
        [("web", 700), ("code", 300), ("math", 90)])}  # fmt: skip
    kwargs = {"weights": {"web": 6, "code": 3, "math": 1}, "batch_size": 25, "shuffle": True,
              "num_workers": workers}  # fmt: skip
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    full = [b["id"].tolist() for b in loader]
    assert sum(map(len, full)) == 1090
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    it = iter(loader)
    first = [next(it)["id"].tolist() for _ in range(17)]
    state = loader.state_dict()
    del it
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    loader.load_state_dict(state)
    assert first + [b["id"].tolist() for b in loader] == full


def test_batches_name_each_rows_source(tmp_path: Path) -> None:
    paths = {"a": write_source(tmp_path, "a", 0, 50), "b": write_source(tmp_path, "b", 1, 50)}
    loader, dataset = StructuredDataset.create_dataloader(
        paths, weights={"a": 1, "b": 1}, batch_size=10, source_column="origin"
    )
    for epoch in range(2):
        dataset.set_epoch(epoch)
        for number, batch in enumerate(loader):
            assert batch["origin"].tolist() == (batch["id"] // _SPAN).tolist()
            if number == 0:
                assert batch["origin"].tolist() == [0, 1] * 5
            batch["origin"] += 7  # the user's own tensor: not the schedule's kept interleave


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shuffled_mixture_keeps_every_column_of_its_rows(tmp_path: Path, workers: int) -> None:
    """Token lists, strings and numbers with nulls come mixed with their own row: gathered
    from each source's window, then interleaved (numbers scattered, the others gathered)."""
    paths = {}
    for number, (name, rows) in enumerate({"a": 300, "b": 200}.items()):
        ids = np.arange(rows, dtype=np.int64) + number * _SPAN
        table = pa.table({
            "id": ids,
            "tokens": pa.array([list(range(i % 9)) for i in ids.tolist()], pa.list_(pa.int32())),
            "text": pa.array([f"row {i}" for i in ids.tolist()]),
            "maybe": pa.array([None if i % 5 == 0 else float(i) for i in ids.tolist()]),
        })  # fmt: skip
        (tmp_path / name).mkdir()
        pq.write_table(table, tmp_path / name / "part-0.parquet", row_group_size=32)
        paths[name] = str(tmp_path / name)
    loader, _ = StructuredDataset.create_dataloader(
        paths, weights={"a": 3, "b": 2}, batch_size=20, shuffle=True, shuffle_memory_bytes=4096,
        num_workers=workers, output="numpy",
    )  # fmt: skip
    seen = []
    for batch in loader:
        ids = batch["id"].tolist()
        seen.extend(ids)
        assert [t.tolist() for t in batch["tokens"]] == [list(range(i % 9)) for i in ids]
        assert list(batch["text"]) == [f"row {i}" for i in ids]
        expected = [np.nan if i % 5 == 0 else float(i) for i in ids]
        np.testing.assert_array_equal(batch["maybe"], expected)
    assert sorted(seen) == sorted([*range(300), *range(_SPAN, _SPAN + 200)])
    assert seen != sorted(seen)


# ----------------------------------------------------------------------------- a changed mixture


@given(
    before=st.lists(st.integers(1, 9), min_size=2, max_size=2),
    after=st.lists(st.integers(1, 9), min_size=3, max_size=3),
    stop=st.integers(0, 30),
    workers=st.integers(0, 2),
)
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_reweight_loses_and_repeats_nothing(
    tmp_path_factory: pytest.TempPathFactory,
    before: list[int],
    after: list[int],
    stop: int,
    workers: int,
) -> None:
    """Weights changed and a source added at a checkpoint: every source continues where it
    stood (each row once per source epoch), the added one from its first epoch, and the new
    weights hold from the checkpoint on."""
    root = tmp_path_factory.mktemp("mix")
    rows = [90, 40, 30]
    paths = {f"s{i}": write_source(root, f"s{i}", i, n) for i, n in enumerate(rows)}
    two = {k: paths[k] for k in ("s0", "s1")}
    old = StructuredDataset(two, weights=dict(zip(two, before, strict=True)), batch_size=5,
                            shuffle=True)  # fmt: skip
    first, state = state_after(old, workers, stop)
    new = StructuredDataset(paths, weights=dict(zip(paths, after, strict=True)), batch_size=5,
                            shuffle=True)  # fmt: skip
    with pytest.raises(CheckpointMismatchError, match="reweight=True"):
        new.load_state_dict(state)
    new.load_state_dict(state, reweight=True)
    start = new._start
    rest = new._epochs.begin(start, workers)
    per_stream = []
    for w in range(max(1, workers)):
        later = [np.asarray(b["id"]) for b, _ in new._reader(rest, w).batches()]
        later += [b for b in stream_batches(new, 1, workers)[w]]
        tail = np.concatenate(later)
        assert_within_one(tail, after, 1)
        per_stream.append(np.concatenate([*first[w], tail]))
    assert_each_source_epoch_once(per_stream, rows)


def test_changed_weights_are_refused_without_opt_in(tmp_path: Path) -> None:
    paths = {"a": write_source(tmp_path, "a", 0, 60), "b": write_source(tmp_path, "b", 1, 60)}
    loader, _ = StructuredDataset.create_dataloader(paths, weights={"a": 2, "b": 1}, batch_size=8)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader, _ = StructuredDataset.create_dataloader(paths, weights={"a": 1, "b": 1}, batch_size=8)
    with pytest.raises(CheckpointMismatchError) as info:
        loader.load_state_dict(state)
    assert info.value.field == "weights"
    assert "Likely cause: weights or sources changed" in str(info.value)


def test_a_changed_file_names_its_source(tmp_path: Path) -> None:
    paths = {"a": write_source(tmp_path, "a", 0, 60), "b": write_source(tmp_path, "b", 1, 60)}
    kwargs = {"weights": {"a": 2, "b": 1}, "batch_size": 8}
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    write_source(tmp_path, "b", 2, 60)  # new content, same names
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    with pytest.raises(CheckpointMismatchError, match="source 'b'") as info:
        loader.load_state_dict(state)
    assert info.value.field == "files"


def test_states_of_one_dataset_and_of_a_mixture_do_not_mix(tmp_path: Path) -> None:
    paths = {"a": write_source(tmp_path, "a", 0, 60), "b": write_source(tmp_path, "b", 1, 60)}
    mixed = StructuredDataset(paths, weights={"a": 1, "b": 1}, batch_size=8)
    single = StructuredDataset(paths["a"], batch_size=8)
    with pytest.raises(InvalidStateError, match="saved by a dataset of one source"):
        mixed.load_state_dict(single.state_dict())
    with pytest.raises(InvalidStateError, match="mixture"):
        single.load_state_dict(mixed.state_dict())


# ----------------------------------------------------------------------------- arguments


def test_sources_must_agree_on_columns(tmp_path: Path) -> None:
    a = write_source(tmp_path, "a", 0, 30)
    (tmp_path / "b").mkdir()
    pq.write_table(pa.table({"id": np.arange(30), "y": np.zeros(30)}), tmp_path / "b/0.parquet")
    with pytest.raises(SchemaMismatchError, match="sources 'a' and 'b' differ in column 'x'"):
        StructuredDataset({"a": a, "b": str(tmp_path / "b")}, weights={"a": 1, "b": 1})
    ds = StructuredDataset(
        {"a": a, "b": str(tmp_path / "b")}, weights={"a": 1, "b": 1}, columns=["id"]
    )
    assert ds._epochs.schema.names == ["id", "source"]


def test_weights_are_checked(tmp_path: Path) -> None:
    paths = {"a": write_source(tmp_path, "a", 0, 30), "b": write_source(tmp_path, "b", 1, 30)}
    with pytest.raises(TypeError, match="needs weights="):
        StructuredDataset(paths)
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        StructuredDataset(paths, weights={"a": 1, "c": 1})
    with pytest.raises(TypeError, match=r"weights\['a'\] must be an int"):
        StructuredDataset(paths, weights={"a": 0.7, "b": 0.3})
    with pytest.raises(ValueError, match=r"weights\['b'\] must be"):
        StructuredDataset(paths, weights={"a": 1, "b": 0})
    with pytest.raises(TypeError, match="are for a mixture"):
        StructuredDataset(paths["a"], weights={"a": 1})


def test_every_stream_must_read_every_source(tmp_path: Path) -> None:
    paths = {
        "big": write_source(tmp_path, "big", 0, 100),
        "tiny": write_source(tmp_path, "t", 1, 3, 1),
    }
    ds = StructuredDataset(paths, weights={"big": 9, "tiny": 1}, rank=0, world_size=2)
    with pytest.raises(ValueError, match="source 'tiny' has 3 row"):
        stream_batches(ds, 0, 2)


def test_sources_may_differ_in_format_and_split_size(tmp_path: Path) -> None:
    import pyarrow.feather as feather

    (tmp_path / "arrow").mkdir()
    ids = np.arange(40, dtype=np.int64) + _SPAN
    feather.write_feather(pa.table({"id": ids, "x": ids.astype(np.float32)}),
                          tmp_path / "arrow/0.arrow", chunksize=9)  # fmt: skip
    paths = {
        "pq": write_source(tmp_path, "pq", 0, 60),
        "ipc": Source(path=str(tmp_path / "arrow"), format="arrow", split_bytes=1),
    }
    loader, _ = StructuredDataset.create_dataloader(
        paths, weights={"pq": 3, "ipc": 2}, batch_size=10
    )
    ids_read = np.concatenate([b["id"].numpy() for b in loader])
    assert sorted(ids_read[ids_read < _SPAN].tolist()) == list(range(60))
    assert len(ids_read) == 100 and math.isclose((ids_read >= _SPAN).mean(), 0.4)


def test_a_source_may_have_its_own_shuffle_budget(tmp_path: Path) -> None:
    """``Source(shuffle_memory_bytes=)`` sizes that source's windows (the others keep the
    dataset's), is recorded in its state, and a resume under another budget names the source."""
    a, b = write_source(tmp_path, "a", 0, 400, 4), write_source(tmp_path, "b", 1, 200)

    def mixture(budget: int) -> tuple[Any, StructuredDataset]:
        return StructuredDataset.create_dataloader(
            {"a": Source(path=a, shuffle_memory_bytes=budget), "b": b}, weights={"a": 2, "b": 1},
            batch_size=10, shuffle=True, shuffle_memory_bytes=1 << 20,
        )  # fmt: skip

    loader, ds = mixture(4096)
    windows = [epochs.window_rows for epochs in ds._epochs.sources]
    assert windows[0] == 4096 // (3 * ds._epochs.sources[0].index.file_row_bytes) < windows[1]
    batches = iter(loader)
    seen = [i for batch in itertools.islice(batches, 5) for i in batch["id"].tolist()]
    state = json.loads(json.dumps(loader.state_dict()))
    assert [state["sources"][n]["_shuffle_memory_bytes"] for n in "ab"] == [4096, 1 << 20]
    seen += [i for batch in batches for i in batch["id"].tolist()]
    assert sorted(seen) == list(range(400)) + list(range(_SPAN, _SPAN + 200))

    resumed, _ = mixture(4096)
    resumed.load_state_dict(state)
    assert [i for b in resumed for i in b["id"].tolist()] == seen[50:]
    other, _ = mixture(8192)
    with pytest.raises(CheckpointMismatchError, match=r"source 'a'.*shuffle_memory_bytes"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="source 'a': shuffle_memory_bytes=100 is below"):
        mixture(100)


# ----------------------------------------------------------------------------- packed mixtures


def write_documents(root: Path, name: str, number: int, docs: int, files: int = 2) -> str:
    """``docs`` documents of 1-12 tokens; token ``t`` of document ``d`` is
    ``(number * _SPAN + d) * 100 + t``, so every token names its source, document and place."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(number)
    bounds = np.linspace(0, docs, files + 1).astype(int)
    for f in range(files):
        tokens = [
            [(number * _SPAN + d) * 100 + t for t in range(int(rng.integers(1, 13)))]
            for d in range(bounds[f], bounds[f + 1])
        ]
        table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int64()))})
        pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=5)
    return str(folder)


def documents_started(batches: Sequence[Any]) -> np.ndarray:
    """The documents whose first token these packed batches hand out, in order, as ids
    ``source * _SPAN + document``."""
    tokens = np.concatenate([np.asarray(b["input_ids"]).ravel() for b in batches])
    return tokens[tokens % 100 == 0] // 100


@st.composite
def packed_mixtures(draw: Any) -> dict[str, Any]:
    count = draw(st.integers(1, 3))
    return {
        "docs": [draw(st.integers(8, 60)) for _ in range(count)],
        "weights": [draw(st.integers(1, 5)) for _ in range(count)],
        "world_size": draw(st.integers(1, 2)),
        "workers": draw(st.integers(0, 2)),
        "batch_size": draw(st.integers(1, 5)),
        "seq_len": draw(st.integers(1, 24)),
        "shuffle": draw(st.booleans()),
        "epoch_size": draw(st.integers(4, 60)),
    }


def packed_kwargs(case: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    return {
        "weights": dict(zip(paths, case["weights"], strict=True)),
        "batch_size": case["batch_size"], "shuffle": case["shuffle"],
        "epoch_size": case["epoch_size"],
        "packing": TokenPacking("tokens", seq_len=case["seq_len"]),
    }  # fmt: skip


@given(case=packed_mixtures())
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_packed_mixture_hands_out_every_document_once_per_source_epoch(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    """Weights count sequences: after every batch each source's sequences are within 1 of
    their share; each source packs its own documents, every one once per source epoch."""
    root = tmp_path_factory.mktemp("packed")
    paths = {f"s{i}": write_documents(root, f"s{i}", i, n) for i, n in enumerate(case["docs"])}
    per_stream = []
    for rank in range(case["world_size"]):
        ds = StructuredDataset(
            paths, rank=rank, world_size=case["world_size"], **packed_kwargs(case, paths)
        )
        for w in range(max(1, case["workers"])):
            batches = []
            for epoch in range(3):
                start = ds._carried(epoch) if epoch else Start.fresh(0)
                assert start is not None
                progress = ds._epochs.begin(start, case["workers"])
                for batch, position in ds._reader(progress, w).batches():
                    progress.record(w, position, 0)
                    batches.append(batch)
                    sources = np.concatenate([np.asarray(b["source"]) for b in batches])
                    assert_within_one(
                        sources.astype(np.int64) * _SPAN, case["weights"], len(sources)
                    )
                ds._progress = progress
            per_stream.append(documents_started(batches))
    assert_each_source_epoch_once(per_stream, case["docs"])


@given(case=packed_mixtures(), stop=st.integers(0, 30))
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_packed_mixture_resumes_exactly_across_epochs(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any], stop: int
) -> None:
    """A checkpoint after any batch of two epochs, through JSON, continues the same batches,
    also into the next epoch (which continues each source where the epoch left it)."""
    root = tmp_path_factory.mktemp("packed")
    paths = {f"s{i}": write_documents(root, f"s{i}", i, n) for i, n in enumerate(case["docs"])}
    kwargs = packed_kwargs(case, paths)

    def epochs(loader: Any, ds: StructuredDataset, first: int, loaded: bool) -> list[list[int]]:
        out = []
        for epoch in range(first, 2):
            if epoch > first or not loaded:
                ds.set_epoch(epoch)
            out += [b["input_ids"].flatten().tolist() for b in loader]
        return out

    loader, ds = StructuredDataset.create_dataloader(paths, **kwargs)
    full = epochs(loader, ds, 0, loaded=False)
    loader, ds = StructuredDataset.create_dataloader(paths, **kwargs)
    taken: list[list[int]] = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        it = iter(loader)
        for batch in it:
            taken.append(batch["input_ids"].flatten().tolist())
            if len(taken) == stop:
                break
        if len(taken) == stop:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    loader, ds = StructuredDataset.create_dataloader(paths, **kwargs)
    loader.load_state_dict(state)
    assert taken + epochs(loader, ds, state["epoch"], loaded=True) == full


def test_a_packed_mixture_needs_its_epoch_size_and_its_epochs_in_order(tmp_path: Path) -> None:
    paths = {"a": write_documents(tmp_path, "a", 0, 30), "b": write_documents(tmp_path, "b", 1, 30)}
    packing = TokenPacking("tokens", seq_len=8)
    with pytest.raises(ValueError, match="needs epoch_size="):
        StructuredDataset(paths, weights={"a": 1, "b": 1}, packing=packing)
    loader, ds = StructuredDataset.create_dataloader(
        paths, weights={"a": 1, "b": 1}, packing=packing, epoch_size=10, batch_size=2
    )
    assert len(loader) == 5
    with pytest.raises(ValueError, match="epoch 3 continues each source where the epoch before"):
        ds.set_epoch(3)


def test_a_packed_mixture_state_is_builtins_only(tmp_path: Path) -> None:
    """JSON and ``torch.load(weights_only=True)`` take it, and it loads as it was saved."""
    paths = {"a": write_documents(tmp_path, "a", 0, 30), "b": write_documents(tmp_path, "b", 1, 30)}
    kwargs = {"weights": {"a": 2, "b": 1}, "packing": TokenPacking("tokens", seq_len=8),
              "epoch_size": 12, "batch_size": 2}  # fmt: skip
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert torch_round_trip(state) == state
    expected = [b["input_ids"].tolist() for b in it]
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    loader.load_state_dict(state)
    assert [b["input_ids"].tolist() for b in loader] == expected


# ----------------------------------------------------------------------------- exhaustion


@given(
    rows=st.lists(st.integers(12, 80), min_size=2, max_size=3),
    weights=st.lists(st.integers(1, 6), min_size=3, max_size=3),
    limits=st.lists(st.one_of(st.none(), st.integers(1, 2)), min_size=3, max_size=3),
    stop=st.booleans(),
    world_size=st.integers(1, 2),
    workers=st.integers(0, 2),
    shuffle=st.booleans(),
)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_source_stops_after_its_max_epochs(
    tmp_path_factory: pytest.TempPathFactory,
    rows: list[int],
    weights: list[int],
    limits: list[int | None],
    stop: bool,
    world_size: int,
    workers: int,
    shuffle: bool,
) -> None:
    """Each stream reads exactly ``max_epochs`` epochs of a limited source (every row once
    per epoch), then the others go on (renormalize), or the stream ends right after that
    source's last row (stop)."""
    root = tmp_path_factory.mktemp("limits")
    count = len(rows)
    policy = "stop" if stop else "renormalize"
    paths = {
        f"s{i}": Source(path=write_source(root, f"s{i}", i, n), max_epochs=limits[i],
                        when_exhausted=policy)
        for i, n in enumerate(rows)
    }  # fmt: skip
    per_stream = []
    for rank in range(world_size):
        ds = StructuredDataset(
            paths, weights=dict(zip(paths, weights[:count], strict=True)), batch_size=7,
            shuffle=shuffle, rank=rank, world_size=world_size, even_batches=False,
            epoch_size=3000 * world_size * max(1, workers),  # long enough to run out
        )  # fmt: skip
        streams = [stream_batches(ds, 0, workers)]
        for w in range(max(1, workers)):
            ids = np.concatenate([b for epoch in streams for b in epoch[w]] or [np.empty(0, int)])
            sources = ids // _SPAN
            g = rank * max(1, workers) + w
            read = np.bincount(sources, minlength=count)
            quota = [limits[s] and limits[s] * shares(rows[s], world_size * max(1, workers))[g]
                     for s in range(count)]  # fmt: skip
            limited = [s for s in range(count) if quota[s]]
            assert all(read[s] <= quota[s] for s in limited)
            ran_out = [s for s in limited if read[s] == quota[s]]
            if stop and limited:  # the stream ends right after the first one's last row
                assert ran_out and sources[-1] in ran_out
            else:  # renormalize: every limited source runs out, the others go on
                assert ran_out == limited
            per_stream.append(ids)
    assert_each_source_epoch_once(per_stream, rows)


def test_exhaustion_policies_are_checked(tmp_path: Path) -> None:
    a, b = write_source(tmp_path, "a", 0, 40), write_source(tmp_path, "b", 1, 40)
    with pytest.raises(ValueError, match="when_exhausted of source 'a' must be one of"):
        StructuredDataset({"a": Source(path=a, max_epochs=1, when_exhausted="halt"), "b": b},
                          weights={"a": 1, "b": 1})  # fmt: skip
    with pytest.raises(ValueError, match="DDP would hang"):
        StructuredDataset({"a": Source(path=a, max_epochs=1, when_exhausted="stop"), "b": b},
                          weights={"a": 1, "b": 1}, rank=0, world_size=2)  # fmt: skip
    docs = {
        "a": write_documents(tmp_path, "da", 0, 20),
        "b": write_documents(tmp_path, "db", 1, 20),
    }
    with pytest.raises(ValueError, match="max_epochs with packing"):
        StructuredDataset({"a": Source(path=docs["a"], max_epochs=1), "b": docs["b"]},
                          weights={"a": 1, "b": 1}, epoch_size=10,
                          packing=TokenPacking("tokens", seq_len=4))  # fmt: skip


def test_a_changed_policy_needs_reweight(tmp_path: Path) -> None:
    a, b = write_source(tmp_path, "a", 0, 40), write_source(tmp_path, "b", 1, 40)
    loader, _ = StructuredDataset.create_dataloader(
        {"a": Source(path=a, max_epochs=1), "b": b}, weights={"a": 1, "b": 1}, batch_size=6
    )
    it = iter(loader)
    first = [next(it)["id"].tolist() for _ in range(5)]
    state = loader.state_dict()
    rest = [batch["id"].tolist() for batch in it]
    loader, _ = StructuredDataset.create_dataloader(
        {"a": a, "b": b}, weights={"a": 1, "b": 1}, batch_size=6
    )
    with pytest.raises(CheckpointMismatchError, match="policies"):
        loader.load_state_dict(state)
    loader, _ = StructuredDataset.create_dataloader(
        {"a": Source(path=a, max_epochs=1), "b": b}, weights={"a": 1, "b": 1}, batch_size=6
    )
    loader.load_state_dict(json.loads(json.dumps(state)))
    assert first + [batch["id"].tolist() for batch in loader] == first + rest


def test_the_plan_command_shows_what_a_step_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan --source ... --step K`` names the source, file and row of every row of batch
    ``K``, as the loader then delivers it; and the rows of each source an epoch reads."""
    from torch_dataloader_utils.cli import main

    rows = {"web": 70, "code": 30, "math": 12}
    paths = {n: write_source(tmp_path, n, i, r) for i, (n, r) in enumerate(rows.items())}
    weights = {"web": 6, "code": 3, "math": 1}
    loader, _ = StructuredDataset.create_dataloader(
        paths, weights=weights, batch_size=8, shuffle=True
    )
    batches = list(loader)
    args = ["plan", "--shuffle", "--batch-size", "8", "--json", "--step", "3"]
    for name in rows:
        args += ["--source", f"{name}={paths[name]}", "--weight", f"{name}={weights[name]}"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    first_rows = {}  # the first row of each file, as write_source spreads them
    for number, (name, count) in enumerate(rows.items()):
        for f, lo in enumerate(np.linspace(0, count, 3).astype(int)[:2]):
            first_rows[f"{paths[name]}/part-{f}.parquet"] = number * _SPAN + lo
    listed = [first_rows[r["file"]] + r["row"] for r in report["step"]["rows"]]
    assert listed == batches[3]["id"].tolist()
    stream = report["streams"][0][0]
    ids = np.concatenate([b["id"].numpy() for b in batches])
    assert stream["rows"] == {n: int((ids // _SPAN == i).sum()) for i, n in enumerate(rows)}
    wrapped = [n for n in rows if stream["rows"][n] >= rows[n]]  # read past its rows
    assert [w["source"] for w in stream["wraps"]] == wrapped == ["code"]


# ----------------------------------------------------------------------------- elastic


def labelled(ids: np.ndarray, source: int, sizes: Sequence[tuple[int, int]]) -> list[tuple]:
    """``(epoch, row)`` of the rows of ``source`` among ``ids``, cut into ``sizes`` =
    ``[(source epoch, rows), ...]`` in reading order."""
    mine = (ids[ids // _SPAN == source] - source * _SPAN).tolist()
    out, at = [], 0
    for epoch, size in sizes:
        out += [(epoch, row) for row in mine[at : at + size]]
        at += size
        if at >= len(mine):
            break
    assert at >= len(mine), "more rows than the plan's shares"
    return out


def reading_order(mix: Any, source: int, stream: int, workers: int) -> list[tuple[int, int]]:
    """``(source epoch, rows)`` a stream reads of ``source``, in order (20 fresh epochs)."""
    rest = mix.rest(source)
    sizes = [(e, mix.order(source, stream, e, workers).total) for e, _ in rest.epochs]
    share = mix.share(source, stream, workers)
    return sizes + [(rest.fresh + k, share) for k in range(20)]


@given(
    rows=st.lists(st.integers(12, 70), min_size=1, max_size=3),
    weights=st.lists(st.integers(1, 5), min_size=3, max_size=3),
    old=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    new=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    steps=st.lists(st.integers(0, 12), min_size=3, max_size=3),
    shuffle=st.booleans(),
)
# The old job's streams are dealt with its own even_batches (False on 3 ranks here: the new,
# one-rank job's True gave rank 2's streams 3 positions where they had read 4, a refusal).
@example(rows=[21], weights=[1, 1, 1], old=(3, 2), new=(1, 0), steps=[0, 0, 1], shuffle=False)
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_an_elastic_resume_delivers_every_row_once_per_source_epoch(
    tmp_path_factory: pytest.TempPathFactory,
    rows: list[int],
    weights: list[int],
    old: tuple[int, int],
    new: tuple[int, int],
    steps: list[int],
    shuffle: bool,
) -> None:
    """Ranks stopped at different batches of epoch 0 (``steps``), resumed elastically on
    another world size and number of workers, to the end of epoch 1: each source epoch's rows
    (the old streams' and the new ones' together) once each, and all of them where every new
    stream read its part of that source epoch to the end."""
    root = tmp_path_factory.mktemp("elastic")
    paths = {f"s{i}": write_source(root, f"s{i}", i, n) for i, n in enumerate(rows)}
    kwargs = {"weights": dict(zip(paths, weights[: len(rows)], strict=True)), "batch_size": 5,
              "shuffle": shuffle}  # fmt: skip
    read: list[list[tuple[int, int]]] = [[] for _ in rows]  # per source: (source epoch, row)
    states = []
    world, workers = old
    for rank in range(world):
        ds = StructuredDataset(paths, rank=rank, world_size=world, **kwargs)
        progress = ds._epochs.begin(Start.fresh(0), workers)
        for w in range(max(1, workers)):
            batches = ds._reader(progress, w).batches()
            got = []
            for batch, position in itertools.islice(batches, steps[rank]):
                got.append(np.asarray(batch["id"]))
                progress.record(w, position, 0)
            for s in range(len(rows)):
                order = reading_order(ds._epochs, s, progress.stream(w), workers)
                read[s] += labelled(np.concatenate([np.empty(0, np.int64), *got]), s, order)
        states.append(json.loads(json.dumps(encode_mixture(ds._epochs, progress))))
    world, workers = new
    finished: list[set[int] | None] = [None for _ in rows]  # epochs every new stream finished
    for rank in range(world):
        ds = StructuredDataset(paths, rank=rank, world_size=world, **kwargs)
        ds._loader_workers = workers
        ds.load_state_dict(states, elastic=True)
        rest = ds._epochs.begin(ds._start, workers)
        later = stream_batches(ds, 1, workers)
        for w in range(max(1, workers)):
            got = [np.asarray(b["id"]) for b, _ in ds._reader(rest, w).batches()] + later[w]
            ids = np.concatenate([np.empty(0, np.int64), *got])
            for s in range(len(rows)):
                order = reading_order(ds._epochs, s, rest.stream(w), workers)
                mine = labelled(ids, s, order)
                read[s] += mine
                ends = itertools.accumulate(size for _, size in order)
                done = {e for (e, _), end in zip(order, ends, strict=False) if end <= len(mine)}
                finished[s] = done if finished[s] is None else finished[s] & done
    for s, n in enumerate(rows):
        by_epoch: dict[int, list[int]] = {}
        for epoch, row in read[s]:
            by_epoch.setdefault(epoch, []).append(row)
        for epoch, got_rows in by_epoch.items():
            assert len(set(got_rows)) == len(got_rows), (s, epoch)  # none twice
            if epoch in (finished[s] or set()):
                assert sorted(got_rows) == list(range(n)), (s, epoch)  # none lost


def test_elastic_then_checkpoint_then_elastic_again(tmp_path: Path) -> None:
    """Through the loaders (workers included): 2 ranks stop, 1 rank with 2 workers resumes
    elastically, checkpoints, resumes exactly from it, stops; 3 ranks resume elastically again
    and finish the epoch. No row twice; every row of a source read once before any twice."""
    sizes = {"web": 400, "code": 160}
    paths = {n: write_source(tmp_path, n, i, r, 4) for i, (n, r) in enumerate(sizes.items())}
    kwargs = {"weights": {"web": 5, "code": 2}, "batch_size": 8, "shuffle": True,
              "epoch_size": 500}  # fmt: skip
    seen: list[int] = []

    def take(loader: Any, count: int | None) -> None:
        for number, batch in enumerate(loader):
            seen.extend(batch["id"].tolist())
            if number + 1 == count:
                return

    states = []
    for rank in range(2):
        loader, _ = StructuredDataset.create_dataloader(paths, rank=rank, world_size=2, **kwargs)
        take(loader, 5 + 4 * rank)
        states.append(json.loads(json.dumps(loader.state_dict())))
    loader, _ = StructuredDataset.create_dataloader(paths, num_workers=2, **kwargs)
    loader.load_state_dict(states, elastic=True)
    it = iter(loader)
    for _ in range(6):
        seen.extend(next(it)["id"].tolist())
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [b["id"].tolist() for b in itertools.islice(it, 7)]
    del it
    loader, _ = StructuredDataset.create_dataloader(paths, num_workers=2, **kwargs)
    loader.load_state_dict(state)
    it = iter(loader)
    resumed = [next(it)["id"].tolist() for _ in range(7)]
    assert resumed == expected
    seen.extend(i for batch in resumed for i in batch)
    final = json.loads(json.dumps(loader.state_dict()))
    del it
    for rank in range(3):
        loader, _ = StructuredDataset.create_dataloader(paths, rank=rank, world_size=3, **kwargs)
        loader.load_state_dict([final], elastic=True)
        take(loader, None)
    counts = Counter(seen)
    assert max(counts.values()) == 1  # 500 positions read: no source wrapped
    assert len(seen) >= 495  # the epoch's positions, but for even_batches' few


def test_elastic_then_reweight(tmp_path: Path) -> None:
    """Elastic under the old mixture, the resumed start saved, then loaded under new weights:
    the epoch keeps the positions the elastic resume left it, and no row is read twice."""
    paths = {n: write_source(tmp_path, n, i, r, 3) for i, (n, r) in enumerate(
        [("web", 300), ("code", 200), ("math", 100)])}  # fmt: skip
    two = {"web": paths["web"], "code": paths["code"]}
    kwargs = {"batch_size": 6, "shuffle": True, "epoch_size": 240}
    seen: list[int] = []
    states = []
    for rank in range(2):
        loader, _ = StructuredDataset.create_dataloader(
            two, weights={"web": 2, "code": 1}, rank=rank, world_size=2, **kwargs
        )
        seen += [i for b in itertools.islice(loader, 4 + rank) for i in b["id"].tolist()]
        states.append(loader.state_dict())
    left = 240 - len(seen)
    _, resumed = StructuredDataset.create_dataloader(two, weights={"web": 2, "code": 1}, **kwargs)
    resumed.load_state_dict(states, elastic=True)
    start = json.loads(json.dumps(resumed.state_dict()))
    loader, _ = StructuredDataset.create_dataloader(
        paths, weights={"web": 1, "code": 1, "math": 1}, **kwargs
    )
    loader.load_state_dict(start, reweight=True)
    rest = [i for b in loader for i in b["id"].tolist()]
    assert len(rest) == left
    assert max(Counter(seen + rest).values()) == 1


@given(
    old=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    new=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    steps=st.lists(st.integers(0, 8), min_size=3, max_size=3),
    seq_len=st.integers(1, 9),
)
@example(old=(2, 2), new=(1, 0), steps=[0, 4, 0], seq_len=1)  # the same, packed
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_packed_mixture_resumes_elastically_to_the_token(
    tmp_path_factory: pytest.TempPathFactory,
    old: tuple[int, int],
    new: tuple[int, int],
    steps: list[int],
    seq_len: int,
) -> None:
    """Ranks stopped at different steps, resumed on another world: no token twice, and every
    document's tokens a run from its first (a document cut by the stop goes on where its
    tokens stopped). The sources are larger than two epochs read: none wraps."""
    root = tmp_path_factory.mktemp("packed-elastic")
    paths = {f"s{i}": write_documents(root, f"s{i}", i, 200, 3) for i in range(3)}
    kwargs = {"weights": {"s0": 3, "s1": 2, "s2": 1}, "batch_size": 2, "epoch_size": 30,
              "packing": TokenPacking("tokens", seq_len=seq_len), "shuffle": True}  # fmt: skip
    batches = mixture_elastic_batches(paths, kwargs, old, new, steps)
    tokens = [t for batch in batches for t in np.asarray(batch["input_ids"]).ravel().tolist()]
    counts = Counter(tokens)
    assert max(counts.values()) == 1
    places: dict[int, list[int]] = {}
    for token in counts:
        places.setdefault(token // 100, []).append(token % 100)
    for document, got in places.items():
        assert sorted(got) == list(range(len(got))), document  # from its first token, no gap


@given(
    weights=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    block=st.integers(1, 400),
    seed=st.integers(0, 3),
)
@settings(max_examples=60, deadline=None)
def test_a_permuted_schedule_is_exact_per_block(weights: list[int], block: int, seed: int) -> None:
    """Each block holds each source's exact share; counts agree with the sources; blocks
    differ (the period's order no longer repeats); keyed by the seed."""
    schedule = Schedule(tuple(weights), block=block, seed=seed)
    length, reduced = schedule.block_length, np.array(schedule.reduced)
    assert length % schedule.period_length == 0 and length >= block
    sources = schedule.sources(0, max(3 * length + 5, 90))
    for k in range(0, len(sources) + 1, 7):
        assert np.array_equal(schedule.counts(k), np.bincount(sources[:k], minlength=len(weights)))
    for number in range(4):
        assert np.array_equal(
            schedule.counts(number * length) * schedule.period_length, number * length * reduced
        )
    assert np.array_equal(schedule.sources(5, 90), sources[5:90])


def test_schedule_block_mixes_the_period_and_resumes_exactly(tmp_path: Path) -> None:
    paths = {"a": write_source(tmp_path, "a", 0, 200), "b": write_source(tmp_path, "b", 1, 200)}
    kwargs = {"weights": {"a": 3, "b": 1}, "batch_size": 16, "schedule_block": 64}
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    batches = [b["source"].tolist() for b in loader]
    plain, _ = StructuredDataset.create_dataloader(paths, weights={"a": 3, "b": 1}, batch_size=16)
    assert next(iter(plain))["source"].tolist() == [0, 0, 1, 0] * 4  # the period, in order
    assert batches[0] != batches[1]  # permuted: no period repeats batch after batch
    assert all(sum(batches[i] + batches[i + 1] + batches[i + 2] + batches[i + 3]) == 16
               for i in range(0, 24, 4))  # fmt: skip  # every 64 positions: 16 of b exactly
    ids = [b["id"].tolist() for b in loader]
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    it = iter(loader)
    first = [next(it)["id"].tolist() for _ in range(9)]
    state = json.loads(json.dumps(loader.state_dict()))
    loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
    loader.load_state_dict(state)
    assert first + [b["id"].tolist() for b in loader] == ids
    loader, _ = StructuredDataset.create_dataloader(paths, weights={"a": 3, "b": 1}, batch_size=16)
    with pytest.raises(CheckpointMismatchError, match="schedule_block=64"):
        loader.load_state_dict(state)


@pytest.fixture(scope="module")
def mixture_states(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[Any]]:
    """Real mixture states: after 0, 3 and 11 batches, after an elastic resume, after a
    reweight; with a limited source."""
    root = tmp_path_factory.mktemp("mix-fuzz")
    paths: dict[str, Any] = {n: write_source(root, n, i, r) for i, (n, r) in enumerate(
        [("a", 50), ("b", 30)])}  # fmt: skip
    kwargs = {"weights": {"a": 2, "b": 1}, "batch_size": 4, "shuffle": True}
    states = []
    for k in (0, 3, 11):
        loader, _ = StructuredDataset.create_dataloader(paths, **kwargs)
        it = iter(loader)
        for _ in range(k):
            next(it)
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
    _, ds = StructuredDataset.create_dataloader(paths, **kwargs)
    ds.load_state_dict([states[1]], elastic=True)
    states.append(json.loads(json.dumps(ds.state_dict())))
    return paths, states


@given(data=st.data())
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_corrupted_mixture_state_is_refused_by_name(
    mixture_states: tuple[dict[str, str], list[Any]], data: Any
) -> None:
    """Mutated mixture states load and resume, or raise the library's errors (never a raw
    ``TypeError``, ``KeyError``, ``IndexError``..., never a hang: at most 100 batches read)."""
    paths, states = mixture_states
    state = mutate(data.draw(st.sampled_from(states)), data.draw)
    loader, _ = StructuredDataset.create_dataloader(
        paths, weights={"a": 2, "b": 1}, batch_size=4, shuffle=True
    )
    try:
        loader.load_state_dict(state)
        rest = [i for batch in itertools.islice(loader, 100) for i in batch["id"].tolist()]
    except (InvalidStateError, CheckpointMismatchError) as exc:
        assert str(exc).strip()
        return
    assert set(rest) <= {*range(50), *range(_SPAN, _SPAN + 30)}


@given(
    rows=st.lists(st.integers(200, 1000), min_size=1, max_size=3),
    worlds=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 2)), min_size=2, max_size=4),
    cut=st.integers(0, 6),
    shuffle=st.booleans(),
    epoch_size=st.integers(60, 200),
)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_chain_of_elastic_resumes_through_the_loaders(
    tmp_path_factory: pytest.TempPathFactory,
    rows: list[int],
    worlds: list[tuple[int, int]],
    cut: int,
    shuffle: bool,
    epoch_size: int,
) -> None:
    """Jobs of 1-3 ranks x 0-2 DataLoader workers, each stopped after ``cut`` batches and
    resumed elastically by the next, the last to the end of the epoch: no row twice (the
    sources are larger than an epoch reads), and the epoch's positions all delivered but
    the few each evened deal leaves out."""
    root = tmp_path_factory.mktemp("chain")
    paths = {f"s{i}": write_source(root, f"s{i}", i, n) for i, n in enumerate(rows)}
    kwargs = {"weights": {p: 1 + i for i, p in enumerate(paths)}, "batch_size": 4,
              "shuffle": shuffle, "epoch_size": epoch_size}  # fmt: skip
    seen: list[int] = []
    states: list[Any] | None = None
    for number, (world, workers) in enumerate(worlds):
        last = number == len(worlds) - 1
        saved = []
        for rank in range(world):
            loader, _ = StructuredDataset.create_dataloader(
                paths, rank=rank, world_size=world, num_workers=workers, **kwargs
            )
            if states is not None:
                loader.load_state_dict(states, elastic=True)
            it = iter(loader)
            for batch in it if last else itertools.islice(it, cut):
                seen.extend(batch["id"].tolist())
            saved.append(json.loads(json.dumps(loader.state_dict())))
            del it
        states = saved
    assert max(Counter(seen).values(), default=1) == 1
    assert epoch_size - len(seen) < sum(w for w, _ in worlds)  # fewer than world_size a deal


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.data())
def test_interleaving_puts_every_source_row_at_its_schedule_place(sources: int, data) -> None:
    """Few sources are placed by a comparison each, more by a stable sort: the same result,
    each source's rows in order at the positions the schedule gives it, in pieces cut
    anywhere; numbers are scattered, token lists and strings gathered; columns joined by name
    whatever their order in a source."""
    ids = np.array(data.draw(st.lists(st.integers(0, sources - 1), min_size=1, max_size=200)),
                   dtype=np.int16)  # fmt: skip
    parts = []
    for s in range(sources):
        values = np.arange(int((ids == s).sum()), dtype=np.int64) + 1000 * s
        batch = pa.record_batch({
            "v": values, "f": values.astype(np.float32),
            "t": pa.array([list(range(v % 7)) for v in values.tolist()], pa.list_(pa.int32())),
            "s": pa.array([str(v) for v in values.tolist()], pa.string()),
        })  # fmt: skip
        schema = batch.schema
        batch = batch.select(data.draw(st.permutations(schema.names)))
        cuts = sorted(data.draw(st.lists(st.integers(0, len(values)), max_size=3)))
        bounds = [0, *cuts, len(values)]
        parts.append([batch.slice(lo, hi - lo) for lo, hi in itertools.pairwise(bounds)])
    mixed = interleaved(parts, Interleave.of(ids, sources), schema, "source")
    assert mixed.schema.names == ["v", "f", "t", "s", "source"]
    expected = np.empty(len(ids), dtype=np.int64)
    for s in range(sources):
        expected[ids == s] = np.arange(int((ids == s).sum())) + 1000 * s
    assert mixed.column("v").to_numpy().tolist() == expected.tolist()
    assert mixed.column("f").to_numpy().tolist() == expected.astype(np.float32).tolist()
    assert mixed.column("t").to_pylist() == [list(range(v % 7)) for v in expected.tolist()]
    assert mixed.column("s").to_pylist() == [str(v) for v in expected.tolist()]
    assert mixed.column("source").to_numpy().tolist() == ids.tolist()


@given(
    weights=st.lists(st.integers(1, 9), min_size=1, max_size=10),
    block=st.sampled_from([0, 0, 1, 37, 400]),
    start=st.integers(0, 10_000),
    length=st.integers(0, 300),
)
@settings(max_examples=80, deadline=None)
def test_an_interleave_places_each_source_where_the_schedule_reads_it(
    weights: list[int], block: int, start: int, length: int
) -> None:
    """A schedule's interleave (kept for the next chunk at the same place of an unpermuted
    period, so read-only) is its sources, and each source's places among them, in order;
    a stream's phases (sources leaving at their limits) renumber and join them."""
    schedule = Schedule(tuple(weights), block=block, seed=3)
    for _ in range(2):  # the second time from the kept interleave
        mixed = schedule.interleave(start, start + length)
        sources = schedule.sources(start, start + length)
        assert np.array_equal(mixed.sources, sources)
        for s in range(len(weights)):
            assert np.array_equal(mixed.places[s], np.flatnonzero(sources == s))
        assert not mixed.sources.flags.writeable and not mixed.places[0].flags.writeable
    limits = tuple(None if s % 2 else 5 * (s + 1) for s in range(len(weights)))
    stream = phases(tuple(weights), (0,) * len(weights), limits, (False,) * len(weights))
    end = stream_end(stream)
    stop = start + length if end is None else min(start + length, end)
    lo = min(start, stop)
    mixed = phase_interleave(stream, lo, stop)
    sources = phase_sources(stream, lo, stop)
    assert np.array_equal(mixed.sources, sources)
    assert len(mixed.places) == len(weights)
    for s in range(len(weights)):
        assert np.array_equal(mixed.places[s], np.flatnonzero(sources == s))
