"""``loader.stats().processes``: where each process's reading time goes, exact counts of what
the workers sent and of what storage served, and the verdict each slow stage gets."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from _data import write_dataset, write_token_documents
from _launch import run_logged, torchrun
from fsspec.implementations.memory import MemoryFileSystem

from torch_dataloader_utils import StructuredDataLoader, StructuredDataset, TokenPacking
from torch_dataloader_utils.api.stage_stats import StageStats


def _loader(path: str | Path, workers: int, **kwargs: Any) -> StructuredDataLoader:
    options = {"persistent_workers": False} if workers else {}
    return StructuredDataLoader(
        StructuredDataset(str(path), **kwargs), num_workers=workers, **options
    )


def _total(stages: list[StageStats], name: str) -> float:
    return sum(getattr(s, name) for s in stages)


@pytest.fixture
def memory_dataset(tmp_path: Path) -> Iterator[str]:
    """``memory://<unique>/train``: 3 files of 400 rows in row groups of 50."""
    fs = fsspec.filesystem("memory")
    root = f"/{uuid.uuid4().hex}"
    for path in write_dataset(tmp_path / "src", [400, 400, 400], row_group_size=50):
        fs.pipe_file(f"{root}/train/{Path(path).name}", Path(path).read_bytes())
    yield f"memory://{root}/train"
    fs.rm(root, recursive=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_each_process_counts_what_the_loop_was_handed(tmp_path: Path, workers: int) -> None:
    write_dataset(tmp_path, [300, 200, 101], row_group_size=25)
    loader = _loader(tmp_path, workers, batch_size=32, shuffle=True)
    batches = list(loader)
    stats = loader.stats()
    names = [p.process for p in stats.processes]
    assert names == ["main"] + [f"worker {w}" for w in range(workers)]
    senders = [p.since_start for p in stats.processes[1:]] or [stats.processes[0].since_start]
    assert sum(s.rows for s in senders) == 601 == stats.since_start.rows
    assert sum(s.batches for s in senders) == len(batches) == stats.since_start.batches
    assert _total(senders, "shuffle") > 0 and _total(senders, "decode") > 0
    assert stats.processes[0].since_start.listing > 0  # this process built the index
    assert stats.queued_batches == 0  # all handed out


@pytest.mark.parametrize("workers", [0, 2])
def test_packing_time_and_packed_rows_are_counted(tmp_path: Path, workers: int) -> None:
    write_token_documents(tmp_path)
    packing = TokenPacking("tokens", seq_len=16, separator=-1)
    loader = _loader(tmp_path, workers, batch_size=4, columns=["tokens"], packing=packing)
    batches = list(loader)
    stats = loader.stats()
    senders = [p.since_start for p in stats.processes[1:]] or [stats.processes[0].since_start]
    assert sum(s.rows for s in senders) == sum(len(b["input_ids"]) for b in batches)
    assert _total(senders, "packing") > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_slow_transform_is_named_with_the_setting_to_change(tmp_path: Path, workers: int) -> None:
    write_dataset(tmp_path, [480], row_group_size=40)

    def slow(batch: dict[str, Any]) -> dict[str, Any]:
        time.sleep(0.01)
        return batch

    loader = _loader(tmp_path, workers, batch_size=16, transform=slow)
    assert sum(len(b["id"]) for b in loader) == 480  # the loop does nothing: it waits
    stats = loader.stats()
    senders = [p.since_start for p in stats.processes[1:]] or [stats.processes[0].since_start]
    assert _total(senders, "transform") >= 30 * 0.01  # 30 batches of at least 10 ms each
    assert stats.bottleneck == "transform"
    assert ("set num_workers >= 1" if workers == 0 else "raise num_workers") in stats.advice


@pytest.mark.parametrize("workers", [0, 2])
def test_bytes_requests_and_retries_are_exact(
    memory_dataset: str, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the object store served, counted by the store (in shared memory: the workers are
    forked with the patched store), equals the loader's figures; so do the retries."""
    monkeypatch.setenv("TDU_RETRY_BASE_DELAY", "0.001")
    served = multiprocessing.Value("q", 0)  # bytes, requests, failures injected
    requests = multiprocessing.Value("q", 0)
    failures = multiprocessing.Value("q", 0)
    cat_file = MemoryFileSystem.cat_file

    def counted(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        with failures.get_lock():
            if failures.value < 2 and requests.value % 2 == 0:  # 2 transient failures
                failures.value += 1
                requests.value += 1
                raise ConnectionError("connection reset by peer (injected)")
        data: bytes = cat_file(self, path, start=start, end=end, **kw)
        with served.get_lock():
            served.value += len(data)
            requests.value += 1
        return data

    loader = _loader(memory_dataset, workers, batch_size=50)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", counted)
    assert sum(len(b["id"]) for b in loader) == 1200
    processes = [p.since_start for p in loader.stats().processes]
    assert failures.value == 2
    assert sum(p.bytes_fetched for p in processes) == served.value > 0
    assert sum(p.requests for p in processes) == requests.value - 2  # those that succeeded
    assert sum(p.retries for p in processes) == 2


def test_slow_storage_is_named_with_the_setting_to_change(
    memory_dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cat_file = MemoryFileSystem.cat_file

    def slow(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        time.sleep(0.03)  # an object store far away
        data: bytes = cat_file(self, path, start=start, end=end, **kw)
        return data

    loader = _loader(memory_dataset, 0, batch_size=50)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", slow)
    assert sum(len(b["id"]) for b in loader) == 1200
    stats = loader.stats()
    main = stats.processes[0].since_start
    assert main.requests >= 3 and main.storage >= 0.03  # the first GET at least was waited for
    assert stats.bottleneck == "storage"
    assert "split_bytes" in stats.advice and "set num_workers >= 1" in stats.advice


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_reports_each_sources_rows_against_its_share(
    tmp_path: Path, workers: int
) -> None:
    """Rows of each source equal those the batches hold, mid-epoch and at its end; ``small``
    (60 rows, weight 1 of 3) cycles into its third epoch while ``big`` reads its first."""
    write_dataset(tmp_path / "big", [200, 200], row_group_size=20)
    write_dataset(tmp_path / "small", [60], row_group_size=20, start=10_000)
    options = {"persistent_workers": False} if workers else {}
    loader, _ = StructuredDataset.create_dataloader(
        {"big": str(tmp_path / "big"), "small": str(tmp_path / "small")},
        weights={"big": 2, "small": 1}, batch_size=16, shuffle=True, num_workers=workers,
        **options,
    )  # fmt: skip
    assert loader.stats().mixture == ()  # nothing handed out yet
    ids: list[int] = []
    it = iter(loader)
    for _ in range(7):
        ids += next(it)["id"].tolist()

    def check() -> tuple[Any, ...]:
        mixture = loader.stats().mixture
        by_name = {s.name: s for s in mixture}
        assert by_name["big"].rows == sum(i < 10_000 for i in ids)
        assert by_name["small"].rows == sum(i >= 10_000 for i in ids)
        assert (by_name["big"].weight, by_name["big"].share) == (2, pytest.approx(2 / 3))
        assert sum(s.delivered_share for s in mixture) == pytest.approx(1.0)
        return mixture

    mid = check()
    assert {s.name: s.epoch for s in mid}["big"] == 0
    ids += [i for batch in it for i in batch["id"].tolist()]
    end = {s.name: s for s in check()}
    assert end["big"].rows + end["small"].rows == len(ids)
    assert end["small"].rows > 120 and end["small"].epoch == end["small"].rows // 60
    assert end["big"].epoch == 0
    assert end["small"].delivered_share == pytest.approx(1 / 3, abs=0.01)


def test_gather_stats_names_the_slowest_rank_under_torchrun(tmp_path: Path) -> None:
    """2 ranks (torchrun, gloo): rank 1's transform is slow, rank 0's loop is; rank 0 receives
    both ranks' figures, rank 1 named with its verdict."""
    write_dataset(tmp_path / "data", [160, 160], row_group_size=16)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"data": str(tmp_path / "data"), "dir": str(tmp_path)}))
    script = Path(__file__).parent / "ddp" / "stats_job.py"
    code, log = run_logged(
        [*torchrun(2, script), str(job)],
        log_file=tmp_path / "torchrun.log",
        cwd=tmp_path,
        pythonpath=[str(Path(__file__).parent)],
        timeout=180,
    )
    assert code == 0, f"torchrun failed ({code}):\n{log[-4000:]}"
    gathered = json.loads((tmp_path / "stats.json").read_text())
    ranks = gathered["ranks"]
    assert [r["since_start"]["rows"] for r in ranks] == [160, 160]
    assert [r["num_workers"] for r in ranks] == [2, 2]
    # rank 0's figures vary with the load of the machine (4 workers on its cores): only less
    assert ranks[0]["recent"]["wait_fraction"] < ranks[1]["recent"]["wait_fraction"]
    assert gathered["slowest_rank"] == 1
    assert gathered["bottleneck"] == ranks[1]["bottleneck"] == "transform"
    assert gathered["advice"].startswith("rank 1: the loop waits")


def test_gather_stats_outside_a_process_group_says_what_to_do(tmp_path: Path) -> None:
    write_dataset(tmp_path, [16], row_group_size=8)
    loader = _loader(tmp_path, 0, batch_size=8)
    with pytest.raises(RuntimeError, match="gather_stats"):
        loader.gather_stats()


def test_an_info_line_every_n_seconds_when_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_dataset(tmp_path, [200], row_group_size=20)
    loader = _loader(tmp_path, 0, batch_size=10)
    with caplog.at_level(logging.INFO, logger="torch_dataloader_utils"):
        assert sum(1 for _ in loader) == 20
        assert not [r for r in caplog.records if "data: the loop waited" in r.message]
        loader.log_stats_every = 0.05
        for _ in loader:
            time.sleep(0.01)
    lines = [r.message for r in caplog.records if r.message.startswith("data: the loop waited")]
    assert 1 <= len(lines) <= 4  # 20 steps of >= 10 ms: one line per 50 ms at most
    assert "rows/s" in lines[0] and "bottleneck trainer" in lines[0]


def test_data_metrics_for_trainers(tmp_path: Path) -> None:
    write_dataset(tmp_path / "a", [60], row_group_size=20)
    write_dataset(tmp_path / "b", [60], row_group_size=20, start=100)
    loader, _ = StructuredDataset.create_dataloader(
        {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}, weights={"a": 1, "b": 1},
        batch_size=10,
    )  # fmt: skip
    rows = sum(len(b["id"]) for b in loader)
    metrics = loader.stats().metrics()
    assert all(k.startswith("data/") and isinstance(v, float) for k, v in metrics.items())
    assert metrics["data/a/delivered_share"] == pytest.approx(0.5)
    assert metrics["data/decode_seconds"] > 0
    seconds = loader.stats().recent.seconds
    assert metrics["data/rows_per_second"] == pytest.approx(rows / seconds, rel=0.2)


def test_the_hf_callback_puts_the_figures_into_the_log(tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState

    from torch_dataloader_utils.integrations.hf import DataStatsCallback

    write_dataset(tmp_path, [40], row_group_size=20)
    loader = _loader(tmp_path, 0, batch_size=10)
    list(loader)
    state = TrainerState()
    state.log_history.append({"loss": 1.0, "step": 5})
    logs: dict[str, float] = {"loss": 1.0}
    DataStatsCallback(loader).on_log(None, state, TrainerControl(), logs=logs)  # type: ignore[arg-type]
    assert logs["data/rows_per_second"] > 0 and logs["loss"] == 1.0
    assert state.log_history[-1]["data/wait_fraction"] == logs["data/wait_fraction"]


def test_the_lightning_callback_logs_every_n_steps(tmp_path: Path) -> None:
    from torch_dataloader_utils.integrations.lightning import DataStats

    write_dataset(tmp_path, [40], row_group_size=20)
    loader = _loader(tmp_path, 0, batch_size=10)
    list(loader)
    logged: list[dict[str, float]] = []

    class Module:
        def log_dict(self, metrics: dict[str, float], on_step: bool) -> None:
            assert on_step
            logged.append(metrics)

    class Trainer:
        log_every_n_steps = 2

    callback = DataStats(loader)
    for step in range(5):
        callback.on_train_batch_end(Trainer(), Module(), None, None, step)  # type: ignore[arg-type]
    assert len(logged) == 3 and logged[0]["data/rows_per_second"] > 0


def test_threads_that_ended_keep_their_seconds_and_leave_no_entry() -> None:
    """A read-ahead thread per iteration: a long job's snapshot must not grow with them."""
    import gc
    import threading

    from torch_dataloader_utils.base import stages

    def work() -> None:
        with stages.Stage(stages.PACKING):
            time.sleep(0.001)

    before, kept = stages.snapshot()[stages.PACKING], len(stages._threads)
    for _ in range(20):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    del thread
    gc.collect()
    assert len(stages._threads) <= kept
    assert stages.snapshot()[stages.PACKING] - before >= 20 * 0.001
