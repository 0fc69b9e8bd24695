"""Token packing's companion columns: per-token values cut and padded in lockstep with the tokens.

Documents are rows of ``tokens: list<int64>`` whose ids encode where they come from (``doc *
10_000 + i``, unique), with two companions: ``labels`` (``list<int64>``, ``-(token) - 7``) and
``mask`` (``list<int8>``, ``token % 3 == 0``). The reference is the per-row model: each row's
tokens and the separator, its companions and their pads, concatenated and cut into sequences. A
batch of any run (shuffled, workers, resumed) is checked against it token by token: where the
batch has a document's token, each companion holds that token's value in the files; where it has
the separator or padding, the companion's pad.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_dataloader_utils import (
    CheckpointMismatchError,
    DataSourceError,
    InvalidStateError,
    StructuredDataset,
    Tokenize,
    TokenPacking,
)
from torch_dataloader_utils.cli import main

SEP, PAD, SPAN = -1, -2, 10_000
PADS = {"labels": -100, "mask": 0}
KEYS = ["input_ids", "position_ids", "cu_seqlens", "num_tokens", "labels", "mask"]
PACKING = TokenPacking("tokens", seq_len=8, separator=SEP, pad_id=PAD, companions=PADS)


def label(token: int) -> int:
    return -token - 7


def write_documents(root: Path, lengths: Sequence[Sequence[int]], row_group: int = 7) -> Path:
    """One Parquet file per list of document lengths, with the companions of every token."""
    root.mkdir(parents=True, exist_ok=True)
    doc = 0
    for number, file_lengths in enumerate(lengths):
        tokens = [list(range(d * SPAN, d * SPAN + n)) for d, n in enumerate(file_lengths, doc)]
        table = pa.table({
            "doc": pa.array(range(doc, doc + len(tokens)), pa.int64()),
            "tokens": pa.array(tokens, pa.list_(pa.int64())),
            "labels": pa.array([[label(t) for t in row] for row in tokens], pa.list_(pa.int64())),
            "mask": pa.array([[int(t % 3 == 0) for t in r] for r in tokens], pa.list_(pa.int8())),
        })  # fmt: skip
        pq.write_table(table, root / f"part-{number:02d}.parquet", row_group_size=row_group)
        doc += len(file_lengths)
    return root


def companions_of(tokens: Sequence[int], real: int) -> dict[str, list[int]]:
    """The per-row model's companions of delivered ``tokens`` (the first ``real`` real): each
    token's own values in the files, the pads at separators and padding."""
    out: dict[str, list[int]] = {"labels": [], "mask": []}
    for k, t in enumerate(tokens):
        document = k < real and t != SEP
        out["labels"].append(label(t) if document else PADS["labels"])
        out["mask"].append(int(t % 3 == 0) if document else PADS["mask"])
    return out


def assert_companions_follow(batches: Sequence[Mapping[str, Any]]) -> None:
    """Every canonical batch's companions are its tokens' (``companions_of``), in the
    columns' types, shaped as ``input_ids``."""
    for batch in batches:
        rows = batch["input_ids"][1]
        flat = [t for row in rows for t in row]
        expected = companions_of(flat, batch["num_tokens"][1])
        for name, kind in (("labels", "int64"), ("mask", "int8")):
            got_kind, got = batch[name]
            assert got_kind.endswith(kind) and [len(r) for r in got] == [len(r) for r in rows]
            assert [v for row in got for v in row] == expected[name], name


def without_companions(batches: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k not in PADS} for b in batches]


def case(root: Path, **kwargs: Any) -> dict[str, Any]:
    """A run's options; ``TokenPacking``'s among ``kwargs`` go to the packing."""
    options = {"seq_len": 8, "separator": SEP, "pad_id": PAD, "companions": PADS}
    for name in ("seq_len", "companions", "whole_documents", "window", "overlong"):
        options |= {name: kwargs.pop(name)} if name in kwargs else {}
    packing = TokenPacking("tokens", **options)
    return {"path": str(root), "batch_size": 3, "split_bytes": 600, "packing": packing, **kwargs}


def row_model(doc: int, length: int) -> dict[str, list[int]]:
    """The per-row model of document ``doc`` of ``length`` tokens: its tokens and the
    separator, each token's companion values in the files and the pads at the separator."""
    row = list(range(doc * SPAN, doc * SPAN + length))
    return {
        "input_ids": [*row, SEP],
        "labels": [*(label(t) for t in row), PADS["labels"]],
        "mask": [*(int(t % 3 == 0) for t in row), PADS["mask"]],
    }


@pytest.fixture(scope="module")
def lengths() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.choice([0, 1, 3, 9, 17, 40], size=n).tolist() for n in (30, 21, 26)]


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory: pytest.TempPathFactory, lengths: list[list[int]]) -> Path:
    return write_documents(tmp_path_factory.mktemp("docs"), lengths)


def expected_tokens(lengths: Sequence[Sequence[int]]) -> Counter[int]:
    flat = [n for file_lengths in lengths for n in file_lengths]
    tokens = Counter(t for d, n in enumerate(flat) for t in range(d * SPAN, d * SPAN + n))
    tokens[SEP] = len(flat)
    return tokens


def real_tokens(batches: Sequence[Mapping[str, Any]]) -> list[int]:
    out: list[int] = []
    for batch in batches:
        out += [t for row in batch["input_ids"][1] for t in row][: batch["num_tokens"][1]]
    return out


# ------------------------------------------------------------------------------- the batches


def test_companions_are_the_rows_concatenated_and_cut(docs_dir: Path, lengths) -> None:
    """Unshuffled, one stream: every key equals the per-row model (each row's tokens and the
    separator, companions and pads, concatenated in file order, cut into batches of 3 x 8)."""
    batches = _harness.run_epoch(case(docs_dir))
    flat = [n for f in lengths for n in f]
    model: dict[str, list[int]] = {"tokens": [], "labels": [], "mask": []}
    for d, n in enumerate(flat):
        row = row_model(d, n)
        model["tokens"] += row["input_ids"]
        model["labels"] += row["labels"]
        model["mask"] += row["mask"]
    real = len(model["tokens"])
    padded = -(-real // 8) * 8
    model["tokens"] += [PAD] * (padded - real)
    model["labels"] += [PADS["labels"]] * (padded - real)
    model["mask"] += [PADS["mask"]] * (padded - real)
    for number, batch in enumerate(batches):
        assert list(batch) == KEYS
        lo, rows = number * 24, len(batch["input_ids"][1])
        for key, name, dtype in (("tokens", "input_ids", "torch.int64"),
                                 ("labels", "labels", "torch.int64"),
                                 ("mask", "mask", "torch.int8")):  # fmt: skip
            values = model[key][lo : lo + rows * 8]
            assert batch[name] == (dtype, [values[r * 8 : r * 8 + 8] for r in range(rows)])
    assert sum(len(b["input_ids"][1]) for b in batches) * 8 == padded
    assert batches[-1]["num_tokens"][1] == real - (len(batches) - 1) * 24


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("shuffle", "drop_last"), [(False, True), (True, False)])
def test_companions_follow_their_tokens(docs_dir: Path, num_workers, shuffle, drop_last) -> None:
    """The same tokens, positions and boundaries as without companions, and beside every token
    its own companion values (pads at separators and padding)."""
    options = {"shuffle": shuffle, "shuffle_seed": 3, "drop_last": drop_last,
               "num_workers": num_workers}  # fmt: skip
    with_them = _harness.run_epoch(case(docs_dir, **options))
    plain = _harness.run_epoch(case(docs_dir, companions={}, **options))
    assert without_companions(with_them) == plain and len(plain) > 10
    assert_companions_follow(with_them)
    assert all(list(batch) == KEYS for batch in with_them)


def test_numpy_output_and_large_list_companions(tmp_path: Path) -> None:
    table = pa.table({
        "t": pa.array([[1, 2, 3], [], [4, 5]], pa.large_list(pa.int32())),
        "m": pa.array([[1, 0, 1], [], [0, 1]], pa.large_list(pa.uint8())),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "a.parquet")
    packing = TokenPacking("t", seq_len=3, separator=0, pad_id=9, companions={"m": 7})
    (batch,) = list(StructuredDataset(str(tmp_path), output="numpy", batch_size=3,
                                      packing=packing))  # fmt: skip
    assert batch["input_ids"].tolist() == [[1, 2, 3], [0, 0, 4], [5, 0, 9]]
    assert isinstance(batch["m"], np.ndarray) and batch["m"].dtype == np.uint8
    assert batch["m"].tolist() == [[1, 0, 1], [7, 7, 0], [1, 7, 7]]
    assert batch["m"].flags.c_contiguous


# ------------------------------------------------------------------------------- resume


@given(k=st.integers(0, 30), seq_len=st.integers(1, 12), batch_size=st.integers(1, 4),
       shuffle=st.booleans())  # fmt: skip
@settings(max_examples=10, deadline=None)
def test_resume_at_any_batch_is_exact(docs_dir: Path, k, seq_len, batch_size, shuffle) -> None:
    packed = case(docs_dir, seq_len=seq_len, batch_size=batch_size, shuffle=shuffle)
    full = _harness.run_epoch(packed)
    assert_companions_follow(full)
    state = _harness.assert_resume_exact(packed, min(k, len(full)), full=full)
    assert state["_companions"] == PADS and state["_packing"] == ["tokens", SEP]


def test_resume_with_workers_is_exact(docs_dir: Path) -> None:
    packed = case(docs_dir, shuffle=True, num_workers=2)
    full = _harness.run_epoch(packed)
    for k in (1, len(full) // 2 + 1):
        _harness.assert_resume_exact(packed, k, full=full)


def test_elastic_resume_carries_the_companions(docs_dir: Path, lengths) -> None:
    base = case(docs_dir, shuffle=True, even_batches=False)
    got: list[dict[str, Any]] = []
    states = []
    for rank, k in enumerate((4, 7)):
        state, batches = _harness.checkpoint_after({**base, "rank": rank, "world_size": 2}, k)
        assert any(entry[1] for entry in state["streams"]) or rank  # a document cut
        states.append(state)
        got += batches
    for rank in range(3):
        loader, _ = _harness.make_loader({**base, "rank": rank, "world_size": 3, "num_workers": 2})
        loader.load_state_dict(states, elastic=True)
        got += _harness.take(loader)
    assert_companions_follow(got)
    assert Counter(real_tokens(got)) == expected_tokens(lengths)


@pytest.mark.parametrize(
    ("companions", "found"),
    [({}, "None"), ({"labels": -100}, "{'labels': -100}"),
     ({"labels": -1, "mask": 0}, "{'labels': -1, 'mask': 0}")],
)  # fmt: skip
def test_resume_with_other_companions_is_refused(docs_dir: Path, companions, found) -> None:
    state, _ = _harness.checkpoint_after(case(docs_dir), 3)
    with pytest.raises(CheckpointMismatchError) as caught:
        _harness.resume(case(docs_dir, companions=companions), state)
    assert caught.value.field == "companions"
    assert f"Likely cause: companions changed: checkpoint={PADS!r}, current={found}" in str(
        caught.value
    )
    plain, _ = _harness.checkpoint_after(case(docs_dir, companions={}), 3)
    assert "_companions" not in plain  # the states of packing without companions stay as they were
    with pytest.raises(CheckpointMismatchError, match="companions changed: checkpoint=None"):
        _harness.resume(case(docs_dir), plain)


def test_a_malformed_companions_state_is_refused(docs_dir: Path) -> None:
    state, _ = _harness.checkpoint_after(case(docs_dir), 2)
    for bad in ({"labels": "-100"}, ["labels", -100], {"labels": True}):
        with pytest.raises(InvalidStateError, match="state key '_companions' must be a dict"):
            _harness.resume(case(docs_dir), {**state, "_companions": bad})


# ------------------------------------------------------------------------------- mixtures


def test_a_mixture_packs_each_sources_companions(tmp_path: Path) -> None:
    a = write_documents(tmp_path / "a", [[3, 0, 9, 17, 1, 40, 2]], row_group=3)
    b = write_documents(tmp_path / "b", [[5, 1, 0, 12, 30]], row_group=2)
    (b / "part-00.parquet").rename(b / "b.parquet")  # the same tokens in both: checked alike
    options = {"path": {"a": str(a), "b": str(b)}, "weights": {"a": 2, "b": 1},
               "epoch_size": 30, "batch_size": 3, "split_bytes": 300,
               "packing": PACKING, "shuffle": True}  # fmt: skip
    for workers in (0, 2):
        full = _harness.run_epoch({**options, "num_workers": workers})
        assert_companions_follow(full)
        assert {s for b in full for s in b["source"][1]} == {0, 1}
        _harness.assert_resume_exact({**options, "num_workers": workers}, 4, full=full)
    pq.write_table(pq.read_table(b / "b.parquet").drop_columns(["mask"]), b / "b.parquet")
    with pytest.raises(ValueError, match=r"has no column\(s\) \['mask'\]"):
        StructuredDataset(options.pop("path"), **options)


# ------------------------------------------------------------------------------- bad input


# What a row whose labels are one short of its tokens raises (row 2 of write_misaligned's file).
MISALIGNED = (
    r"bad.parquet, row group 1, row 2: companion column 'labels' holds 2 values where column "
    r"'tokens' holds 3 tokens"
)


def write_misaligned(root: Path) -> Path:
    root.mkdir()
    table = pa.table({
        "tokens": pa.array([[1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int64())),
        "labels": pa.array([[1, 2], [3], [4, 5], [7]], pa.list_(pa.int64())),
        "mask": pa.array([[1, 1], [1], [1, 1, 1], [1]], pa.list_(pa.int8())),
    })  # fmt: skip
    pq.write_table(table, root / "bad.parquet", row_group_size=2)
    return root


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_row_of_other_lengths_names_file_row_and_columns(tmp_path: Path, num_workers) -> None:
    root = write_misaligned(tmp_path / "bad")
    loader, _ = StructuredDataset.create_dataloader(
        str(root), batch_size=1, packing=PACKING, num_workers=num_workers
    )
    with pytest.raises(DataSourceError, match=MISALIGNED):
        list(loader)


def test_a_misaligned_row_of_a_mixture_names_its_source(tmp_path: Path) -> None:
    good = write_documents(tmp_path / "good", [[3, 4]])
    bad = write_misaligned(tmp_path / "bad")
    dataset = StructuredDataset(
        {"good": str(good), "bad": str(bad)}, weights={"good": 1, "bad": 1}, epoch_size=8,
        batch_size=2, packing=TokenPacking("tokens", seq_len=2, companions=PADS),
    )  # fmt: skip
    with pytest.raises(DataSourceError, match=r"source 'bad' epoch 0: .*" + MISALIGNED):
        list(dataset)


def test_a_null_companion_names_its_row(tmp_path: Path) -> None:
    table = pa.table({
        "tokens": pa.array([[1, 2], [3], [4, 5]], pa.list_(pa.int32())),
        "labels": pa.array([[1, 2], [3], [4, None]], pa.list_(pa.int32())),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "nulls.parquet")
    packing = TokenPacking("tokens", seq_len=2, companions={"labels": -100})
    with pytest.raises(DataSourceError, match=r"nulls.parquet, row group 0, row 2: companion "
                                              r"column 'labels' holds a null"):  # fmt: skip
        list(StructuredDataset(str(tmp_path), packing=packing))


def test_bad_companions_are_refused_by_name(docs_dir: Path, tmp_path: Path) -> None:
    def packing(companions: Any) -> TokenPacking:
        return TokenPacking("tokens", seq_len=4, companions=companions)

    with pytest.raises(TypeError, match="companions must be a mapping"):
        packing(["labels"])
    with pytest.raises(ValueError, match="companion 'tokens' is the token column"):
        packing({"tokens": 0})
    with pytest.raises(ValueError, match="companion 'position_ids' is a key of packed batches"):
        packing({"position_ids": 0})
    with pytest.raises(TypeError, match=r"companions\['labels'\] \(its pad\) must be an int"):
        packing({"labels": 1.5})
    with pytest.raises(TypeError, match=r"must be an int, got True \(bool\)"):
        packing({"labels": True})
    with pytest.raises(TypeError, match="must map column names"):
        packing({3: 0})
    assert packing({"labels": np.int64(-100)}).companions == {"labels": -100}
    with pytest.raises(ValueError, match=r"companion 'doc' has type int64; packing needs a list"):
        StructuredDataset(str(docs_dir), packing=packing({"doc": 0}))
    with pytest.raises(ValueError, match=r"has no column\(s\) \['nope'\]"):
        StructuredDataset(str(docs_dir), packing=packing({"nope": 0}))
    with pytest.raises(ValueError, match=r"companions\['mask'\]=300 does not fit column 'mask'"):
        StructuredDataset(str(docs_dir), packing=packing({"mask": 300}))
    with pytest.raises(ValueError, match=r"and companions \['mask'\]; got columns=\['doc'\]"):
        StructuredDataset(str(docs_dir), columns=["doc"], packing=packing({"mask": 0}))
    (batch, *_) = StructuredDataset(
        str(docs_dir), columns=["tokens", "mask"], packing=packing({"mask": 0})
    )
    assert list(batch) == ["input_ids", "position_ids", "cu_seqlens", "num_tokens", "mask"]


def test_a_file_companion_of_tokenized_text_is_refused(tmp_path: Path) -> None:
    """Tokens made in the loader cannot align with a file column's values."""
    pq.write_table(
        pa.table({"text": ["a b", "c"], "labels": pa.array([[1, 2], [3]], pa.list_(pa.int32()))}),
        tmp_path / "t.parquet",
    )
    tokenize = Tokenize("text", lambda texts: [[1] * len(t) for t in texts], name="ones")
    with pytest.raises(ValueError, match=r"companion 'labels' is not made by tokenize=Tokenize"):
        StructuredDataset(str(tmp_path), tokenize=tokenize,
                          packing=TokenPacking("input_ids", seq_len=2,
                                               companions={"labels": -100}))  # fmt: skip


def test_the_cli_verifies_a_state_with_companions(
    capsys: pytest.CaptureFixture[str], docs_dir: Path, tmp_path: Path
) -> None:
    state, _ = _harness.checkpoint_after(case(docs_dir, shuffle=True), 3)
    (tmp_path / "state.json").write_text(json.dumps(state))
    code = main(["verify", str(tmp_path / "state.json"), str(docs_dir)])
    out = capsys.readouterr().out
    assert code == 0 and "Likely cause" not in out, out


# ------------------------------------------------------------------------------- whole documents

WHOLE = {"whole_documents": True, "seq_len": 20, "window": 6}  # documents of 40 are truncated


def whole_documents_of(
    batches: Sequence[Mapping[str, Any]], lengths: Sequence[Sequence[Sequence[int]]], seq_len: int
) -> list[tuple[int, int]]:
    """The ``(source, document)`` of every part of canonical whole-document batches, each part
    checked against its row's model (``row_model``; ``lengths[source]``: the source's files'
    document lengths): every column of a document's part is its row's, all of it or its first
    ``seq_len`` values (truncated); every column of a padding part is its pad. A batch without
    ``source`` is source 0's; an empty document is -1."""
    models = [
        {-1: row_model(0, 0)} | {d: row_model(d, n) for d, n in enumerate(itertools.chain(*f))}
        for f in lengths
    ]
    pads = {"input_ids": PAD, **PADS}
    docs = []
    for batch in batches:
        assert batch["labels"][0].endswith("int64") and batch["mask"][0].endswith("int8")
        flat = {key: [v for row in batch[key][1] for v in row] for key in pads}
        sources = batch["source"][1] if "source" in batch else [0] * len(batch["input_ids"][1])
        for lo, hi in itertools.pairwise(batch["cu_seqlens"][1]):
            assert lo // seq_len == (hi - 1) // seq_len, f"part {lo}..{hi} crosses a sequence"
            part = {key: values[lo:hi] for key, values in flat.items()}
            if part["input_ids"][0] == PAD:
                assert part == {key: [pad] * (hi - lo) for key, pad in pads.items()}
                continue
            source, doc = sources[lo // seq_len], part["input_ids"][0] // SPAN
            model = models[source][doc]
            assert part == {key: values[: hi - lo] for key, values in model.items()}
            assert hi - lo in (len(model["input_ids"]), seq_len)  # whole, or truncated
            docs.append((source, doc))
    return docs


def expected_whole(lengths: Sequence[Sequence[int]], seq_len: int, drop: bool = False) -> Counter:
    """Each document of source 0 (``lengths``: its files'), an empty one as -1; without those
    longer than ``seq_len`` with ``drop``."""
    flat = [n for file_lengths in lengths for n in file_lengths]
    return Counter((0, d if n else -1) for d, n in enumerate(flat) if not drop or n < seq_len)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_whole_documents_carry_their_companions(
    docs_dir: Path, lengths, num_workers, shuffle
) -> None:
    """Each document whole in one sequence, its companions beside its tokens (truncated in
    lockstep), the pads at separators and at each sequence's padding; tokens, positions and
    boundaries as without companions."""
    options = {**WHOLE, "shuffle": shuffle, "num_workers": num_workers}
    with_them = _harness.run_epoch(case(docs_dir, **options))
    plain = _harness.run_epoch(case(docs_dir, companions={}, **options))
    assert without_companions(with_them) == plain and len(plain) > 10
    assert all(list(batch) == KEYS for batch in with_them)
    docs = whole_documents_of(with_them, [lengths], 20)
    assert Counter(docs) == expected_whole(lengths, 20)
    assert any(n >= 20 for n in itertools.chain(*lengths))  # some truncated, companions too


def test_whole_documents_drop_overlong_ones_with_their_companions(docs_dir: Path, lengths) -> None:
    full = _harness.run_epoch(case(docs_dir, overlong="drop", shuffle=True, **WHOLE))
    docs = whole_documents_of(full, [lengths], 20)
    assert Counter(docs) == expected_whole(lengths, 20, drop=True)
    assert len(docs) < sum(map(len, lengths))  # some dropped


@given(k=st.integers(0, 30), batch_size=st.integers(1, 4), window=st.integers(1, 9),
       shuffle=st.booleans())  # fmt: skip
@settings(max_examples=8, deadline=None)
def test_whole_documents_resume_exactly_with_companions(
    docs_dir: Path, lengths, k, batch_size, window, shuffle
) -> None:
    packed = case(docs_dir, batch_size=batch_size, shuffle=shuffle, **(WHOLE | {"window": window}))
    full = _harness.run_epoch(packed)
    assert Counter(whole_documents_of(full, [lengths], 20)) == expected_whole(lengths, 20)
    state = _harness.assert_resume_exact(packed, min(k, len(full)), full=full)
    assert state["_companions"] == PADS and state["_whole_documents"]["window"] == window


def test_whole_documents_resume_elastically_with_companions(docs_dir: Path, lengths) -> None:
    """Old streams stopped inside windows: the new ones leave out those windows' delivered
    documents, companions and all; every document once, each beside its companions."""
    base = case(docs_dir, shuffle=True, even_batches=False, **(WHOLE | {"window": 12}))
    before, after, states = _harness.elastic_run(base, [2, 3], 3, 2)
    assert any(entry[1] for state in states for entry in state["streams"])  # mid-window
    got = [d for batches in before + after for d in whole_documents_of(batches, [lengths], 20)]
    assert Counter(got) == expected_whole(lengths, 20)


def mixture_sources(root: Path) -> tuple[dict[str, str], list[list[list[int]]]]:
    """Two sources of documents with companions (token ids alike in both: the ``source`` of
    each sequence tells which row a part is), and their files' document lengths."""
    rng = np.random.default_rng(5)
    lengths = [[rng.choice([0, 1, 3, 9, 17, 40], size=n).tolist() for n in sizes]
               for sizes in ((40, 35), (60,))]  # fmt: skip
    paths = {name: str(write_documents(root / name, f, row_group=4))
             for name, f in zip("ab", lengths, strict=True)}  # fmt: skip
    return paths, lengths


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_mixture_packs_whole_documents_with_companions(tmp_path: Path, num_workers) -> None:
    paths, lengths = mixture_sources(tmp_path)
    options = {"path": paths, "weights": {"a": 2, "b": 1}, "epoch_size": 24, "batch_size": 3,
               "split_bytes": 300, "shuffle": True, "num_workers": num_workers,
               "packing": case(tmp_path, **WHOLE)["packing"]}  # fmt: skip
    full = _harness.run_epoch(options)
    docs = whole_documents_of(full, lengths, 20)
    assert {s for s, _ in docs} == {0, 1}
    assert max(n for (s, d), n in Counter(docs).items() if d >= 0) == 1  # none twice
    for k in (1, 5):
        _harness.assert_resume_exact(options, k, full=full)


def test_a_mixture_resumes_elastically_with_companions(tmp_path: Path) -> None:
    paths, lengths = mixture_sources(tmp_path)
    packing = case(tmp_path, **(WHOLE | {"window": 5}))["packing"]
    options = {"weights": {"a": 2, "b": 1}, "epoch_size": 12, "batch_size": 2, "shuffle": True,
               "packing": packing}  # fmt: skip
    batches = _harness.mixture_elastic_batches(paths, options, (2, 2), (3, 0), [3, 2])
    docs = whole_documents_of([_harness.canonical(b) for b in batches], lengths, 20)
    assert {s for s, _ in docs} == {0, 1}
    assert max(n for (s, d), n in Counter(docs).items() if d >= 0) == 1  # none twice
