"""Splits: a file's row-group / record-batch units cut into byte-bounded row ranges."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Split", "cut_splits"]


@dataclass(frozen=True, slots=True)
class Split:
    """Rows ``[row_offset, row_offset + row_length)`` of file ``file``: its units ``units``.

    Every rank holds one per split of the dataset, so it has slots (no ``__dict__``).
    """

    file: int
    units: range
    row_offset: int
    row_length: int


def cut_splits(
    unit_bytes: Sequence[Sequence[int]], unit_rows: Sequence[Sequence[int]], split_bytes: int
) -> list[Split]:
    """Greedy, per file: consecutive units while their bytes stay within ``split_bytes``.

    A unit larger than the bound is a split of its own; splits without rows are dropped.
    """
    if split_bytes <= 0:
        raise ValueError(f"split_bytes must be positive, got {split_bytes}")
    splits: list[Split] = []
    for file, (sizes, rows) in enumerate(zip(unit_bytes, unit_rows, strict=True)):
        first, size, offset = 0, 0, 0
        for unit, unit_size in enumerate(sizes):
            if unit > first and size + unit_size > split_bytes:
                splits.append(_split(file, first, unit, rows, offset))
                offset += splits[-1].row_length
                first, size = unit, 0
            size += unit_size
        if len(sizes) > first:
            splits.append(_split(file, first, len(sizes), rows, offset))
    return [s for s in splits if s.row_length > 0]


def _split(file: int, first: int, end: int, rows: Sequence[int], offset: int) -> Split:
    return Split(file, range(first, end), offset, sum(rows[first:end]))
