"""Conversations to tokens and labels, a chunk at a time (``Tokenize(..., chat_template=...)``).

Each call of the tokenizer takes about ``_CALL_BYTES`` of content: its conversations
become Python messages (the only per-message Python besides the template), each renders with
the template (Jinja: Python by nature) recording the character spans of its ``{% generation %}``
blocks, the renders are tokenized in one batched call with character offsets, and the labels
come from the offsets and the spans with numpy, exactly as ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` marks tokens: a token is the assistant's when it overlaps
the first span (in the order they closed) not wholly before the furthest token start so far.

The column is checked first, with Arrow's kernels: a null conversation, an empty one, a null
message, a null role or a null content is an error naming the file, row and field.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jinja2
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..base.errors import DataSourceError
from ..planning.chat import REASONING_FIELDS, ChatFormat, Spans, compiled, recording
from ..planning.text import Tokenize
from .tokenizing import Describe, call_bounds

__all__ = ["chat_tokenized"]

# Labels outside the assistant's tokens (what PyTorch's cross-entropy ignores).
IGNORED = -100
# Bytes of content per call of the tokenizer: ~130 conversations of ~600 tokens. Calls of 30
# cost ~25 % more CPU a token (byte-level BPE, tokenizers 0.23); the tokenizer's objects for a
# call (ids, offsets: ~12 times the text) stay a few MiB.
_CALL_BYTES = 2**19
# Template text per message, about, in a call's bytes (role markers and the like).
_MESSAGE_BYTES = 16


def chat_tokenized(
    chunk: pa.RecordBatch, tokenize: Tokenize, describe: Describe
) -> Iterator[tuple[pa.RecordBatch, int]]:
    """``chunk``'s rows a slice per call of the tokenizer, the conversation column replaced by
    the tokens ``tokenize.output`` (``list<int32>``) and the ``labels`` after them
    (``list<int64>``), with
    the chunk's rows up to the slice's end (as ``tokenizing.tokenized``)."""
    chat = tokenize.chat
    assert chat is not None, "chat_tokenized needs a chat Tokenize"
    column = chunk.column(tokenize.column)
    starts, messages = _checked(column, tokenize.column, chat, describe)
    index = chunk.schema.get_field_index(tokenize.column)
    delivered = tokenize.delivered(chunk.schema)
    template, encode = compiled(chat.template), tokenize.chat_encoder()
    content = messages.field(chat.content_field)
    if content.type == pa.string_view():  # Arrow's length kernel takes offsets
        content = content.cast(pa.large_string())
    sizes = pc.binary_length(content).to_numpy(zero_copy_only=False)
    before = np.concatenate(([0], np.cumsum(sizes + _MESSAGE_BYTES)))
    for start, stop in itertools.pairwise(
        call_bounds(np.diff(before[starts]), _CALL_BYTES).tolist()
    ):

        def named(row: int, start: int = start) -> str:
            return describe(start + row)

        part = messages.slice(starts[start], starts[stop] - starts[start])
        texts, spans = _rendered(template, chat, _conversations(part, starts, start, stop), named)
        try:
            encodings = encode(texts)
        except Exception as exc:  # a tokenizer may raise anything: name the rows
            raise DataSourceError(
                f"{named(0)} and the {stop - start - 1} rows after it: tokenizer "
                f"{tokenize.label} raised {type(exc).__name__}: {exc}"
            ) from exc
        tokens, labels = _labelled(encodings, texts, spans)
        sliced = chunk.slice(start, stop - start).set_column(index, delivered.field(index), tokens)
        yield sliced.add_column(index + 1, delivered.field(index + 1), labels), stop


def _checked(
    column: pa.Array, name: str, chat: ChatFormat, describe: Describe
) -> tuple[np.ndarray, pa.StructArray]:
    """The conversations' bounds (row ``r``'s messages are ``starts[r]:starts[r + 1]``) and their
    messages, or the error naming the first malformed row."""
    if column.null_count:
        row = _first(column.is_null())
        raise DataSourceError(
            f"{describe(row)}: column {name!r} is null; a conversation needs messages (fill "
            f"or filter such rows out of the files)"
        )
    counts = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if not counts.all():
        raise DataSourceError(
            f"{describe(int(np.flatnonzero(counts == 0)[0]))}: column {name!r} holds an empty "
            f"conversation (no messages): there is nothing to render"
        )
    starts = np.concatenate(([0], np.cumsum(counts)))
    messages = pc.list_flatten(column)
    checks = (
        (messages.is_null(), "is null; every message needs a role and a content"),
        (pc.struct_field(messages, chat.role_field).is_null(), f"has a null {chat.role_field!r} "
         f"(its role)"),
        (pc.struct_field(messages, chat.content_field).is_null(), f"has a null "
         f"{chat.content_field!r} (its content: a string, empty if need be)"),
    )  # fmt: skip
    for nulls, what in checks:
        if pc.any(nulls).as_py():
            bad = _first(nulls)
            row = int(np.searchsorted(starts, bad, side="right")) - 1
            raise DataSourceError(
                f"{describe(row)}: column {name!r}, message {bad - starts[row]} {what}"
            )
    return starts, messages


def _first(flags: pa.Array) -> int:
    return int(np.flatnonzero(flags.to_numpy(zero_copy_only=False))[0])


def _conversations(
    part: pa.StructArray, starts: np.ndarray, start: int, stop: int
) -> Iterator[list[dict[str, Any]]]:
    """Rows ``start:stop``'s conversations as lists of message dicts (``part``: their
    messages): what the template sees, before ``ChatFormat`` renames roles and fields."""
    flat = part.to_pylist()
    bounds = (starts[start : stop + 1] - starts[start]).tolist()
    return (flat[lo:hi] for lo, hi in itertools.pairwise(bounds))


def _rendered(
    template: jinja2.Template,
    chat: ChatFormat,
    conversations: Iterator[list[dict[str, Any]]],
    describe: Describe,
) -> tuple[list[str], list[Spans]]:
    """Each conversation rendered, with the character spans of its generation blocks."""
    message = _message_maker(chat)
    # as apply_chat_template passes them (its special tokens, then no tools, documents, prompt)
    variables = {**chat.variables, "tools": None, "documents": None, "add_generation_prompt": False}
    texts, spans = [], []
    for row, conversation in enumerate(conversations):
        blocks: list[str] = []
        found: Spans = []
        try:
            messages = [message(fields) for fields in conversation]
            with recording(blocks, found):
                blocks.extend(template.generate(messages=messages, **variables))
        except Exception as exc:  # raise_exception, or any error of the template: name the row
            raise DataSourceError(
                f"{describe(row)}: the chat template raised {type(exc).__name__}: {exc}"
            ) from exc
        texts.append("".join(blocks))
        spans.append(found)
    return texts, spans


def _message_maker(chat: ChatFormat) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A message of the data as transformers hands it to the template: fields renamed to
    ``role`` and ``content``, its role renamed by ``roles``, null fields left out, and the
    reasoning under each of its names."""
    names = {chat.role_field: "role", chat.content_field: "content"}
    roles: Mapping[str, str] = chat.roles
    role_field = chat.role_field

    def message(fields: dict[str, Any]) -> dict[str, Any]:
        made = {
            names.get(key, key): roles.get(value, value) if key == role_field else value
            for key, value in fields.items()
            if value is not None
        }
        reasoning = next((made[key] for key in REASONING_FIELDS if key in made), None)
        if reasoning is not None:
            return {"thinking": reasoning, **made, "reasoning_content": reasoning}
        return made

    return message


def _labelled(
    encodings: list[Any], texts: list[str], spans: list[Spans]
) -> tuple[pa.Array, pa.Array]:
    """The tokens of ``encodings`` and their labels (the token where it overlaps an assistant
    span, as ``apply_chat_template`` decides, else ``IGNORED``), as list columns."""
    ids = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    total = int(lengths.sum())
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)
    chars = itertools.chain.from_iterable(
        itertools.chain.from_iterable(encoding.offsets for encoding in encodings)
    )
    offsets = np.fromiter(chars, dtype=np.int64, count=2 * total).reshape(-1, 2)
    # every row's characters, tokens and spans one after the other: one sorted search for all
    bases = np.cumsum([0, *map(len, texts)])[:-1]
    shift = np.repeat(bases, lengths)
    span_counts = np.fromiter(map(len, spans), dtype=np.int64, count=len(spans))
    flat = np.array(list(itertools.chain.from_iterable(spans)), dtype=np.int64).reshape(-1, 2)
    flat += np.repeat(bases, span_counts)[:, None]
    # a token is compared with the first span (in the order they closed) whose end passes the
    # furthest token start so far (transformers' loop), if its row has one: past the row's
    # last span, the sentinel start no token ends after
    ends = np.maximum.accumulate(flat[:, 1])
    span = np.searchsorted(ends, np.maximum.accumulate(offsets[:, 0] + shift), side="right")
    span_starts = np.append(flat[:, 0], np.iinfo(np.int64).max)
    past_row = span >= np.repeat(np.cumsum(span_counts), lengths)
    span[past_row] = len(flat)
    labels = values.astype(np.int64)
    labels[offsets[:, 1] + shift <= span_starts[span]] = IGNORED
    bounds = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    return (
        pa.ListArray.from_arrays(bounds, pa.array(values)),
        pa.ListArray.from_arrays(bounds, pa.array(labels)),
    )
