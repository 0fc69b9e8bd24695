"""Validated, frozen dataset options: checked once at the boundary, trusted everywhere else."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ..base.args import whole
from ..base.errors import UnsendableSettingError
from ..base.row_bytes import converted_row_bytes
from .text import Tokenize
from .tokens import TokenPacking

__all__ = [
    "DEFAULT_SHUFFLE_MEMORY_BYTES",
    "DEFAULT_SPLIT_BYTES",
    "MIN_SHUFFLE_MEMORY_BYTES",
    "DatasetConfig",
]

DEFAULT_SPLIT_BYTES = 128 * 2**20
# What batches are made of (``reading.convert``).
OUTPUTS = ("torch", "numpy", "arrow")
# The decoded rows a shuffled stream may hold: its window and the next one being read.
DEFAULT_SHUFFLE_MEMORY_BYTES = 256 * 2**20
# Below this a window holds a handful of rows: surely a unit mistaken (bytes, not MiB).
MIN_SHUFFLE_MEMORY_BYTES = 4096
# A window's permutation is 32-bit integer arithmetic.
_MAX_WINDOW_ROWS = 2**31


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    format: str = "parquet"
    batch_size: int = 1024
    columns: tuple[str, ...] | None = None
    shuffle: bool = False
    shuffle_seed: int = 0
    split_bytes: int = DEFAULT_SPLIT_BYTES
    output: str = "torch"
    transform: Callable[[Any], Any] | None = None
    drop_last: bool = False
    shuffle_memory_bytes: int = DEFAULT_SHUFFLE_MEMORY_BYTES
    packing: TokenPacking | None = None
    tokenize: Tokenize | None = None

    def __post_init__(self) -> None:
        self._normalize_ints()
        self._check_shuffle_knobs()
        if self.output not in OUTPUTS:
            raise ValueError(f"unknown output {self.output!r}; supported outputs: {OUTPUTS}")
        if self.transform is not None and not callable(self.transform):
            raise TypeError(f"transform must be callable, got {type(self.transform).__name__}")
        if self.columns is not None and (
            not self.columns or not all(isinstance(c, str) for c in self.columns)
        ):
            raise ValueError(f"columns must be a non-empty list of names, got {self.columns!r}")
        if self.tokenize is not None and not isinstance(self.tokenize, Tokenize):
            raise TypeError(f"tokenize must be a Tokenize, got {type(self.tokenize).__name__}")
        self._check_packing()
        if self.tokenize is not None and self.packing is not None:
            self.tokenize.check_packing(self.packing)

    def _normalize_ints(self) -> None:
        """Builtin ints (numpy's taken too), so that a state holds builtins only."""
        for name in ("batch_size", "split_bytes", "shuffle_memory_bytes"):
            object.__setattr__(self, name, whole(name, getattr(self, name), at_least=1))
        object.__setattr__(self, "shuffle_seed", whole("shuffle_seed", self.shuffle_seed))

    def batch_bytes(self, schema: pa.Schema) -> int:
        """About how many bytes a converted batch of ``schema`` (the columns read) holds."""
        if self.packing is None:
            return self.batch_size * converted_row_bytes(schema)
        tokens = self.batch_size * self.packing.seq_len
        keys = (self.packing.column, *self.packing.companions)
        items = sum(int(schema.field(k).type.value_type.bit_width) // 8 for k in keys)
        return tokens * (items + 8)  # input_ids, companions and int64 position_ids

    @property
    def read_columns(self) -> tuple[str, ...] | None:
        """The columns read from the files: packing reads its token column and companions
        only; a column that ``tokenize`` makes is read as its text column."""
        packing = self.packing
        columns = self.columns if packing is None else (packing.column, *packing.companions)
        if self.tokenize is None or columns is None:
            return columns
        # a chat's tokens and labels are both read as its conversations: once
        return tuple(dict.fromkeys(self.tokenize.read_column(name) for name in columns))

    def delivered(self, schema: pa.Schema) -> pa.Schema:
        """The schema of what a stream delivers from files of ``schema`` (the columns read):
        tokenized text as its tokens."""
        return schema if self.tokenize is None else self.tokenize.delivered(schema)

    def check_sendable(self, start_method: str) -> None:
        """Raise unless what the workers call pickles: under ``spawn`` or ``forkserver`` the
        DataLoader pickles the dataset to each worker (``fork`` copies it). Checked when the
        loader is made, so a lambda fails there, by name, not in the middle of a job."""
        if start_method == "fork":
            return
        tokenizer = None if self.tokenize is None else self.tokenize.tokenizer
        for name, value in (("transform", self.transform), ("Tokenize tokenizer", tokenizer)):
            try:
                pickle.dumps(value)
            except Exception as exc:
                raise UnsendableSettingError(
                    f"{name} {value!r:.80} cannot be pickled to the DataLoader workers, which "
                    f"start by {start_method!r}: {type(exc).__name__}: {exc}. Define it at a "
                    f"module's top level (not a lambda or a local function), or pass "
                    f"multiprocessing_context='fork', or num_workers=0"
                ) from exc

    def _check_packing(self) -> None:
        packing = self.packing
        if packing is None:
            return
        if not isinstance(packing, TokenPacking):
            raise TypeError(f"packing must be a TokenPacking, got {type(packing).__name__}")
        if self.output == "arrow":
            raise ValueError(
                "packing makes tensors or arrays of token ids: use output='torch' or 'numpy'"
            )
        delivered = [packing.column, *packing.companions]
        if self.columns is not None and not set(self.columns) <= set(delivered):
            raise ValueError(
                f"packing delivers only its token column {packing.column!r}"
                + (f" and companions {list(packing.companions)}" if packing.companions else "")
                + f"; got columns={list(self.columns)}: drop columns= or pass {delivered}"
            )
        for name in packing.companions:
            # a column of the files cannot align with tokens the loader makes
            if self.tokenize is not None and self.tokenize.read_column(name) == name:
                raise ValueError(
                    f"TokenPacking companion {name!r} is not made by tokenize=Tokenize("
                    f"{self.tokenize.column!r}, ...): a column of the files holds values for "
                    f"the files' tokens, not for the tokens the tokenizer makes of column "
                    f"{self.tokenize.column!r}; drop the companion, or pack pre-tokenized "
                    f"token ids (without tokenize=) that it was written for"
                )

    def window_rows(self, row_bytes: int) -> int:
        """Rows of a shuffle window for rows of ``row_bytes`` decoded bytes: three windows' worth
        fill ``shuffle_memory_bytes`` (the one handed out, and the next while it is read: its
        decoded parts, then one contiguous copy)."""
        rows = self.shuffle_memory_bytes // (3 * max(1, row_bytes))
        return int(min(max(1, rows), _MAX_WINDOW_ROWS))

    def _check_shuffle_knobs(self) -> None:
        if self.shuffle_memory_bytes < MIN_SHUFFLE_MEMORY_BYTES:
            raise ValueError(
                f"shuffle_memory_bytes={self.shuffle_memory_bytes} is below the minimum of "
                f"{MIN_SHUFFLE_MEMORY_BYTES} bytes per stream (the default is 256 MiB)"
            )

    @staticmethod
    def columns_from(columns: Sequence[str] | None) -> tuple[str, ...] | None:
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of names, got the string {columns!r}")
        return None if columns is None else tuple(columns)
