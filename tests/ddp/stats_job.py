"""One rank of a torchrun job for tests/test_stage_stats.py: ``stats_job.py job.json``.

Under a gloo process group each rank reads its share with 2 workers; rank 1's transform is
slow (5 ms a batch) and its loop does nothing, rank 0's loop steps 30 ms a batch. Then
``loader.gather_stats()``; rank 0 writes what it received to ``stats.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torch_dataloader_utils import StructuredDataset


def slow(batch: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.005)
    return batch


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader, _ = StructuredDataset.create_dataloader(
        job["data"], batch_size=8, num_workers=2, transform=slow if rank == 1 else None
    )
    for _ in loader:
        if rank == 0:
            time.sleep(0.03)
    gathered = loader.gather_stats()
    assert (gathered is None) == (rank != 0)
    if gathered is not None:
        Path(job["dir"], "stats.json").write_text(json.dumps(gathered.as_dict()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
