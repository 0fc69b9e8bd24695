"""torchdata's ``StatefulDataLoader`` over a ``StructuredDataset``: exact resume.

``StatefulDataLoader(dataset, batch_size=None, num_workers=k)`` asks the dataset for its state
in each worker after every item (``dataset.state_dict()`` there records what that worker
yielded), keeps the state of the last item it handed out per worker, and on resume calls
``dataset.load_state_dict`` inside each new worker. The continuation must equal the
uninterrupted run, batch for batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _data import ids_of

from torch_dataloader_utils import CheckpointMismatchError, StructuredDataset

stateful = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful.StatefulDataLoader

pytestmark = [
    # torchdata 0.11 calls torch's deprecated DataLoader.set_vital.
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

Batches = list[list[int]]


@pytest.fixture(scope="module")
def case(parquet_dir: Path, small_split: int) -> dict[str, Any]:
    return {
        "path": str(parquet_dir), "batch_size": 24, "shuffle": True, "shuffle_seed": 3,
        "split_bytes": small_split,
    }  # fmt: skip


def loader(case: dict[str, Any], num_workers: int, **dataset_kwargs: Any) -> Any:
    dataset = StructuredDataset(**{**case, **dataset_kwargs})
    return StatefulDataLoader(dataset, batch_size=None, num_workers=num_workers)


def run(case: dict[str, Any], num_workers: int, state: Any = None) -> Batches:
    ld = loader(case, num_workers)
    if state is not None:
        ld.load_state_dict(state)
    return [ids_of(b) for b in ld]


def checkpoint(
    case: dict[str, Any], num_workers: int, k: int, state: Any = None
) -> tuple[Batches, Any]:
    """``k`` batches from a fresh loader (resumed from ``state``), then its state (JSON trip)."""
    ld = loader(case, num_workers)
    if state is not None:
        ld.load_state_dict(state)
    it = iter(ld)
    got = [ids_of(next(it)) for _ in range(k)]
    saved = json.loads(json.dumps(ld.state_dict()))
    del it
    return got, saved


@pytest.fixture(scope="module")
def full(case: dict[str, Any]) -> dict[int, Batches]:
    return {k: run(case, k) for k in (0, 2)}


@pytest.mark.parametrize(
    ("num_workers", "k"),
    [
        (0, 0), (0, 1), (0, 5), (0, -1), (0, None),
        (2, 0), (2, 1), (2, 2), (2, 5), (2, 8), (2, -1), (2, None),
    ],
)  # fmt: skip
def test_resume_equals_uninterrupted(
    case: dict[str, Any], full: dict[int, Batches], num_workers: int, k: int | None
) -> None:
    """``k`` batches, ``loader.state_dict()``, a NEW loader resumes: exactly the rest."""
    batches = full[num_workers]
    k = len(batches) if k is None else k % len(batches)  # None: at the end; -1: before it
    first, state = checkpoint(case, num_workers, k)
    assert first == batches[:k]
    assert run(case, num_workers, state) == batches[k:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_a_resumed_checkpoint(
    case: dict[str, Any], full: dict[int, Batches], num_workers: int
) -> None:
    batches = full[num_workers]
    first, state = checkpoint(case, num_workers, 3)
    second, state = checkpoint(case, num_workers, 4, state)
    assert first + second == batches[:7]
    assert run(case, num_workers, state) == batches[7:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_next_epoch_after_set_epoch(case: dict[str, Any], num_workers: int) -> None:
    dataset = StructuredDataset(**case)
    ld = StatefulDataLoader(dataset, batch_size=None, num_workers=num_workers)
    epoch0 = [ids_of(b) for b in ld]
    dataset.set_epoch(1)
    epoch1 = [ids_of(b) for b in ld]
    assert epoch0 != epoch1
    assert sorted(i for b in epoch1 for i in b) == sorted(i for b in epoch0 for i in b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_one_rank_of_a_ddp_job(case: dict[str, Any], num_workers: int) -> None:
    """Rank 1 of 2 (evened out, the DDP default): the same exact resume."""
    ranked = {**case, "rank": 1, "world_size": 2}
    batches = run(ranked, num_workers)
    first, state = checkpoint(ranked, num_workers, 3)
    assert first == batches[:3]
    assert run(ranked, num_workers, state) == batches[3:]
    assert len(batches) == len(run({**case, "rank": 0, "world_size": 2}, num_workers))


def test_changed_seed_raises_in_the_worker(case: dict[str, Any]) -> None:
    _, state = checkpoint(case, 2, 4)
    reseeded = loader(case, 2, shuffle_seed=4)
    reseeded.load_state_dict(state)
    with pytest.raises(CheckpointMismatchError, match="shuffle_seed changed: checkpoint=3"):
        list(reseeded)


def test_state_before_a_worker_yields(case: dict[str, Any], full: dict[int, Batches]) -> None:
    """The narrowest reproduction: checkpoint before the first batch, 2 workers."""
    _, state = checkpoint(case, 2, 0)
    assert run(case, 2, state) == full[2]
