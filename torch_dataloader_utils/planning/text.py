"""``Tokenize``: the choice of turning a text column into token ids, and its fingerprint.

A row's tokens are ``[bos_id] + tokens(text) + [eos_id]`` (each end only when given), where
``tokens(text)`` is what the tokenizer gives for that text alone, without the special tokens a
tokenizer may add by itself. So the tokens of a row are a pure function of its text and of this
value, and a checkpoint needs only the fingerprint to know the tokens it counted are the ones
a resume makes again.

The tokenizer is one of:

- a ``tokenizers.Tokenizer``;
- a ``transformers`` fast tokenizer (its ``backend_tokenizer`` is the one above);
- any callable ``list[str] -> list[list[int]]`` (tiktoken's ``encode_ordinary_batch``, say),
  with ``name=``: a callable's definition cannot be read, so its name stands for it (refused
  without one: drift could not be detected).

The fingerprint is the xxh3 of the tokenizer's complete serialized definition (``to_str()``:
vocabulary, merges, normalizer, pre-tokenizer, added tokens), or of ``name`` for a callable,
with ``bos_id`` and ``eos_id``. No tokenizer library is imported here.

With ``chat_template`` the column holds conversations instead (``planning.chat``): each renders
with the template and makes the token column and a ``labels`` column beside it; the template,
roles and fields are part of the fingerprint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.types as pat
import xxhash

from ..base.args import optional_name, optional_whole
from .chat import ChatFormat
from .tokens import TokenPacking

__all__ = ["MAX_TOKEN_ID", "Encoder", "Tokenize"]

# Token ids are stored as int32.
MAX_TOKEN_ID = 2**31 - 1

Encoder = Callable[[list[str]], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class Tokenize:
    """Tokenize the text column ``column`` into the token column ``output`` (``list<int32>``).

    ``bos_id`` / ``eos_id`` (optional) begin / end every row's tokens. ``name`` names a callable
    tokenizer (required for one; optional otherwise, used in messages).

    ``chat_template`` (``True``: the tokenizer's own; or a template string) reads the column as
    conversations (``list<struct<role, content>>``; ``role_field`` / ``content_field`` name
    other fields, ``roles`` renames roles) and adds the column ``labels``: a token where the
    template's ``{% generation %}`` blocks hold it, -100 elsewhere (``docs/chat.md``).
    """

    column: str
    tokenizer: Any = field(repr=False, compare=False)
    bos_id: int | None = None
    eos_id: int | None = None
    output: str = "input_ids"
    name: str | None = None
    chat_template: bool | str = False
    roles: Mapping[str, str] | None = field(default=None, compare=False)  # in the fingerprint
    role_field: str = "role"
    content_field: str = "content"
    labels: str = "labels"
    fingerprint: str = field(init=False)
    chat: ChatFormat | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in ("column", "output"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise TypeError(f"Tokenize {key} must be a column name, got {value!r}")
        object.__setattr__(self, "name", optional_name("Tokenize name", self.name))
        for key in ("bos_id", "eos_id"):
            value = optional_whole(f"Tokenize {key}", getattr(self, key))
            if value is not None and not 0 <= value <= MAX_TOKEN_ID:
                raise ValueError(f"Tokenize {key}={value} is not a token id (0..{MAX_TOKEN_ID})")
            object.__setattr__(self, key, value)
        object.__setattr__(self, "chat", self._chat())
        parts = [_definition(self.tokenizer, self.name), str(self.bos_id), str(self.eos_id)]
        if self.chat is not None:
            parts.append(self.chat.definition)
        digest = xxhash.xxh3_64()
        for part in parts:
            digest.update(part.encode())
            digest.update(b"\0")
        object.__setattr__(self, "fingerprint", digest.hexdigest())

    def _chat(self) -> ChatFormat | None:
        """The chat format asked for (``None``: text), checked against the other arguments."""
        if self.chat_template is False:
            return None
        if self.bos_id is not None or self.eos_id is not None:
            raise ValueError(
                "Tokenize takes bos_id/eos_id for text, not with chat_template: a chat template "
                "writes the special tokens itself"
            )
        if _backend(self.tokenizer) is None:
            raise TypeError(
                f"Tokenize with chat_template needs a tokenizers.Tokenizer or a transformers fast "
                f"tokenizer, got {type(self.tokenizer).__name__}: the labels map the assistant's "
                f"characters to tokens through the tokenizer's offsets"
            )
        if self.labels in (self.output, self.column):
            raise ValueError(f"Tokenize labels {self.labels!r} is also the tokens' or the "
                             f"column's name")  # fmt: skip
        return ChatFormat.of(
            self.tokenizer, self.chat_template, roles=self.roles, role_field=self.role_field,
            content_field=self.content_field, labels=self.labels,
        )  # fmt: skip

    @property
    def setting(self) -> list[str]:
        """What a checkpoint records: the text column and the tokenizer's fingerprint."""
        return [self.column, self.fingerprint]

    def check(self, schema: pa.Schema, where: str) -> None:
        """Raise unless ``schema`` (of ``where``: the files, or a source) holds the text column
        and no column already named as the tokens."""
        if self.column not in schema.names:
            raise ValueError(
                f"Tokenize column {self.column!r} is not in {where}; columns: {schema.names}"
            )
        kind = schema.field(self.column).type
        if self.chat is not None:
            self.chat.check(schema, self.column, where)
        elif not _is_text(kind):
            raise ValueError(
                f"Tokenize column {self.column!r} of {where} has type {kind}; tokenizing needs "
                f"text: string, large_string, string_view, or binary holding UTF-8"
            )
        if self.output != self.column and self.output in schema.names:
            raise ValueError(
                f"Tokenize output {self.output!r} is already a column of {where}; name the "
                f"tokens otherwise (Tokenize(..., output=...)) or leave that column out "
                f"(columns=)"
            )

    def check_packing(self, packing: TokenPacking) -> None:
        """Raise unless ``packing`` can pack what this makes: a chat's labels travel beside its
        tokens as a per-token companion column."""
        if self.chat is None:
            return
        labels = self.chat.labels
        if labels not in packing.companions:
            raise ValueError(
                f"packing chat data carries its labels beside the tokens: pass "
                f"TokenPacking({self.output!r}, ..., companions={{{labels!r}: -100}})"
            )

    def delivered(self, schema: pa.Schema) -> pa.Schema:
        """``schema`` with the text column replaced, in its place, by the token column (and
        the labels column after it, for chat)."""
        if self.chat is not None:
            return self.chat.delivered(schema, self.column, self.output)
        index = schema.get_field_index(self.column)
        return schema.set(index, pa.field(self.output, pa.list_(pa.int32()), nullable=False))

    def read_column(self, name: str) -> str:
        """The column of the files that delivers column ``name``."""
        made = (self.output,) if self.chat is None else (self.output, self.chat.labels)
        return self.column if name in made else name

    @property
    def label(self) -> str:
        """The tokenizer as messages name it."""
        return self.name or type(self.tokenizer).__name__

    def encoder(self) -> Encoder:
        """The call that tokenizes a list of texts, each alone, without special tokens."""
        backend = _backend(self.tokenizer)
        if backend is None:
            return self.tokenizer  # type: ignore[no-any-return]
        encode = backend.encode_batch_fast

        def encode_texts(texts: list[str]) -> list[list[int]]:
            return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

        return encode_texts

    def chat_encoder(self) -> Callable[[list[str]], list[Any]]:
        """The call that tokenizes rendered conversations as ``apply_chat_template`` does: no
        special tokens added, ``tokenizers.Encoding`` s with their character offsets."""
        return functools.partial(_backend(self.tokenizer).encode_batch, add_special_tokens=False)


def _is_text(kind: pa.DataType) -> bool:
    return bool(
        pat.is_string(kind)
        or pat.is_large_string(kind)
        or pat.is_binary(kind)
        or pat.is_large_binary(kind)
        or kind == pa.string_view()
    )


def _backend(tokenizer: object) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (itself, or a fast tokenizer's), else
    ``None``."""
    for candidate in (tokenizer, getattr(tokenizer, "backend_tokenizer", None)):
        if callable(getattr(candidate, "to_str", None)) and callable(
            getattr(candidate, "encode_batch_fast", None)
        ):
            return candidate
    return None


def _definition(tokenizer: object, name: str | None) -> str:
    """What the fingerprint hashes: the tokenizer's serialized definition, or a callable's
    name."""
    backend = _backend(tokenizer)
    if backend is not None:
        return str(backend.to_str())
    if not callable(tokenizer):
        raise TypeError(
            f"Tokenize tokenizer must be a tokenizers.Tokenizer, a transformers fast tokenizer "
            f"or a callable list[str] -> list[list[int]], got {type(tokenizer).__name__}"
        )
    if name is None:
        raise ValueError(
            f"Tokenize needs name= for a callable tokenizer ({tokenizer!r:.80}): its definition "
            f"cannot be read, so its name is what a checkpoint records to refuse a resume under "
            f"another tokenizer; name it by what decides its tokens (e.g. "
            f"name='tiktoken/cl100k_base')"
        )
    return f"callable:{name}"
