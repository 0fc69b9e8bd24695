"""What ``StructuredDataLoader`` uses of the ``StructuredDataset`` it serves: an abstract base.

The dataset builds its loader (``create_dataloader``), so the loader's module cannot import the
dataset's: it names the dataset by this base class, which ``StructuredDataset`` implements.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch.utils.data

from ..mixing.epochs import AnyProgress
from ..planning.epochs import Start
from ..transport.slots import SharedSlots
from .handout import Mark

__all__ = ["ServedDataset"]


class ServedDataset(torch.utils.data.IterableDataset[Any], ABC):
    """The dataset's public checkpoint methods, and the hooks only our loader calls."""

    _progress: AnyProgress | None  # the current iteration's, if one began

    @property
    @abstractmethod
    def epoch(self) -> int: ...

    @abstractmethod
    def set_epoch(self, epoch: int) -> None: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(
        self,
        state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        elastic: bool = False,
        reweight: bool = False,
    ) -> None: ...

    @abstractmethod
    def save_state_global(self, dst_rank: int = 0) -> list[dict[str, Any]] | None: ...

    @abstractmethod
    def restore_state_global(
        self,
        states: Sequence[Mapping[str, Any]] | None,
        src_rank: int | None = 0,
        *,
        elastic: bool = False,
    ) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @property
    @abstractmethod
    def _next_start(self) -> Start: ...

    @abstractmethod
    def _attach_loader(self, num_workers: int, start_method: str) -> None: ...

    @abstractmethod
    def _trainer_moves_epochs(self) -> None: ...

    @abstractmethod
    def _batch_bytes(self) -> int: ...

    @abstractmethod
    def _mark(self) -> Mark: ...

    @abstractmethod
    def _state_at(self, mark: Mark) -> dict[str, Any]: ...

    @abstractmethod
    def _iteration(
        self, num_workers: int, slots: SharedSlots | None = None
    ) -> AbstractContextManager[AnyProgress]: ...

    @abstractmethod
    def _describe_stream(self, progress: AnyProgress, worker: int, position: int) -> str: ...

    @abstractmethod
    def _ended(self) -> bool: ...
