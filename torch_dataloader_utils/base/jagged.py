"""List columns as jagged values: numpy's ``JaggedArray``, a worker's ``JaggedTensorParts``, and
``torch.jagged`` nested tensors (``jagged``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["JaggedArray", "JaggedTensorParts", "is_jagged", "jagged"]


@dataclass(frozen=True, eq=False)
class JaggedArray:
    """A list column under ``output="numpy"``: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    ``values`` holds every row's items one after another (numpy, as the item type maps);
    ``offsets`` is ``int64``, one longer than the rows, from 0. ``len()`` is the rows.
    """

    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, row: int) -> np.ndarray:
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} of a JaggedArray of {len(self)} rows")
        row %= len(self)
        return self.values[self.offsets[row] : self.offsets[row + 1]]

    def tolist(self) -> list[list[Any]]:
        """Rows as Python lists (per-row work: for inspection, not for the training loop)."""
        return [self[row].tolist() for row in range(len(self))]


@dataclass(frozen=True, eq=False)
class JaggedTensorParts:
    """A list column's values tensor and ``int64`` offsets from 0, not yet a nested tensor:
    what a DataLoader worker writes into shared memory (the main process builds the nested
    tensor of each batch from the slot, so the worker does not build one per chunk)."""

    values: torch.Tensor
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def nested(self) -> torch.Tensor:
        return jagged(self.values, torch.from_numpy(self.offsets))


def is_jagged(value: object) -> bool:
    """Is ``value`` a ``torch.jagged`` nested tensor?"""
    return isinstance(value, torch.Tensor) and value.layout == torch.jagged


def jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch.nested.nested_tensor_from_jagged``, without the warning torch logs on its
    first call in a process (about fx tracing, which this library never does)."""
    fx_log = logging.getLogger("torch.fx._symbolic_trace")
    fx_log.addFilter(_no_fx_notice)
    try:
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    finally:
        fx_log.removeFilter(_no_fx_notice)


def _no_fx_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("is_fx_tracing will return true")
