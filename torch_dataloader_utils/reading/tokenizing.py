"""Text to tokens, a chunk at a time: ``Tokenize``'s text column becomes its token column.

Batched calls of the tokenizer, each on about ``_ENCODE_BYTES`` of a chunk's text (a tokenizer's
own objects for a text take ~12 times its size: a 4 MiB chunk in one call would peak at ~45 MiB);
each call's ids go to numpy at once and its rows go on as a slice of the chunk (the first
tokens are ready after one call). The ids are laid out with numpy (``bos_id`` and
``eos_id`` inserted, every id checked to fit ``int32``), never per token in Python. A row's
tokens depend on its text alone, so a resume that tokenizes a chunk again makes the same ones.

Texts: ``string``, ``large_string``, ``string_view``, and ``binary`` / ``large_binary`` holding
UTF-8 (checked: invalid bytes are an error naming the row). An empty text is a document of no
tokens (``[bos_id, eos_id]`` when those are given); a null text is an error naming the row, as a
null document is for packing: a row is never dropped or made up in silence.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from ..base.errors import DataSourceError
from ..planning.text import MAX_TOKEN_ID, Encoder, Tokenize

__all__ = ["call_bounds", "tokenized"]

# Bytes of text per call of the tokenizer: a few hundred rows, calls' overhead negligible.
_ENCODE_BYTES = 2**17

# Rows are named by ``describe(row)``: the file, unit and row of the chunk's row ``row``.
Describe = Callable[[int], str]


def tokenized(
    chunk: pa.RecordBatch, tokenize: Tokenize, encode: Encoder, describe: Describe
) -> Iterator[tuple[pa.RecordBatch, int]]:
    """``chunk``'s rows a slice per call of the tokenizer, each with its text column replaced
    by the token column ``tokenize.output`` (``list<int32>``, at the text column's place), and
    the chunk's rows up to the slice's end: a consumer has its first tokens after one call, not
    after the whole chunk."""
    column = _texts(chunk.column(tokenize.column), tokenize, describe)
    index = chunk.schema.get_field_index(tokenize.column)
    field = tokenize.delivered(chunk.schema).field(index)
    sizes = pc.binary_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    for start, stop in itertools.pairwise(call_bounds(sizes).tolist()):
        texts = column.slice(start, stop - start).to_pylist()  # one call's texts at a time
        lengths, values = _encoded(texts, start, tokenize, encode, describe)

        def named(row: int, start: int = start) -> str:
            return describe(start + row)

        tokens = _token_lists(lengths, values, tokenize, named)
        yield chunk.slice(start, stop - start).set_column(index, field, tokens), stop


def call_bounds(sizes: np.ndarray, per_call: int = _ENCODE_BYTES) -> np.ndarray:
    """Row bounds of the tokenizer's calls over rows of ``sizes`` bytes of text (``int64``): a
    call per ``per_call`` bytes of text begun."""
    call = (np.cumsum(sizes) - sizes) // per_call
    return np.concatenate(([0], np.flatnonzero(np.diff(call)) + 1, [len(sizes)]))


def _encoded(
    part: list[str], start: int, tokenize: Tokenize, encode: Encoder, describe: Describe
) -> tuple[np.ndarray, np.ndarray]:
    """Token counts and ids (``int64``) of ``part``, the chunk's texts from row ``start``, by
    one call of the tokenizer."""
    try:
        ids = encode(part)
    except Exception as exc:  # a tokenizer may raise anything: name the row it failed on
        raise DataSourceError(
            f"{_failing_row(part, encode, lambda row: describe(start + row))}: tokenizer "
            f"{tokenize.label} raised {type(exc).__name__}: {exc}"
        ) from exc
    if len(ids) != len(part):
        raise DataSourceError(
            f"{describe(start)}: tokenizer {tokenize.label} returned {len(ids)} token lists for "
            f"{len(part)} texts; a tokenizer must return one list per text"
        )
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=lengths.sum())
    return lengths, values


def _texts(column: pa.Array, tokenize: Tokenize, describe: Describe) -> pa.Array:
    """The column as Arrow text (binary checked to be UTF-8); a null or invalid UTF-8 is an
    error naming its row."""
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataSourceError(
            f"{describe(row)}: column {tokenize.column!r} is null; a null text has no tokens "
            f"(fill it, e.g. with an empty text, or filter such rows out of the files)"
        )
    if column.type == pa.string_view():  # Arrow's kernels (sizes, slices) take offsets
        return column.cast(pa.large_string())
    if pat.is_binary(column.type) or pat.is_large_binary(column.type):
        try:
            column = column.cast(pa.large_string())
        except pa.ArrowInvalid:
            row = _first_invalid_utf8(column)
            raise DataSourceError(
                f"{describe(row)}: column {tokenize.column!r} ({column.type}) is not valid "
                f"UTF-8 text"
            ) from None
    return column


def _first_invalid_utf8(column: pa.Array) -> int:
    """The first row whose bytes do not decode (the error path only: Python per row)."""
    for row, value in enumerate(column.to_pylist()):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return row
    return 0


def _failing_row(texts: list[str], encode: Encoder, describe: Describe) -> str:
    """Where a batched call failed: the first text that fails alone (the error path only)."""
    for row, text in enumerate(texts):
        try:
            encode([text])
        except Exception:  # the same error as the batched call's, for this one text
            return describe(row)
    return describe(0)


def _token_lists(
    lengths: np.ndarray, values: np.ndarray, tokenize: Tokenize, describe: Describe
) -> pa.Array:
    """Rows of ``lengths`` ids of ``values``, with ``bos_id`` / ``eos_id`` around each, as
    ``list<int32>``."""
    if len(values) and (values.min() < 0 or values.max() > MAX_TOKEN_ID):
        bad = int(np.flatnonzero((values < 0) | (values > MAX_TOKEN_ID))[0])
        row = int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
        raise DataSourceError(
            f"{describe(row)}: tokenizer {tokenize.label} gave token id {values[bad]}, outside "
            f"0..{MAX_TOKEN_ID} (ids are stored as int32)"
        )
    starts = np.cumsum(lengths) - lengths
    if tokenize.bos_id is not None:
        values = np.insert(values, starts, tokenize.bos_id)
        lengths = lengths + 1
        starts = np.cumsum(lengths) - lengths
    if tokenize.eos_id is not None:
        values = np.insert(values, starts + lengths, tokenize.eos_id)
        lengths = lengths + 1
    # one call's tokens: far below int32 offsets' 2**31
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(values.astype(np.int32))
    )
