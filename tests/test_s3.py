"""The exactness suite against a real S3 endpoint (moto's server on 127.0.0.1) and memory://.

Every test builds datasets over ``s3://`` paths through s3fs with ``storage_options`` (endpoint
and fake credentials), exactly as users do: a full epoch delivers every row once, a checkpoint
resumes exactly in a new dataset (num_workers 0 and 2, so forked workers rebuild the
filesystem), and an object overwritten at the same key with other values is drift (its footer).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import _harness
import pytest
from _data import rows_table, write_dataset
from _s3server import FAKE_KEY, FAKE_SECRET, S3Env, s3_fixture, s3_server_fixture  # noqa: F401

from torch_dataloader_utils import CheckpointMismatchError, DataSourceError, StructuredDataset
from torch_dataloader_utils._secrets import Redactor, secret_values
from torch_dataloader_utils._storage import Storage

pytestmark = pytest.mark.s3

ROWS = (90, 60, 110)  # 260 rows in row groups of 10: 26 row groups over 3 objects
TOTAL = sum(ROWS)


@pytest.fixture(autouse=True)
def _private_index_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "index-cache"))


@pytest.fixture
def dataset_url(s3: S3Env, tmp_path: Path) -> str:
    """``s3://tdu-test/data`` holding three Parquet objects with ids 0..259 (and a _SUCCESS)."""
    for path in write_dataset(tmp_path / "src", ROWS, row_group_size=10):
        s3.put_bytes(f"data/{Path(path).name}", Path(path).read_bytes())
    s3.put_bytes("data/_SUCCESS", b"")
    return s3.url("data")


def _case(s3: S3Env, url: str, **kw: Any) -> dict[str, Any]:
    return {"path": url, "storage_options": s3.options, "batch_size": 16, "split_bytes": 1, **kw}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_full_epoch_delivers_every_row_once(s3: S3Env, dataset_url: str, num_workers: int):
    case = _case(s3, dataset_url, shuffle=True, num_workers=num_workers)
    batches = _harness.run_epoch(case)
    assert sorted(_harness.ids(batches)) == list(range(TOTAL))
    first = batches[0]
    assert first["x"][1] == [i * 0.5 for i in first["id"][1]]
    assert first["name"][1] == [f"r{i}" for i in first["id"][1]]


def test_plain_dataloader_with_forked_workers(s3: S3Env, dataset_url: str):
    import torch.utils.data

    dataset = StructuredDataset(dataset_url, batch_size=32, storage_options=s3.options)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    got = sorted(int(i) for batch in loader for i in batch["id"])
    assert got == list(range(TOTAL))


@pytest.mark.parametrize(("num_workers", "k"), [(0, 5), (2, 7)])
def test_resume_is_exact_in_a_new_dataset(s3: S3Env, dataset_url: str, num_workers: int, k: int):
    case = _case(s3, dataset_url, shuffle=True, shuffle_seed=3, num_workers=num_workers)
    state = _harness.assert_resume_exact(case, k)
    assert state["files"]["root"] == "s3://tdu-test/data"  # names are relative to it
    assert all(entry[0].startswith("part-0000") for entry in state["partial"])


def test_resume_with_projection_after_epoch_end(s3: S3Env, dataset_url: str):
    case = _case(s3, dataset_url, columns=["id", "name"], batch_size=50)
    full = _harness.run_epoch(case)
    assert set(full[0]) == {"id", "name"}
    state, _ = _harness.checkpoint_after(case, len(full))
    assert _harness.resume(case, state) == []


def test_overwritten_object_is_drift_through_its_footer(s3: S3Env, dataset_url: str):
    case = _case(s3, dataset_url)
    state, _ = _harness.checkpoint_after(case, 3)
    # Same key, size and row-group layout, other values: the footer's statistics tell.
    import io

    import pyarrow.parquet as pq

    table = rows_table(1000, ROWS[1])
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=10)
    old = s3.fs().info(s3.url("data/part-00001.parquet"))
    s3.put_bytes("data/part-00001.parquet", buffer.getvalue())
    new = s3.fs().info(s3.url("data/part-00001.parquet"))
    assert new["ETag"] != old["ETag"]
    loader, _ = _harness.make_loader(case)
    with pytest.raises(CheckpointMismatchError) as info:
        loader.load_state_dict(state)
    assert "part-00001.parquet" in str(info.value) and "s3://tdu-test/data" in str(info.value)


def test_credentials_never_in_state_logs_or_errors(
    s3: S3Env, dataset_url: str, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG, logger="torch_dataloader_utils")
    loader, dataset = StructuredDataset.create_dataloader(
        dataset_url, batch_size=16, storage_options=s3.options, split_bytes=1
    )
    it = iter(loader)
    next(it)
    state_text = json.dumps(loader.state_dict())
    del it
    # The object disappears after planning: the read error names it, without credentials.
    s3.fs().rm(s3.url("data/part-00000.parquet"))
    with pytest.raises(DataSourceError) as info:
        list(loader)
    message = str(info.value)
    assert "s3://tdu-test/data/part-00000.parquet" in message
    for text in (state_text, message, caplog.text, repr(dataset.state_dict())):
        assert FAKE_KEY not in text
        assert FAKE_SECRET not in text


def test_storage_redacts_secrets_from_its_messages():
    options = {
        "key": "AKIAXYZXYZ",
        "secret": "s3cr3t-value",
        "client_kwargs": {"aws_session_token": "tok-123", "region_name": "us-east-1"},
    }
    assert set(secret_values(options)) == {"AKIAXYZXYZ", "s3cr3t-value", "tok-123"}
    storage = Storage("memory://x", {})
    storage.redact = Redactor(secret_values(options))
    message = storage.redact("denied for AKIAXYZXYZ with s3cr3t-value/tok-123 in us-east-1")
    assert message == "denied for *** with ***/*** in us-east-1"


def test_missing_prefix_and_bucket_name_the_path(s3: S3Env, dataset_url: str):
    with pytest.raises(FileNotFoundError, match="s3://tdu-test/nothing"):
        StructuredDataset(s3.url("nothing"), storage_options=s3.options)


def test_second_build_reads_no_footers_from_s3(
    s3: S3Env, dataset_url: str, monkeypatch: pytest.MonkeyPatch
):
    from torch_dataloader_utils import _index

    StructuredDataset(dataset_url, storage_options=s3.options)
    calls: list[str] = []
    original = _index._read_metadata
    monkeypatch.setattr(
        _index, "_read_metadata", lambda st, fmt, e: calls.append(e.path) or original(st, fmt, e)
    )
    dataset = StructuredDataset(dataset_url, storage_options=s3.options, batch_size=64)
    assert calls == []
    assert sorted(int(i) for b in dataset for i in b["id"]) == list(range(TOTAL))


def test_reads_fetch_only_projected_columns(s3: S3Env, dataset_url: str):
    from torch_dataloader_utils import _remote

    fetched: list[int] = []
    original = _remote.RemoteObject.get

    def counting(self: Any, start: int, stop: int) -> bytes:
        fetched.append(stop - start)
        return original(self, start, stop)

    _remote.RemoteObject.get = counting  # type: ignore[method-assign]
    try:
        full = StructuredDataset(dataset_url, storage_options=s3.options, batch_size=64)
        list(full)
        all_columns = sum(fetched)
        fetched.clear()
        narrow = StructuredDataset(dataset_url, storage_options=s3.options, columns=["id"])
        list(narrow)
        id_only = sum(fetched)
    finally:
        _remote.RemoteObject.get = original  # type: ignore[method-assign]
    assert 0 < id_only < all_columns / 2
