"""DDP with the real engine: torchrun + gloo on 127.0.0.1, checkpoint, crash, relaunch, resume.

The jobs (``tests/ddp/ddp_job.py``) run as a user's would: rank and world size come from the
process group. Each rank reports the row ids of every batch it delivered; the uninterrupted run
of every rank is computed here in-process with explicit ``rank``/``world_size``.

Launches (module-scoped, shared by the tests): 2 ranks x 2 workers train and are killed;
relaunch with 2 ranks; relaunch elastically with 3 ranks x 0 workers; 3 ranks train and stop;
relaunch with 3 ranks; relaunch elastically with 1 rank x 2 workers.

The rest of this file tests ``checkpoint.distributed`` without torchrun: the ``src_rank=None`` path,
validation, and the errors outside an initialised process group.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import make_loader
from _launch import free_port, run_logged
from _launch import torchrun as launch_torchrun
from conftest import TOTAL_ROWS

from torch_dataloader_utils import (
    CheckpointMismatchError,
    InvalidStateError,
    StructuredDataLoader,
    StructuredDataset,
)
from torch_dataloader_utils.checkpoint.distributed import gather_states, scatter_states

TESTS = Path(__file__).parent
JOB_SCRIPT = TESTS / "ddp" / "ddp_job.py"
LAUNCH_TIMEOUT = 180

Batches = list[list[int]]


# ----------------------------------------------------------------------------- launching


def torchrun(nproc: int, job: dict[str, Any], workdir: Path) -> tuple[int, str]:
    """Run ``ddp_job.py`` under torchrun; ``(return code, log)``. The whole tree dies on timeout."""
    job_file = workdir / f"{job['phase']}-job.json"
    job_file.write_text(json.dumps({**job, "dir": str(workdir)}))
    return run_logged(
        [*launch_torchrun(nproc, JOB_SCRIPT), str(job_file)],
        log_file=workdir / f"{job['phase']}.log",
        cwd=workdir,
        pythonpath=[str(TESTS), str(JOB_SCRIPT.parent)],
        timeout=LAUNCH_TIMEOUT,
    )


def results(workdir: Path, phase: str, nproc: int) -> list[dict[str, Any]]:
    return [json.loads((workdir / f"{phase}-rank{r}.json").read_text()) for r in range(nproc)]


def launch_ok(nproc: int, job: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    start = time.monotonic()
    code, log = torchrun(nproc, job, workdir)
    assert code == 0, f"torchrun {job['phase']} failed ({code}):\n{log[-4000:]}"
    print(f"torchrun {nproc} x {job['phase']}: {time.monotonic() - start:.1f}s")
    return results(workdir, job["phase"], nproc)


def uninterrupted(case: Mapping[str, Any], rank: int, world_size: int) -> Batches:
    """Row ids of every batch ``rank`` delivers in the uninterrupted epoch (in-process)."""
    loader, _ = make_loader({**case, "rank": rank, "world_size": world_size})
    return [[int(i) for i in b["id"].tolist()] for b in loader]


def flat(batches: Batches) -> list[int]:
    return [i for b in batches for i in b]


def assert_every_row_once(*parts: Batches, rows: set[int] | None = None) -> None:
    """Every row of ``rows`` (default: the whole dataset) exactly once, no other row."""
    rows = set(range(TOTAL_ROWS)) if rows is None else rows
    counts = Counter(i for part in parts for i in flat(part))
    twice = sorted(i for i, n in counts.items() if n > 1)
    missing = sorted(rows - set(counts))
    extra = sorted(set(counts) - rows)
    assert not (twice or missing or extra), f"twice: {twice[:20]}, never: {missing[:20]}"


# ----------------------------------------------------------------------------- the jobs

CASE: dict[str, Any] = {"batch_size": 24, "shuffle": True, "shuffle_seed": 5}


@pytest.fixture(scope="module")
def cases(parquet_dir: Path, small_split: int) -> dict[str, dict[str, Any]]:
    base = {**CASE, "path": str(parquet_dir), "split_bytes": small_split}
    return {
        # 2 ranks x 2 workers, every row of the epoch (balanced shares, not evened out)
        "two": {**base, "num_workers": 2, "even_batches": False},
        # 3 ranks in the main process, the DDP default: every rank yields as many batches
        "three": {**base, "num_workers": 0},
        "three_all": {**base, "num_workers": 0, "even_batches": False},
        "one": {**base, "num_workers": 2},  # 1 rank x 2 workers
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, cases: dict[str, Any]) -> dict[str, Any]:
    """2 ranks x 2 workers: 3 batches, save, 2 more, SIGKILL; relaunch and resume."""
    workdir = tmp_path_factory.mktemp("ddp2")
    job = {"phase": "train", "case": cases["two"], "k": 3, "extra": 2, "kill": True}
    start = time.monotonic()
    code, log = torchrun(2, job, workdir)
    assert code != 0, f"rank 0 was to be killed, but torchrun succeeded:\n{log[-2000:]}"
    print(f"torchrun 2 x train (killed): {time.monotonic() - start:.1f}s")
    train = results(workdir, "train", 2)
    resumed = launch_ok(2, {"phase": "resume", "case": cases["two"]}, workdir)
    return {"dir": workdir, "train": train, "resume": resumed, "case": cases["two"]}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory, cases: dict[str, Any]) -> dict[str, Any]:
    """3 ranks x 0 workers: 4 batches, save, stop; relaunch and resume."""
    workdir = tmp_path_factory.mktemp("ddp3")
    train = launch_ok(3, {"phase": "train", "case": cases["three"], "k": 4}, workdir)
    resumed = launch_ok(3, {"phase": "resume", "case": cases["three"]}, workdir)
    return {"dir": workdir, "train": train, "resume": resumed, "case": cases["three"]}


def _elastic(old: dict[str, Any], case: dict[str, Any], nproc: int, tmp: Path) -> dict[str, Any]:
    job = {"phase": "elastic", "case": case, "states": str(old["dir"] / "global.pt")}
    return {"old": old, "elastic": launch_ok(nproc, job, tmp), "case": case}


@pytest.fixture(scope="module")
def two_to_three(
    tmp_path_factory: pytest.TempPathFactory, two_ranks: dict[str, Any], cases: dict[str, Any]
) -> dict[str, Any]:
    return _elastic(two_ranks, cases["three_all"], 3, tmp_path_factory.mktemp("ddp2to3"))


@pytest.fixture(scope="module")
def three_to_one(
    tmp_path_factory: pytest.TempPathFactory, three_ranks: dict[str, Any], cases: dict[str, Any]
) -> dict[str, Any]:
    return _elastic(three_ranks, cases["one"], 1, tmp_path_factory.mktemp("ddp3to1"))


# ----------------------------------------------------------------------------- launched tests

RESTORES = ("plain", "per_rank", "global", "global_src1", "global_all")
RESTORES += ("energon_rank", "energon_global")  # Megatron-Energon's names on the loader


@pytest.mark.parametrize("job", ["two_ranks", "three_ranks"])
@pytest.mark.parametrize("how", RESTORES)
@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_continues_the_uninterrupted_run(
    request: pytest.FixtureRequest, job: str, how: str
) -> None:
    ran = request.getfixturevalue(job)
    world_size = len(ran["train"])
    fulls = [uninterrupted(ran["case"], rank, world_size) for rank in range(world_size)]
    for rank, full in enumerate(fulls):
        train, resumed = ran["train"][rank], ran["resume"][rank][how]
        k = len(train["first"])
        assert train["world"] == [rank, world_size]
        assert (train["state_rank"], train["state_world_size"]) == (rank, world_size)
        assert train["first"] == full[:k]
        assert train["lost"] == full[k : k + len(train["lost"])]
        assert "error" not in resumed, resumed
        assert resumed["batches"] == full[k:], f"rank {rank} via {how}"
        assert train["len"] == resumed["len"] == len(full)  # the epoch's batches on this rank
    firsts = [r["first"] for r in ran["train"]]
    rests = [r[how]["batches"] for r in ran["resume"]]
    assert_every_row_once(*firsts, *rests, rows=set(flat([b for f in fulls for b in f])))
    if ran["case"].get("even_batches", True):  # the default under DDP
        assert len({len(full) for full in fulls}) == 1, [len(full) for full in fulls]
    else:  # every row, in shares that differ by at most one row per stream
        assert_every_row_once(*fulls)
        rows = [len(flat(full)) for full in fulls]
        assert max(rows) - min(rows) <= max(1, ran["case"].get("num_workers", 0)), rows


@pytest.mark.parametrize("job", ["two_ranks", "three_ranks"])
@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_saved_lists_agree(request: pytest.FixtureRequest, job: str) -> None:
    ran = request.getfixturevalue(job)
    assert ran["train"][0]["helper_equals_plain"] is True
    assert all(r["energon_equals_plain"] for r in ran["train"])  # loader.save_state_global
    assert [r["helper_is_none"] for r in ran["train"]] == [False] + [True] * (len(ran["train"]) - 1)
    states = torch.load(ran["dir"] / "global.pt", weights_only=True)
    assert [s["_rank"] for s in states] == list(range(len(ran["train"])))
    json.dumps(states)  # one plain, JSON-safe file for the whole job


@pytest.mark.parametrize("job", ["two_ranks", "three_ranks"])
@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_misuse_raises_on_every_rank(request: pytest.FixtureRequest, job: str) -> None:
    ran = request.getfixturevalue(job)
    world_size = len(ran["train"])
    for rank, resumed in enumerate(ran["resume"]):
        other = (rank + 1) % world_size
        wrong = resumed["wrong_rank"]
        assert wrong["error"] == "CheckpointMismatchError" and wrong["field"] == "rank"
        assert f"the state of rank {other}" in wrong["message"]
        assert f"rank={other}" in wrong["message"] and f"rank={rank}" in wrong["message"]
        flipped = resumed["reversed"]
        assert flipped["error"] == "CheckpointMismatchError" and flipped["field"] == "rank"
        last = world_size - 1
        assert f"not in rank order: states[0] is the state of rank {last}" in flipped["message"]
        dup = resumed["duplicated"]
        assert dup["error"] == "CheckpointMismatchError" and dup["field"] == "rank"
        missing = list(range(1, world_size))
        assert f"missing {missing}, duplicated [0]" in dup["message"]


@pytest.mark.parametrize("job", ["two_to_three", "three_to_one"])
@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_delivers_the_rest_once(request: pytest.FixtureRequest, job: str) -> None:
    ran = request.getfixturevalue(job)
    before = [r["first"] for r in ran["old"]["train"]]
    # The old job's even_batches left some rows out; the elastic deal takes them in again, so
    # across both jobs only what the new deal leaves out is missing (fewer than its streams).
    old_world = len(ran["old"]["train"])
    dealt = {
        i
        for rank in range(old_world)
        for i in flat(uninterrupted(ran["old"]["case"], rank, old_world))
    }
    assert TOTAL_ROWS - len(dealt) < old_world
    new_world = len(ran["elastic"])
    for how in ("global", "plain"):
        after = [r[how]["batches"] for r in ran["elastic"]]
        delivered = Counter(i for part in (*before, *after) for i in flat(part))
        assert max(delivered.values()) == 1, "a row delivered twice"
        assert set(delivered) <= set(range(TOTAL_ROWS))
        assert TOTAL_ROWS - len(delivered) < new_world * max(1, ran["case"]["num_workers"])
    # Both entry points deal the remainder the same way, and so does an in-process rank.
    states = torch.load(ran["old"]["dir"] / "global.pt", weights_only=True)
    world_size = len(ran["elastic"])
    for rank, result in enumerate(ran["elastic"]):
        assert result["global"]["batches"] == result["plain"]["batches"]
        assert result["global"]["len"] == len(result["global"]["batches"])
        loader, dataset = make_loader({**ran["case"], "rank": rank, "world_size": world_size})
        dataset.load_state_dict(states, elastic=True)
        assert [[int(i) for i in b["id"].tolist()] for b in loader] == result["global"]["batches"]


@pytest.mark.parametrize("job", ["two_to_three", "three_to_one"])
@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_still_refuses_a_changed_seed(request: pytest.FixtureRequest, job: str) -> None:
    for result in request.getfixturevalue(job)["elastic"]:
        error = result["reseeded"]
        assert error["error"] == "CheckpointMismatchError" and error["field"] == "shuffle_seed"
        assert "Likely cause: shuffle_seed changed: checkpoint=5, current=6" in error["message"]


# ----------------------------------------------------------------------------- without torchrun


def _states(parquet_dir: Path, small_split: int, world_size: int) -> list[dict[str, Any]]:
    """Every rank's state after one batch, from in-process ranks."""
    out = []
    for rank in range(world_size):
        loader, dataset = StructuredDataset.create_dataloader(
            str(parquet_dir), batch_size=24, split_bytes=small_split, rank=rank,
            world_size=world_size,
        )  # fmt: skip
        it = iter(loader)
        next(it)
        out.append(dataset.state_dict())
        del it
    return out


@pytest.fixture(scope="module")
def two_states(parquet_dir: Path, small_split: int) -> list[dict[str, Any]]:
    return _states(parquet_dir, small_split, 2)


def test_all_held_returns_own_state(two_states: list[dict[str, Any]]) -> None:
    for rank in range(2):
        own = scatter_states(two_states, None, rank, 2, elastic=False)
        assert own is two_states[rank]
    assert scatter_states(two_states, None, 0, 3, elastic=True) == two_states


@pytest.mark.parametrize(
    ("pick", "message"),
    [
        ([0], "ranks [0] for world_size=2 (missing [1], duplicated [])"),
        ([0, 0], "ranks [0, 0] for world_size=2 (missing [1], duplicated [0])"),
        ([1, 0], "not in rank order: states[0] is the state of rank 1"),
    ],
)
def test_all_held_refuses_a_bad_list(
    two_states: list[dict[str, Any]], pick: list[int], message: str
) -> None:
    with pytest.raises(CheckpointMismatchError, match=re.escape(message)) as info:
        scatter_states([two_states[i] for i in pick], None, 0, 2, elastic=False)
    assert info.value.field == "rank"
    assert "Likely cause:" in str(info.value)


def test_all_held_refuses_another_world_size(two_states: list[dict[str, Any]]) -> None:
    with pytest.raises(CheckpointMismatchError, match="pass elastic=True") as info:
        scatter_states(two_states, None, 0, 3, elastic=False)
    assert (info.value.field, info.value.expected, info.value.found) == ("world_size", 2, 3)
    assert "Likely cause: world_size changed: checkpoint=2, current=3" in str(info.value)


@pytest.mark.parametrize(
    ("states", "error", "message"),
    [
        ({"_rank": 0}, TypeError, "takes the list of every rank's state"),
        ([], InvalidStateError, "no states given"),
        ([{"_rank": "0", "_world_size": 1}], InvalidStateError, r"states\[0\] has no int key"),
        ([[1, 2]], InvalidStateError, r"states\[0\] must be a dict, got list"),
    ],
)
def test_all_held_rejects_what_is_no_list_of_states(
    states: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        scatter_states(states, None, 0, 1, elastic=False)


def test_restore_global_without_process_group_needs_src_none(
    two_states: list[dict[str, Any]], parquet_dir: Path, small_split: int
) -> None:
    dataset = StructuredDataset(
        str(parquet_dir), batch_size=24, split_bytes=small_split, rank=1, world_size=2
    )
    with pytest.raises(RuntimeError, match=r"not initialised.*init_process_group"):
        dataset.restore_state_global(two_states)
    dataset.restore_state_global(two_states, src_rank=None)  # no collective needed
    assert dataset.state_dict() == two_states[1]


def test_save_global_without_process_group_says_how(two_states: list[dict[str, Any]]) -> None:
    with pytest.raises(RuntimeError, match=r"save_state_global is a collective .* not initialised"):
        gather_states(two_states[0], 0)


@pytest.fixture
def solo_group() -> Iterator[None]:
    """A one-rank gloo process group in this process, on a free 127.0.0.1 port."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_helpers_in_a_one_rank_group(solo_group: None, parquet_dir: Path, small_split: int) -> None:
    loader, dataset = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=24, split_bytes=small_split
    )
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    saved = dataset.save_state_global()
    del it
    assert saved == [dataset.state_dict()]
    with pytest.raises(ValueError, match=r"dst_rank must be a rank .* \[0, 1\), got 1"):
        dataset.save_state_global(dst_rank=1)
    resumed_loader, resumed = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=24, split_bytes=small_split
    )
    resumed.restore_state_global(saved)
    rest = list(resumed_loader)
    assert len(first) + len(rest) == len(loader)
    with pytest.raises(ValueError, match="got states=None on the rank that must hold them"):
        resumed.restore_state_global(None)
    with pytest.raises(CheckpointMismatchError, match=r"missing \[\], duplicated \[0\]"):
        resumed.restore_state_global(saved * 2)  # ranks 0, 0 of world_size 1
    with pytest.raises(ValueError, match="got states=None on the rank that must hold them"):
        resumed.restore_state_global(None, elastic=True)


@pytest.mark.ddp
def test_helpers_refuse_a_dataset_world_other_than_the_group(
    solo_group: None, parquet_dir: Path, small_split: int
) -> None:
    """With model parallelism the data-parallel world is not the default group: say so."""
    dataset = StructuredDataset(
        str(parquet_dir), batch_size=24, split_bytes=small_split, rank=0, world_size=2
    )
    with pytest.raises(ValueError, match=r"default process group of 1 ranks.*world_size=2"):
        dataset.save_state_global()
    states = _states(parquet_dir, small_split, 2)
    with pytest.raises(ValueError, match=r"default process group of 1 ranks.*world_size=2"):
        dataset.restore_state_global(states)


def test_plain_dataloader_has_no_dist_in_state_dict(parquet_dir: Path, small_split: int) -> None:
    """Rank-local ``state_dict()`` works without a process group: it never calls ``dist.*``."""
    loader = StructuredDataLoader(
        StructuredDataset(str(parquet_dir), split_bytes=small_split, rank=1, world_size=3)
    )
    assert loader.state_dict()["_rank"] == 1


def test_loader_speaks_energon(parquet_dir: Path, small_split: int) -> None:
    """Megatron-Energon's idioms on the loader, in one process: the dataset's states."""
    case = {"path": str(parquet_dir), "batch_size": 24, "split_bytes": small_split}
    states, rests = [], []
    for rank in range(2):
        loader, _ = make_loader({**case, "rank": rank, "world_size": 2})
        it = iter(loader)
        next(it)
        states.append(loader.save_state_rank())
        assert states[-1] == loader.state_dict()
        rests.append([[int(i) for i in b["id"].tolist()] for b in it])
    for rank in range(2):
        by_rank, _ = make_loader({**case, "rank": rank, "world_size": 2})
        by_rank.restore_state_rank(states[rank])
        by_list, _ = make_loader({**case, "rank": rank, "world_size": 2})
        by_list.restore_state_global(states, src_rank=None)
        for loader in (by_rank, by_list):
            assert [[int(i) for i in b["id"].tolist()] for b in loader] == rests[rank]
    with pytest.raises(RuntimeError, match="save_state_global is a collective"):
        by_rank.save_state_global()
