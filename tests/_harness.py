"""The resume-equivalence harness: an uninterrupted run against checkpoint -> new loader -> resume.

A *case* is the keyword arguments of ``StructuredDataset.create_dataloader`` (JSON-safe; a
transform is named by a key of ``TRANSFORMS`` so a case can cross a process boundary). Every
helper builds a fresh dataset and loader from the case, as a restarted job would.

    full = run_epoch(case)                      # batches of the uninterrupted epoch
    state = checkpoint_after(case, k)           # fresh loader, k batches, JSON round trip
    assert resume(case, state) == full[k:]      # a NEW loader continues exactly there

Batches are compared as canonical Python values (``canonical``): column names, dtypes and every
value, NaN included. Run as a script (``python _harness.py job.json``) to resume in a new
process; ``resume_in_subprocess`` does that.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from torch_dataloader_utils import StructuredDataLoader, StructuredDataset
from torch_dataloader_utils.base.jagged import JaggedArray
from torch_dataloader_utils.mixing.state import encode_mixture
from torch_dataloader_utils.planning.epochs import Start

__all__ = [
    "TRANSFORMS",
    "assert_resume_exact",
    "canonical",
    "checkpoint_after",
    "count_decoded_rows",
    "ids",
    "json_round_trip",
    "make_loader",
    "resume",
    "resume_in_subprocess",
    "run_epoch",
    "take",
]

Case = Mapping[str, Any]


def keep_even(batch: dict[str, Any]) -> dict[str, Any]:
    """A filtering transform: drops rows with an odd id (batches shrink, some become empty)."""
    keep = batch["id"] % 2 == 0
    return {
        k: (v[keep] if isinstance(v, torch.Tensor) else _pick(v, keep)) for k, v in batch.items()
    }


def add_doubled(batch: dict[str, Any]) -> dict[str, Any]:
    """A transform that adds a column."""
    return {**batch, "doubled": batch["id"] * 2}


def _pick(values: list[Any], keep: torch.Tensor) -> list[Any]:
    return [v for v, k in zip(values, keep.tolist(), strict=True) if k]


TRANSFORMS: dict[str, Callable[[Any], Any]] = {"keep_even": keep_even, "add_doubled": add_doubled}


def make_loader(case: Case) -> tuple[StructuredDataLoader, StructuredDataset]:
    kwargs = dict(case)
    if isinstance(kwargs.get("transform"), str):
        kwargs["transform"] = TRANSFORMS[kwargs["transform"]]
    return StructuredDataset.create_dataloader(**kwargs)


# ---------------------------------------------------------------------------- canonical values


def canonical(batch: Any) -> dict[str, Any]:
    """A batch as ``{column: (dtype, values)}`` of plain Python values, NaN as the string."""
    if isinstance(batch, pa.RecordBatch):
        return {
            n: (str(c.type), _plain(c.to_pylist()))
            for n, c in zip(batch.schema.names, batch.columns, strict=True)
        }
    assert isinstance(batch, dict), f"unexpected batch type {type(batch).__name__}"
    out = {}
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and value.layout == torch.jagged:  # list columns
            out[name] = (f"jagged {value.dtype}", [_plain(r.tolist()) for r in value.unbind()])
        elif isinstance(value, JaggedArray):
            out[name] = (f"jagged {value.values.dtype}", _plain(value.tolist()))
        elif isinstance(value, torch.Tensor | np.ndarray):
            out[name] = (str(value.dtype), _plain(value.tolist()))
        elif isinstance(value, int):
            out[name] = ("int", value)
        else:
            out[name] = (type(value).__name__, _plain(list(value)))
    return out


def _plain(values: Any) -> Any:
    if isinstance(values, list):
        return [_plain(v) for v in values]
    if isinstance(values, float) and math.isnan(values):
        return "NaN"
    return values


def ids(batches: list[dict[str, Any]]) -> list[int]:
    """Row ids of canonical batches, in delivery order."""
    return [i for b in batches for i in b["id"][1]]


# ---------------------------------------------------------------------------- runs


def take(loader: StructuredDataLoader, n: int | None = None) -> list[dict[str, Any]]:
    """Up to ``n`` canonical batches from one iteration of ``loader`` (all when ``None``)."""
    out: list[dict[str, Any]] = []
    it: Iterator[Any] = iter(loader)
    try:
        for batch in it:
            if n is not None and len(out) >= n:
                break
            out.append(canonical(batch))
    finally:
        del it
    return out


def run_epoch(case: Case, epoch: int = 0) -> list[dict[str, Any]]:
    """Every batch of ``epoch`` from a fresh loader."""
    loader, dataset = make_loader(case)
    dataset.set_epoch(epoch)
    return take(loader)


def json_round_trip(state: Any) -> Any:
    return json.loads(json.dumps(state))


def torch_round_trip(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def checkpoint_after(
    case: Case, k: int, epoch: int = 0, state: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fresh loader (resumed from ``state`` if given), ``k`` batches, state (JSON round trip).

    The state is taken while the iterator is still alive, as a training loop would; returns the
    state and the ``k`` batches.
    """
    loader, dataset = make_loader(case)
    if state is None:
        dataset.set_epoch(epoch)
    else:
        loader.load_state_dict(state)
    got: list[dict[str, Any]] = []
    it = iter(loader)
    try:
        while len(got) < k:
            got.append(canonical(next(it)))
        saved = json_round_trip(loader.state_dict())
    finally:
        del it
    assert saved == json_round_trip(dataset.state_dict())
    return saved, got


def resume(case: Case, state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A new dataset and loader from ``case``, ``load_state_dict(state)``, the rest of the epoch."""
    loader, _ = make_loader(case)
    loader.load_state_dict(state)
    return take(loader)


def assert_resume_exact(
    case: Case, k: int, epoch: int = 0, full: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Checkpoint after ``k`` batches, resume in a new loader: exactly ``full[k:]``."""
    full = run_epoch(case, epoch) if full is None else full
    state, first = checkpoint_after(case, k, epoch)
    assert first == full[:k]
    assert state["epoch"] == epoch
    rest = resume(case, state)
    assert len(rest) == len(full) - k, (len(rest), len(full), k)
    assert rest == full[k:]
    assert resume(case, torch_round_trip(state)) == full[k:]
    return state


def elastic_run(
    case: Case, steps: list[int], new_world: int, new_workers: int
) -> tuple[list[list[dict[str, Any]]], list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """Ranks of a ``len(steps)``-rank job each take ``steps[rank]`` batches; every new rank of
    ``new_world`` (``new_workers`` workers) loads all their states elastically and runs the
    rest. Returns the old ranks' batches, the new ranks' and the old states."""
    before, states = [], []
    for rank, k in enumerate(steps):
        state, batches = checkpoint_after({**case, "rank": rank, "world_size": len(steps)}, k)
        states.append(state)
        before.append(batches)
    after = []
    for rank in range(new_world):
        loader, _ = make_loader(
            {**case, "rank": rank, "world_size": new_world, "num_workers": new_workers}
        )
        loader.load_state_dict(states, elastic=True)
        after.append(take(loader))
    return before, after, states


def mixture_elastic_batches(
    paths: Mapping[str, str],
    options: Mapping[str, Any],
    old: tuple[int, int],
    new: tuple[int, int],
    steps: list[int],
) -> list[Any]:
    """A packed mixture's batches: ranks of an ``old`` (world_size, num_workers) job take
    ``steps[rank]`` batches per worker stream; each rank of a ``new`` job loads every state
    elastically, delivers the rest of the epoch, then epoch 1 (which goes on from where each
    stream's sources stood). Worker streams are read in process, one after another."""
    got: list[Any] = []
    states = []
    world, workers = old
    for rank in range(world):
        ds = StructuredDataset(dict(paths), rank=rank, world_size=world, **options)
        progress = ds._epochs.begin(Start.fresh(0), workers)
        for w in range(max(1, workers)):
            for batch, position in itertools.islice(ds._reader(progress, w).batches(), steps[rank]):
                got.append(batch)
                progress.record(w, position, 0)
        states.append(json_round_trip(encode_mixture(ds._epochs, progress)))
    world, workers = new
    for rank in range(world):
        ds = StructuredDataset(dict(paths), rank=rank, world_size=world, **options)
        ds._loader_workers = workers
        ds.load_state_dict(states, elastic=True)
        rest = ds._epochs.begin(ds._start, workers)
        ds._progress = rest
        for w in range(max(1, workers)):
            for batch, position in ds._reader(rest, w).batches():
                got.append(batch)
                rest.record(w, position, 0)
        carried = ds._carried(1)
        assert carried is not None
        following = ds._epochs.begin(carried, workers)
        for w in range(max(1, workers)):
            got += [batch for batch, _ in ds._reader(following, w).batches()]
    return got


# ---------------------------------------------------------------------------- reads


def join_read_ahead() -> None:
    """Wait for the read-ahead threads of abandoned iterators (they stop after one item)."""
    import gc

    from torch_dataloader_utils.reading import prefetch as _prefetch

    gc.collect()
    for _, thread in list(_prefetch._running):
        thread.join(10)


def count_decoded_rows(monkeypatch: Any, fmt: str) -> list[tuple[int, int]]:
    """Record ``(first unit, rows decoded)`` of every ``read_units`` call of format ``fmt``."""
    from torch_dataloader_utils.formats import get_format

    read: list[tuple[int, int]] = []
    cls = type(get_format(fmt))
    original = cls.read_units

    def counting(self, source, metadata, units, columns, batch_rows):
        rows = 0
        try:
            for batch in original(self, source, metadata, units, columns, batch_rows):
                rows += batch.num_rows
                yield batch
        finally:  # the reader may stop early, once its piece's rows are read
            read.append((units.start, rows))

    monkeypatch.setattr(cls, "read_units", counting)
    return read


# ---------------------------------------------------------------------------- new process


def resume_in_subprocess(
    case: Case, state: Mapping[str, Any], workdir: str | os.PathLike[str]
) -> list[dict[str, Any]]:
    """``resume(case, state)`` in a new Python process; its batches, canonical."""
    job = Path(workdir) / "resume-job.json"
    out = Path(workdir) / "resume-out.json"
    job.write_text(json.dumps({"case": dict(case), "state": state, "out": str(out)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, __file__, str(job)], env=env, timeout=240, capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, f"resume subprocess failed:\n{done.stderr}"
    return [_from_json(b) for b in json.loads(out.read_text())]


def _from_json(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: (v[0], v[1]) for k, v in batch.items()}


def _main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    batches = resume(job["case"], job["state"])
    Path(job["out"]).write_text(json.dumps(batches))


if __name__ == "__main__":
    _main(sys.argv[1])
