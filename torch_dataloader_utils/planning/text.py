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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.types as pat
import xxhash

from ..base.args import optional_name, optional_whole

__all__ = ["MAX_TOKEN_ID", "Encoder", "Tokenize"]

# Token ids are stored as int32.
MAX_TOKEN_ID = 2**31 - 1

Encoder = Callable[[list[str]], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class Tokenize:
    """Tokenize the text column ``column`` into the token column ``output`` (``list<int32>``).

    ``bos_id`` / ``eos_id`` (optional) begin / end every row's tokens. ``name`` names a callable
    tokenizer (required for one; optional otherwise, used in messages).
    """

    column: str
    tokenizer: Any = field(repr=False, compare=False)
    bos_id: int | None = None
    eos_id: int | None = None
    output: str = "input_ids"
    name: str | None = None
    fingerprint: str = field(init=False)

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
        definition = _definition(self.tokenizer, self.name)
        digest = xxhash.xxh3_64()
        for part in (definition, str(self.bos_id), str(self.eos_id)):
            digest.update(part.encode())
            digest.update(b"\0")
        object.__setattr__(self, "fingerprint", digest.hexdigest())

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
        if not _is_text(kind):
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

    def delivered(self, schema: pa.Schema) -> pa.Schema:
        """``schema`` with the text column replaced, in its place, by the token column."""
        index = schema.get_field_index(self.column)
        return schema.set(index, pa.field(self.output, pa.list_(pa.int32()), nullable=False))

    def read_column(self, name: str) -> str:
        """The column of the files that delivers column ``name``."""
        return self.column if name == self.output else name

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
