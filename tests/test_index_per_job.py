"""One index per job: under torch.distributed, rank 0 reads the footers and the others receive it.

A real ``torchrun`` launch of 4 ranks (gloo on 127.0.0.1, ``tests/ddp/index_job.py``) builds
datasets over moto S3 through a proxy that logs every request, so GETs are counted where S3
would bill them. Cold start (index cache off): each object's footer is fetched once per job,
not once per rank. The rest of the file tests ``from_rank_zero`` without a launch.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from _data import rows_table, write_dataset
from _faultproxy import FaultProxy
from _launch import run_logged, torchrun
from _s3server import S3Env, s3_fixture, s3_server_fixture, storage_options  # noqa: F401

from torch_dataloader_utils.checkpoint import distributed as _distributed
from torch_dataloader_utils.checkpoint.distributed import spans_process_group
from torch_dataloader_utils.formats import get_format
from torch_dataloader_utils.index.build import build_index
from torch_dataloader_utils.index.index import DatasetIndex
from torch_dataloader_utils.storage.filesystem import Storage

TESTS = Path(__file__).parent
JOB_SCRIPT = TESTS / "ddp" / "index_job.py"
RANKS = 4
FILES = 8
ROWS = 40  # per file, row groups of 10


def _torchrun(job: dict[str, Any], workdir: Path, pythonpath: str) -> None:
    """Launch ``index_job.py`` on ``RANKS`` local ranks; the tree dies on timeout."""
    job_file = workdir / "job.json"
    job_file.write_text(json.dumps({**job, "dir": str(workdir)}))
    code, log = run_logged(
        [*torchrun(RANKS, JOB_SCRIPT), str(job_file)],
        log_file=workdir / "torchrun.log",
        cwd=workdir,
        pythonpath=[pythonpath, str(TESTS)],
        timeout=240,
        env={"TDU_INDEX_CACHE": "0"},  # a cold start: every footer from storage
    )
    assert code == 0, f"torchrun failed ({code}):\n{log[-4000:]}"


def launch(s3: S3Env, workdir: Path, pythonpath: str) -> tuple[dict[str, Counter[str]], list[Any]]:
    """Requests per step (``"GET object"``, ``"GET list"``, ``"HEAD"``) and each rank's report."""
    for path in write_dataset(workdir / "src", [ROWS] * FILES, row_group_size=10):
        s3.put_bytes(f"data/{Path(path).name}", Path(path).read_bytes())
    s3.put_table("mismatch/a.parquet", rows_table(0, 10), row_group_size=10)
    s3.put_table("mismatch/b.parquet", pa.table({"id": [1.5]}), row_group_size=10)
    logged: list[tuple[str, str]] = []
    lock = threading.Lock()

    def record(number: int, method: str, path: str) -> str:
        with lock:
            logged.append((method, path))
        return "ok"

    with FaultProxy(s3.endpoint, record) as proxy:
        job = {
            "url": s3.url("data"), "mismatch_url": s3.url("mismatch"), "bucket": s3.bucket,
            "options": storage_options(proxy.endpoint),
        }  # fmt: skip
        _torchrun(job, workdir, pythonpath)
    steps: dict[str, Counter[str]] = {}
    step = "setup"
    for method, path in logged:
        marker = re.search(r"marker-(\w+)", path)  # the HEAD of a marker, or s3fs's LIST of it
        if marker:
            step = marker.group(1)
            continue
        kind = "HEAD" if method == "HEAD" else f"{method} {'list' if '?' in path else 'object'}"
        steps.setdefault(step, Counter())[kind] += 1
    reports = [json.loads((workdir / f"index-rank{r}.json").read_text()) for r in range(RANKS)]
    return steps, reports


@pytest.mark.s3
@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_footers_are_fetched_once_per_job(s3: S3Env, tmp_path: Path):
    worktree = str(Path(__file__).parent.parent)
    steps, reports = launch(s3, tmp_path, worktree)
    print("requests per step at 4 ranks:", {k: dict(v) for k, v in steps.items()})
    # Rank 0 reads each object's footer with one GET; the other ranks only list.
    assert steps["index"]["GET object"] == FILES
    assert steps["index"]["GET list"] <= 2 * RANKS and "HEAD" not in steps["index"]
    assert {r["digest"] for r in reports} == {reports[0]["digest"]}
    assert [r["files"] for r in reports] == [FILES] * RANKS
    # The received index reads: every row once across the ranks (even_batches may leave out
    # fewer than 4 rows).
    ids = [i for r in reports for i in r["ids"]]
    assert len(ids) == len(set(ids)) and len(ids) > FILES * ROWS - RANKS
    # Ranks that project other columns than rank 0 index for themselves.
    assert steps["columns"]["GET object"] == FILES * RANKS
    assert [r["columns"] for r in reports] == [["id", "x", "label", "name"]] + [["id"]] * 3
    # An error while rank 0 indexes is raised on every rank (none waits for the others).
    assert steps["mismatch"]["GET object"] == 2
    assert {r["mismatch"][0] for r in reports} == {"SchemaMismatchError"}
    assert all("b.parquet" in r["mismatch"][1] for r in reports)
    # Without share_index a dataset is no collective: rank 0 builds one alone, not waiting.
    assert reports[0]["alone"] == FILES and steps["alone"]["GET object"] == FILES


# ----------------------------------------------------------------------------- without torchrun


def test_no_process_group_means_no_collective():
    assert not spans_process_group(0, 1)
    assert not spans_process_group(0, 4)  # RANK/WORLD_SIZE without init_process_group


def test_warm_caches_on_every_rank_skip_the_broadcast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "cache"))
    write_dataset(tmp_path / "data", [30, 20], row_group_size=10)
    storage, fmt = Storage(str(tmp_path)), get_format("parquet")
    asked: list[bool] = []
    broadcasts: list[object] = []

    class OneRank:  # the collectives of a job of one rank, recorded
        def on_every_rank(self, flag: bool) -> bool:
            asked.append(flag)
            return flag

        def from_rank_zero(self, compute: Any) -> Any:
            broadcasts.append(compute)
            return compute()

    def build() -> DatasetIndex:
        return build_index(storage, fmt, str(tmp_path / "data"), None, 2**30, job=OneRank())

    cold = build()
    assert (asked, len(broadcasts)) == ([False], 1)  # cold: rank 0 builds, the index travels
    warm = build()
    assert (asked, len(broadcasts)) == ([False, True], 1)  # warm everywhere: no broadcast
    assert warm.digest == cold.digest and warm.splits == cold.splits


def test_from_rank_zero_sends_values_and_errors(monkeypatch: pytest.MonkeyPatch):
    sent: list[Any] = []

    def broadcast(payload: list[Any], src: int) -> None:
        assert src == 0
        sent.append(payload[0])

    monkeypatch.setattr(_distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(_distributed.dist, "broadcast_object_list", broadcast)
    assert _distributed.from_rank_zero(lambda: {"a": 1}) == {"a": 1}

    def fails() -> None:
        raise FileNotFoundError("no such file, directory or prefix: s3://b/x")

    with pytest.raises(FileNotFoundError, match="s3://b/x"):
        _distributed.from_rank_zero(fails)
    with pytest.raises(RuntimeError, match="cannot send its generator"):
        _distributed.from_rank_zero(lambda: (i for i in range(3)))
    # What the other ranks receive and raise: the same values and errors.
    monkeypatch.setattr(_distributed.dist, "get_rank", lambda: 1)
    received = iter(sent)

    def receive(payload: list[Any], src: int) -> None:
        payload[0] = next(received)

    monkeypatch.setattr(_distributed.dist, "broadcast_object_list", receive)
    assert _distributed.from_rank_zero(lambda: pytest.fail("only rank 0 computes")) == {"a": 1}
    with pytest.raises(FileNotFoundError, match="s3://b/x"):
        _distributed.from_rank_zero(lambda: None)
    with pytest.raises(RuntimeError, match="cannot send its generator"):
        _distributed.from_rank_zero(lambda: None)
