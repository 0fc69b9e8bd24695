"""The loader inside the trainers people already use: Hugging Face Accelerate, Lightning Fabric.

Accelerate: ``accelerator.prepare(loader)`` must return our loader itself (Accelerate would
otherwise rebuild a plain DataLoader over the dataset that reads a batch ahead and never records
what workers delivered: 4,096 rows lost or 40,960 repeated per resume, docs/trainers.md). The
jobs (``tests/trainers/accelerate_job.py``) run under ``accelerate launch`` with 1 and 2 CPU
processes (gloo, 127.0.0.1), with 0 and 2 workers each: steps, checkpoint, more steps, SIGKILL;
relaunch, resume. Every row exactly once, and each process's batches are those of its
uninterrupted run, computed here in-process with explicit ``rank``/``world_size``. A DataLoader
rebuilt over the dataset (``skip_first_batches``) raises instead.

Lightning Fabric: ``setup_dataloaders`` wraps our loader without rebuilding it; in-process with
one process, under ``torchrun`` (``tests/trainers/fabric_job.py``) with two.

CI installs both (the ``dev`` extra); outside CI a missing package skips its tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import make_loader
from _launch import free_port, launch_job
from _launch import torchrun as launch_torchrun
from conftest import TOTAL_ROWS
from trainers._common import (
    case_kinds,
    epochs_of,
    loader_of,
    packed_case,
    rows_case,
    trained_values,
)

TESTS = Path(__file__).parent
ACCELERATE_JOB = TESTS / "trainers" / "accelerate_job.py"
FABRIC_JOB = TESTS / "trainers" / "fabric_job.py"
LAUNCH_TIMEOUT = 240

Batches = list[list[int]]


def _require(module: str) -> None:
    """Skip when ``module`` is not installed, except in CI, which must run these tests."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed; CI installs it with the dev extra")
        pytest.skip(f"{module} is not installed (pip install -c constraints.txt -e '.[dev]')")


# ----------------------------------------------------------------------------- launching


def launch(cmd: list[str], job: dict[str, Any], workdir: Path) -> tuple[int, str]:
    """Run ``cmd`` + the job file; ``(return code, log)``. The whole tree dies on timeout."""
    env = {"HF_HOME": str(workdir / "hf_home")}  # no user's default accelerate config
    return launch_job(cmd, job, workdir, timeout=LAUNCH_TIMEOUT, env=env)


def accelerate_launch(nproc: int) -> list[str]:
    """``accelerate launch`` of ``ACCELERATE_JOB`` on ``nproc`` CPU processes (torchrun inside)."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", f"--num_processes={nproc}",
        "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
        "--main_process_ip=127.0.0.1", f"--main_process_port={free_port()}",
        *(["--multi_gpu", "--monitor_interval=0.2"] if nproc > 1 else []),
        str(ACCELERATE_JOB),
    ]  # fmt: skip


def torchrun(nproc: int) -> list[str]:
    """``torchrun`` of ``FABRIC_JOB`` on ``nproc`` processes."""
    return launch_torchrun(nproc, FABRIC_JOB)


def reports(workdir: Path, phase: str, nproc: int) -> list[dict[str, Any]]:
    return [json.loads((workdir / f"{phase}-rank{r}.json").read_text()) for r in range(nproc)]


def uninterrupted(case: dict[str, Any], rank: int, world_size: int) -> Batches:
    """Row ids of every batch ``rank`` delivers in the uninterrupted epoch (in-process)."""
    loader, _ = make_loader({**case, "rank": rank, "world_size": world_size})
    return [[int(i) for i in b["id"].tolist()] for b in loader]


def lost_and_repeated(parts: list[Batches]) -> tuple[int, int]:
    """Rows of the dataset never delivered, and deliveries beyond the first of a row."""
    counts = Counter(i for part in parts for batch in part for i in batch)
    return TOTAL_ROWS - len(counts), sum(n - 1 for n in counts.values())


# ----------------------------------------------------------------------------- Accelerate

WORKERS = (0, 2)


@pytest.fixture(scope="module")
def accelerate_cases(parquet_dir: Path, small_split: int) -> list[dict[str, Any]]:
    base = {"path": str(parquet_dir), "split_bytes": small_split, "batch_size": 24}
    return [
        {
            "name": f"workers{w}",
            "kwargs": {**base, "num_workers": w, "shuffle": True, "shuffle_seed": 3 + w},
            "k": 5,
            "extra": 3,
        }
        for w in WORKERS
    ]


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def accelerate_run(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    accelerate_cases: list[dict[str, Any]],
) -> dict[str, Any]:
    """``nproc`` processes: train, checkpoint, SIGKILL; relaunch and resume."""
    _require("accelerate")
    nproc: int = request.param
    workdir = tmp_path_factory.mktemp(f"accelerate{nproc}")
    start = time.monotonic()
    job = {"phase": "train", "cases": accelerate_cases, "kill": True}
    code, log = launch(accelerate_launch(nproc), job, workdir)
    assert code != 0, f"process 0 was to be killed, but the job succeeded:\n{log[-2000:]}"
    train = reports(workdir, "train", nproc)
    code, log = launch(
        accelerate_launch(nproc), {"phase": "resume", "cases": accelerate_cases}, workdir
    )
    assert code == 0, f"accelerate resume failed ({code}):\n{log[-4000:]}"
    print(f"accelerate {nproc} process(es), train + resume: {time.monotonic() - start:.1f}s")
    return {"nproc": nproc, "train": train, "resume": reports(workdir, "resume", nproc)}


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accelerate_resume_continues_the_uninterrupted_run(
    accelerate_run: dict[str, Any], accelerate_cases: list[dict[str, Any]], workers: int
) -> None:
    case = next(c for c in accelerate_cases if c["kwargs"]["num_workers"] == workers)
    name, nproc = case["name"], accelerate_run["nproc"]
    delivered: list[Batches] = []
    for rank in range(nproc):
        train = accelerate_run["train"][rank][name]
        resumed = accelerate_run["resume"][rank][name]
        assert accelerate_run["train"][rank]["world"] == [rank, nproc]
        assert train["prepared_is_loader"] and resumed["prepared_is_loader"]
        assert train["state_rank"] == rank
        full = uninterrupted(case["kwargs"], rank, nproc)
        assert len(full) > case["k"] + case["extra"]
        assert train["first"] == full[: case["k"]]
        assert train["lost"] == full[case["k"] : case["k"] + case["extra"]]
        assert resumed["len"] == len(full)  # the epoch's batches on this process
        assert resumed["batches"] == full[case["k"] :]
        delivered += [train["first"], resumed["batches"]]
    assert lost_and_repeated(delivered) == (0, 0)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_dataloader_rebuilt_from_the_dataset_raises(
    parquet_dir: Path, small_split: int, workers: int
) -> None:
    """What Accelerate's ``skip_first_batches`` and ``prepare_data_loader`` build (a DataLoader
    over ``loader.dataset``) would read ahead or leave the state unrecorded: it raises."""
    loader, dataset = make_loader(
        {"path": str(parquet_dir), "split_bytes": small_split, "num_workers": workers}
    )
    rebuilt = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    with pytest.raises(RuntimeError, match="other than the StructuredDataLoader created for it"):
        next(iter(rebuilt))
    assert sum(len(b["id"]) for b in loader) == TOTAL_ROWS  # the loader itself still works


@pytest.mark.parametrize("workers", WORKERS)
def test_accelerate_skip_first_batches_raises(
    parquet_dir: Path, small_split: int, workers: int
) -> None:
    """Accelerate's resume recipe, ``skip_first_batches(loader, n)``, rebuilds the loader."""
    _require("accelerate")
    from accelerate.data_loader import skip_first_batches

    loader, _ = make_loader(
        {"path": str(parquet_dir), "split_bytes": small_split, "num_workers": workers}
    )
    with pytest.raises(RuntimeError, match=r"Likely cause: .*skip_first_batches"):
        next(iter(skip_first_batches(loader, 2)))


# ----------------------------------------------------------------------------- Lightning Fabric


@pytest.mark.parametrize("workers", WORKERS)
def test_fabric_keeps_the_loader_and_resumes_exactly(
    parquet_dir: Path, small_split: int, tmp_path: Path, workers: int
) -> None:
    """``setup_dataloaders`` wraps our loader as it is; ``fabric.save``/``load`` of the loader
    (not of Fabric's wrapper, which has no state) continue the uninterrupted run."""
    _require("lightning_fabric")
    from lightning_fabric import Fabric

    case = {"path": str(parquet_dir), "split_bytes": small_split, "batch_size": 24}
    case |= {"num_workers": workers, "shuffle": True, "shuffle_seed": 11}
    full = uninterrupted(case, 0, 1)
    fabric = Fabric(accelerator="cpu", devices=1)
    k, extra = 4, 2

    def setup() -> tuple[Any, dict[str, Any]]:
        loader, _ = make_loader(case)
        model = torch.nn.Linear(1, 1)
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        wrapped = fabric.setup_dataloaders(loader)
        assert wrapped._dataloader is loader  # kept, not rebuilt
        return wrapped, {"model": model, "optimizer": optimizer, "data": loader}

    wrapped, state = setup()
    it = iter(wrapped)
    first = [next(it)["id"].tolist() for _ in range(k)]
    fabric.save(tmp_path / "checkpoint.pt", state)
    lost = [next(it)["id"].tolist() for _ in range(extra)]  # after the checkpoint: lost
    del it
    assert first + lost == full[: k + extra]

    wrapped, state = setup()
    fabric.load(tmp_path / "checkpoint.pt", state)
    rest = [b["id"].tolist() for b in wrapped]
    assert rest == full[k:]
    assert lost_and_repeated([first, rest]) == (0, 0)


@pytest.fixture(scope="module")
def fabric_case(parquet_dir: Path, small_split: int) -> dict[str, Any]:
    base = {"path": str(parquet_dir), "split_bytes": small_split, "batch_size": 24}
    return {**base, "num_workers": 2, "shuffle": True, "shuffle_seed": 17}


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fabric_two_processes_resume_from_a_file_per_process(
    tmp_path: Path, fabric_case: dict[str, Any]
) -> None:
    """torchrun, 2 processes x 2 workers: steps, ``fabric.save``, SIGKILL; relaunch, resume.

    ``fabric.save`` writes on process 0 only, so the loader in it holds process 0's state:
    restored from it, process 1 raises ``CheckpointMismatchError`` (nothing lost silently);
    restored from one file per process, both continue their uninterrupted runs.
    """
    _require("lightning_fabric")
    k, extra = 4, 2
    job = {"phase": "train", "case": fabric_case, "k": k, "extra": extra, "kill": True}
    code, log = launch(torchrun(2), job, tmp_path)
    assert code != 0, f"process 0 was to be killed, but the job succeeded:\n{log[-2000:]}"
    train = reports(tmp_path, "train", 2)
    code, log = launch(torchrun(2), {"phase": "resume", "case": fabric_case}, tmp_path)
    assert code == 0, f"fabric resume failed ({code}):\n{log[-4000:]}"
    resumed = reports(tmp_path, "resume", 2)
    delivered: list[Batches] = []
    for rank in range(2):
        full = uninterrupted(fabric_case, rank, 2)
        assert train[rank]["world"] == [rank, 2] and train[rank]["kept"]
        assert train[rank]["first"] + train[rank]["lost"] == full[: k + extra]
        assert resumed[rank]["per_rank"] == full[k:]
        delivered += [train[rank]["first"], resumed[rank]["per_rank"]]
    assert lost_and_repeated(delivered) == (0, 0)
    assert resumed[0]["fabric_only"] == {"batches": uninterrupted(fabric_case, 0, 2)[k:]}
    assert resumed[1]["fabric_only"] == {"error": "CheckpointMismatchError", "field": "rank"}


# ----------------------------------------------------------------------------- epochs


def readme_loop(loader: Any, epochs: int, save_after: int = -1) -> tuple[Batches, Any]:
    """The README's loop over ``epochs``: what it trains, and the state taken after batch
    ``save_after`` (1-based; -1: none)."""
    dataset, trained, saved = loader.dataset, [], None
    for epoch in range(dataset.epoch, epochs):
        if epoch != dataset.epoch:
            dataset.set_epoch(epoch)  # never for the epoch just resumed
        for batch in loader:
            trained.append(trained_values(batch))
            if len(trained) == save_after:
                saved = json.loads(json.dumps(loader.state_dict()))
    return trained, saved


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("kind", ["rows", "packed"])
def test_readme_loop_resumes_from_a_checkpoint_on_an_epochs_last_batch(
    parquet_dir: Path, small_split: int, few_tokens: Path, kind: str, workers: int
) -> None:
    """A plain loop's state taken after an epoch's last batch resumes to the empty rest of
    that epoch, and the README's loop goes on to the next: every epoch once, in order. Taken
    by a loader a trainer drives (its sampler's ``set_epoch`` called), the state says
    ``finished`` and continues with the next epoch: the README's loop trains the same."""
    kwargs = case_kinds(parquet_dir, small_split, few_tokens)[kind, workers]
    epochs = epochs_of(kwargs, epochs=3)
    full = [batch for epoch in epochs for batch in epoch]
    last = len(epochs[0]) + len(epochs[1])  # epoch 1's last batch
    trained, plain = readme_loop(loader_of(kwargs), 3, save_after=last)
    assert trained == full and "finished" not in plain
    resumed = loader_of(kwargs)
    resumed.load_state_dict(plain)
    assert resumed.dataset.epoch == 1
    assert readme_loop(resumed, 3)[0] == full[last:]
    driven = loader_of(kwargs)
    driven.sampler.set_epoch(0)  # as Lightning does
    trained, saved = readme_loop(driven, 3, save_after=last)
    assert trained == full and saved["finished"] is True
    resumed = loader_of(kwargs)
    resumed.load_state_dict(saved)
    assert resumed.dataset.epoch == 2
    assert readme_loop(resumed, 3)[0] == full[last:]
    resumed.load_state_dict(saved)  # then set_epoch(2), as before this meaning: the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.dataset.set_epoch(2)
    assert [trained_values(b) for b in resumed] == epochs[2]
    for again in (1, 2):  # a loop counting epochs from the checkpoint's (1) trains one again
        resumed.load_state_dict(saved)
        if again == 2:
            list(resumed)
        with pytest.warns(UserWarning, match=rf"set_epoch\({again}\) trains epoch {again} again"):
            resumed.dataset.set_epoch(again)


def test_a_trainers_epoch_moves_the_loader_forward_only(
    parquet_dir: Path, small_split: int
) -> None:
    """``loader.sampler.set_epoch(e)``, as Lightning calls it before each epoch's first batch
    (after it created the iterator: without workers too the iteration begins at the first
    ``next``), starts epoch ``e``; a resumed epoch and an earlier ``e`` (Fabric's count of
    ``iter()`` calls in a resumed process) are left alone."""
    kwargs = rows_case(parquet_dir, small_split, 0)
    epochs = epochs_of(kwargs, epochs=3)
    loader = loader_of(kwargs)
    it = iter(loader)
    loader.sampler.set_epoch(2)
    assert [trained_values(b) for b in it] == epochs[2]
    loader = loader_of(kwargs)
    loader.load_state_dict(saved_after(kwargs, epoch=1, batches=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "set_epoch after load_state_dict discards ..."
        loader.sampler.set_epoch(0)
        loader.sampler.set_epoch(1)
    assert [trained_values(b) for b in loader] == epochs[1][4:]
    assert loader.dataset.epoch == 1


@pytest.mark.parametrize(
    ("workers", "ahead", "persistent"),
    [(0, 1, False), (2, 1, False), (2, 2, False), (2, 1, True)],
    ids=["w0", "w2", "w2-ahead2", "w2-persistent"],
)
def test_a_trainers_epoch_after_batches_taken_unread_restarts_under_them(
    few_tokens: Path, workers: int, ahead: int, persistent: bool
) -> None:
    """Lightning resumed from an epoch-end checkpoint with a loader without ``len()`` takes a
    batch of epoch 0 (its fetcher reads one ahead), then calls ``sampler.set_epoch(1)``: the
    iteration restarts in epoch 1 under the batch held unread, refilled in place with epoch
    1's first. The loop trains epoch 1 exactly, counted by ``stats()``; a state taken in it
    resumes exactly. Before, ``set_epoch`` raised ``RuntimeError``."""
    kwargs = {**packed_case(few_tokens, workers), "persistent_workers": persistent}
    epochs = epochs_of(kwargs, epochs=2)
    loader = loader_of(kwargs)
    it = iter(loader)
    held = [next(it) for _ in range(ahead)]  # a trainer's read-ahead, not read yet
    loader.sampler.set_epoch(1)
    trained = [trained_values(batch) for batch in held]
    for batch in it:
        trained.append(trained_values(batch))
        if len(trained) == 5:
            state, stats = json.loads(json.dumps(loader.state_dict())), loader.stats()
    assert trained == epochs[1] and trained[0] != epochs[0][0]
    assert stats.since_start.batches == 5
    assert stats.since_start.tokens == sum(len(values) for values in trained[:5])
    resumed = loader_of(kwargs)
    resumed.load_state_dict(state)
    assert resumed.dataset.epoch == 1
    assert [trained_values(batch) for batch in resumed] == epochs[1][5:]


def test_a_trainers_epoch_after_batches_not_dicts_taken_raises(
    parquet_dir: Path, small_split: int
) -> None:
    """A batch that is not a dict (``output="arrow"``) cannot be refilled: the iterator that
    handed it out raises at its next ``next()`` instead of training epoch 0 as epoch 1. An
    iterator made after ``set_epoch`` trains epoch 1. Before, the old one trained epoch 0."""
    kwargs = {**rows_case(parquet_dir, small_split, 0), "output": "arrow"}
    loader = loader_of(kwargs)
    it = iter(loader)
    next(it)
    loader.sampler.set_epoch(1)
    with pytest.raises(RuntimeError, match="after it took batches of epoch 0 ahead") as raised:
        next(it)
    assert "not dicts" in str(raised.value) and "every_n_train_steps" in str(raised.value)
    ids = [batch.column("id").to_pylist() for batch in loader]
    assert ids == epochs_of(rows_case(parquet_dir, small_split, 0), epochs=2)[1]


def saved_after(kwargs: dict[str, Any], *, epoch: int, batches: int) -> dict[str, Any]:
    """The state after ``batches`` batches of ``epoch``."""
    loader = loader_of(kwargs)
    loader.dataset.set_epoch(epoch)
    it = iter(loader)
    for _ in range(batches):
        trained_values(next(it))
    return loader.state_dict()
