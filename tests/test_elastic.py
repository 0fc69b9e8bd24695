"""Elastic resume in one process: ranks simulated with explicit ``rank``/``world_size``.

An elastic resume takes every old rank's state and re-deals what they had not delivered to the
new ranks and workers. The promise: every row of the epoch not yet delivered is delivered exactly
once, none twice; the order may differ from the uninterrupted run. Files, seed and
``split_bytes`` must still match. (tests/test_ddp.py does the same under torchrun.)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from _data import ids_of
from _harness import json_round_trip, make_loader
from conftest import TOTAL_ROWS
from hypothesis import given
from hypothesis import strategies as st

from torch_dataloader_utils import CheckpointMismatchError

Batches = list[list[int]]

# 4 workers on a 2-core machine is the point of the worker tests, not a mistake.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def case(parquet_dir: Path, small_split: int) -> dict[str, Any]:
    return {
        "path": str(parquet_dir), "batch_size": 24, "shuffle": True, "shuffle_seed": 11,
        "split_bytes": small_split, "even_batches": False,
    }  # fmt: skip


def take(
    case: Mapping[str, Any],
    rank: int,
    world_size: int,
    n: int | None,
    *,
    num_workers: int = 0,
    states: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    elastic: bool = True,
) -> tuple[Batches, dict[str, Any]]:
    """A fresh rank (optionally resumed from ``states``): ``n`` batches (all if None), state."""
    loader, _ = make_loader(
        {**case, "rank": rank, "world_size": world_size, "num_workers": num_workers}
    )
    if states is not None:
        loader.load_state_dict(states, elastic=elastic)
    got: Batches = []
    it = iter(loader)
    try:
        for batch in it:
            got.append(ids_of(batch))
            if n is not None and len(got) >= n:
                break
        state = json_round_trip(loader.state_dict())
    finally:
        del it
    return got, state


def job(
    case: Mapping[str, Any],
    world_size: int,
    steps: Sequence[int | None],
    states: Sequence[Mapping[str, Any]] | None = None,
    num_workers: int = 0,
) -> tuple[list[Batches], list[dict[str, Any]]]:
    """Every rank of a job: rank ``r`` takes ``steps[r]`` batches; their batches and states."""
    runs = [
        take(case, r, world_size, steps[r], num_workers=num_workers, states=states)
        for r in range(world_size)
    ]
    return [b for b, _ in runs], [s for _, s in runs]


def assert_every_row_once(*parts: Batches) -> None:
    counts = Counter(i for part in parts for batch in part for i in batch)
    twice = sorted(i for i, n in counts.items() if n > 1)
    missing = sorted(set(range(TOTAL_ROWS)) - set(counts))
    assert not twice and not missing, f"twice: {twice[:20]}, never: {missing[:20]}"


# ----------------------------------------------------------------------------- world size


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 2), (2, 2)])
def test_ranks_change(case: dict[str, Any], old: int, new: int) -> None:
    before, states = job(case, old, [3] * old)
    after, _ = job(case, new, [None] * new, states)
    assert_every_row_once(*before, *after)


@given(
    old=st.integers(1, 4),
    new=st.integers(1, 4),
    steps=st.lists(st.integers(0, 12), min_size=4, max_size=4),
    again=st.integers(1, 4),
    cut=st.integers(0, 6),
)
def test_elastic_twice_delivers_every_row_once(
    case: dict[str, Any], old: int, new: int, steps: list[int], again: int, cut: int
) -> None:
    """Ranks at different steps; an elastic resume, stopped and resumed elastically again."""
    before, states = job(case, old, steps[:old])
    middle, middle_states = job(case, new, [cut] * new, states)
    after, _ = job(case, again, [None] * again, middle_states)
    assert_every_row_once(*before, *middle, *after)


def test_elastic_with_even_batches_gives_ranks_equal_counts(case: dict[str, Any]) -> None:
    """The DDP default: the re-dealt remainder is evened out again; no row twice."""
    evened = {**case, "even_batches": True}
    before, states = job(evened, 2, [3, 5])
    after, _ = job(evened, 3, [None] * 3, states)
    assert len({len(batches) for batches in after}) == 1, [len(b) for b in after]
    delivered = Counter(i for part in (*before, *after) for batch in part for i in batch)
    assert max(delivered.values()) == 1


@given(worlds=st.lists(st.integers(1, 4), min_size=2, max_size=4), cut=st.integers(0, 4))
def test_a_chain_of_evened_elastic_resumes_leaves_out_less_than_its_last_streams(
    case: dict[str, Any], worlds: list[int], cut: int
) -> None:
    """even_batches leaves out fewer than S rows of an epoch, however many elastic resumes
    the epoch goes through: a deal takes in again what the one before left out. S: the
    streams of the job in which the epoch ended (a later job resumes a finished epoch, whose
    left-out rows stay out, and delivers nothing)."""
    evened = {**case, "even_batches": True}
    parts: list[Batches] = []
    states = None
    ended = worlds[0]
    for number, world in enumerate(worlds):
        last = number == len(worlds) - 1
        batches, states = job(evened, world, [None if last else cut] * world, states)
        parts += batches
        if any(batches):
            ended = world  # one stream per rank
    delivered = Counter(i for part in parts for batch in part for i in batch)
    assert max(delivered.values()) == 1
    assert TOTAL_ROWS - len(delivered) < ended


def test_elastic_order_is_deterministic(case: dict[str, Any]) -> None:
    """Not the uninterrupted order, but the same for the same checkpoint and new world."""
    _, states = job(case, 2, [2, 5])
    first, _ = job(case, 3, [None] * 3, states)
    second, _ = job(case, 3, [None] * 3, json_round_trip(states[::-1]))  # list order is free
    assert first == second


def test_elastic_resume_at_end_of_epoch_is_empty_then_next_epoch(case: dict[str, Any]) -> None:
    _, states = job(case, 2, [None, None])
    after, _ = job(case, 3, [None] * 3, states)
    assert after == [[], [], []]
    loader, dataset = make_loader({**case, "rank": 0, "world_size": 1})
    dataset.load_state_dict(states, elastic=True)
    assert list(loader) == []
    dataset.set_epoch(1)
    assert_every_row_once([ids_of(b) for b in loader])


def test_elastic_len_counts_the_remainder(case: dict[str, Any]) -> None:
    _, states = job(case, 2, [4, 4])
    for rank in range(3):
        loader, dataset = make_loader({**case, "rank": rank, "world_size": 3})
        dataset.load_state_dict(states, elastic=True)
        expected = len(dataset)
        assert len(list(loader)) == expected


# ----------------------------------------------------------------------------- workers


@pytest.mark.slow
def test_two_to_four_workers(case: dict[str, Any]) -> None:
    before, state = take(case, 0, 1, 5, num_workers=2)
    with pytest.raises(
        CheckpointMismatchError, match="Likely cause: num_workers changed: checkpoint=2, current=4"
    ):
        take(case, 0, 1, None, num_workers=4, states=state, elastic=False)
    after, _ = take(case, 0, 1, None, num_workers=4, states=state)  # one state: one old rank
    assert_every_row_once(before, after)
    again, _ = take(case, 0, 1, None, num_workers=4, states=[state])
    assert again == after


@pytest.mark.slow
def test_ranks_and_workers_change_together(case: dict[str, Any]) -> None:
    before, states = job(case, 2, [3, 4], num_workers=2)
    middle, middle_states = job(case, 3, [2, 2, 2], states, num_workers=1)
    after, _ = job(case, 1, [None], middle_states, num_workers=3)
    assert_every_row_once(*before, *middle, *after)


# ----------------------------------------------------------------------------- still refused


@pytest.mark.parametrize(
    ("change", "field", "cause"),
    [
        ({"shuffle_seed": 12}, "shuffle_seed", "shuffle_seed changed: checkpoint=11, current=12"),
        ({"shuffle": False}, "shuffle", "shuffle changed: checkpoint=True, current=False"),
        ({"split_bytes": "double"}, "split_bytes", "split_bytes changed: checkpoint="),
    ],
)
def test_elastic_refuses_changed_settings(
    case: dict[str, Any], change: dict[str, Any], field: str, cause: str
) -> None:
    _, states = job(case, 2, [3, 3])
    if change.get("split_bytes") == "double":
        change = {"split_bytes": 2 * case["split_bytes"]}
    with pytest.raises(CheckpointMismatchError, match=re.escape(cause)) as info:
        job({**case, **change}, 3, [None] * 3, states)
    assert info.value.field == field


def test_elastic_refuses_changed_files(
    case: dict[str, Any], tmp_path: Path, parquet_dir: Path
) -> None:
    import shutil

    from _data import write_dataset

    copy = tmp_path / "data"
    shutil.copytree(parquet_dir, copy)
    moved = {**case, "path": str(copy)}
    _, moved_states = job(moved, 2, [3, 3])
    write_dataset(copy, (230, 170, 301), row_group_size=16)  # one more row in the last file
    with pytest.raises(CheckpointMismatchError, match="files changed") as info:
        job(moved, 3, [None] * 3, moved_states)
    assert info.value.field == "files"


@pytest.mark.parametrize(
    ("pick", "message"),
    [
        ([0], "ranks [0] for world_size=2 (missing [1], duplicated [])"),
        ([0, 0, 1], "ranks [0, 0, 1] for world_size=2 (missing [], duplicated [0])"),
    ],
)
def test_elastic_refuses_missing_or_duplicated_ranks(
    case: dict[str, Any], pick: list[int], message: str
) -> None:
    _, states = job(case, 2, [3, 3])
    with pytest.raises(CheckpointMismatchError, match=re.escape(message)) as info:
        take(case, 0, 3, None, states=[states[i] for i in pick])
    assert info.value.field == "rank"


def test_elastic_refuses_mixed_epochs(case: dict[str, Any]) -> None:
    _, states = job(case, 2, [3, 3])
    loader, dataset = make_loader({**case, "rank": 1, "world_size": 2})
    dataset.set_epoch(1)
    it = iter(loader)
    next(it)
    later = dataset.state_dict()
    del it
    with pytest.raises(CheckpointMismatchError, match=r"different epochs \[0, 1\]") as info:
        take(case, 0, 3, None, states=[states[0], later])
    assert info.value.field == "epoch"


# ----------------------------------------------------------------------------- rank ownership


def test_loading_another_ranks_state_says_whose(case: dict[str, Any]) -> None:
    _, states = job(case, 2, [3, 3])
    with pytest.raises(CheckpointMismatchError, match="the state of rank 1 does not match") as info:
        take(case, 0, 2, None, states=states[1], elastic=False)
    message = str(info.value)
    assert "Likely cause: rank changed: checkpoint=1, current=0" in message
    assert (info.value.field, info.value.expected, info.value.found) == ("rank", 1, 0)
    assert "pass elastic=True" in message


def test_non_elastic_load_refuses_a_list(case: dict[str, Any]) -> None:
    _, states = job(case, 2, [3, 3])
    with pytest.raises(TypeError, match="needs elastic=True"):
        take(case, 0, 2, None, states=states, elastic=False)
