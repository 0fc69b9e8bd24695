"""What the trainer jobs of tests/test_hf_trainer.py and tests/test_lightning_trainer.py share.

A *case* is JSON: ``create_dataloader`` keyword arguments, with ``packing`` as the keyword
arguments of ``TokenPacking``. Every step of a job appends what it trained on (row ids, or a
packed batch's real tokens) as one JSON line to ``<dir>/<case>/<phase>-rank<r>.jsonl``,
flushed at once, so a SIGKILL loses nothing of the record.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed
from _harness import make_loader

from torch_dataloader_utils import StructuredDataLoader, TokenPacking


def loader_of(kwargs: dict[str, Any]) -> StructuredDataLoader:
    kwargs = dict(kwargs)
    if kwargs.get("packing"):
        kwargs["packing"] = TokenPacking(**kwargs["packing"])
    loader, _ = make_loader(kwargs)
    return loader


def trained_values(batch: Any) -> list[int]:
    """What a step trains on: row ids, or a packed batch's real tokens."""
    if "id" in batch:
        return [int(i) for i in batch["id"].tolist()]
    return [int(t) for t in batch["input_ids"].flatten()[: int(batch["num_tokens"])].tolist()]


def record(path: Path, values: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log:
        log.write(json.dumps(values) + "\n")


def recorded(path: Path) -> list[list[int]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def note_resumed_from(log: Path, trained: int) -> None:
    """Next to a resumed run's ``log``: the batches trained before the checkpoint it resumed
    from was saved (``resumed_from``)."""
    log.with_suffix(".from").write_text(json.dumps(trained))


def run_job(run_case: Callable[[dict[str, Any], dict[str, Any], int], None]) -> None:
    """``run_case(job, case, rank)`` for every case of the job file ``sys.argv[1]``; then,
    with ``kill``, process 0 dies by SIGKILL (no teardown; torchrun ends the others)."""
    job = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    for case in job["cases"]:
        run_case(job, case, rank)
    if job.get("kill"):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    # Gloo's threads outlive a process group left undestroyed and now and then abort the
    # interpreter's exit ("terminate called without an active exception", pytorch#190489)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- the tests' side


def train_and_resume(
    launch: Callable[..., tuple[int, str]],
    cmd: list[str],
    cases: list[dict[str, Any]],
    workdir: Path,
) -> None:
    """The job's ``train`` phase (killed at its end), then its ``resume`` phase, which must
    succeed; ``launch`` is ``_launch.launch_job``."""
    job = {"phase": "train", "cases": cases, "kill": True}
    code, log = launch(cmd, job, workdir, timeout=300)
    assert code != 0, f"the job was to be killed, but it succeeded:\n{log[-3000:]}"
    code, log = launch(cmd, {"phase": "resume", "cases": cases}, workdir, timeout=300)
    assert code == 0, f"resume failed ({code}):\n{log[-4000:]}"


def packed_case(tokens_dir: Path, workers: int) -> dict[str, Any]:
    """Shuffled, packed 16-token sequences, 4 a batch."""
    return {
        "path": str(tokens_dir), "batch_size": 4, "split_bytes": 2_000, "shuffle": True,
        "num_workers": workers, "packing": {"column": "tokens", "seq_len": 16, "separator": -1},
    }  # fmt: skip


def rows_case(parquet_dir: Path, split_bytes: int, workers: int) -> dict[str, Any]:
    """Shuffled rows, 24 a batch."""
    return {
        "path": str(parquet_dir), "batch_size": 24, "split_bytes": split_bytes, "shuffle": True,
        "shuffle_seed": 9, "num_workers": workers, "columns": ["id", "x"],
    }  # fmt: skip


def case_kinds(
    parquet_dir: Path, split_bytes: int, tokens_dir: Path
) -> dict[tuple[str, int], dict[str, Any]]:
    """``rows_case`` and ``packed_case`` with 0 and 2 workers, by ``("rows" or "packed",
    workers)``."""
    return {
        (kind, workers): rows_case(parquet_dir, split_bytes, workers)
        if kind == "rows"
        else packed_case(tokens_dir, workers)
        for kind in ("rows", "packed")
        for workers in (0, 2)
    }


def kind_of(name: str) -> tuple[str, int]:
    """The ``case_kinds`` key of a case named ``<kind>-w<workers>-...``."""
    kind, workers = name.split("-")[:2]
    return kind, int(workers.removeprefix("w"))


def uninterrupted(
    kwargs: dict[str, Any], rank: int = 0, world_size: int = 1, epochs: int = 1
) -> list[list[int]]:
    """What every batch of ``epochs`` uninterrupted epochs holds (in-process)."""
    loader = loader_of({**kwargs, "rank": rank, "world_size": world_size})
    batches = []
    for epoch in range(epochs):
        loader.dataset.set_epoch(epoch)
        batches += [trained_values(b) for b in loader]
    return batches


def epochs_of(
    kwargs: dict[str, Any], rank: int = 0, world_size: int = 1, epochs: int = 1
) -> list[list[list[int]]]:
    """Each epoch's batches (``uninterrupted``, one list per epoch)."""
    loader = loader_of({**kwargs, "rank": rank, "world_size": world_size})
    out = []
    for epoch in range(epochs):
        loader.dataset.set_epoch(epoch)
        out.append([trained_values(b) for b in loader])
    return out


def resumed_from(out: Path, rank: int = 0) -> int:
    """The batches the checkpoint that rank ``rank`` resumed from had seen trained."""
    return int(json.loads((out / f"resume-rank{rank}.from").read_text()))


def assert_epochs_continue(out: Path, epochs: list[list[list[int]]], rank: int = 0) -> None:
    """What was trained before the checkpoint resumed from, then after the resume, is every
    epoch's batches in the uninterrupted order: 0 lost, 0 repeated. The message counts, per
    epoch, the batches of that epoch trained (an epoch skipped: 0 of n; replayed: 2n)."""
    full = [batch for epoch in epochs for batch in epoch]
    train = recorded(out / f"train-rank{rank}.jsonl")
    saved = resumed_from(out, rank)
    assert len(train) > saved, (out.name, rank, "no crash after the checkpoint", len(train), saved)
    assert train == full[: len(train)], (out.name, rank, "the run before the crash differs")
    done = train[:saved] + recorded(out / f"resume-rank{rank}.jsonl")
    epoch_of = {tuple(batch): e for e, batches in enumerate(epochs) for batch in batches}
    counts = Counter(epoch_of.get(tuple(batch), -1) for batch in done)
    trained = ", ".join(f"epoch {e}: {counts[e]} of {len(b)}" for e, b in enumerate(epochs))
    assert done == full, f"{out.name}, rank {rank}, resumed after {saved} batches: {trained}"


def assert_continues(
    out: Path, full: list[list[int]], *, saved: int, crashed: int, rank: int = 0
) -> None:
    """Trained up to the checkpoint (``saved`` batches) + trained after the resume == ``full``:
    0 lost, 0 repeated, the same batches in the same order. ``crashed``: batches trained
    before the crash (those after the checkpoint are lost with it)."""
    train = recorded(out / f"train-rank{rank}.jsonl")
    resumed = recorded(out / f"resume-rank{rank}.jsonl")
    assert len(train) == crashed > saved, (out.name, rank, len(train), crashed, saved)
    assert train == full[:crashed]
    assert resumed == full[saved:], (out.name, rank, len(resumed), len(full) - saved)
    counts = Counter(v for batch in train[:saved] + resumed for v in batch)
    assert counts == Counter(v for batch in full for v in batch)  # 0 lost, 0 repeated
