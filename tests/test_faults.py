"""Transient S3 faults are retried; persistent ones raise an error naming the object and split.

A fault-injecting proxy (``_faultproxy``) sits on 127.0.0.1 between s3fs and the moto server
and answers some requests with 503s, connection resets, truncated bodies or stalls. botocore's
own retries are switched off (``max_attempts: 1``) and its timeouts kept short, so the
library's retry layer is what recovers, and the tests stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _harness
import pytest
from _data import write_dataset
from _faultproxy import FaultProxy, every, on_key
from _s3server import FAKE_KEY, FAKE_SECRET, S3Env, s3_fixture, s3_server_fixture, storage_options  # noqa: F401

from torch_dataloader_utils import DataSourceError, StructuredDataset
from torch_dataloader_utils.storage.retry import RetryPolicy, is_transient, retry_call

pytestmark = pytest.mark.s3

ROWS = (60, 40, 70)
TOTAL = sum(ROWS)


@pytest.fixture(autouse=True)
def _fast_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "index-cache"))
    monkeypatch.setenv("TDU_RETRY_ATTEMPTS", "6")
    monkeypatch.setenv("TDU_RETRY_BASE_DELAY", "0.01")
    monkeypatch.setenv("TDU_RETRY_MAX_DELAY", "0.1")


@pytest.fixture
def data(s3: S3Env, tmp_path: Path) -> S3Env:
    for path in write_dataset(tmp_path / "src", ROWS, row_group_size=10):
        s3.put_bytes(f"data/{Path(path).name}", Path(path).read_bytes())
    return s3


def _options(proxy: FaultProxy) -> dict[str, Any]:
    # No botocore retries, short timeouts: recovering is the library's job here.
    return storage_options(
        proxy.endpoint, retries={"max_attempts": 1, "mode": "standard"}, read_timeout=1
    )


def _case(options: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {
        "path": "s3://tdu-test/data",
        "storage_options": options,
        "batch_size": 16,
        "split_bytes": 1,
        "shuffle": True,
        **kw,
    }


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epoch_under_transient_faults_equals_the_clean_epoch(data: S3Env, num_workers: int):
    clean = _harness.run_epoch(_case(data.options, num_workers=num_workers))
    assert sorted(_harness.ids(clean)) == list(range(TOTAL))
    schedule = every(3, ["503", "reset", "truncate", "slowdown"], methods=("GET", "HEAD"))
    with FaultProxy(data.endpoint, schedule) as proxy:
        faulty = _harness.run_epoch(_case(_options(proxy), num_workers=num_workers))
    assert faulty == clean  # every row once, same batches, same order
    assert sum(proxy.faults.values()) >= 4, proxy.faults


def test_resume_under_faults_is_exact(data: S3Env):
    case = _case(data.options)
    full = _harness.run_epoch(case)
    state, _ = _harness.checkpoint_after(case, 4)
    with FaultProxy(data.endpoint, every(2, ["reset", "503"])) as proxy:
        rest = _harness.resume(_case(_options(proxy)), state)
    assert rest == full[4:]
    assert proxy.faults


def test_a_stalled_read_times_out_and_is_retried(data: S3Env):
    done: list[str] = []

    def once(number: int, method: str, path: str) -> str:
        if method == "GET" and "part-00001" in path and not done:
            done.append(path)
            return "stall"
        return "ok"

    with FaultProxy(data.endpoint, once, stall_seconds=1.5) as proxy:
        dataset = StructuredDataset(
            "s3://tdu-test/data", storage_options=_options(proxy), batch_size=50
        )
        got = sorted(int(i) for batch in dataset for i in batch["id"])
    assert got == list(range(TOTAL))
    assert proxy.faults["stall"] == 1


def test_persistent_failure_names_the_object_and_split(data: S3Env):
    broken: list[bool] = []  # the object fails once the dataset is built

    def schedule(number: int, method: str, path: str) -> str:
        return (
            "503"
            if broken and on_key("part-00001.parquet", "503")(number, method, path) != "ok"
            else "ok"
        )

    with FaultProxy(data.endpoint, schedule) as proxy:
        dataset = StructuredDataset(
            "s3://tdu-test/data", storage_options=_options(proxy), batch_size=16
        )
        broken.append(True)
        with pytest.raises(DataSourceError) as info:
            list(dataset)
    message = str(info.value)
    assert "s3://tdu-test/data/part-00001.parquet rows [" in message  # the split
    assert "bytes [" in message and "after 6 attempts" in message  # the range, the retries
    assert FAKE_KEY not in message and FAKE_SECRET not in message
    assert proxy.faults["503"] >= 6  # every attempt was made


def test_persistent_failure_while_indexing_names_the_object(data: S3Env):
    expected = r"s3://tdu-test/data/part-00002\.parquet"
    with (
        FaultProxy(data.endpoint, on_key("part-00002.parquet", "reset")) as proxy,
        pytest.raises(DataSourceError, match=expected),
    ):
        StructuredDataset("s3://tdu-test/data", storage_options=_options(proxy))


def test_missing_object_is_not_retried():
    calls: list[int] = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("no such key: s3://b/k")

    with pytest.raises(FileNotFoundError):
        retry_call(missing, RetryPolicy(attempts=5, base_delay=0))
    assert calls == [1]


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (OSError(5, "An error occurred (SlowDown): Please reduce your request rate."), True),
        (OSError("An error occurred (503) when calling the GetObject operation"), True),
        (PermissionError("Access Denied"), False),
        (FileNotFoundError("NoSuchKey"), False),
        (ValueError("bad range"), False),
    ],
)
def test_transient_classification(exc: BaseException, transient: bool):
    assert is_transient(exc) is transient


def test_backoff_is_bounded_exponential_with_jitter():
    policy = RetryPolicy(attempts=8, base_delay=0.1, max_delay=1.0)
    slept: list[float] = []
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 8:
            raise ConnectionResetError("reset")
        return "ok"

    assert retry_call(flaky, policy, sleep=slept.append) == "ok"
    ceilings = [min(1.0, 0.1 * 2**n) for n in range(7)]
    assert len(slept) == 7 and all(0 <= s <= c for s, c in zip(slept, ceilings, strict=True))
