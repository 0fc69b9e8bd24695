"""Malformed state lists under DDP: every rank raises the same library error, none waits.

One torchrun launch (2 ranks, gloo on 127.0.0.1, a process-group timeout of a few seconds)
restores a dozen malformed lists into a dataset of one source and into a mixture, each by
``restore_state_global`` (scattered from rank 0, and broadcast with ``elastic=True``) and by
``load_state_dict(states, elastic=True)`` (``tests/ddp/malformed_job.py``). A rank left waiting
in a collective would fail with gloo's ``RuntimeError`` after the timeout, not a library error.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from _launch import launch_job, torchrun
from test_ddp import solo_group  # noqa: F401 (a fixture)
from test_mixing import write_source

from torch_dataloader_utils import InvalidStateError, StructuredDataset
from torch_dataloader_utils.checkpoint.distributed import _Failure, _outcome

TESTS = Path(__file__).parent
JOB_SCRIPT = TESTS / "ddp" / "malformed_job.py"
GROUP_TIMEOUT = 5  # seconds a rank may wait in a collective before gloo gives up
LIBRARY_ERRORS = {"InvalidStateError", "CheckpointMismatchError"}

# case -> what every rank's message says, whichever way the list was restored
EXPECTED = {
    "no_epoch": ("InvalidStateError", "states[1]: state has no key 'epoch'"),
    "epoch_str": ("InvalidStateError", "states[1]: state key 'epoch' must be int, got str"),
    "no_rank": ("InvalidStateError", "states[0]", "'_rank'"),
    "rank_str": ("InvalidStateError", "states[1]", "'_rank'"),
    "streams_str": ("InvalidStateError", "states[1]: state key 'streams' must be list, got str"),
    "cursor_7": ("InvalidStateError", "states[1]: state key 'cursor' is 7, but 'streams' holds"),
    "duplicate": (
        "CheckpointMismatchError",
        "ranks [0, 0] for world_size=2 (missing [1], duplicated [0])",
    ),
    "short": ("CheckpointMismatchError", "ranks [0] for world_size=2 (missing [1], duplicated [])"),
    "long": (
        "CheckpointMismatchError",
        "ranks [0, 1, 1] for world_size=2 (missing [], duplicated [1])",
    ),
    "not_dict": ("InvalidStateError", "states[1]", "must be a dict, got list"),
    "none_entry": ("InvalidStateError", "states[1]", "must be a dict, got NoneType"),
    # only rank 1's own load (against its files) can tell: every rank raises rank 1's error
    "files_of_rank_1": ("InvalidStateError", "state key 'num_splits' is", "the state is corrupted"),
}


@pytest.fixture(scope="module")
def launched(
    tmp_path_factory: pytest.TempPathFactory, parquet_dir: Path, small_split: int
) -> dict[int, Any]:
    workdir = tmp_path_factory.mktemp("ddp-malformed")
    sources = {"a": write_source(workdir, "a", 0, 50), "b": write_source(workdir, "b", 1, 30)}
    datasets = {
        "single": {"path": str(parquet_dir), "batch_size": 24, "split_bytes": small_split},
        "mixture": {"path": sources, "weights": {"a": 2, "b": 1}, "batch_size": 4},
    }
    job = {"phase": "malformed", "datasets": datasets, "timeout": GROUP_TIMEOUT}
    began = time.monotonic()
    code, log = launch_job(torchrun(2, JOB_SCRIPT), job, workdir, timeout=240)
    assert code == 0, f"torchrun failed ({code}):\n{log[-4000:]}"
    print(f"torchrun 2 x malformed: {time.monotonic() - began:.1f}s")
    return {r: json.loads((workdir / f"malformed-rank{r}.json").read_text()) for r in range(2)}


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dataset", ["single", "mixture"])
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_every_rank_raises_the_same_library_error(
    launched: dict[int, Any], dataset: str, case: str
) -> None:
    kind, *parts = EXPECTED[case]
    for way in ("scatter", "broadcast", "held_elastic"):
        outcomes = [launched[rank][dataset][case][way] for rank in (0, 1)]
        for rank, got in enumerate(outcomes):
            assert got["error"] == kind, f"rank {rank} via {way}: {got}"
            assert got["seconds"] < GROUP_TIMEOUT, f"rank {rank} waited via {way}: {got}"
            for part in parts:
                assert part in got["message"], f"rank {rank} via {way}: {got['message']}"
            assert got["unchanged"], f"rank {rank} kept a state it refused via {way}"
        assert outcomes[0]["message"] == outcomes[1]["message"], f"via {way}"


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dataset", ["single", "mixture"])
def test_the_valid_list_still_loads(launched: dict[int, Any], dataset: str) -> None:
    for rank in (0, 1):
        assert launched[rank][dataset]["valid"]["scatter"]["error"] is None


# ----------------------------------------------------------------------------- in one process


def test_any_error_of_a_validation_is_a_library_refusal() -> None:
    """What the source rank ships instead of the states: a raw error as an InvalidStateError."""
    failure = _outcome(lambda: {"version": 6}["epoch"])
    assert isinstance(failure, _Failure) and isinstance(failure.error, InvalidStateError)
    assert str(failure.error) == "a malformed state (KeyError: 'epoch')"
    assert isinstance(failure.error.__cause__, KeyError)


@pytest.mark.ddp
def test_a_failed_load_in_a_group_leaves_the_dataset_as_it_was(
    solo_group: None,  # noqa: F811
    parquet_dir: Path,
    small_split: int,
) -> None:
    """The load after the scatter fails (the state names other files): raised with a note
    naming the rank, and the dataset keeps the state it had before."""
    loader, dataset = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=24, split_bytes=small_split
    )
    it = iter(loader)
    next(it)
    state = dataset.state_dict()
    del it
    before = dataset.state_dict()
    state["files"]["digest"] = "0" * 16
    with pytest.raises(InvalidStateError, match="state key 'num_splits' is") as info:
        dataset.restore_state_global([state])
    assert "(rank 0 could not load its state;" in "".join(info.value.__notes__)
    assert dataset.state_dict() == before


@pytest.mark.ddp
def test_a_state_of_the_other_kind_is_refused_naming_what_saved_it(
    solo_group: None,  # noqa: F811
    parquet_dir: Path,
    small_split: int,
    tmp_path: Path,
) -> None:
    """``docs/ddp.md``: a state of one dataset given to a mixture, or the other way round, is
    refused by ``restore_state_global`` (scattered or not) and ``load_state_dict`` alike,
    naming what saved it; the dataset keeps the state it had."""
    single = StructuredDataset(str(parquet_dir), batch_size=24, split_bytes=small_split)
    paths = {"a": write_source(tmp_path, "a", 0, 40), "b": write_source(tmp_path, "b", 1, 40)}
    mixture = StructuredDataset(paths, weights={"a": 1, "b": 1}, batch_size=4)
    cases = [
        (single, mixture, "this state was saved by a mixture of sources ['a', 'b']"),
        (mixture, single, "the state has no key '_mixture': it was saved by a dataset of one"),
    ]
    for into, other, said in cases:
        before = into.state_dict()
        states = [other.state_dict()]
        loads: list[tuple[Any, Any, dict[str, Any]]] = [
            (into.restore_state_global, states, {}),
            (into.restore_state_global, states, {"src_rank": None}),
            (into.restore_state_global, states, {"elastic": True}),
            (into.load_state_dict, states[0], {}),
        ]
        for load, given, kwargs in loads:
            with pytest.raises(InvalidStateError) as info:
                load(given, **kwargs)
            assert said in str(info.value), str(info.value)
        assert into.state_dict() == before
