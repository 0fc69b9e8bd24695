"""Token packing's values: the ``TokenPacking`` choice and a packed stream's ``TokenPosition``.

Each row of the token column is a document. A stream's documents, in delivery order (each
followed by the ``separator`` token if one is given), form one token sequence, cut into batches
of ``batch_size`` sequences of exactly ``seq_len`` tokens; a document may end in one batch and
continue in the next. A packed stream's position is therefore a ``TokenPosition``: the rows of
its share wholly delivered, and how many tokens of the next row already were. Resuming there
skips exactly those tokens, so no token is delivered twice and none is lost. The packing
itself is ``reading.packing``'s.

With ``whole_documents`` no document is cut: the stream's rows are taken in windows of
``window`` rows from the stream's start, and each window's documents are packed best-fit
decreasing into sequences (``reading.bestfit``). The position is then a ``TokenPosition`` whose
rows are the start of the window being handed out and whose ``tokens`` count the window's
sequences already delivered: the same window start always gives the same sequences.

*Companions* are other list columns holding one value per token (pre-tokenized ``labels``,
``loss_mask``, ``token_type_ids``): cut and padded in lockstep with the tokens, each with its own
pad (at a separator's place too). They do not change which tokens a row makes, so positions are
the same with or without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from ..base.args import flag, optional_mapping, optional_whole, whole

__all__ = ["OVERLONG", "PACKED_KEYS", "TokenPacking", "TokenPosition"]

# What whole-document packing does with a document longer than seq_len.
OVERLONG = ("truncate", "drop", "error")
# Documents per best-fit window by default: 512 waste 0.5 % of a log-normal SFT set (median 600
# tokens, seq_len 4,096; benchmarks/bench_packing_waste.py), 64 would waste 3.8 %.
DEFAULT_WINDOW = 512


class TokenPosition(int):
    """A packed stream's position: the rows wholly delivered (the int's value), and ``tokens``
    of the next row delivered too (0: none)."""

    tokens: int

    def __new__(cls, rows: int, tokens: int = 0) -> TokenPosition:
        position = super().__new__(cls, rows)
        position.tokens = tokens
        return position

    def __getnewargs__(self) -> tuple[int, int]:  # type: ignore[override]
        return int(self), self.tokens

    def __repr__(self) -> str:
        return f"TokenPosition(rows={int(self)}, tokens={self.tokens})"


@dataclass(frozen=True)
class TokenPacking:
    """Pack the list-of-integers ``column`` into sequences of exactly ``seq_len`` tokens.

    ``separator`` (e.g. the EOS id) is appended to every document; the padding of the last
    sequence of a stream (only with ``drop_last=False``) is ``pad_id``. Batches are dicts of
    ``input_ids`` ``(batch, seq_len)``, ``position_ids`` (position within each document part,
    from 0 at every document start and sequence start), ``cu_seqlens`` (int32 boundaries of
    those parts over the flattened batch, as variable-length attention takes them) and
    ``num_tokens`` (an int: the real tokens; the rest of the flattened batch is padding).

    ``companions`` maps other list-of-integers columns, one value per token in every row, to
    their pad: each is delivered as ``(batch, seq_len)`` values of its column's type, aligned
    with ``input_ids``, its pad wherever ``input_ids`` has the separator or ``pad_id``; e.g.
    ``{"labels": -100, "loss_mask": 0}``. Other columns are not read.

    ``whole_documents=True`` never cuts a document: each window of ``window`` documents (rows)
    is packed best-fit decreasing into sequences padded with ``pad_id`` (the padding of each
    sequence a part of its own in ``cu_seqlens``; each companion padded with its pad). A
    document longer than ``seq_len`` is cut to its first ``seq_len`` tokens (and companion
    values) (``overlong="truncate"``), left out (``"drop"``) or refused
    (``"error"``); truncated and dropped ones are counted in a warning of the
    ``torch_dataloader_utils`` logger (the first, then each time a stream's count doubles).
    """

    column: str
    seq_len: int
    separator: int | None = None
    pad_id: int = 0
    companions: Mapping[str, int] = field(default_factory=dict, hash=False)
    whole_documents: bool = False
    window: int = DEFAULT_WINDOW
    overlong: str = "truncate"

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise TypeError(f"TokenPacking column must be a column name, got {self.column!r}")
        # builtin ints (numpy's taken too): ``setting`` goes into the state
        object.__setattr__(self, "seq_len", whole("TokenPacking seq_len", self.seq_len))
        object.__setattr__(
            self, "separator", optional_whole("TokenPacking separator", self.separator)
        )
        object.__setattr__(self, "pad_id", whole("TokenPacking pad_id", self.pad_id))
        if self.seq_len < 1:
            raise ValueError(f"TokenPacking seq_len must be >= 1, got {self.seq_len}")
        object.__setattr__(
            self, "whole_documents", flag("TokenPacking whole_documents", self.whole_documents)
        )
        object.__setattr__(self, "window", whole("TokenPacking window", self.window, at_least=1))
        if self.overlong not in OVERLONG:
            raise ValueError(
                f"TokenPacking overlong must be one of {OVERLONG}, got {self.overlong!r}"
            )
        object.__setattr__(self, "companions", self._checked_companions())

    def _checked_companions(self) -> dict[str, int]:
        """``companions`` as a dict of names (neither the token column nor a packed batch's
        key) to builtin ints."""
        given = optional_mapping("TokenPacking companions", self.companions) or {}
        out = {}
        for name, pad in given.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"TokenPacking companions must map column names, got {name!r}")
            if name == self.column or name in PACKED_KEYS:
                raise ValueError(
                    f"TokenPacking companion {name!r} is "
                    + ("the token column" if name == self.column else "a key of packed batches")
                    + f" ({', '.join([self.column, *PACKED_KEYS])}); name another column"
                )
            out[name] = whole(f"TokenPacking companions[{name!r}] (its pad)", pad)
        return out

    def check(self, schema: pa.Schema) -> None:
        """Raise unless the column and the companions are lists of integers that hold the
        separator and pads."""
        pads = {"separator": self.separator, "pad_id": self.pad_id}
        _check_integers(schema, self.column, "TokenPacking column", "token ids", pads)
        for name, pad in self.companions.items():
            pads = {f"companions[{name!r}]": pad}
            _check_integers(schema, name, "TokenPacking companion", "values", pads)

    @property
    def setting(self) -> list[Any]:
        """What a checkpoint records: the choices that decide which tokens a row makes."""
        return [self.column, self.separator]

    @property
    def whole_setting(self) -> dict[str, Any] | None:
        """What a checkpoint records of whole-document packing: the choices that decide which
        sequences a window makes (its position counts them); ``None`` when documents are cut."""
        if not self.whole_documents:
            return None
        return {"seq_len": self.seq_len, "window": self.window, "overlong": self.overlong}

    @property
    def companion_setting(self) -> dict[str, int] | None:
        """What a checkpoint records of the companions (``None``: none): their names and pads,
        so that a resume delivers the batches the checkpointed run would have."""
        return dict(self.companions) or None


def _check_integers(
    schema: pa.Schema, column: str, role: str, what: str, values: Mapping[str, int | None]
) -> None:
    """Raise unless ``column`` (the ``role``) is a list of integers that holds ``values``."""
    if column not in schema.names:
        raise ValueError(f"{role} {column!r} is not in the files; columns: {schema.names}")
    kind = schema.field(column).type
    if not (pat.is_list(kind) or pat.is_large_list(kind)) or not pat.is_integer(kind.value_type):
        raise ValueError(
            f"{role} {column!r} has type {kind}; packing needs a list (or large_list) of "
            f"integers, e.g. list<int32> {what}"
        )
    limits = np.iinfo(kind.value_type.to_pandas_dtype())
    for name, value in values.items():
        if value is not None and not limits.min <= value <= limits.max:
            raise ValueError(
                f"TokenPacking {name}={value} does not fit column {column!r} of type {kind} "
                f"(range {limits.min}..{limits.max})"
            )


# The keys of a packed batch (``packed_batch``).
PACKED_KEYS = ("input_ids", "position_ids", "cu_seqlens", "num_tokens")
