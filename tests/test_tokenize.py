"""Text to tokens, a chunk at a time (``planning.text.Tokenize``, ``reading.tokenizing``): each
row's tokens are exactly the tokenizer's for that text alone, between ``bos_id`` and ``eos_id``;
bad rows are errors that name them. Tokenizers are trained here, in a fraction of a second."""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torch_dataloader_utils import (
    CheckpointMismatchError,
    DataSourceError,
    Source,
    StructuredDataset,
    Tokenize,
    TokenPacking,
)
from torch_dataloader_utils.base.errors import UnsendableSettingError
from torch_dataloader_utils.reading.tokenizing import tokenized

CORPUS = [f"row {i}: the café serves crème brûlée, 東京 {i * 7} ünïcode" for i in range(400)]


def train(vocab_size: int = 400, corpus: list[str] = CORPUS) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train()


def where(row: int) -> str:
    return f"file t.parquet, row group 0, row {row}"


STRING = pa.string()


def tokens_of(texts: list[Any], tokenize: Tokenize, kind: pa.DataType = STRING) -> list:
    """A chunk's tokens, its slices (one per call of the tokenizer) joined; each slice holds
    the chunk's rows up to the end it names, ids unchanged."""
    chunk = pa.record_batch({"id": list(range(len(texts))), "text": pa.array(texts, kind)})
    slices = list(tokenized(chunk, tokenize, tokenize.encoder(), where))
    ends = [end for _, end in slices]
    assert ends == sorted(ends) and ends[-1] == len(texts)
    ids = [i for part, _ in slices for i in part.column("id").to_pylist()]
    assert ids == list(range(len(texts)))
    for part, _ in slices:
        assert part.schema.names == ["id", tokenize.output]
        assert part.schema.field(tokenize.output).type == pa.list_(pa.int32())
    return [row for part, _ in slices for row in part.column(tokenize.output).to_pylist()]


def reference(bpe: Tokenizer, texts: list[str], bos: int | None, eos: int | None) -> list:
    """Each text tokenized alone, between bos and eos."""
    alone = [bpe.encode(t, add_special_tokens=False).ids for t in texts]
    return [([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
            for ids in alone]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    texts=st.lists(st.text(max_size=40), max_size=20),
    bos=st.sampled_from([None, 0]),
    eos=st.sampled_from([None, 1]),
    binary=st.booleans(),
)
def test_tokens_are_each_text_tokenized_alone(
    bpe: Tokenizer, texts: list[str], bos: int | None, eos: int | None, binary: bool
) -> None:
    """Empty texts included: an empty text is a document of no tokens (only bos/eos)."""
    tokenize = Tokenize("text", bpe, bos_id=bos, eos_id=eos)
    values = [t.encode("utf-8", "surrogatepass") for t in texts] if binary else texts
    if binary and any("\ud800" <= c <= "\udfff" for t in texts for c in t):
        return  # lone surrogates are not UTF-8: the invalid-UTF-8 test covers that
    got = tokens_of(values, tokenize, pa.binary() if binary else pa.string())
    assert got == reference(bpe, texts, bos, eos)


@pytest.mark.parametrize("kind", [pa.large_string(), pa.string_view(), pa.large_binary()])
def test_every_text_type(bpe: Tokenizer, kind: pa.DataType) -> None:
    texts = ["crème brûlée", "", "東京"]
    values = [t.encode() for t in texts] if "binary" in str(kind) else texts
    assert tokens_of(values, Tokenize("text", bpe, eos_id=1), kind) == reference(
        bpe, texts, None, 1
    )


def test_a_transformers_fast_tokenizer_gives_its_own_ids(bpe: Tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    texts = [*CORPUS[:30], "", "x"]
    expected = fast(texts, add_special_tokens=False)["input_ids"]
    assert tokens_of(texts, Tokenize("text", fast)) == expected


def test_a_named_callable(bpe: Tokenizer) -> None:
    def encode(texts: list[str]) -> list[list[int]]:
        return [[len(t), 7] for t in texts]

    assert tokens_of(["ab", ""], Tokenize("text", encode, bos_id=5, name="lengths")) == [
        [5, 2, 7],
        [5, 0, 7],
    ]


def test_a_callable_without_a_name_is_refused() -> None:
    with pytest.raises(ValueError, match="needs name= for a callable tokenizer"):
        Tokenize("text", lambda texts: [[1] for _ in texts])


def test_not_a_tokenizer_is_refused() -> None:
    with pytest.raises(TypeError, match="got int"):
        Tokenize("text", 3)


@pytest.mark.parametrize("field", ["bos_id", "eos_id"])
def test_special_ids_must_be_token_ids(bpe: Tokenizer, field: str) -> None:
    with pytest.raises(ValueError, match=f"Tokenize {field}=-1 is not a token id"):
        Tokenize("text", bpe, **{field: -1})


def test_the_fingerprint_is_the_tokenizers_whole_definition(bpe: Tokenizer) -> None:
    """The same definition (also after pickling): the same fingerprint; another vocabulary,
    another added token or another bos/eos: another. A name is not part of a tokenizer's."""
    same = Tokenize("text", pickle.loads(pickle.dumps(bpe)), name="anything")
    assert same.fingerprint == Tokenize("text", bpe).fingerprint
    other_vocab = train(vocab_size=300)
    assert Tokenize("text", other_vocab).fingerprint != same.fingerprint
    added = pickle.loads(pickle.dumps(bpe))
    added.add_tokens(["<extra>"])
    assert Tokenize("text", added).fingerprint != same.fingerprint
    assert Tokenize("text", bpe, eos_id=1).fingerprint != same.fingerprint
    assert (
        Tokenize("text", bpe, bos_id=1).fingerprint != Tokenize("text", bpe, eos_id=1).fingerprint
    )


def test_a_callables_fingerprint_is_its_name() -> None:
    def encode(texts: list[str]) -> list[list[int]]:
        return [[1] for _ in texts]

    assert Tokenize("t", encode, name="a").fingerprint == Tokenize("t", len, name="a").fingerprint
    assert (
        Tokenize("t", encode, name="a").fingerprint != Tokenize("t", encode, name="b").fingerprint
    )


def test_a_null_text_is_an_error_naming_its_row(bpe: Tokenizer) -> None:
    with pytest.raises(DataSourceError, match=r"row group 0, row 2: column 'text' is null"):
        tokens_of(["a", "b", None], Tokenize("text", bpe))


def test_invalid_utf8_is_an_error_naming_its_row(bpe: Tokenizer) -> None:
    with pytest.raises(
        DataSourceError, match=r"row 1: column 'text' \(binary\) is not valid UTF-8"
    ):
        tokens_of([b"ok", b"\xff\xfe", b"fine"], Tokenize("text", bpe), pa.binary())


def test_a_tokenizer_that_raises_names_the_row_and_the_tokenizer() -> None:
    def picky(texts: list[str]) -> list[list[int]]:
        if any("bad" in t for t in texts):
            raise RuntimeError("cannot tokenize that")
        return [[1] for _ in texts]

    with pytest.raises(
        DataSourceError, match=r"row 1: tokenizer picky raised RuntimeError: cannot tokenize"
    ):
        tokens_of(["good", "bad", "good"], Tokenize("text", picky, name="picky"))


def test_a_chunk_is_tokenized_in_calls_of_bounded_text() -> None:
    """A tokenizer's objects for a text take ~12 times its size: a chunk of a few MiB is
    tokenized a few hundred KiB at a time, the rows' tokens in order; a failing row is named by
    its row in the chunk, whichever call it is in."""
    calls: list[int] = []

    def lengths(texts: list[str]) -> list[list[int]]:
        if "bad" in texts:
            raise RuntimeError("cannot tokenize that")
        calls.append(sum(map(len, texts)))
        return [[len(t), i] for i, t in enumerate(texts)]

    texts = [str(row % 10) * (1000 + row) for row in range(600)]  # 900 KB of text
    got = tokens_of(texts, Tokenize("text", lengths, name="lengths"))
    assert [ids[0] for ids in got] == [1000 + row for row in range(600)]
    assert len(calls) >= 6 and max(calls) <= 2**17 + 1600 and sum(calls) == sum(map(len, texts))
    chunk = pa.record_batch({"text": texts})
    slices = tokenized(chunk, Tokenize("text", lengths, name="l"), lengths, where)
    first, end = next(slices)  # tokens after the first call, not after the whole chunk
    assert first.num_rows == end < 600 and len(calls) == 7 and len(list(slices)) == 5
    texts[450] = "bad"
    with pytest.raises(DataSourceError, match=r"row 450: tokenizer lengths raised RuntimeError"):
        tokens_of(texts, Tokenize("text", lengths, name="lengths"))


@pytest.mark.parametrize("bad", [-1, 2**31])
def test_ids_outside_int32_are_an_error(bad: int) -> None:
    def encode(texts: list[str]) -> list[list[int]]:
        return [[3, bad] if t == "x" else [3] for t in texts]

    with pytest.raises(DataSourceError, match=rf"row 2: tokenizer enc gave token id {bad}"):
        tokens_of(["a", "b", "x"], Tokenize("text", encode, name="enc"))


def test_one_list_per_text() -> None:
    with pytest.raises(DataSourceError, match="returned 1 token lists for 2 texts"):
        tokens_of(["a", "b"], Tokenize("text", lambda t: [[1]], name="short"))


def test_the_text_column_is_checked(bpe: Tokenizer) -> None:
    schema = pa.schema({"id": pa.int64(), "text": pa.string(), "input_ids": pa.list_(pa.int32())})
    Tokenize("text", bpe, output="tokens").check(schema, "source 'web'")
    with pytest.raises(ValueError, match="Tokenize column 'body' is not in source 'web'"):
        Tokenize("body", bpe).check(schema, "source 'web'")
    with pytest.raises(ValueError, match="has type int64; tokenizing needs text"):
        Tokenize("id", bpe).check(schema, "source 'web'")
    with pytest.raises(ValueError, match="output 'input_ids' is already a column"):
        Tokenize("text", bpe).check(schema, "source 'web'")


# ----------------------------------------------------------------------------- in a dataset

WORDS = ["alpha", "beta", "gamma", "café", "東京", "zeta", "ω", "crème", "x"]
SEQ = 16


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 files of 120 texts of 0-30 words (empty ones too), row groups of 25 rows."""
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(3)
    for f in range(3):
        texts = [" ".join(rng.choice(WORDS, rng.integers(0, 30))) for _ in range(120)]
        table = pa.table({"id": np.arange(f * 120, (f + 1) * 120), "text": texts})
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=25)
    return root


def loader_of(path: Path, tokenize: Tokenize, **kwargs: Any) -> Any:
    packing = TokenPacking("input_ids", seq_len=SEQ)
    return StructuredDataset.create_dataloader(
        str(path), batch_size=3, tokenize=tokenize, packing=packing, **kwargs
    )[0]


def sequences(loader: Any) -> list[list[int]]:
    return [row for batch in loader for row in batch["input_ids"].tolist()]


def real_tokens(loader: Any) -> Counter[int]:
    """Every token a loader delivers, padding left out."""
    return Counter(
        token
        for batch in loader
        for token in batch["input_ids"].flatten()[: batch["num_tokens"]].tolist()
    )


@pytest.mark.parametrize("shuffle", [False, True])
def test_packed_tokens_are_the_rows_texts_tokenized_alone(
    bpe: Tokenizer, text_dir: Path, shuffle: bool
) -> None:
    """The packed stream is every row's ``tokens(text) + [eos]``, in delivery order (the rows
    of the same dataset read without tokenizing), cut into sequences of SEQ tokens."""
    tokenize = Tokenize("text", bpe, eos_id=1)
    rows, _ = StructuredDataset.create_dataloader(
        str(text_dir), batch_size=50, columns=["text"], shuffle=shuffle, output="arrow"
    )
    texts = [t for batch in rows for t in batch.column("text").to_pylist()]
    stream = [token for ids in reference(bpe, texts, None, 1) for token in ids]
    got = sequences(loader_of(text_dir, tokenize, shuffle=shuffle, drop_last=True))
    full = len(stream) // (3 * SEQ) * 3 * SEQ  # whole batches of 3 sequences
    assert [t for row in got for t in row] == stream[:full]


@settings(max_examples=8, deadline=None)
@given(stop=st.integers(0, 40), shuffle=st.booleans())
def test_resume_continues_token_for_token(
    bpe: Tokenizer, text_dir: Path, stop: int, shuffle: bool
) -> None:
    """Stopped after any batch (mid-document), a new loader resumes exactly: the rest is the
    uninterrupted run's, sequence for sequence."""
    tokenize = Tokenize("text", bpe, bos_id=0, eos_id=1)
    full = sequences(loader_of(text_dir, tokenize, shuffle=shuffle))
    first = loader_of(text_dir, tokenize, shuffle=shuffle)
    it = iter(first)
    head = [
        row
        for _, batch in zip(range(stop), it, strict=False)
        for row in batch["input_ids"].tolist()
    ]
    state = first.state_dict()
    assert state["_tokenize"] == ["text", tokenize.fingerprint]
    resumed = loader_of(text_dir, tokenize, shuffle=shuffle)
    resumed.load_state_dict(state)
    assert head + sequences(resumed) == full


def test_a_training_scripts_sequence_over_epochs(bpe: Tokenizer, text_dir: Path) -> None:
    """Break out of epoch 0 and iterate again (epoch 0 from its start), move to epoch 1 (another
    order), checkpoint mid-way, resume in a new loader: every step as the uninterrupted runs."""
    tokenize = Tokenize("text", bpe, eos_id=1)
    loader = loader_of(text_dir, tokenize, shuffle=True, num_workers=2)
    epoch0 = sequences(loader_of(text_dir, tokenize, shuffle=True, num_workers=2))
    for _ in zip(range(4), loader, strict=False):
        pass  # the loop breaks
    assert sequences(loader) == epoch0
    loader.dataset.set_epoch(1)
    it = iter(loader)
    head = [row for _, b in zip(range(6), it, strict=False) for row in b["input_ids"].tolist()]
    state = loader.state_dict()
    del it
    fresh = loader_of(text_dir, tokenize, shuffle=True, num_workers=2)
    fresh.dataset.set_epoch(1)
    epoch1 = sequences(fresh)
    assert epoch1 != epoch0 and real_tokens(fresh) == real_tokens(loader)
    resumed = loader_of(text_dir, tokenize, shuffle=True, num_workers=2)
    resumed.load_state_dict(state)
    assert head + sequences(resumed) == epoch1


def test_workers_tokenize_and_resume_exactly(bpe: Tokenizer, text_dir: Path) -> None:
    tokenize = Tokenize("text", bpe, eos_id=1)
    full = sequences(loader_of(text_dir, tokenize, shuffle=True, num_workers=2))
    # two streams now, one before: the same real tokens (every row's, once), other sequences
    assert real_tokens(loader_of(text_dir, tokenize, shuffle=True, num_workers=2)) == (
        real_tokens(loader_of(text_dir, tokenize, shuffle=True))
    )
    first = loader_of(text_dir, tokenize, shuffle=True, num_workers=2)
    it = iter(first)
    head = [
        row for _, batch in zip(range(5), it, strict=False) for row in batch["input_ids"].tolist()
    ]
    state = first.state_dict()
    del it
    resumed = loader_of(text_dir, tokenize, shuffle=True, num_workers=2)
    resumed.load_state_dict(state)
    assert head + sequences(resumed) == full


@settings(max_examples=6, deadline=None)
@given(steps=st.tuples(st.integers(0, 15), st.integers(0, 15)), new_world=st.integers(1, 3))
def test_elastic_resume_delivers_every_token_once(
    bpe: Tokenizer, text_dir: Path, steps: tuple[int, int], new_world: int
) -> None:
    """2 ranks stop anywhere (mid-document); ``new_world`` ranks deal the rest anew: with what
    the 2 ranks delivered, every row's tokens exactly once."""
    tokenize = Tokenize("text", bpe, eos_id=1)
    common = {"shuffle": True, "even_batches": False}
    states, got = [], Counter[int]()
    for rank, k in enumerate(steps):
        loader = loader_of(text_dir, tokenize, rank=rank, world_size=2, **common)
        it = iter(loader)
        for _, batch in zip(range(k), it, strict=False):
            got += Counter(batch["input_ids"].flatten()[: batch["num_tokens"]].tolist())
        states.append(loader.state_dict())
    for rank in range(new_world):
        loader = loader_of(text_dir, tokenize, rank=rank, world_size=new_world, **common)
        loader.load_state_dict(states, elastic=True)
        got += real_tokens(loader)
    assert got == real_tokens(loader_of(text_dir, tokenize))


def test_another_tokenizer_is_refused_naming_it(bpe: Tokenizer, text_dir: Path) -> None:
    first = loader_of(text_dir, Tokenize("text", bpe, eos_id=1))
    next(iter(first))
    state = first.state_dict()
    for other in (
        Tokenize("text", bpe, eos_id=0),
        Tokenize("text", train(vocab_size=300), eos_id=1),
    ):
        resumed = loader_of(text_dir, other)
        with pytest.raises(
            CheckpointMismatchError, match="Likely cause: tokenizer changed"
        ) as info:
            resumed.load_state_dict(state)
        assert info.value.field == "tokenizer"


def test_unpacked_batches_hold_each_rows_tokens(bpe: Tokenizer, text_dir: Path) -> None:
    """Without packing the tokens are a jagged column; columns= names it by its output name."""
    loader, _ = StructuredDataset.create_dataloader(
        str(text_dir), batch_size=40, columns=["id", "tokens"],
        tokenize=Tokenize("text", bpe, eos_id=1, output="tokens"),
    )  # fmt: skip
    texts = pq.read_table(text_dir / "part-0.parquet").column("text").to_pylist()[:40]
    batch = next(iter(loader))
    assert list(batch) == ["id", "tokens"]
    assert [t.tolist() for t in batch["tokens"].unbind()] == reference(bpe, texts, None, 1)


def test_a_null_text_names_its_file_row_group_and_row(bpe: Tokenizer, tmp_path: Path) -> None:
    texts = ["a b"] * 30 + [None] + ["c"] * 9
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=25)
    loader = loader_of(tmp_path, Tokenize("text", bpe))
    with pytest.raises(DataSourceError, match=r"t.parquet, row group 1, row 30: column 'text'"):
        sequences(loader)


def test_what_cannot_be_tokenized_is_refused(bpe: Tokenizer, text_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"part-0.parquet has no column\(s\) \['body'\]"):
        loader_of(text_dir, Tokenize("body", bpe))
    with pytest.raises(ValueError, match="has type int64; tokenizing needs text"):
        loader_of(text_dir, Tokenize("id", bpe))
    with pytest.raises(TypeError, match="tokenize must be a Tokenize"):
        StructuredDataset.create_dataloader(str(text_dir), tokenize="text")


# ----------------------------------------------------------------------------- in a mixture


@pytest.fixture(scope="module")
def content_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A source whose text column is called ``content``."""
    root = tmp_path_factory.mktemp("content")
    rng = np.random.default_rng(4)
    texts = [" ".join(rng.choice(WORDS, rng.integers(0, 20))) for _ in range(150)]
    pq.write_table(pa.table({"content": texts}), root / "c.parquet", row_group_size=30)
    return root


def mixture_of(text_dir: Path, content_dir: Path, tokenize: Tokenize, **kwargs: Any) -> Any:
    sources = {"web": str(text_dir), "code": Source(path=str(content_dir), text_column="content")}
    return StructuredDataset.create_dataloader(
        sources, weights={"web": 2, "code": 1}, epoch_size=40, batch_size=2, shuffle=True,
        tokenize=tokenize, packing=TokenPacking("input_ids", seq_len=SEQ), **kwargs,
    )[0]  # fmt: skip


@settings(max_examples=5, deadline=None)
@given(stop=st.integers(0, 19))
def test_a_mixture_tokenizes_each_sources_column_and_resumes_exactly(
    bpe: Tokenizer, text_dir: Path, content_dir: Path, stop: int
) -> None:
    """Each source names its own text column; every source's state holds the tokenizer."""
    tokenize = Tokenize("text", bpe, eos_id=1)
    full = sequences(mixture_of(text_dir, content_dir, tokenize))
    first = mixture_of(text_dir, content_dir, tokenize)
    it = iter(first)
    head = [row for _, b in zip(range(stop), it, strict=False) for row in b["input_ids"].tolist()]
    state = first.state_dict()
    resumed = mixture_of(text_dir, content_dir, tokenize)
    resumed.load_state_dict(state)
    assert head + sequences(resumed) == full
    assert json.dumps(state).count('"_tokenize"') == 2  # one per source


def test_a_mixture_refuses_another_tokenizer(
    bpe: Tokenizer, text_dir: Path, content_dir: Path
) -> None:
    first = mixture_of(text_dir, content_dir, Tokenize("text", bpe, eos_id=1))
    next(iter(first))
    state = first.state_dict()
    resumed = mixture_of(text_dir, content_dir, Tokenize("text", bpe, eos_id=0))
    with pytest.raises(CheckpointMismatchError, match="Likely cause: tokenizer changed"):
        resumed.load_state_dict(state)


def test_a_sources_text_column_needs_tokenize(text_dir: Path, content_dir: Path) -> None:
    sources = {"web": str(text_dir), "code": Source(path=str(content_dir), text_column="content")}
    with pytest.raises(ValueError, match="source 'code': text_column='content' names a text"):
        StructuredDataset.create_dataloader(sources, weights={"web": 1, "code": 1})


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_what_cannot_reach_spawned_workers_is_refused_when_the_loader_is_made(
    text_dir: Path, method: str
) -> None:
    """A lambda cannot be pickled to workers that ``spawn`` or ``forkserver`` start: the loader
    refuses it by name when it is made, not with pickle's error when an epoch begins."""
    local = Tokenize("text", lambda texts: [[1] for _ in texts], name="ones")
    with pytest.raises(UnsendableSettingError, match=rf"^Tokenize tokenizer .* by '{method}'"):
        loader_of(text_dir, local, num_workers=1, multiprocessing_context=method)
    with pytest.raises(UnsendableSettingError, match=r"^transform .*module's top level"):
        StructuredDataset.create_dataloader(
            str(text_dir), num_workers=2, multiprocessing_context=method, transform=lambda b: b
        )
    for fine in ({"num_workers": 0, "multiprocessing_context": None},
                 {"num_workers": 1, "multiprocessing_context": "fork"}):  # fmt: skip
        assert len(sequences(loader_of(text_dir, local, **fine))) > 0


def parallelism(texts: list[str]) -> list[list[int]]:
    """A token per text saying whether ``tokenizers`` may start a thread pool here (1: no)."""
    return [[int(os.environ.get("TOKENIZERS_PARALLELISM") == "false")] for _ in texts]


@pytest.mark.parametrize("users", [None, "true"])
def test_workers_tokenize_on_one_thread_unless_the_user_says(
    text_dir: Path, users: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker's tokenizer runs on one thread (a worker whose parent never used the pool
    would start a thread per core); a TOKENIZERS_PARALLELISM the user set is kept."""
    if users is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", users)
    tokenize = Tokenize("text", parallelism, name="parallelism")
    loader = loader_of(text_dir, tokenize, num_workers=2, multiprocessing_context="fork")
    assert set(real_tokens(loader)) == {1 if users is None else 0}
    assert os.environ.get("TOKENIZERS_PARALLELISM") == users  # the training process's unchanged
