"""Token packing: every token once, in document order, resumable to the exact token.

Documents are rows of a ``list<int64>`` column whose token ids encode where they come from
(``doc * 10_000 + i``), so a delivered stream of tokens can be checked against the documents
alone: every document's tokens once, in order, each followed by the separator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_dataloader_utils import (
    CheckpointMismatchError,
    DataSourceError,
    StructuredDataset,
    TokenPacking,
)

SEP = -1
PAD = -2
_SPAN = 10_000


def write_documents(root: Path, lengths: Sequence[Sequence[int]], row_group: int = 7) -> Path:
    """One Parquet file per list of document lengths; doc ids number all documents in order."""
    root.mkdir(parents=True, exist_ok=True)
    doc = 0
    for number, file_lengths in enumerate(lengths):
        docs = list(range(doc, doc + len(file_lengths)))
        tokens = [
            list(range(d * _SPAN, d * _SPAN + n)) for d, n in zip(docs, file_lengths, strict=True)
        ]
        table = pa.table({
            "doc": pa.array(docs, pa.int64()),
            "tokens": pa.array(tokens, pa.list_(pa.int64())),
        })  # fmt: skip
        pq.write_table(table, root / f"part-{number:02d}.parquet", row_group_size=row_group)
        doc += len(file_lengths)
    return root


def expected_tokens(lengths: Sequence[Sequence[int]], separator: bool = True) -> Counter[int]:
    flat = [n for file_lengths in lengths for n in file_lengths]
    tokens = Counter(t for d, n in enumerate(flat) for t in range(d * _SPAN, d * _SPAN + n))
    if separator:
        tokens[SEP] = len(flat)
    return tokens


def real_tokens(batches: Sequence[Mapping[str, Any]]) -> list[int]:
    """The tokens of canonical packed batches, padding removed, in delivery order."""
    out: list[int] = []
    for batch in batches:
        flat = [t for row in batch["input_ids"][1] for t in row]
        out += flat[: batch["num_tokens"][1]]
    return out


def assert_documents_in_order(tokens: Sequence[int]) -> None:
    """Each document's tokens appear consecutively numbered (a stream reads its documents front
    to back; streams interleave by whole batches; a resumed one may begin mid-document)."""
    last: dict[int, int] = {}
    for t in tokens:
        if t == SEP:
            continue
        doc, i = divmod(t, _SPAN)
        assert last.get(doc, i - 1) == i - 1, f"token {i} of document {doc} out of order"
        last[doc] = i


def case(root: Path, **kwargs: Any) -> dict[str, Any]:
    packing = TokenPacking("tokens", seq_len=kwargs.pop("seq_len", 8), separator=SEP, pad_id=PAD)
    return {"path": str(root), "batch_size": 3, "split_bytes": 600, "packing": packing, **kwargs}


@pytest.fixture(scope="module")
def lengths() -> list[list[int]]:
    rng = np.random.default_rng(5)
    # empty documents, short ones, and some longer than a whole batch of sequences
    return [rng.choice([0, 1, 3, 9, 17, 40], size=n).tolist() for n in (40, 25, 33)]


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory: pytest.TempPathFactory, lengths: list[list[int]]) -> Path:
    return write_documents(tmp_path_factory.mktemp("docs"), lengths)


# ------------------------------------------------------------------------------- the batches


def test_unshuffled_stream_is_the_documents_concatenated(docs_dir: Path, lengths) -> None:
    full = _harness.run_epoch(case(docs_dir))
    tokens = real_tokens(full)
    flat = [n for f in lengths for n in f]
    expected = [t for d, n in enumerate(flat) for t in [*range(d * _SPAN, d * _SPAN + n), SEP]]
    assert tokens == expected
    for batch in full[:-1]:
        assert batch["input_ids"][0] == "torch.int64"
        assert len(batch["input_ids"][1]) == 3 and all(len(r) == 8 for r in batch["input_ids"][1])
        assert batch["num_tokens"][1] == 24


def test_boundaries_mark_every_document_and_sequence_start(docs_dir: Path) -> None:
    dataset = StructuredDataset(
        str(docs_dir), **{k: v for k, v in case(docs_dir).items() if k != "path"}
    )
    for batch in dataset:
        ids = batch["input_ids"].flatten().tolist()
        positions = batch["position_ids"].flatten().tolist()
        cu = batch["cu_seqlens"].tolist()
        assert batch["cu_seqlens"].dtype == torch.int32 and cu[0] == 0 and cu[-1] == len(ids)
        assert [p for p, v in enumerate(positions) if v == 0] == cu[:-1]
        real = batch["num_tokens"]
        assert isinstance(real, int)
        for k in range(1, len(ids)):
            starts = k % 8 == 0 or ids[k - 1] == SEP or k == real
            assert (positions[k] == 0) == starts, (k, ids[k - 1 : k + 1])
        assert all(t == PAD for t in ids[real:])


@given(
    lengths=st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=25), min_size=1, max_size=3),
    seq_len=st.integers(1, 12),
    batch_size=st.integers(1, 4),
    shuffle=st.booleans(),
    world_size=st.integers(1, 3),
    drop_last=st.booleans(),
)
@settings(max_examples=30)
def test_every_token_once_whatever_the_documents(
    tmp_path_factory, lengths, seq_len, batch_size, shuffle, world_size, drop_last
) -> None:
    root = write_documents(tmp_path_factory.mktemp("prop"), lengths, row_group=3)
    got: list[int] = []
    for rank in range(world_size):
        full = _harness.run_epoch(
            case(root, seq_len=seq_len, batch_size=batch_size, shuffle=shuffle, rank=rank,
                 world_size=world_size, even_batches=False, drop_last=drop_last, split_bytes=300)
        )  # fmt: skip
        tokens = real_tokens(full)
        assert_documents_in_order(tokens)
        if drop_last:
            assert all(b["num_tokens"][1] == batch_size * seq_len for b in full)
        got += tokens
    expected = expected_tokens(lengths)
    if drop_last:  # each rank drops less than one batch of tokens
        assert not Counter(got) - expected
        assert sum((expected - Counter(got)).values()) < world_size * batch_size * seq_len
    else:
        assert Counter(got) == expected


# ------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_continues_at_the_exact_token(docs_dir: Path, num_workers, shuffle) -> None:
    packed = case(docs_dir, num_workers=num_workers, shuffle=shuffle, shuffle_seed=4)
    full = _harness.run_epoch(packed)
    assert len(full) > 10
    cut = 0
    for k in (1, 5, len(full) // 2, len(full) - 1, len(full)):
        state = _harness.assert_resume_exact(packed, k, full=full)
        assert state["_packing"] == ["tokens", SEP]
        cut += sum(1 for entry in state["streams"] if entry[1])  # streams mid-document
    assert cut


@given(k=st.integers(0, 40), seq_len=st.integers(1, 20), batch_size=st.integers(1, 5))
@settings(max_examples=20)
def test_resume_at_any_batch(docs_dir: Path, k, seq_len, batch_size) -> None:
    packed = case(docs_dir, seq_len=seq_len, batch_size=batch_size, shuffle=True)
    full = _harness.run_epoch(packed)
    _harness.assert_resume_exact(packed, min(k, len(full)), full=full)


def test_resume_with_another_seq_len_continues_at_the_token(docs_dir: Path, lengths) -> None:
    first, got = _harness.checkpoint_after(case(docs_dir, seq_len=8), 7)
    rest = _harness.resume(case(docs_dir, seq_len=5), first)
    assert all(len(r) == 5 for b in rest for r in b["input_ids"][1])
    assert Counter(real_tokens(got) + real_tokens(rest)) == expected_tokens(lengths)


def test_resume_with_another_separator_is_refused(docs_dir: Path) -> None:
    state, _ = _harness.checkpoint_after(case(docs_dir), 4)
    other = case(docs_dir)
    other["packing"] = TokenPacking("tokens", seq_len=8, separator=0)
    with pytest.raises(CheckpointMismatchError, match="packing"):
        _harness.resume(other, state)


@given(
    steps=st.lists(st.integers(0, 12), min_size=2, max_size=2),
    new_world=st.integers(1, 3),
    new_workers=st.sampled_from([0, 2]),
    shuffle=st.booleans(),
)
@settings(max_examples=12)
def test_elastic_resume_delivers_every_token_once(
    docs_dir: Path, lengths, steps, new_world, new_workers, shuffle
) -> None:
    base = case(docs_dir, shuffle=shuffle, even_batches=False)
    got: list[int] = []
    states = []
    for rank, k in enumerate(steps):
        state, batches = _harness.checkpoint_after({**base, "rank": rank, "world_size": 2}, k)
        states.append(state)
        got += real_tokens(batches)
    for rank in range(new_world):
        loader, _ = _harness.make_loader(
            {**base, "rank": rank, "world_size": new_world, "num_workers": new_workers}
        )
        loader.load_state_dict(states, elastic=True)
        rest = _harness.take(loader)
        assert_documents_in_order(real_tokens(rest))
        got += real_tokens(rest)
    assert Counter(got) == expected_tokens(lengths)


def test_elastic_twice_then_exact(docs_dir: Path, lengths) -> None:
    base = case(docs_dir, shuffle=True, even_batches=False)
    got: list[int] = []
    old = []
    for rank, k in enumerate((5, 2)):
        state, batches = _harness.checkpoint_after({**base, "rank": rank, "world_size": 2}, k)
        old.append(state)
        got += real_tokens(batches)
    middle = []
    for rank, k in enumerate((3, 1, 4)):
        state, batches = _elastic_checkpoint({**base, "rank": rank, "world_size": 3}, old, k)
        middle.append(state)
        got += real_tokens(batches)
    for rank in range(3):  # an exact resume of each rank, from its state after the elastic one
        got += real_tokens(_harness.resume({**base, "rank": rank, "world_size": 3}, middle[rank]))
    assert Counter(got) == expected_tokens(lengths)


def _elastic_checkpoint(
    packed: dict[str, Any], states: list[dict[str, Any]], k: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    loader, _ = _harness.make_loader(packed)
    loader.load_state_dict(states, elastic=True)
    got = []
    it = iter(loader)
    for _ in range(k):
        got.append(_harness.canonical(next(it)))
    state = _harness.json_round_trip(loader.state_dict())
    del it
    return state, got


# ------------------------------------------------------------------------------- bad input


def test_bad_packing_arguments_name_the_value(docs_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        TokenPacking("tokens", seq_len=0)
    with pytest.raises(TypeError, match="separator must be an int"):
        TokenPacking("tokens", seq_len=4, separator=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'doc' has type int64; packing needs a list"):
        StructuredDataset(str(docs_dir), packing=TokenPacking("doc", seq_len=4))
    with pytest.raises(ValueError, match=r"has no column\(s\) \['nope'\]"):
        StructuredDataset(str(docs_dir), packing=TokenPacking("nope", seq_len=4))
    with pytest.raises(ValueError, match="output='torch' or 'numpy'"):
        StructuredDataset(str(docs_dir), output="arrow", packing=TokenPacking("tokens", seq_len=4))
    with pytest.raises(ValueError, match="drop columns= or pass"):
        StructuredDataset(str(docs_dir), columns=["doc", "tokens"],
                          packing=TokenPacking("tokens", seq_len=4))  # fmt: skip
    small = tmp_path / "small"
    small.mkdir()
    pq.write_table(pa.table({"t": pa.array([[1, 2]], pa.list_(pa.int8()))}), small / "a.parquet")
    with pytest.raises(
        ValueError, match=r"separator=300 does not fit column 't' of type list<element: int8>"
    ):
        StructuredDataset(str(small), packing=TokenPacking("t", seq_len=4, separator=300))


def test_null_documents_raise_naming_the_split(tmp_path: Path) -> None:
    table = pa.table({"t": pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "nulls.parquet")
    dataset = StructuredDataset(str(tmp_path), packing=TokenPacking("t", seq_len=2))
    with pytest.raises(DataSourceError, match=r"nulls.parquet rows \[0, 3\).*null documents"):
        list(dataset)


def test_packed_dataset_has_no_len(docs_dir: Path) -> None:
    dataset = StructuredDataset(str(docs_dir), packing=TokenPacking("tokens", seq_len=4))
    with pytest.raises(TypeError, match="no len"):
        len(dataset)


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_workers_deliver_the_same_batches_as_the_main_process(docs_dir: Path, output) -> None:
    """Workers leave position_ids to the main process (from cu_seqlens): same values, dtype,
    shape and key order as batches packed in the main process."""

    def epoch(num_workers: int) -> list[dict[str, Any]]:
        options = {k: v for k, v in case(docs_dir, output=output).items() if k != "path"}
        loader, _ = StructuredDataset.create_dataloader(
            str(docs_dir), num_workers=num_workers, **options
        )
        return [
            {k: v if isinstance(v, int) else np.asarray(v) for k, v in batch.items()}
            for batch in loader
        ]

    alone, with_workers = epoch(0), epoch(2)
    assert len(alone) == len(with_workers) > 2
    # batches of both workers, in the loader's order: compare as multisets of batches
    key = lambda b: b["input_ids"].tobytes()  # noqa: E731
    for mine, theirs in zip(sorted(alone, key=key), sorted(with_workers, key=key), strict=True):
        assert list(mine) == list(theirs) == ["input_ids", "position_ids", "cu_seqlens",
                                              "num_tokens"]  # fmt: skip
        for name in ("input_ids", "position_ids", "cu_seqlens"):
            assert mine[name].dtype == theirs[name].dtype
            np.testing.assert_array_equal(mine[name], theirs[name])
        assert mine["num_tokens"] == theirs["num_tokens"]


def test_numpy_output_and_large_list(tmp_path: Path) -> None:
    table = pa.table({"t": pa.array([[1, 2, 3], [], [4, 5]], pa.large_list(pa.int32()))})
    pq.write_table(table, tmp_path / "a.parquet")
    dataset = StructuredDataset(str(tmp_path), output="numpy", batch_size=4,
                                packing=TokenPacking("t", seq_len=2, separator=0))  # fmt: skip
    (batch,) = list(dataset)
    assert isinstance(batch["input_ids"], np.ndarray) and batch["input_ids"].dtype == np.int32
    assert batch["input_ids"].tolist() == [[1, 2], [3, 0], [0, 4], [5, 0]]
    assert batch["num_tokens"] == 8


@pytest.mark.parametrize("num_workers", [0, 2])
def test_even_batches_leaves_out_whole_documents_only(docs_dir: Path, lengths, num_workers):
    """even_batches evens rows: fewer than world_size whole documents left out, the rest once,
    and each rank resumes exactly."""
    got: list[int] = []
    for rank in range(3):
        packed = case(docs_dir, shuffle=True, rank=rank, world_size=3, num_workers=num_workers)
        full = _harness.run_epoch(packed)
        _harness.assert_resume_exact(packed, len(full) // 2, full=full)
        got += real_tokens(full)
    missing = expected_tokens(lengths) - Counter(got)
    assert not Counter(got) - expected_tokens(lengths)  # nothing twice
    documents = {t // _SPAN for t in missing if t != SEP}
    assert missing[SEP] < 3 and len(documents) <= missing[SEP]  # whole documents, < world_size
    flat = [n for f in lengths for n in f]
    assert sum(missing.values()) == sum(flat[d] for d in documents) + missing[SEP]


def test_state_of_an_elastic_start_resumes_exactly(docs_dir: Path, lengths) -> None:
    """state_dict() after an elastic load, before any batch: each new rank's own cut rows."""
    base = case(docs_dir, shuffle=True, even_batches=False)
    got: list[int] = []
    old = []
    for rank, k in enumerate((4, 7)):
        state, batches = _harness.checkpoint_after({**base, "rank": rank, "world_size": 2}, k)
        old.append(state)
        got += real_tokens(batches)
    for rank in range(3):
        packed = {**base, "rank": rank, "world_size": 3}
        loader, dataset = _harness.make_loader(packed)
        loader.load_state_dict(old, elastic=True)
        state = _harness.json_round_trip(dataset.state_dict())
        continued = _harness.take(loader)
        assert _harness.resume(packed, state) == continued
        got += real_tokens(continued)
    assert Counter(got) == expected_tokens(lengths)


def test_a_cut_row_of_another_rank_is_refused(tmp_path: Path) -> None:
    root = write_documents(tmp_path / "long", [[40] * 10])
    packed = case(root, rank=0, world_size=2, even_batches=False)
    state, _ = _harness.checkpoint_after(packed, 1)  # 24 of the first document's 41 tokens
    assert [entry[:2] for entry in state["streams"]] == [[0, 24]]  # no row whole yet: a cut
    state["_rank"] = 1  # rank 0's progress, presented as rank 1's
    with pytest.raises(CheckpointMismatchError, match=r"out of order"):
        _harness.resume({**packed, "rank": 1}, state)


def test_checkpoint_at_every_token_after_an_elastic_resume(tmp_path: Path) -> None:
    """Batches of one token: some checkpoint falls where a document ends just before a row an
    old rank cut mid-document; resuming from each one still delivers every token once."""
    lengths = [[3, 0, 4, 2, 1, 3, 0, 2, 4, 1, 2, 3]]
    root = write_documents(tmp_path / "docs", lengths, row_group=2)
    base = case(root, seq_len=1, batch_size=1, even_batches=False, split_bytes=1)
    before: list[int] = []
    old = []
    for rank, k in enumerate((2, 3)):
        state, batches = _harness.checkpoint_after({**base, "rank": rank, "world_size": 2}, k)
        old.append(state)
        before += real_tokens(batches)
    assert sum(1 for s in old for e in s["streams"] if e[1]) == 2  # both ranks cut a document
    one = {**base, "rank": 0, "world_size": 1}
    elastic = _elastic_checkpoint(one, old, 0)[0]
    rest = _harness.resume(one, elastic)
    for k in range(len(rest) + 1):
        state, first = _harness.checkpoint_after(one, k, state=elastic)
        assert first == rest[:k]
        assert _harness.resume(one, state) == rest[k:], f"after batch {k}"
    assert Counter(before + real_tokens(rest)) == expected_tokens(lengths)
