"""``RemoteFile``: exact ranged reads, coalesced per split, bounded read-ahead (no server needed).

The same path serves every non-local protocol, so the last tests run it over ``memory://``.
"""

from __future__ import annotations

import io
import threading
import uuid
from pathlib import Path

import _harness
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _data import rows_table, write_dataset

from torch_dataloader_utils import DataSourceError, StructuredDataset, _remote
from torch_dataloader_utils._remote import Layout, RemoteFile, parquet_layout
from torch_dataloader_utils._retry import RetryPolicy


class Recorder:
    """A fetch function over ``data`` that records every range asked for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.ranges: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, start: int, stop: int) -> bytes:
        with self.lock:
            self.ranges.append((start, stop))
        return self.data[start:stop]


def _parquet(rows: int = 4000, group: int = 500) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(rows_table(0, rows), buffer, row_group_size=group, compression="none")
    return buffer.getvalue()


def _column_spans(footer: pq.FileMetaData, groups: range, names: set[str]) -> list[tuple[int, int]]:
    spans = []
    for r in groups:
        group = footer.row_group(r)
        for c in range(group.num_columns):
            col = group.column(c)
            if col.path_in_schema in names:
                start = min(
                    o for o in (col.dictionary_page_offset, col.data_page_offset) if o is not None
                )
                spans.append((start, start + col.total_compressed_size))
    return spans


def test_without_layout_reads_exactly_what_is_asked():
    data = bytes(range(256)) * 1024  # 256 KiB
    fetch = Recorder(data)
    f = RemoteFile(fetch, len(data), "mem://x")
    f.seek(100_000)
    assert f.read(100_000) == data[100_000:200_000]
    assert fetch.ranges == [(100_000, 200_000)]
    f.seek(-10, io.SEEK_END)
    assert f.read() == data[-10:]
    assert fetch.ranges[-1] == (len(data) - 10, len(data))  # a small read, clipped at the end
    assert f.read(5) == b""


def test_small_reads_share_one_rounded_request():
    data = bytes(200_000)
    fetch = Recorder(data)
    f = RemoteFile(fetch, len(data), "mem://x")
    for offset in (1000, 1100, 1200, 60_000):
        f.seek(offset)
        f.read(50)
    assert fetch.ranges == [(1000, 1000 + _remote.MIN_READ)]


def test_projected_split_is_read_in_coalesced_windows_without_over_read(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(_remote, "WINDOW", 64 * 1024)
    data = _parquet()
    footer = pq.ParquetFile(pa.BufferReader(data)).metadata
    # Splits: row groups [0, 3), [3, 5), [5, 8); read the middle one, columns id and x.
    layout = parquet_layout(footer, ["id", "x"], [0, 3, 5, 8])
    fetch = Recorder(data)
    source = RemoteFile(fetch, len(data), "mem://x", layout=layout)
    reader = pq.ParquetFile(source, metadata=footer)
    table = reader.read_row_groups([3, 4], columns=["id", "x"])
    assert table["id"].to_pylist() == list(range(1500, 2500))
    needed = _column_spans(footer, range(3, 5), {"id", "x"})
    lo, hi = min(a for a, _ in needed), max(b for _, b in needed)
    assert all(lo <= a and b <= hi for a, b in fetch.ranges), (fetch.ranges, (lo, hi))
    fetched = sum(b - a for a, b in fetch.ranges)
    assert fetched == sum(b - a for a, b in layout.windows(3, 64 * 1024, _remote.HOLE))
    assert all(b - a <= 64 * 1024 for a, b in fetch.ranges)
    assert fetched < 0.7 * len(data) * 2 / 5  # columns "label" and "name" and other splits skipped


def test_read_ahead_is_bounded(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_remote, "WINDOW", 1000)
    spans = tuple(((i * 1000, (i + 1) * 1000),) for i in range(20))
    layout = Layout(spans, (0, 20))
    data = bytes(20_000)
    fetch = Recorder(data)
    f = RemoteFile(fetch, len(data), "mem://x", layout=layout)
    most = 0
    for offset in range(0, 20_000, 500):
        f.seek(offset)
        assert f.read(500) == data[offset : offset + 500]
        most = max(most, len(f._futures))
    assert most <= _remote.AHEAD + 1
    assert sorted(fetch.ranges) == [(i * 1000, (i + 1) * 1000) for i in range(20)]


def test_layout_windows_stop_at_the_split_end():
    layout = Layout(tuple(((i * 10, i * 10 + 8),) for i in range(6)), (0, 2, 4))
    assert layout.split_end(0) == 2 and layout.split_end(3) == 4 and layout.split_end(5) == 6
    assert layout.windows(2, window=100, hole=2) == [(20, 38)]
    assert layout.windows(2, window=100, hole=1) == [(20, 28), (30, 38)]
    assert layout.windows(4, window=5, hole=2) == [(40, 45), (45, 50), (50, 55), (55, 58)]


def test_transient_errors_are_retried_and_permanent_ones_named():
    data = bytes(100_000)
    failures = iter([ConnectionResetError(104, "Connection reset by peer"), TimeoutError()])

    def flaky(start: int, stop: int) -> bytes:
        error = next(failures, None)
        if error is not None:
            raise error
        return data[start:stop]

    policy = RetryPolicy(attempts=3, base_delay=0)
    f = RemoteFile(flaky, len(data), "s3://b/k.parquet", retry=policy)
    assert f.read(70_000) == data[:70_000]

    def denied(start: int, stop: int) -> bytes:
        raise PermissionError("Access Denied for secret-abc")

    f = RemoteFile(denied, len(data), "s3://b/k.parquet", retry=policy,
                   redact=lambda m: m.replace("secret-abc", "***"))  # fmt: skip
    with pytest.raises(DataSourceError, match=r"s3://b/k\.parquet bytes \[0, 70000\)") as info:
        f.read(70_000)
    assert "not retried" in str(info.value) and "secret-abc" not in str(info.value)
    assert info.value.__cause__ is None  # the cause held the secret


def test_short_body_is_retried():
    data = bytes(100_000)
    calls = []

    def short_once(start: int, stop: int) -> bytes:
        calls.append(1)
        return data[start : stop - (1 if len(calls) == 1 else 0)]

    f = RemoteFile(short_once, len(data), "x", retry=RetryPolicy(attempts=2, base_delay=0))
    assert f.read(90_000) == data[:90_000]
    assert len(calls) == 2


# ---------------------------------------------------------------------------- memory://


@pytest.fixture
def memory_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    root = f"/tdu-remote-{uuid.uuid4().hex}"
    for path in write_dataset(tmp_path / "src", [70, 50], row_group_size=10):
        fs.pipe(f"{root}/{Path(path).name}", Path(path).read_bytes())
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def test_memory_protocol_uses_planned_reads_and_resumes(memory_data: str):
    dataset = StructuredDataset(memory_data, columns=["id", "name"], split_bytes=1, batch_size=8)
    storage = dataset._storage
    assert not storage.is_local
    source = storage.open(dataset._index.files[0].path)
    assert isinstance(source, RemoteFile) and source._layout is not None
    rows = [(int(i), n) for b in dataset for i, n in zip(b["id"], b["name"], strict=True)]
    assert sorted(rows) == [(i, f"r{i}") for i in range(120)]
    case = {"path": memory_data, "columns": ["id", "name"], "batch_size": 8, "split_bytes": 1,
            "shuffle": True, "num_workers": 2}  # fmt: skip
    _harness.assert_resume_exact(case, 5)


def test_prefetch_hint_is_adopted_by_the_next_open(memory_data: str):
    dataset = StructuredDataset(memory_data, split_bytes=1, batch_size=8)
    storage, index = dataset._storage, dataset._index
    split = index.splits[3]
    path = index.files[split.file].path
    storage.prefetch(path, split.units.start)
    other = index.files[1 - split.file].path
    storage.prefetch(other, 0)  # a newer hint replaces the older one
    storage.prefetch(path, split.units.start)
    source = storage.open(path)
    assert isinstance(source, RemoteFile) and source._prefetched
    early = dict(source._prefetched)
    reader = pq.ParquetFile(source, metadata=index.files[split.file].metadata.footer)
    table = reader.read_row_groups(list(split.units))
    first = split.row_offset + (0 if split.file == 0 else 70)
    assert table["id"].to_pylist() == list(range(first, first + split.row_length))
    assert not source._prefetched  # used, not fetched again
    assert all(f.done() for f in early.values())
    assert storage.open(path)._prefetched == {}  # a hint serves one open


def _prefetch_in_child(storage: object, path: str, unit: int, done: object) -> None:
    storage.prefetch(path, unit)  # type: ignore[attr-defined]
    source = storage.open(path)  # type: ignore[attr-defined]
    done.put(bool(source._prefetched))  # type: ignore[attr-defined]


def test_prefetch_in_a_forked_worker_never_takes_an_inherited_lock(memory_data: str):
    import multiprocessing

    dataset = StructuredDataset(memory_data, split_bytes=1, batch_size=8)
    storage, index = dataset._storage, dataset._index
    split = index.splits[3]
    path = index.files[split.file].path
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    child = context.Process(
        target=_prefetch_in_child, args=(storage, path, split.units.start, done), daemon=True
    )
    with storage._lock:  # a parent thread holds it at the fork
        child.start()
    try:
        assert done.get(timeout=30) is True  # prefetched, no deadlock
        child.join(10)
        assert child.exitcode == 0
    finally:
        child.kill()
