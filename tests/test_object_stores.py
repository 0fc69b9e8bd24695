"""The exactness suite on every object store: S3 (moto), GCS (gcp-storage-emulator) and Azure
Blob (Azurite), all on 127.0.0.1 (``_cloudservers``).

Every test builds datasets over the backend's URLs through its fsspec filesystem with
``storage_options``, exactly as users do: a full epoch delivers every row once, a checkpoint
resumes exactly in a new dataset (shuffled, at a random batch, num_workers 0 and 2, so forked
workers rebuild the filesystem), an object overwritten at the same key with other values is
drift (its footer), a checkpoint moves between backends and a local copy, and an epoch fetches
at most 1.10 x the stored bytes of the columns it reads.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import _harness
import pyarrow.parquet as pq
import pytest
from _cloudservers import (  # noqa: F401
    Store,
    azure_options,
    azurite_fixture,
    gcs_emulator_fixture,
    gcs_options,
    store_fixture,
)
from _data import rows_table, write_dataset
from _s3server import FAKE_KEY, FAKE_SECRET, S3Env, s3_fixture, s3_server_fixture  # noqa: F401

from torch_dataloader_utils import CheckpointMismatchError, DataSourceError, StructuredDataset
from torch_dataloader_utils.storage.filesystem import Storage
from torch_dataloader_utils.storage.secrets import Redactor, secret_values

ROWS = (90, 60, 110)  # 260 rows in row groups of 10: 26 row groups over 3 objects
TOTAL = sum(ROWS)


@pytest.fixture(autouse=True)
def _private_index_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "index-cache"))


@pytest.fixture
def local_data(tmp_path: Path) -> Path:
    """Three Parquet files with ids 0..259 in row groups of 10 (and a _SUCCESS)."""
    write_dataset(tmp_path / "src", ROWS, row_group_size=10)
    (tmp_path / "src" / "_SUCCESS").write_bytes(b"")
    return tmp_path / "src"


@pytest.fixture
def dataset_url(store: Store, local_data: Path) -> str:
    """``<scheme>://<bucket>/data`` holding the files of ``local_data``."""
    for path in sorted(local_data.iterdir()):
        store.put_bytes(f"data/{path.name}", path.read_bytes())
    return store.url("data")


def _case(store: Store, url: str, **kw: Any) -> dict[str, Any]:
    options = store.options
    return {"path": url, "storage_options": options, "batch_size": 16, "split_bytes": 1, **kw}


def test_full_epoch_delivers_every_row_once(store: Store, dataset_url: str):
    case = _case(store, dataset_url, shuffle=True)
    batches = _harness.run_epoch(case)
    assert sorted(_harness.ids(batches)) == list(range(TOTAL))
    first = batches[0]
    assert first["x"][1] == [i * 0.5 for i in first["id"][1]]
    assert first["name"][1] == [f"r{i}" for i in first["id"][1]]


def test_plain_dataloader_with_forked_workers(store: Store, dataset_url: str):
    import torch.utils.data

    dataset = StructuredDataset(dataset_url, batch_size=32, storage_options=store.options)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    got = sorted(int(i) for batch in loader for i in batch["id"])
    assert got == list(range(TOTAL))


@pytest.mark.parametrize(("num_workers", "shuffle"), [(0, True), (2, True), (0, False)])
def test_resume_is_exact_in_a_new_dataset(
    store: Store, dataset_url: str, num_workers: int, shuffle: bool
):
    k = random.Random(f"{store.name} {num_workers} {shuffle}").randrange(1, TOTAL // 16)
    case = _case(store, dataset_url, shuffle=shuffle, shuffle_seed=3, num_workers=num_workers)
    state = _harness.assert_resume_exact(case, k)
    assert state["files"]["root"] == dataset_url  # names are relative to it
    assert all(e[3].startswith("part-0000") for e in state["streams"] if e and len(e) == 8)


def test_resume_with_projection_after_epoch_end(store: Store, dataset_url: str):
    case = _case(store, dataset_url, columns=["id", "name"], batch_size=50)
    full = _harness.run_epoch(case)
    assert set(full[0]) == {"id", "name"}
    state, _ = _harness.checkpoint_after(case, len(full))
    assert _harness.resume(case, state) == []


def test_overwritten_object_is_drift_through_its_footer(store: Store, dataset_url: str):
    case = _case(store, dataset_url)
    state, _ = _harness.checkpoint_after(case, 3)
    # Same key, size and row-group layout, other values: the footer's statistics tell.
    key = "data/part-00001.parquet"
    old = store.fs().info(store.url(key))
    store.put_table(key, rows_table(1000, ROWS[1]), row_group_size=10)
    new = store.fs().info(store.url(key))
    assert new != old  # another version tag
    loader, _ = _harness.make_loader(case)
    with pytest.raises(CheckpointMismatchError) as info:
        loader.load_state_dict(state)
    assert "part-00001.parquet" in str(info.value) and dataset_url in str(info.value)


def test_credentials_never_in_state_logs_or_errors(
    store: Store, dataset_url: str, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG, logger="torch_dataloader_utils")
    loader, dataset = StructuredDataset.create_dataloader(
        dataset_url, batch_size=16, storage_options=store.options, split_bytes=1
    )
    it = iter(loader)
    next(it)
    state_text = json.dumps(loader.state_dict())
    del it
    # The object disappears after planning: the read error names it, without credentials.
    store.fs().rm(store.url("data/part-00000.parquet"))
    with pytest.raises(DataSourceError) as info:
        list(loader)
    message = str(info.value)
    assert store.url("data/part-00000.parquet") in message
    secrets = secret_values(store.options)
    assert secrets
    for text in (state_text, message, caplog.text, repr(dataset.state_dict())):
        assert not any(secret in text for secret in secrets)


def test_missing_prefix_and_bucket_name_the_path(store: Store, dataset_url: str):
    with pytest.raises(FileNotFoundError, match=f"{store.url('nothing')}$"):
        StructuredDataset(store.url("nothing"), storage_options=store.options)
    with pytest.raises(FileNotFoundError, match="no data files under"):
        StructuredDataset(store.url("data/_SUCCESS*"), storage_options=store.options)


def test_second_build_reads_no_footers(
    store: Store, dataset_url: str, monkeypatch: pytest.MonkeyPatch
):
    from torch_dataloader_utils.index import build as _build

    StructuredDataset(dataset_url, storage_options=store.options)
    calls: list[str] = []
    original = _build._read_metadata
    monkeypatch.setattr(
        _build, "_read_metadata", lambda st, fmt, e: calls.append(e.path) or original(st, fmt, e)
    )
    dataset = StructuredDataset(dataset_url, storage_options=store.options, batch_size=64)
    assert calls == []
    assert sorted(int(i) for b in dataset for i in b["id"]) == list(range(TOTAL))


def _stored_bytes(local: Path, columns: set[str] | None) -> int:
    """Compressed bytes of ``columns`` (all when ``None``) in the files of ``local``."""
    total = 0
    for path in sorted(local.glob("*.parquet")):
        meta = pq.ParquetFile(path).metadata
        for r in range(meta.num_row_groups):
            group = meta.row_group(r)
            chunks = (group.column(c) for c in range(group.num_columns))
            total += sum(
                c.total_compressed_size
                for c in chunks
                if columns is None or c.path_in_schema in columns
            )
    return total


def test_an_epoch_fetches_at_most_110_percent_of_the_stored_bytes(
    store: Store, dataset_url: str, local_data: Path, monkeypatch: pytest.MonkeyPatch
):
    from torch_dataloader_utils.storage import remote as _remote

    fetched: list[int] = []
    original = _remote.RemoteObject.get

    def counting(self: Any, start: int, stop: int) -> bytes:
        fetched.append(stop - start)
        return original(self, start, stop)

    monkeypatch.setattr(_remote.RemoteObject, "get", counting)
    for columns in (None, ["id"]):
        dataset = StructuredDataset(dataset_url, storage_options=store.options, columns=columns)
        fetched.clear()  # after indexing: the footers are read once per dataset, not per epoch
        assert sorted(int(i) for b in dataset for i in b["id"]) == list(range(TOTAL))
        stored = _stored_bytes(local_data, None if columns is None else set(columns))
        assert stored <= sum(fetched) <= 1.10 * stored, (columns, sum(fetched), stored)


def test_a_checkpoint_moves_between_gcs_azure_s3_and_a_local_copy(
    s3: S3Env, gcs_emulator: str, azurite: str, local_data: Path
):
    stores = [
        Store("gcs", "gs", "tdu-portable", gcs_emulator, gcs_options(gcs_emulator)),
        Store("azure", "abfs", "tdu-portable", azurite, azure_options(azurite)),
        Store("s3", "s3", s3.bucket, s3.endpoint, s3.options),
    ]
    cases = []
    for store in stores:
        if store.name != "s3":
            store.fs().mkdir(store.bucket)
        for path in sorted(local_data.glob("*.parquet")):
            store.put_bytes(f"train/{path.name}", path.read_bytes())
        cases.append({**_case(store, store.url("train")), "shuffle": True})
    cases.append({"path": str(local_data), "batch_size": 16, "split_bytes": 1, "shuffle": True})
    full = _harness.run_epoch(cases[0])
    moves = zip(cases, [*cases[1:], cases[0]], strict=True)
    for k, (here, there) in enumerate(moves, start=3):
        state, first = _harness.checkpoint_after(here, k)
        assert first == full[:k]
        assert _harness.resume(there, state) == full[k:], (here["path"], there["path"])


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


@pytest.mark.gcs
@pytest.mark.azure
def test_index_cache_namespaces_name_the_endpoint_and_account(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("gcsfs")
    pytest.importorskip("adlfs")

    def azure(account: str, endpoint: str) -> dict[str, Any]:
        blob = f"BlobEndpoint={endpoint}/{account};AccountName={account};AccountKey=a2V5"
        return {"connection_string": blob}

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    google = Storage("gs://b/x", {"token": "anon"}).namespace
    emulator = Storage("gs://b/x", gcs_options("http://127.0.0.1:4443")).namespace
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4444")
    by_env = Storage("gs://b/x", {"token": "anon"}).namespace
    first = Storage("abfs://c/x", azure("acct1", "http://127.0.0.1:10000")).namespace
    second = Storage("abfs://c/x", azure("acct2", "http://127.0.0.1:10000")).namespace
    real = Storage("abfs://c/x", {"account_name": "acct1", "account_key": "a2V5"}).namespace
    assert google == "gs at=https://storage.googleapis.com"
    assert emulator.startswith("gs at=http://127.0.0.1:4443")
    assert by_env == "gs at=http://127.0.0.1:4444"
    assert first == "abfs at=http://127.0.0.1:10000/acct1/"
    assert second == "abfs at=http://127.0.0.1:10000/acct2/"
    assert real.startswith("abfs at=https://acct1.blob.core.windows.net/")
    assert "a2V5" not in first + second + real  # no secret in a cache key
