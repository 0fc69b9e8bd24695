"""One rank of a torchrun job for tests/test_index_per_job.py: ``index_job.py job.json``.

Under a gloo process group each rank builds datasets over S3 (through a request-logging proxy
in the test process) as a user's job would. Between steps rank 0 sends a marker request (a HEAD
of ``marker-<step>``) after a barrier, so the test can attribute every logged request to a step:

- ``index``: ``StructuredDataset(url, share_index=True)`` on every rank (rank 0 reads the
  footers);
- ``read``: every rank reads its share of the epoch with the index it received;
- ``columns``: rank 0 projects no columns, the others ``["id"]``: they index for themselves;
- ``mismatch``: a prefix whose files' schemas differ: every rank raises rank 0's error;
- ``alone``: rank 0 alone builds a dataset without ``share_index``: no collective, no hang.

Each rank writes ``index-rank<r>.json``: its index digest, the row ids it read, the errors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import s3fs
import torch.distributed as dist

from torch_dataloader_utils import StructuredDataset


def _marker(fs: Any, bucket: str, step: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        fs.exists(f"{bucket}/marker-{step}")
    dist.barrier()


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    options = job["options"]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    out: dict[str, Any] = {}

    _marker(fs, job["bucket"], "index")
    dataset = StructuredDataset(
        job["url"], storage_options=options, batch_size=32, share_index=True
    )
    out["digest"] = dataset._index.digest
    out["files"] = len(dataset._index.files)
    _marker(fs, job["bucket"], "read")
    out["ids"] = [int(i) for batch in dataset for i in batch["id"]]
    _marker(fs, job["bucket"], "columns")
    columns = None if rank == 0 else ["id"]
    projected = StructuredDataset(
        job["url"], storage_options=options, columns=columns, share_index=True
    )
    out["columns"] = projected._index.schema.names
    _marker(fs, job["bucket"], "mismatch")
    try:
        StructuredDataset(job["mismatch_url"], storage_options=options, share_index=True)
    except Exception as exc:
        out["mismatch"] = [type(exc).__name__, str(exc)]
    _marker(fs, job["bucket"], "alone")
    if rank == 0:  # an evaluation set on one rank: it must not wait for the others
        out["alone"] = len(StructuredDataset(job["url"], storage_options=options)._index.files)
    _marker(fs, job["bucket"], "end")

    Path(job["dir"], f"index-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
