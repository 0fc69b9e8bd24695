"""Chat in, input_ids and labels out (``Tokenize(..., chat_template=...)``: ``planning.chat``,
``reading.chat``): every row's tokens and labels equal transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` for templates and tokenizers built here; malformed
conversations are errors naming the file, row and field."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from torch_dataloader_utils import (
    CheckpointMismatchError,
    DataSourceError,
    StructuredDataset,
    Tokenize,
    TokenPacking,
)
from torch_dataloader_utils.reading import chat
from torch_dataloader_utils.reading.chat import chat_tokenized

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
)
# a system prompt (a default one when the conversation has none), then turns that must alternate
SYSTEM = """{%- if messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}
{%- else -%}
{%- set system = 'You are a helpful assistant.' -%}{%- set turns = messages -%}
{%- endif -%}
{{ bos_token }}[SYS] {{ system }} [/SYS]
{% for message in turns %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('turns must alternate user/assistant') }}
{%- endif -%}
{%- if message['role'] == 'user' -%}
[INST] {{ message['content'] }} [/INST]
{%- else -%}
{% generation %} {{ message['content'] }}{{ eos_token }}{% endgeneration %}

{% endif -%}
{% endfor %}"""
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "system": SYSTEM}

CORPUS = [
    f"user {i}: what is the café's crème brûlée? assistant: 東京 {i * 7} ünïcode, hello world"
    for i in range(300)
]


def train(pre_tokenizer: str) -> Tokenizer:
    """A BPE of 400 tokens: byte-level (offsets with their leading space), or on whitespace-split
    lowercased words (characters no token covers: spaces, and spans that end in them)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<s>"))
    if pre_tokenizer == "bytes":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.normalizer = normalizers.Lowercase()
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def fast_of(pre_tokenizer: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=train(pre_tokenizer), bos_token="<s>", eos_token="</s>",
        chat_template=CHATML,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fast() -> PreTrainedTokenizerFast:
    return fast_of("bytes")


@pytest.fixture(scope="module", params=["bytes", "words"])
def any_fast(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    """Both tokenizers, for what compares with transformers."""
    return fast_of(request.param)


def where(row: int) -> str:
    return f"file c.parquet, row group 0, row {row}"


def delivered(conversations: list[Any], tokenize: Tokenize, kind: Any = None) -> pa.RecordBatch:
    """A chunk's tokens and labels, its slices (one per call of the tokenizer) joined."""
    chunk = pa.record_batch(
        {"id": list(range(len(conversations))), "messages": pa.array(conversations, kind)}
    )
    parts = list(chat_tokenized(chunk, tokenize, where))
    assert [end for _, end in parts][-1] == len(conversations)
    joined = pa.Table.from_batches([part for part, _ in parts]).combine_chunks()
    assert joined.schema.names == ["id", tokenize.output, "labels"]
    assert joined.schema.field("labels").type == pa.list_(pa.int64())
    assert joined.column("id").to_pylist() == list(range(len(conversations)))
    return joined.to_batches()[0]


def reference(fast: PreTrainedTokenizerFast, conversation: list[Any], template: str) -> tuple:
    out = fast.apply_chat_template(
        conversation, chat_template=template, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    ids = list(out["input_ids"])
    return ids, [t if m else -100 for t, m in zip(ids, out["assistant_masks"], strict=True)]


def assert_as_transformers(
    fast: PreTrainedTokenizerFast, conversations: list[Any], tokenize: Tokenize, template: str
) -> None:
    batch = delivered(conversations, tokenize)
    got = zip(
        batch.column("input_ids").to_pylist(), batch.column("labels").to_pylist(), strict=True
    )
    for conversation, (ids, labels) in zip(conversations, got, strict=True):
        assert (ids, labels) == reference(fast, conversation, template)


# text, with spaces and markup-like characters often (no lone surrogates: they are no UTF-8)
CHARACTERS = st.sampled_from(list(" \n\tabcdeé東x.,!?<|>")) | st.characters(codec="utf-8")
CONTENT = st.text(alphabet=CHARACTERS, max_size=30)


@st.composite
def conversation(draw: st.DrawFn) -> list[dict[str, str]]:
    """An optional system message, then user and assistant turns alternating."""
    turns = draw(st.integers(1, 6))
    messages = [{"role": "system", "content": draw(CONTENT)}] if draw(st.booleans()) else []
    for turn in range(turns):
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": draw(CONTENT)})
    return messages


@settings(max_examples=40, deadline=None)
@given(conversations=st.lists(conversation(), min_size=1, max_size=8), name=st.sampled_from(
    list(TEMPLATES)))  # fmt: skip
def test_tokens_and_labels_are_apply_chat_templates(
    any_fast: PreTrainedTokenizerFast,
    conversations: list[Any],
    name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For every row: ``input_ids`` as ``apply_chat_template``'s, ``labels`` its tokens where
    its assistant mask is 1 and -100 elsewhere (calls of ~100 bytes: several per chunk)."""
    monkeypatch.setattr(chat, "_CALL_BYTES", 100)
    tokenize = Tokenize("messages", any_fast, chat_template=TEMPLATES[name])
    assert_as_transformers(any_fast, conversations, tokenize, TEMPLATES[name])


def test_the_tokenizers_own_template_and_a_bare_tokenizer(fast: PreTrainedTokenizerFast) -> None:
    """``chat_template=True`` takes the tokenizer's; a ``tokenizers.Tokenizer`` takes a template
    string (and its bos_token/eos_token are not defined: the template writes them literally)."""
    conversations = [[{"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "world café 3"}]] * 3  # fmt: skip
    assert_as_transformers(fast, conversations, Tokenize("messages", fast, chat_template=True),
                           CHATML)  # fmt: skip
    bare = Tokenize("messages", fast.backend_tokenizer, chat_template=CHATML)
    assert delivered(conversations, bare).equals(
        delivered(conversations, Tokenize("messages", fast, chat_template=True))
    )
    with pytest.raises(ValueError, match=r"Tokenizer has none .* pass the template itself"):
        Tokenize("messages", fast.backend_tokenizer, chat_template=True)


@pytest.mark.parametrize(
    "kind",
    [
        pa.large_list(pa.struct({"role": pa.large_string(), "content": pa.large_string()})),
        pa.list_(pa.struct({"content": pa.string_view(), "role": pa.string()})),
    ],
)
def test_large_and_view_types(fast: PreTrainedTokenizerFast, kind: pa.DataType) -> None:
    rows = [[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "東京 café"}]]
    batch = delivered(rows, Tokenize("messages", fast, chat_template=CHATML), kind)
    expected = reference(fast, rows[0], CHATML)
    assert (batch.column("input_ids")[0].as_py(), batch.column("labels")[0].as_py()) == expected


def test_sharegpt_fields_and_roles(any_fast: PreTrainedTokenizerFast) -> None:
    """``from``/``value`` read as role and content, ``human``/``gpt`` as user/assistant; other
    roles unchanged; other fields reach the template, null ones left out."""
    template = CHATML.replace(
        "message['role'] + '\\n'", "message['role'] + (' ' + message.name if message.name "
        "is defined else '') + '\\n'"
    )  # fmt: skip
    rows = [[{"from": "system", "value": "be brief", "name": None},
             {"from": "human", "value": "hi", "name": "ann"},
             {"from": "gpt", "value": "hello ann", "name": None}]]  # fmt: skip
    tokenize = Tokenize(
        "conversations", any_fast, chat_template=template,
        roles={"human": "user", "gpt": "assistant"}, role_field="from", content_field="value",
    )  # fmt: skip
    chunk = pa.record_batch({"conversations": rows})
    (batch, _), = chat_tokenized(chunk, tokenize, where)  # fmt: skip
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "hello ann"}]  # fmt: skip
    expected = reference(any_fast, messages, template)
    assert (batch.column("input_ids")[0].as_py(), batch.column("labels")[0].as_py()) == expected
    assert batch.schema.names == ["input_ids", "labels"]


def test_reasoning_reaches_the_template_under_each_name(fast: PreTrainedTokenizerFast) -> None:
    template = CHATML.replace("message['content'] + '<|im_end|>' }}{% endgeneration",
                              "message.thinking + message['content'] + '<|im_end|>' }}"
                              "{% endgeneration")  # fmt: skip
    rows = [[{"role": "user", "content": "q", "reasoning": None},
             {"role": "assistant", "content": "a", "reasoning": "think "}]]  # fmt: skip
    batch = delivered(rows, Tokenize("messages", fast, chat_template=template))
    expected = reference(fast, [{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a", "reasoning": "think "}],
                         template)  # fmt: skip
    assert (batch.column("input_ids")[0].as_py(), batch.column("labels")[0].as_py()) == expected


def test_spans_in_any_order_mask_as_transformers(any_fast: PreTrainedTokenizerFast) -> None:
    """A generation block inside another closes first (its span recorded before the outer's),
    and an empty one: the tokens marked are still transformers' ones."""
    template = (
        "{% for message in messages %}{{ message['role'] }}: {% if message['role'] == "
        "'assistant' %}{% generation %}[{% generation %}{{ message['content'] }}"
        "{% endgeneration %}]{% endgeneration %}{% generation %}{% endgeneration %}{% else %}"
        "{{ message['content'] }}{% endif %}\n{% endfor %}"
    )
    rows = [[{"role": "user", "content": "hello world"},
             {"role": "assistant", "content": "the assistant says café"},
             {"role": "user", "content": "x"},
             {"role": "assistant", "content": "東京 7"}]]  # fmt: skip
    assert_as_transformers(
        any_fast, rows, Tokenize("messages", any_fast, chat_template=template), template
    )


def test_a_template_without_generation_blocks_is_refused(fast: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match=r"has no \{% generation %\} block: labels need the "
                       r"assistant's text marked. Wrap what the assistant writes"):  # fmt: skip
        Tokenize(
            "messages", fast, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
        )
    with pytest.raises(ValueError, match=r"chat template does not compile: .*line 1"):
        Tokenize("messages", fast, chat_template="{% generation %}{% if %}")


def test_what_cannot_render_a_chat_is_refused(fast: PreTrainedTokenizerFast) -> None:
    with pytest.raises(TypeError, match=r"chat_template needs a tokenizers\.Tokenizer or a "
                       r"transformers fast tokenizer, got function"):  # fmt: skip
        Tokenize("m", lambda texts: [[1]], name="f", chat_template=CHATML)
    with pytest.raises(ValueError, match="bos_id/eos_id for text, not with chat_template"):
        Tokenize("m", fast, chat_template=CHATML, eos_id=1)
    with pytest.raises(TypeError, match=r"chat_template must be True .* or a template string"):
        Tokenize("m", fast, chat_template=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="roles must map role names to role names"):
        Tokenize("m", fast, chat_template=CHATML, roles={"gpt": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="labels 'input_ids' is also the tokens'"):
        Tokenize("m", fast, chat_template=CHATML, labels="input_ids")


def test_the_fingerprint_covers_template_roles_fields_and_tokenizer(
    fast: PreTrainedTokenizerFast,
) -> None:
    base = Tokenize("m", fast, chat_template=CHATML)
    assert Tokenize("m", fast, chat_template=CHATML).fingerprint == base.fingerprint
    others = [
        Tokenize("m", fast, chat_template=LLAMA3),
        Tokenize("m", fast, chat_template=CHATML, roles={"gpt": "assistant"}),
        Tokenize("m", fast, chat_template=CHATML, role_field="from"),
        Tokenize("m", fast, chat_template=CHATML, content_field="value"),
        Tokenize("m", fast.backend_tokenizer, chat_template=CHATML),  # no bos_token/eos_token
        Tokenize("m", train("words"), chat_template=CHATML),
        Tokenize("m", fast),  # text, not chat
    ]
    assert len({base.fingerprint, *(t.fingerprint for t in others)}) == len(others) + 1
    assert base == Tokenize("m", fast, chat_template=CHATML, roles={})
    assert base != others[1]


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ([[{"role": "user", "content": "a"}], None], r"row 1: column 'messages' is null"),
        ([[{"role": "user", "content": "a"}], []], r"row 1: column 'messages' holds an empty"),
        ([[{"role": "user", "content": "a"}, None]], r"row 0: column 'messages', message 1 is"),
        (
            [[{"role": "user", "content": "a"}], [{"role": None, "content": "b"}]],
            r"row 1: column 'messages', message 0 has a null 'role' \(its role\)",
        ),
        (
            [[{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]],
            r"row 0: column 'messages', message 1 has a null 'content' \(its content",
        ),
    ],
)
def test_malformed_conversations_name_row_message_and_field(
    fast: PreTrainedTokenizerFast, rows: list[Any], error: str
) -> None:
    with pytest.raises(DataSourceError, match=rf"c.parquet, row group 0, {error}"):
        delivered(rows, Tokenize("messages", fast, chat_template=CHATML))


def test_a_template_that_raises_names_the_row(fast: PreTrainedTokenizerFast) -> None:
    rows = [[{"role": "user", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    with pytest.raises(DataSourceError, match=r"row 1: the chat template raised TemplateError: "
                       r"turns must alternate user/assistant"):  # fmt: skip
        delivered(rows, Tokenize("messages", fast, chat_template=SYSTEM))


# ----------------------------------------------------------------------------- in a dataset

ROLES = ["user", "assistant"]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 files of 60 conversations of 1-5 turns, row groups of 16 rows."""
    root = tmp_path_factory.mktemp("chat")
    rng = np.random.default_rng(5)
    words = ["hello", "world", "café", "東京", "the", "assistant", "says", "7"]
    for f in range(2):
        rows = [
            [{"role": ROLES[t % 2], "content": " ".join(rng.choice(words, rng.integers(0, 12)))}
             for t in range(rng.integers(1, 6))]
            for _ in range(60)
        ]  # fmt: skip
        table = pa.table({"id": np.arange(f * 60, (f + 1) * 60), "messages": rows})
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=16)
    return root


def loader_of(path: Path, tokenize: Tokenize, **kwargs: Any) -> Any:
    kwargs.setdefault("shuffle", True)
    return StructuredDataset.create_dataloader(
        str(path), batch_size=7, tokenize=tokenize, **kwargs
    )[0]


def rows_of(loader: Any) -> list[tuple[int, list[int], list[int]]]:
    return [
        (int(i), ids.tolist(), labels.tolist())
        for batch in loader
        for i, ids, labels in zip(
            batch["id"], batch["input_ids"].unbind(), batch["labels"].unbind(), strict=True
        )
    ]


def test_batches_hold_jagged_tokens_and_labels_and_resume_exactly(
    fast: PreTrainedTokenizerFast, chat_dir: Path
) -> None:
    """Unpacked, 2 workers: each row's ``input_ids`` and ``labels`` (jagged tensors) are
    ``apply_chat_template``'s; a checkpoint resumes to the same rows; ``columns=`` names the
    tokens and the labels."""
    tokenize = Tokenize("messages", fast, chat_template=True)
    full = rows_of(loader_of(chat_dir, tokenize, num_workers=2))
    table = pq.read_table(chat_dir)
    conversations = dict(zip(table.column("id").to_pylist(), table.column("messages").to_pylist(),
                             strict=True))  # fmt: skip
    assert sorted(i for i, _, _ in full) == list(range(120))
    for i, ids, labels in full:
        assert (ids, labels) == reference(fast, conversations[i], CHATML)
    first = loader_of(chat_dir, tokenize, num_workers=2)
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()
    del it
    assert state["_tokenize"] == ["messages", tokenize.fingerprint]
    resumed = loader_of(chat_dir, tokenize, num_workers=2)
    resumed.load_state_dict(state)
    assert rows_of(head) + rows_of(resumed) == full
    only, _ = StructuredDataset.create_dataloader(
        str(chat_dir), batch_size=4, tokenize=tokenize, columns=["input_ids", "labels"]
    )
    batch = next(iter(only))
    assert list(batch) == ["input_ids", "labels"]
    # labels are int64: cross-entropy's targets as they come (int32 ones are refused)
    assert (batch["input_ids"].dtype, batch["labels"].dtype) == (torch.int32, torch.int64)


def test_another_template_is_refused_on_resume(
    fast: PreTrainedTokenizerFast, chat_dir: Path
) -> None:
    first = loader_of(chat_dir, Tokenize("messages", fast, chat_template=CHATML))
    next(iter(first))
    state = first.state_dict()
    resumed = loader_of(chat_dir, Tokenize("messages", fast, chat_template=LLAMA3))
    with pytest.raises(CheckpointMismatchError, match="chat template") as info:
        resumed.load_state_dict(state)
    assert info.value.field == "tokenizer"


def test_a_malformed_row_names_its_file(fast: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    rows = [[{"role": "user", "content": "a"}]] * 20 + [[{"role": None, "content": "b"}]]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "c.parquet", row_group_size=16)
    loader = loader_of(tmp_path, Tokenize("messages", fast, chat_template=CHATML), shuffle=False)
    with pytest.raises(DataSourceError, match=r"c.parquet, row group 1, row 20: column "
                       r"'messages', message 0 has a null 'role'"):  # fmt: skip
        list(loader)


def test_what_is_not_a_conversation_column_is_refused(
    fast: PreTrainedTokenizerFast, chat_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"column 'id' of the files at .* has type int64; a "
                       r"chat template needs a conversation column"):  # fmt: skip
        loader_of(chat_dir, Tokenize("id", fast, chat_template=CHATML))
    with pytest.raises(ValueError, match=r"its messages have no field 'from' \(fields: "
                       r"\['role', 'content'\]\)"):  # fmt: skip
        loader_of(chat_dir, Tokenize("messages", fast, chat_template=CHATML, role_field="from"))
    numbers = [[{"role": "user", "content": 3}]]
    pq.write_table(pa.table({"messages": numbers}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match="field 'content' of its messages has type int64"):
        loader_of(tmp_path, Tokenize("messages", fast, chat_template=CHATML))
    with pytest.raises(ValueError, match="labels 'id' is already a column"):
        loader_of(chat_dir, Tokenize("messages", fast, chat_template=CHATML, labels="id"))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packed_chat_carries_its_labels_token_for_token(
    fast: PreTrainedTokenizerFast, chat_dir: Path, workers: int
) -> None:
    """Packed, the labels are a companion: the packed ``input_ids`` and ``labels`` are every
    conversation's, in delivery order, concatenated and cut; a resume goes on exactly."""
    tokenize = Tokenize("messages", fast, chat_template=CHATML)
    rows = rows_of(
        loader_of(chat_dir, tokenize, shuffle=False, columns=["id", "input_ids", "labels"])
    )
    ids = [t for _, row, _ in rows for t in row]
    labels = [t for _, _, row in rows for t in row]
    packing = TokenPacking("input_ids", seq_len=32, companions={"labels": -100})
    loader = loader_of(chat_dir, tokenize, shuffle=False, packing=packing, num_workers=workers)
    batches = list(loader)
    got = torch.cat([b["input_ids"].flatten()[: b["num_tokens"]] for b in batches]).tolist()
    got_labels = torch.cat([b["labels"].flatten()[: b["num_tokens"]] for b in batches]).tolist()
    if workers:  # two streams, interleaved by packed batch: each token keeps its label
        assert sorted(zip(got, got_labels, strict=True)) == sorted(zip(ids, labels, strict=True))
        assert all(label in (-100, token) for token, label in zip(got, got_labels, strict=True))
    else:  # one stream: the conversations in delivery order, concatenated
        assert (got, got_labels) == (ids, labels)
    assert batches[0]["labels"].dtype == torch.int64
    resumed = loader_of(chat_dir, tokenize, shuffle=False, packing=packing, num_workers=workers)
    loader = loader_of(chat_dir, tokenize, shuffle=False, packing=packing, num_workers=workers)
    for _, _ in zip(range(3), loader, strict=False):
        pass
    resumed.load_state_dict(loader.state_dict())
    rest = list(resumed)
    assert all(
        torch.equal(a["labels"], b["labels"]) for a, b in zip(rest, batches[3:], strict=True)
    )


def test_packing_a_chat_needs_the_labels_as_a_companion(
    fast: PreTrainedTokenizerFast, chat_dir: Path
) -> None:
    """Packed, a chat's labels must be a companion of the tokens."""
    tokenize = Tokenize("messages", fast, chat_template=CHATML)
    for companions in ({}, {"loss_mask": 0}):
        with pytest.raises(ValueError, match=r"pass TokenPacking\('input_ids', ..., companions="
                           r"\{'labels': -100\}\)"):  # fmt: skip
            tokenize.check_packing(TokenPacking("input_ids", seq_len=8, companions=companions))
    tokenize.check_packing(TokenPacking("input_ids", seq_len=8, companions={"labels": -100}))
    Tokenize("text", fast).check_packing(TokenPacking("input_ids", seq_len=8))  # text: no check


def test_conversations_packed_whole_keep_their_labels(
    fast: PreTrainedTokenizerFast, chat_dir: Path
) -> None:
    """SFT's packing: each conversation whole in one sequence, its labels beside its tokens;
    every conversation once (the parts ``cu_seqlens`` marks, padding left out)."""
    tokenize = Tokenize("messages", fast, chat_template=CHATML)
    columns = ["id", "input_ids", "labels"]
    rows = rows_of(loader_of(chat_dir, tokenize, shuffle=False, columns=columns))
    longest = max(len(ids) for _, ids, _ in rows)
    packing = TokenPacking(
        "input_ids", seq_len=longest, companions={"labels": -100}, whole_documents=True
    )
    parts = []
    for batch in loader_of(chat_dir, tokenize, packing=packing, num_workers=2):
        ids, labels = batch["input_ids"].flatten(), batch["labels"].flatten()
        bounds = batch["cu_seqlens"].tolist()
        for lo, hi in itertools.pairwise(bounds):
            if batch["position_ids"].flatten()[lo] == 0 and labels[lo:hi].ne(-100).any():
                parts.append((ids[lo:hi].tolist(), labels[lo:hi].tolist()))
    expected = [(ids, labels) for _, ids, labels in rows if any(t != -100 for t in labels)]
    assert sorted(parts) == sorted(expected)
