"""An SFT mixture of chat sets (``Source(role_field=, content_field=, roles=)``): a ShareGPT
source (``conversations`` of ``from``/``value``, ``human``/``gpt``) beside a Hugging Face one
(``messages`` of ``role``/``content``), weighted by tokens and packed with their labels: every
conversation's ``input_ids`` and ``labels`` are ``apply_chat_template``'s for its source, each
once per source epoch, exact and elastic on resume, under new weights, and each source's own
mapping part of its fingerprint."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_chat import CHATML, LLAMA3, fast_of, reference
from transformers import PreTrainedTokenizerFast

from torch_dataloader_utils import (
    CheckpointMismatchError,
    Source,
    StructuredDataset,
    Tokenize,
    TokenPacking,
)

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
WORDS = ["hello", "world", "café", "東京", "the", "assistant", "says", "7"]
PAD = 1  # "</s>": no conversation starts with it (ChatML's start with <|im_start|>)
SIZES = {"sharegpt": 40, "hf": 50, "extra": 30}
NAMES = tuple(SIZES)  # a batch's source: its index in the mixture, added ones last
Part = tuple[tuple[int, ...], tuple[int, ...]]  # a conversation's input_ids and labels


def conversations(seed: int, count: int) -> list[list[dict[str, str]]]:
    """``count`` conversations (a system message sometimes, then 1-4 turns), each unique (its
    first message says its number)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        messages = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
        for turn in range(rng.integers(1, 5)):
            words = " ".join(rng.choice(WORDS, rng.integers(0, 10)))
            content = f"#{i} {words}" if turn == 0 else words
            messages.append({"role": ("user", "assistant")[turn % 2], "content": content})
        out.append(messages)
    return out


def sharegpt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation as ShareGPT writes it."""
    names = {v: k for k, v in SHAREGPT_ROLES.items()}
    return [{"from": names.get(m["role"], m["role"]), "value": m["content"]} for m in messages]


@pytest.fixture(scope="module")
def fast() -> PreTrainedTokenizerFast:
    return fast_of("bytes")


@pytest.fixture(scope="module")
def data(
    tmp_path_factory: pytest.TempPathFactory, fast: PreTrainedTokenizerFast
) -> tuple[dict[str, Path], dict[str, set[Part]]]:
    """Each source's directory (2 files, row groups of 8 rows), and the ``apply_chat_template``
    tokens and labels of its conversations."""
    root = tmp_path_factory.mktemp("chat_mixture")
    paths, expected = {}, {}
    for seed, (name, count) in enumerate(SIZES.items()):
        rows = conversations(seed, count)
        column, stored = ("conversations", [sharegpt(r) for r in rows]) if name == "sharegpt" \
            else ("messages", rows)  # fmt: skip
        paths[name] = root / name
        paths[name].mkdir()
        half = count // 2
        for f, (lo, hi) in enumerate(((0, half), (half, count))):
            table = pa.table({"id": np.arange(lo, hi), column: stored[lo:hi]})
            pq.write_table(table, paths[name] / f"part-{f}.parquet", row_group_size=8)
        refs = [reference(fast, r, CHATML) for r in rows]
        expected[name] = {(tuple(ids), tuple(labels)) for ids, labels in refs}
        assert len(expected[name]) == count
    return paths, expected


def tokenize(fast: PreTrainedTokenizerFast, template: str = CHATML) -> Tokenize:
    return Tokenize("messages", fast, chat_template=template)


def sources(
    paths: Mapping[str, Path], names: tuple[str, ...] = ("sharegpt", "hf"), **sharegpt: Any
) -> dict[str, Any]:
    """The mixture's sources: the ShareGPT one with its own column, fields and roles."""
    own = {"text_column": "conversations", "role_field": "from", "content_field": "value",
           "roles": SHAREGPT_ROLES} | sharegpt  # fmt: skip
    return {
        name: Source(path=str(paths[name]), **own) if name == "sharegpt" else str(paths[name])
        for name in names
    }


def seq_len(expected: Mapping[str, set[Part]]) -> int:
    return max(len(ids) for parts in expected.values() for ids, _ in parts)


def options(
    expected: Mapping[str, set[Part]], fast: PreTrainedTokenizerFast, *, whole: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:  # fmt: skip
    packing = TokenPacking(
        "input_ids", seq_len=seq_len(expected), pad_id=PAD, companions={"labels": -100},
        whole_documents=whole, window=4,
    )  # fmt: skip
    return {"weights": {"sharegpt": 2, "hf": 1}, "epoch_size": 30, "batch_size": 2,
            "shuffle": True, "tokenize": tokenize(fast), "packing": packing} | kwargs  # fmt: skip


def loader_of(paths: Mapping[str, Path], names: tuple[str, ...] = ("sharegpt", "hf"),
              **kwargs: Any) -> Any:  # fmt: skip
    return StructuredDataset.create_dataloader(sources(paths, names), **kwargs)


def parts(batch: Mapping[str, Any], expected: Mapping[str, set[Part]]) -> list[tuple[str, Part]]:
    """The conversations of a batch packed whole: each part ``cu_seqlens`` marks is one
    conversation of its sequence's source (``apply_chat_template``'s tokens and labels), or
    padding."""
    ids = np.asarray(batch["input_ids"])
    labels = np.asarray(batch["labels"])
    length = ids.shape[1]
    flat_ids, flat_labels = ids.ravel().tolist(), labels.ravel().tolist()
    found = []
    for lo, hi in itertools.pairwise(np.asarray(batch["cu_seqlens"]).tolist()):
        assert lo // length == (hi - 1) // length, f"part {lo}..{hi} crosses a sequence"
        if flat_ids[lo] == PAD:
            assert set(flat_ids[lo:hi]) == {PAD} and set(flat_labels[lo:hi]) == {-100}
            continue
        source = NAMES[int(batch["source"][lo // length])]
        part = (tuple(flat_ids[lo:hi]), tuple(flat_labels[lo:hi]))
        assert part in expected[source], f"a part of {source!r} is none of its conversations"
        found.append((source, part))
    return found


def plain(batch: Mapping[str, Any]) -> dict[str, list[Any]]:
    return {key: np.asarray(value).tolist() for key, value in batch.items()}


def assert_each_once_per_source_epoch(
    found: list[tuple[str, Part]], expected: Mapping[str, set[Part]], names: tuple[str, ...],
    streams: int = 1,
) -> None:  # fmt: skip
    """Every conversation of a source read as often as the others, within one: none lost,
    none repeated before the source's epoch ends. (Each of several ``streams`` reads its share
    of a source epoch, and may be an epoch ahead of another when they stop: within two.)"""
    counts = Counter(found)
    assert {source for source, _ in found} == set(names)
    for name in names:
        times = [counts[name, part] for part in expected[name]]
        assert max(times) - min(times) <= (1 if streams == 1 else 2), (name, Counter(times))


# ----------------------------------------------------------------------------- the mixture


@pytest.mark.parametrize("workers", [0, 2])
def test_each_source_renders_with_its_own_fields_packed_whole(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]],
    workers: int,
) -> None:  # fmt: skip
    """Two mixture epochs packed whole: each part is a conversation of its sequence's source as
    ``apply_chat_template`` makes it, each once per source epoch; the ShareGPT source's is
    rendered with ``user``/``assistant`` (the HF source's own names)."""
    paths, expected = data
    loader, dataset = loader_of(paths, **options(expected, fast, num_workers=workers))
    found = []
    for epoch in range(2):
        dataset.set_epoch(epoch)
        found += [part for batch in loader for part in parts(batch, expected)]
    assert_each_once_per_source_epoch(found, expected, ("sharegpt", "hf"), max(1, workers))
    shares = Counter(source for source, _ in found)
    assert shares["sharegpt"] > SIZES["sharegpt"]  # beyond one epoch of it: 2 to 1 by tokens


def test_greedy_packing_concatenates_each_sources_conversations(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]]
) -> None:
    """Packed greedily (one stream): each source's sequences, in order, are its conversations
    concatenated, each ``apply_chat_template``'s tokens and labels, none twice in an epoch."""
    paths, expected = data
    loader, _ = loader_of(paths, **options(expected, fast, whole=False, shuffle=False))
    streams: dict[str, tuple[list[int], list[int]]] = {"sharegpt": ([], []), "hf": ([], [])}
    for batch in loader:
        for row, source in enumerate(batch["source"].tolist()):
            streams[NAMES[source]][0].extend(batch["input_ids"][row].tolist())
            streams[NAMES[source]][1].extend(batch["labels"][row].tolist())
    for name, (ids, labels) in streams.items():
        pos, seen = 0, []
        while pos < len(ids):
            whole = [p for p in expected[name] if (ids[pos : pos + len(p[0])],
                     labels[pos : pos + len(p[0])]) == (list(p[0]), list(p[1]))]  # fmt: skip
            if not whole:  # the stream's end: the start of a conversation, cut
                rest = (tuple(ids[pos:]), tuple(labels[pos:]))
                assert any(p[0][: len(rest[0])] == rest[0] and p[1][: len(rest[1])] == rest[1]
                           for p in expected[name]), name  # fmt: skip
                break
            seen.append(whole[0])
            pos += len(whole[0][0])
        size = SIZES[name]  # each source epoch: every conversation once
        assert len(seen) > size or name == "hf"  # the ShareGPT one read in 2 epochs
        for start in range(0, len(seen), size):
            epoch = seen[start : start + size]
            assert len(set(epoch)) == len(epoch), name
        assert len(seen) < size or set(seen[:size]) == expected[name]


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(stop=st.integers(1, 14))
def test_a_chat_mixture_resumes_exactly(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]], stop: int
) -> None:
    """A checkpoint at a random batch resumes to the same batches, labels and sources."""
    paths, expected = data
    kwargs = options(expected, fast, num_workers=2)
    full = [plain(b) for b in loader_of(paths, **kwargs)[0]]
    first, _ = loader_of(paths, **kwargs)
    it = iter(first)
    head = [plain(next(it)) for _ in range(stop)]
    state = _harness.json_round_trip(first.state_dict())
    del it
    resumed, _ = loader_of(paths, **kwargs)
    resumed.load_state_dict(state)
    assert head + [plain(b) for b in resumed] == full


@pytest.mark.parametrize(("old", "new"), [((1, 2), (1, 0)), ((1, 0), (2, 0))],
                         ids=["2-to-1", "1-to-2"])  # fmt: skip
def test_a_chat_mixture_resumes_elastically(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]],
    old: tuple[int, int], new: tuple[int, int],
) -> None:  # fmt: skip
    """2 streams resumed on 1, and 1 on 2, then the next epoch: every conversation its
    source's, none lost or repeated in a source epoch."""
    paths, expected = data
    kwargs = options(expected, fast)
    kwargs.pop("tokenize")
    batches = _harness.mixture_elastic_batches(
        sources(paths), {"tokenize": tokenize(fast), **kwargs}, old, new, [3, 2]
    )
    found = [part for batch in batches for part in parts(batch, expected)]
    streams = new[0] * max(1, new[1])
    assert_each_once_per_source_epoch(found, expected, ("sharegpt", "hf"), streams)


def test_a_chat_mixture_continues_under_new_weights_and_a_new_source(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]]
) -> None:
    """``reweight=True`` with the weights changed and a third (HF-style) source added: each
    source goes on where it stood, none of its conversations lost or repeated in its epoch."""
    paths, expected = data
    kwargs = options(expected, fast)
    loader, _ = loader_of(paths, **kwargs)
    it = iter(loader)
    found = [part for _ in range(3) for part in parts(next(it), expected)]
    state = _harness.json_round_trip(loader.state_dict())
    del it
    names = ("sharegpt", "hf", "extra")
    weights = {"sharegpt": 1, "hf": 3, "extra": 2}
    loader, dataset = loader_of(paths, names, **kwargs | {"weights": weights})
    loader.load_state_dict(state, reweight=True)
    found += [part for batch in loader for part in parts(batch, expected)]
    dataset.set_epoch(1)
    found += [part for batch in loader for part in parts(batch, expected)]
    assert_each_once_per_source_epoch(found, expected, names)


# ----------------------------------------------------------------------------- fingerprints


@pytest.mark.parametrize(
    "change",
    [{"template": LLAMA3}, {"roles": {"human": "user", "gpt": "assistant", "system": "user"}}],
    ids=["template", "roles"],
)
def test_another_template_or_mapping_is_refused_on_resume(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]],
    change: dict[str, Any],
) -> None:  # fmt: skip
    """A source's rendering changed (the mixture's template, or the ShareGPT source's own
    roles): a ``CheckpointMismatchError`` on ``tokenizer``, naming the source."""
    paths, expected = data
    kwargs = options(expected, fast)
    first, _ = loader_of(paths, **kwargs)
    next(iter(first))
    state = first.state_dict()
    template = change.get("template", CHATML)
    own = {"roles": change["roles"]} if "roles" in change else {}
    resumed, _ = StructuredDataset.create_dataloader(
        sources(paths, **own), **kwargs | {"tokenize": tokenize(fast, template)}
    )
    with pytest.raises(CheckpointMismatchError, match=r"^source 'sharegpt': .* planned with "
                       r"tokenizer=\['conversations', '[0-9a-f]+'\]") as info:  # fmt: skip
        resumed.load_state_dict(state)
    assert info.value.field == "tokenizer"


def test_each_sources_fingerprint_covers_its_own_mapping(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]]
) -> None:
    paths, expected = data
    loader, _ = loader_of(paths, **options(expected, fast))
    state = loader.state_dict()
    found = {name: s["_tokenize"] for name, s in state["sources"].items()}
    mapped = Tokenize("conversations", fast, chat_template=CHATML, role_field="from",
                      content_field="value", roles=SHAREGPT_ROLES)  # fmt: skip
    assert found == {"sharegpt": mapped.setting, "hf": tokenize(fast).setting}


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("own", "error", "message"),
    [
        ({"roles": {"gpt": 1}}, TypeError, "roles of source 'sharegpt' must map role names"),
        ({"roles": ["gpt"]}, TypeError, "roles of source 'sharegpt' must map role names"),
        ({"role_field": 3}, TypeError, "role_field of source 'sharegpt' must be a column name"),
        ({"content_field": ""}, ValueError, "content_field of source 'sharegpt' must be a non"),
        ({"content_field": "from"}, ValueError,
         "source 'sharegpt': Tokenize role_field and content_field are both 'from'"),
        ({"role_field": "role"}, ValueError,
         r"of source 'sharegpt': the files at .*sharegpt: its messages have no field 'role' "
         r"\(fields: \['from', 'value'\]\)"),
    ],
)  # fmt: skip
def test_a_sources_chat_fields_are_checked_by_name(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]],
    own: dict[str, Any], error: type[Exception], message: str,
) -> None:  # fmt: skip
    paths, expected = data
    with pytest.raises(error, match=message):
        StructuredDataset.create_dataloader(sources(paths, **own), **options(expected, fast))


NO_CHAT = (
    r"source 'sharegpt': role_field and content_field and roles describe the source's "
    r"conversations, but the mixture renders none: pass tokenize=Tokenize\(..., chat_template="
)


def test_a_sources_chat_fields_need_a_chat(
    fast: PreTrainedTokenizerFast, data: tuple[dict[str, Path], dict[str, set[Part]]]
) -> None:
    paths, expected = data
    for other in ({"tokenize": None, "packing": None, "epoch_size": None},
                  {"tokenize": Tokenize("conversations", fast), "packing": None}):  # fmt: skip
        with pytest.raises(ValueError, match=NO_CHAT):
            StructuredDataset.create_dataloader(sources(paths), **options(expected, fast) | other)
