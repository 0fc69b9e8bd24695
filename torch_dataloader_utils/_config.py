"""Validated, frozen dataset options: checked once at the boundary, trusted everywhere else."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._convert import OUTPUTS

__all__ = ["DEFAULT_SPLIT_BYTES", "DatasetConfig"]

DEFAULT_SPLIT_BYTES = 128 * 2**20


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

    def __post_init__(self) -> None:
        _positive_int("batch_size", self.batch_size)
        _positive_int("split_bytes", self.split_bytes)
        if not isinstance(self.shuffle_seed, int) or isinstance(self.shuffle_seed, bool):
            raise TypeError(f"shuffle_seed must be an int, got {self.shuffle_seed!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"unknown output {self.output!r}; supported outputs: {OUTPUTS}")
        if self.transform is not None and not callable(self.transform):
            raise TypeError(f"transform must be callable, got {type(self.transform).__name__}")
        if self.columns is not None and (
            not self.columns or not all(isinstance(c, str) for c in self.columns)
        ):
            raise ValueError(f"columns must be a non-empty list of names, got {self.columns!r}")

    @staticmethod
    def columns_from(columns: Sequence[str] | None) -> tuple[str, ...] | None:
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of names, got the string {columns!r}")
        return None if columns is None else tuple(columns)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
