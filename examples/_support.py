"""What the migration examples share: a small generated dataset, a tiny model, and checks.

The dataset is ``FILES`` Parquet files of ``ROWS_PER_FILE`` rows in row groups of
``ROW_GROUP`` rows: a unique int64 ``id``, four float32 features ``f0..f3`` and a target ``y``.
Rows are a pure function of their id, so a rewritten copy is byte for byte the same.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

FILES = 4
ROWS_PER_FILE = 600
ROW_GROUP = 50
TOTAL_ROWS = FILES * ROWS_PER_FILE
FEATURES = ["f0", "f1", "f2", "f3"]
COLUMNS = ["id", *FEATURES, "y"]


def workdir(given: Path | None, name: str) -> Path:
    """``--workdir``, or a directory of the system's temporary one, the same on every rank."""
    return given or Path(tempfile.gettempdir()) / "tdu-examples" / name


def run_distributed(job: Callable[[Path | None, int, int], None], doc: str | None) -> int:
    """``job(workdir, rank, world_size)`` in a process group set up from torchrun's
    environment; ``--workdir`` from the command line (``doc``'s first line is its help).

    The group is destroyed after ``job`` has returned and its DDP models and loaders are
    collected (a DDP reducer outliving its gloo group sometimes hung the rank at exit, or
    aborted it: "terminate called without an active exception"), every rank at once.
    """
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to write data and checkpoints")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit(f"run under torchrun: torchrun --nproc_per_node=2 {sys.argv[0]}")
    dist.init_process_group("gloo")  # CPU here; "nccl" on GPUs
    try:
        job(args.workdir, dist.get_rank(), dist.get_world_size())
        gc.collect()  # DDP models in reference cycles, before their group goes
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def write_sample(directory: Path, *, first_file: int = 0, files: int = FILES) -> Path:
    """Write ``files`` Parquet files (numbered from ``first_file``) under ``directory``; a
    file already there is kept. Each is written to a hidden name and renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    for number in range(first_file, first_file + files):
        path = directory / f"part-{number:04d}.parquet"
        if path.exists():
            continue
        ids = np.arange(number * ROWS_PER_FILE, (number + 1) * ROWS_PER_FILE, dtype=np.int64)
        x = np.stack([np.sin(ids * (k + 1) * 0.01) for k in range(len(FEATURES))], axis=1)
        y = x @ np.array([0.5, -1.0, 2.0, 0.25]) + 0.1
        table = pa.table(
            {"id": ids, **{f: x[:, k].astype(np.float32) for k, f in enumerate(FEATURES)},
             "y": y.astype(np.float32)}
        )  # fmt: skip
        tmp = directory / f".{path.name}.tmp"  # names starting with "." are not read as data
        pq.write_table(table, tmp, row_group_size=ROW_GROUP)
        os.replace(tmp, path)
    return directory


def make_model() -> torch.nn.Module:
    """The same small regression model in every run (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Linear(len(FEATURES), 1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> float:
    x = torch.stack([batch[f] for f in FEATURES], dim=1)
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), batch["y"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item())


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"].tolist()]


def check_each_row_once(batches: Iterable[list[int]], total: int, *, left_out: int = 0) -> int:
    """Assert the batches hold ``total - left_out`` distinct ids of ``[0, total)``, none twice
    (``left_out``: the rows ``even_batches`` may leave out of an epoch); return the count."""
    counts = Counter(i for batch in batches for i in batch)
    twice = sorted(i for i, n in counts.items() if n > 1)
    foreign = sorted(i for i in counts if not 0 <= i < total)
    assert not twice, f"rows delivered twice: {twice[:10]}"
    assert not foreign, f"rows that are not in the data: {foreign[:10]}"
    assert total - left_out <= len(counts) <= total, (
        f"{len(counts)} of {total} rows delivered (at most {left_out} may be left out)"
    )
    return len(counts)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)
