"""Whole-document packing (``TokenPacking(whole_documents=True)``): no document cut, each once,
best-fit within a window, deterministic, exact and elastic resume, overlong policies."""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_mixing import _SPAN as _MIX_SPAN
from test_mixing import write_documents as mix_documents
from test_packing import _SPAN, PAD, SEP, write_documents

from torch_dataloader_utils import (
    CheckpointMismatchError,
    DataSourceError,
    StructuredDataset,
    Tokenize,
    TokenPacking,
)
from torch_dataloader_utils.cli import main
from torch_dataloader_utils.reading.bestfit import Window, best_fit

SEQ_LEN = 32


def whole(**kwargs: Any) -> TokenPacking:
    options = {"seq_len": SEQ_LEN, "separator": SEP, "pad_id": PAD, "whole_documents": True,
               "window": 8} | kwargs  # fmt: skip
    return TokenPacking("tokens", **options)


def case(root: Path, **kwargs: Any) -> dict[str, Any]:
    packing = kwargs.pop("packing", None) or whole()
    return {"path": str(root), "batch_size": 3, "split_bytes": 600, "packing": packing, **kwargs}


def documents_of(batches: Sequence[Mapping[str, Any]], seq_len: int = SEQ_LEN) -> list[int]:
    """The documents of canonical batches in delivery order, each checked whole: every part
    of ``cu_seqlens`` is one whole document (its tokens in order, then the separator) or one
    sequence's padding, and no part crosses a sequence."""
    docs: list[int] = []
    for batch in batches:
        flat = [t for row in batch["input_ids"][1] for t in row]
        cu = batch["cu_seqlens"][1]
        real = 0
        for lo, hi in itertools.pairwise(cu):
            part = flat[lo:hi]
            assert lo // seq_len == (hi - 1) // seq_len, f"part {lo}..{hi} crosses a sequence"
            if part[0] == PAD:
                assert set(part) == {PAD} and hi % seq_len == 0
                continue
            doc = part[0] // _SPAN if part[0] != SEP else None
            body = part[:-1] if part[-1] == SEP else part
            assert part[-1] == SEP or len(part) == seq_len  # truncated ones fill a sequence
            if doc is None:  # an empty document: its separator alone
                assert part == [SEP]
                docs.append(-1)
            else:
                assert body == list(range(doc * _SPAN, doc * _SPAN + len(body))), part
                docs.append(doc)
            real += hi - lo
        assert real == batch["num_tokens"][1]
    return docs


def expected_documents(lengths: Sequence[Sequence[int]]) -> Counter[int]:
    flat = [n for f in lengths for n in f]
    return Counter(d if n else -1 for d, n in enumerate(flat))


@pytest.fixture(scope="module")
def lengths() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.choice([0, 1, 3, 9, 17, 25, 31], size=n).tolist() for n in (40, 25, 33)]


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory: pytest.TempPathFactory, lengths: list[list[int]]) -> Path:
    return write_documents(tmp_path_factory.mktemp("docs"), lengths)


# ------------------------------------------------------------------------------- best fit


def test_best_fit_puts_each_document_where_it_fits_best() -> None:
    # 8, 6 and 5 open sequences (free 2, 4, 5); 3 goes to the 6's (free 4, the least that
    # holds it), 2 to the 8's; in index order inside each; the empty document goes nowhere
    assert best_fit(np.array([5, 3, 8, 2, 0, 6]), 10) == [[2, 3], [1, 5], [0]]
    assert best_fit(np.array([], dtype=np.int64), 10) == []


def test_window_places_documents_whole_and_pads_each_sequence() -> None:
    values = np.arange(100, 116)  # documents of 5, 3, 8 tokens, one after the other
    labels = -values.astype(np.int8)  # a companion: each column placed and padded alike
    window = Window.pack((values, labels), np.array([5, 3, 8]), placed=np.array([5, 3, 8]),
                         seq_len=10, pads=(-2, 7))  # fmt: skip
    rows = window.columns[0].reshape(-1, 10).tolist()
    assert rows == [[108, 109, 110, 111, 112, 113, 114, 115, -2, -2],
                    [100, 101, 102, 103, 104, 105, 106, 107, -2, -2]]  # fmt: skip
    assert window.columns[1].dtype == np.int8
    assert window.columns[1].tolist() == [-t if t != -2 else 7 for row in rows for t in row]
    assert window.starts.tolist() == [0, 8, 10, 15, 18]
    assert window.fill.tolist() == [8, 8] and window.rows_of(1).tolist() == [2]


def test_waste_on_a_log_normal_sft_sample_is_below_5_percent() -> None:
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(np.log(600), 1.0, 20_000)).astype(np.int64)
    placed = np.minimum(lengths, 4096)
    sequences = sum(len(best_fit(placed[a : a + 512], 4096)) for a in range(0, len(placed), 512))
    waste = 1 - placed.sum() / (sequences * 4096)
    assert waste < 0.05
    assert waste > 0.001  # a window, not the whole set: some space is left


# ------------------------------------------------------------------------------- the batches


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_document_once_and_whole(docs_dir: Path, lengths, num_workers, shuffle) -> None:
    full = _harness.run_epoch(case(docs_dir, num_workers=num_workers, shuffle=shuffle))
    assert Counter(documents_of(full)) == expected_documents(lengths)
    # each stream's last batch may be short
    assert sum(len(b["input_ids"][1]) < 3 for b in full) <= max(1, num_workers)
    assert _harness.run_epoch(case(docs_dir, num_workers=num_workers, shuffle=shuffle)) == full


def test_documents_stay_in_their_window(docs_dir: Path, lengths) -> None:
    full = _harness.run_epoch(case(docs_dir, packing=whole(window=5)))
    order = documents_of(full)
    real = [d for d in order if d >= 0]
    # unshuffled, one stream: window w holds documents 5w..5w+4; windows come in order
    assert [d // 5 for d in real] == sorted(d // 5 for d in real)


def test_drop_last_drops_the_short_last_batch(docs_dir: Path, lengths) -> None:
    kept = _harness.run_epoch(case(docs_dir))
    dropped = _harness.run_epoch(case(docs_dir, drop_last=True))
    assert len(kept[-1]["input_ids"][1]) < 3  # this data's last batch is short
    assert dropped == kept[:-1]


def test_waste_beats_a_window_of_one(docs_dir: Path) -> None:
    def padding(packing: TokenPacking) -> int:
        full = _harness.run_epoch(case(docs_dir, packing=packing))
        return sum(len(b["input_ids"][1]) * SEQ_LEN - b["num_tokens"][1] for b in full)

    assert padding(whole(window=64)) < padding(whole(window=1)) / 2


# ------------------------------------------------------------------------------- resume


@given(k=st.integers(0, 30), batch_size=st.integers(1, 4), window=st.integers(1, 12),
       shuffle=st.booleans())  # fmt: skip
@settings(max_examples=15, deadline=None)
def test_resume_at_any_batch_is_exact(docs_dir: Path, k, batch_size, window, shuffle) -> None:
    packed = case(docs_dir, batch_size=batch_size, packing=whole(window=window), shuffle=shuffle)
    full = _harness.run_epoch(packed)
    state = _harness.assert_resume_exact(packed, min(k, len(full)), full=full)
    assert state["_whole_documents"] == {"seq_len": SEQ_LEN, "window": window,
                                         "overlong": "truncate"}  # fmt: skip


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_with_workers_is_exact_mid_window(docs_dir: Path, num_workers) -> None:
    packed = case(docs_dir, num_workers=num_workers, shuffle=True, packing=whole(window=16))
    full = _harness.run_epoch(packed)
    inside = 0
    for k in (1, 4, len(full) // 2, len(full) - 1):
        state = _harness.assert_resume_exact(packed, k, full=full)
        inside += sum(1 for entry in state["streams"] if entry[1])  # mid-window
    assert inside


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (whole(window=9), "whole_documents.window"),
        (whole(seq_len=40), "whole_documents.seq_len"),
        (whole(overlong="drop"), "whole_documents.overlong"),
        (TokenPacking("tokens", seq_len=SEQ_LEN, separator=SEP), "whole_documents"),
    ],
)
def test_resume_with_other_whole_document_settings_is_refused(
    docs_dir: Path, other: TokenPacking, field: str
) -> None:
    state, _ = _harness.checkpoint_after(case(docs_dir), 3)
    with pytest.raises(CheckpointMismatchError, match=re.escape(f"{field}=")) as raised:
        _harness.resume(case(docs_dir, packing=other), state)
    assert raised.value.field == field


def test_a_greedy_state_is_refused_by_whole_documents(docs_dir: Path) -> None:
    greedy = TokenPacking("tokens", seq_len=SEQ_LEN, separator=SEP)
    state, _ = _harness.checkpoint_after(case(docs_dir, packing=greedy), 3)
    with pytest.raises(CheckpointMismatchError, match="whole_documents=False"):
        _harness.resume(case(docs_dir), state)


# ------------------------------------------------------------------------------- elastic


@given(
    steps=st.lists(st.integers(0, 8), min_size=2, max_size=2),
    new_world=st.integers(1, 3),
    new_workers=st.sampled_from([0, 2]),
    shuffle=st.booleans(),
)
@settings(max_examples=10, deadline=None)
def test_elastic_resume_delivers_every_document_once(
    docs_dir: Path, lengths, steps, new_world, new_workers, shuffle
) -> None:
    base = case(docs_dir, shuffle=shuffle, even_batches=False)
    before, after, _ = _harness.elastic_run(base, steps, new_world, new_workers)
    got = [d for batches in before + after for d in documents_of(batches)]
    assert Counter(got) == expected_documents(lengths)


def test_elastic_twice_then_exact(docs_dir: Path, lengths) -> None:
    base = case(docs_dir, shuffle=True, even_batches=False, packing=whole(window=12))
    before, _, old = _harness.elastic_run(base, [5, 2], 0, 0)
    got = [d for batches in before for d in documents_of(batches)]
    middle = []
    for rank, k in enumerate((3, 1, 2)):
        loader, _ = _harness.make_loader({**base, "rank": rank, "world_size": 3})
        loader.load_state_dict(old, elastic=True)
        it = iter(loader)
        got += documents_of([_harness.canonical(next(it)) for _ in range(k)])
        middle.append(_harness.json_round_trip(loader.state_dict()))
        del it
    assert any(entry[1] for state in middle for entry in state["streams"])  # mid-window
    third = []
    for rank in range(3):  # an exact resume of each rank, from its state after the elastic one
        rest = _harness.resume({**base, "rank": rank, "world_size": 3}, middle[rank])
        third.append(rest)
        got += documents_of(rest)
    assert Counter(got) == expected_documents(lengths)
    # and an elastic resume of the elastic states: the second generation's windows found again
    again: list[int] = []
    for rank in range(2):
        loader, _ = _harness.make_loader({**base, "rank": rank, "world_size": 2})
        loader.load_state_dict(middle, elastic=True)
        again += documents_of(_harness.take(loader))
    assert Counter(again) == Counter(d for rest in third for d in documents_of(rest))


# ------------------------------------------------------------------------------- overlong


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_documents(tmp_path_factory.mktemp("long"), [[5, 40, 9, 31, 70, 2]])


def test_overlong_documents_are_truncated_and_counted(long_dir: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="torch_dataloader_utils"):
        full = _harness.run_epoch(case(long_dir))
    # 1 and 4 cut to their first 32 tokens (documents_of checks them: a full sequence each)
    assert sorted(documents_of(full)) == [0, 1, 2, 3, 4, 5]
    assert "truncated 2 document(s) longer than seq_len=32" in caplog.text
    assert "2 in this stream so far" in caplog.text


def test_overlong_documents_can_be_dropped(long_dir: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="torch_dataloader_utils"):
        full = _harness.run_epoch(case(long_dir, packing=whole(overlong="drop")))
    assert sorted(documents_of(full)) == [0, 2, 3, 5]
    assert "dropped 2 document(s)" in caplog.text


def test_overlong_error_names_the_split_and_row(long_dir: Path) -> None:
    dataset = StructuredDataset(str(long_dir), packing=whole(overlong="error"), batch_size=2)
    with pytest.raises(DataSourceError, match=r"part-00.parquet.*stream row 1 is a document of 41"):
        next(iter(dataset))


def test_bad_whole_document_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="overlong must be one of"):
        whole(overlong="cut")
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        whole(window=0)
    with pytest.raises(TypeError, match="whole_documents must be True or False"):
        whole(whole_documents="yes")


# ------------------------------------------------------------------------------- mixtures


def mixture(tmp_path: Path, **kwargs: Any) -> tuple[dict[str, str], dict[str, Any]]:
    paths = {f"s{i}": mix_documents(tmp_path, f"s{i}", i, n) for i, n in enumerate((30, 45))}
    options = {
        "weights": {"s0": 1, "s1": 2},
        "batch_size": 3,
        "epoch_size": 12,
        "packing": TokenPacking("tokens", seq_len=16, pad_id=-1, whole_documents=True, window=6),
    }
    return paths, options | kwargs  # fmt: skip


def mixed_documents(batch: Mapping[str, Any]) -> list[int]:
    """The documents of a packed mixture's batch (token ``t`` of document ``d`` is
    ``d * 100 + t``; padding -1), each checked whole and in one sequence."""
    flat = np.asarray(batch["input_ids"]).ravel().tolist()
    cu = np.asarray(batch["cu_seqlens"]).tolist()
    docs = []
    for lo, hi in itertools.pairwise(cu):
        part = flat[lo:hi]
        assert lo // 16 == (hi - 1) // 16, f"part {lo}..{hi} crosses a sequence"
        if part[0] == -1:
            assert set(part) == {-1} and hi % 16 == 0
            continue
        doc = part[0] // 100
        assert part == [doc * 100 + t for t in range(len(part))], part
        docs.append(doc)
    return docs


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_mixture_packs_whole_documents_and_resumes_exactly(tmp_path: Path, num_workers) -> None:
    paths, options = mixture(tmp_path, num_workers=num_workers, shuffle=True)
    loader, ds = StructuredDataset.create_dataloader(paths, **options)
    full = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        full += [{k: np.asarray(v).tolist() for k, v in b.items()} for b in loader]
    docs = Counter(d for b in full for d in mixed_documents(b))
    for source, count in enumerate((30, 45)):  # each document once per source epoch
        times = [docs[source * _MIX_SPAN + d] for d in range(count)]
        assert max(times) - min(times) <= 1 and max(times) >= 1
    assert sum(b["num_tokens"] for b in full) < len(full) * 3 * 16  # padded, not cut
    for stop in (1, 5, 13):
        loader, ds = StructuredDataset.create_dataloader(paths, **options)
        taken = 0
        for epoch in range(2):
            ds.set_epoch(epoch)
            for _ in loader:
                taken += 1
                if taken == stop:
                    break
            if taken == stop:
                break
        state = _harness.json_round_trip(loader.state_dict())
        loader, ds = StructuredDataset.create_dataloader(paths, **options)
        loader.load_state_dict(state)
        rest = []
        for epoch in range(state["epoch"], 2):
            if epoch > state["epoch"]:
                ds.set_epoch(epoch)
            rest += [{k: np.asarray(v).tolist() for k, v in b.items()} for b in loader]
        assert rest == full[stop:]


def mixture_elastic(
    root: Path,
    docs: list[int],
    old: tuple[int, int],
    new: tuple[int, int],
    steps: list[int],
    window: int,
) -> list[int]:
    """The documents a mixture's ranks deliver before a stop (``old`` world and workers,
    ``steps[rank]`` batches), then ``new`` ranks after an elastic resume, then their epoch 1."""
    paths = {f"s{i}": mix_documents(root, f"s{i}", i, n, 3) for i, n in enumerate(docs)}
    packing = TokenPacking("tokens", seq_len=16, pad_id=-1, whole_documents=True, window=window)
    options = {"weights": {"s0": 3, "s1": 2, "s2": 1}, "batch_size": 2, "epoch_size": 30,
               "shuffle": True, "packing": packing}  # fmt: skip
    batches = _harness.mixture_elastic_batches(paths, options, old, new, steps)
    return [d for batch in batches for d in mixed_documents(batch)]


@given(
    old=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    new=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    steps=st.lists(st.integers(0, 8), min_size=3, max_size=3),
    window=st.integers(1, 9),
)
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_mixture_resumes_elastically_with_every_document_once(
    tmp_path_factory: pytest.TempPathFactory, old, new, steps, window
) -> None:
    """Ranks stopped at different steps (mid-window), resumed on another world, then the next
    epoch: every document whole, none twice (the sources are larger than what is read)."""
    root = tmp_path_factory.mktemp("whole-elastic")
    docs = mixture_elastic(root, [200, 200, 200], old, new, steps, window)
    assert docs and max(Counter(docs).values()) == 1


def test_a_mixture_resumes_elastically_where_a_source_epoch_ends_mid_window(
    tmp_path: Path,
) -> None:
    """Small sources whose epochs end inside windows: the window an old stream stood in is
    found again (it ends with the epoch; crossing it, the resume found 3 sequences where the
    state had delivered 4: InvalidStateError)."""
    docs = mixture_elastic(tmp_path, [13, 12, 12], (1, 2), (1, 0), [4, 0, 0], 8)
    counts = Counter(docs)
    for source, size in enumerate((13, 12, 12)):  # every document of each source read
        assert all(counts[source * _MIX_SPAN + d] for d in range(size))


def test_the_cli_verifies_a_whole_document_state(docs_dir: Path, tmp_path: Path, capsys) -> None:
    state, _ = _harness.checkpoint_after(case(docs_dir), 4)
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    assert main(["verify", str(saved), str(docs_dir)]) == 0, capsys.readouterr().out
    assert "MISMATCH" not in capsys.readouterr().out
    assert main(["inspect", str(saved), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["whole_documents"] == {"seq_len": SEQ_LEN, "window": 8,
                                                     "overlong": "truncate"}  # fmt: skip


def test_a_mixture_state_with_another_window_is_refused(tmp_path: Path) -> None:
    paths, options = mixture(tmp_path)
    loader, _ = StructuredDataset.create_dataloader(paths, **options)
    it = iter(loader)
    next(it)
    state = _harness.json_round_trip(loader.state_dict())
    del it
    other = options | {"packing": TokenPacking("tokens", seq_len=16, pad_id=-1,
                                               whole_documents=True, window=7)}  # fmt: skip
    loader, _ = StructuredDataset.create_dataloader(paths, **other)
    with pytest.raises(CheckpointMismatchError, match=r"whole_documents\.window=6") as raised:
        loader.load_state_dict(state)
    assert raised.value.field == "whole_documents.window"


def test_tokenized_text_is_packed_whole(tmp_path: Path) -> None:
    """Text tokenized in the stream (``Tokenize``) then packed whole: each part of a batch is
    one text's tokens and its EOS, every text once."""
    rng = np.random.default_rng(3)
    texts = [f"{doc}:" + "x" * int(n) for doc, n in enumerate(rng.integers(0, 30, 60))]
    pq.write_table(pa.table({"text": texts}), tmp_path / "part-0.parquet", row_group_size=7)

    def encode(batch: list[str]) -> list[list[int]]:
        out = []
        for text in batch:
            doc, body = text.split(":")
            out.append([int(doc) * _SPAN + i for i in range(len(body))])
        return out

    eos = 999_999
    loader, _ = StructuredDataset.create_dataloader(
        str(tmp_path), batch_size=2, shuffle=True, num_workers=2,
        tokenize=Tokenize("text", encode, eos_id=eos, name="by-length"),
        packing=TokenPacking("input_ids", seq_len=SEQ_LEN, pad_id=PAD, whole_documents=True,
                             window=8),
    )  # fmt: skip
    seen = []
    for batch in loader:
        flat = batch["input_ids"].flatten().tolist()
        for lo, hi in itertools.pairwise(batch["cu_seqlens"].tolist()):
            part = flat[lo:hi]
            if part[0] == PAD:
                continue
            doc = part[0] // _SPAN if len(part) > 1 else None
            if doc is not None:
                assert part == [*range(doc * _SPAN, doc * _SPAN + len(part) - 1), eos]
                seen.append(doc)
    assert sorted(seen) == [d for d, t in enumerate(texts) if len(t.split(":")[1])]


def test_a_mixture_continues_under_new_weights(tmp_path: Path) -> None:
    """``reweight=True``: each source goes on from its window and sequences delivered."""
    paths, options = mixture(tmp_path, num_workers=2, shuffle=True)
    loader, _ = StructuredDataset.create_dataloader(paths, **options)
    it = iter(loader)
    before = [mixed_documents(next(it)) for _ in range(2)]
    state = _harness.json_round_trip(loader.state_dict())
    del it
    reweighted = options | {"weights": {"s0": 2, "s1": 1}}
    loader, _ = StructuredDataset.create_dataloader(paths, **reweighted)
    loader.load_state_dict(state, reweight=True)
    after = [mixed_documents(batch) for batch in loader]
    assert after
    docs = Counter(d for batch in before + after for d in batch)
    assert max(docs.values()) == 1  # less than a source epoch read: none twice
