"""Who this process is: DDP rank and world size, DataLoader worker and worker count."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
import torch.utils.data

__all__ = ["World", "detect_ranks", "detect_worker"]


@dataclass(frozen=True)
class World:
    """One stream's place in the job: ``rank`` of ``world_size``, ``worker`` of ``num_workers``.

    ``num_workers`` counts streams per rank, so it is at least 1 (``num_workers=0`` of a
    DataLoader means one stream in the main process).
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {self.worker}")


def detect_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else the process group, else ``RANK``/``WORLD_SIZE``, else 0/1."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        found = dist.get_rank(), dist.get_world_size()
    else:
        found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return (found[0] if rank is None else rank), (found[1] if world_size is None else world_size)


def detect_worker() -> tuple[int, int] | None:
    """``(worker id, num_workers)`` inside a DataLoader worker, ``None`` in the main process."""
    info = torch.utils.data.get_worker_info()
    return None if info is None else (info.id, info.num_workers)
