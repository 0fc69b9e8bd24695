"""``RemoteFile`` and ``ReadAhead``: exact ranged reads, whole-unit groups, bounded read-ahead.

No server needed.

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

from torch_dataloader_utils import DataSourceError, StructuredDataset
from torch_dataloader_utils.formats import get_format
from torch_dataloader_utils.storage.remote import (
    Group,
    PieceReads,
    ReadAhead,
    RemoteFile,
    RemoteObject,
    plan_groups,
)
from torch_dataloader_utils.storage.retry import RetryPolicy


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


def _file(fetch: Recorder, **kwargs: object) -> RemoteFile:
    return RemoteFile(RemoteObject(fetch, len(fetch.data), "mem://x"), **kwargs)  # type: ignore[arg-type]


def test_without_a_plan_reads_exactly_what_is_asked():
    data = bytes(range(256)) * 1024  # 256 KiB
    fetch = Recorder(data)
    f = _file(fetch)
    f.seek(100_000)
    assert f.read(100_000) == data[100_000:200_000]
    assert fetch.ranges == [(100_000, 200_000)]
    f.seek(-10, io.SEEK_END)
    assert f.read() == data[-10:]
    assert fetch.ranges[-1] == (len(data) - 10, len(data))  # small reads are not rounded up
    assert f.read(5) == b""
    f.seek(-8, io.SEEK_END)
    assert bytes(f.read(8)) == data[-8:]  # inside the last read: kept, not fetched again
    assert len(fetch.ranges) == 2


def test_known_bytes_are_never_fetched():
    data = bytes(range(256)) * 100
    fetch = Recorder(data)
    f = _file(fetch, known=(len(data) - 1000, data[-1000:]))
    f.seek(-10, io.SEEK_END)
    assert f.read(10) == data[-10:]
    f.seek(len(data) - 1000)
    assert bytes(f.read(1000)) == data[-1000:]
    assert fetch.ranges == []
    f.seek(len(data) - 1001)
    assert bytes(f.read(2)) == data[-1001:-999]  # not all known: fetched
    assert fetch.ranges == [(len(data) - 1001, len(data) - 999)]


def _lane(fetch: Recorder, groups: list[Group], ahead: int | None = None) -> PieceReads:
    obj = RemoteObject(fetch, len(fetch.data), "mem://x")
    lane = ReadAhead((((0, g), obj, group) for g, group in enumerate(groups)), ahead)
    return PieceReads(lane, 0, tuple(groups), owned=True)


def test_projected_split_is_read_in_groups_without_over_read():
    data = _parquet()
    footer = pq.ParquetFile(pa.BufferReader(data)).metadata
    meta = get_format("parquet").read_metadata(pa.BufferReader(data))
    # Read the split of row groups [3, 5), columns id and x, in groups of at most 4 KiB.
    spans = get_format("parquet").unit_spans(meta, range(3, 5), ["id", "x"])
    assert spans is not None
    groups = plan_groups(spans, window=4 * 1024)
    assert len(groups) == 2  # one row group each
    fetch = Recorder(data)
    source = RemoteFile(RemoteObject(fetch, len(data), "mem://x"), reads=_lane(fetch, groups))
    reader = pq.ParquetFile(source, metadata=footer, pre_buffer=False)
    table = reader.read_row_groups([3, 4], columns=["id", "x"])  # as read_units reads it
    assert table["id"].to_pylist() == list(range(1500, 2500))
    needed = _column_spans(footer, range(3, 5), {"id", "x"})
    assert sorted(fetch.ranges) == [s for g in groups for s in g.spans]
    assert sum(b - a for a, b in fetch.ranges) == sum(b - a for a, b in needed)


def test_read_ahead_is_bounded_and_in_order():
    data = bytes(20_000)
    spans = [((i * 1000, (i + 1) * 1000),) for i in range(20)]
    groups = plan_groups(spans, window=2000)
    assert [g.spans for g in groups] == [((i * 2000, (i + 1) * 2000),) for i in range(10)]
    fetch = Recorder(data)
    reads = _lane(fetch, groups, ahead=4000)
    f = RemoteFile(RemoteObject(fetch, len(data), "mem://x"), reads=reads)
    most = 0
    for offset in range(0, 20_000, 500):
        f.seek(offset)
        assert f.read(500) == data[offset : offset + 500]
        started = sum(p.fetching is not None for p in reads.lane._queue)
        most = max(most, started)
    assert most == 2  # 4000 bytes ahead: two groups of 2000 beyond the one being read
    assert fetch.ranges == [(i * 2000, (i + 1) * 2000) for i in range(10)]


def test_groups_hold_whole_units_and_merge_only_small_holes():
    units = [((0, 100), (200, 300)), ((300, 400),), ((10_000, 10_100),), ((10_101, 20_000),)]
    # a 100-byte hole in a 300-byte span is more than 1/16: kept apart; touching spans join
    assert plan_groups(units[:2], window=1000, hole=1000) == [Group(((0, 100), (200, 400)))]
    assert plan_groups(units[:2], window=1000, hole=50) == [Group(((0, 100), (200, 400)))]
    # a 1-byte hole in a 10,000-byte span is merged; the window cuts between units only
    assert plan_groups(units[2:], window=100, hole=10) == [
        Group(((10_000, 10_100),)),
        Group(((10_101, 20_000),)),
    ]
    assert plan_groups(units[2:], window=100_000, hole=10) == [Group(((10_000, 20_000),))]


def test_a_lane_fetches_pieces_in_order_and_drops_groups_skipped():
    data = bytes(range(256)) * 40
    fetch = Recorder(data)
    obj = RemoteObject(fetch, len(data), "mem://x")
    planned = [((p, g), obj, Group(((p * 3000 + g * 1000, p * 3000 + g * 1000 + 500),)))
               for p in range(3) for g in range(2)]  # fmt: skip
    lane = ReadAhead(iter(planned), ahead=0)
    first = lane.take((0, 0))
    assert first is not None and bytes(first.read(0, 10)) == data[:10]
    second = lane.take((1, 1))  # (0, 1) and (1, 0) are dropped; (1, 0) was never started
    assert second is not None and bytes(second.read(4000, 4010)) == data[4000:4010]
    assert lane.take((1, 0)) is None  # behind the lane: not planned any more
    lane.close()
    assert {(0, 500), (4000, 4500)} <= set(fetch.ranges)
    assert (3000, 3500) not in fetch.ranges


def test_transient_errors_are_retried_and_permanent_ones_named():
    data = bytes(100_000)
    failures = iter([ConnectionResetError(104, "Connection reset by peer"), TimeoutError()])

    def flaky(start: int, stop: int) -> bytes:
        error = next(failures, None)
        if error is not None:
            raise error
        return data[start:stop]

    policy = RetryPolicy(attempts=3, base_delay=0)
    f = RemoteFile(RemoteObject(flaky, len(data), "s3://b/k.parquet", retry=policy))
    assert f.read(70_000) == data[:70_000]

    def denied(start: int, stop: int) -> bytes:
        raise PermissionError("Access Denied for secret-abc")

    obj = RemoteObject(denied, len(data), "s3://b/k.parquet", retry=policy,
                       redact=lambda m: m.replace("secret-abc", "***"))  # fmt: skip
    with pytest.raises(DataSourceError, match=r"s3://b/k\.parquet bytes \[0, 70000\)") as info:
        RemoteFile(obj).read(70_000)
    assert "not retried" in str(info.value) and "secret-abc" not in str(info.value)
    assert info.value.__cause__ is None  # the cause held the secret


def test_short_body_is_retried():
    data = bytes(100_000)
    calls = []

    def short_once(start: int, stop: int) -> bytes:
        calls.append(1)
        return data[start : stop - (1 if len(calls) == 1 else 0)]

    obj = RemoteObject(short_once, len(data), "x", retry=RetryPolicy(attempts=2, base_delay=0))
    assert RemoteFile(obj).read(90_000) == data[:90_000]
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


def test_memory_protocol_reads_ahead_and_resumes(memory_data: str):
    dataset = StructuredDataset(memory_data, columns=["id", "name"], split_bytes=1, batch_size=8)
    assert not dataset._opened[0].storage.is_local
    rows = [(int(i), n) for b in dataset for i, n in zip(b["id"], b["name"], strict=True)]
    assert sorted(rows) == [(i, f"r{i}") for i in range(120)]
    for budget in (4096, 2**20):  # windows of a few rows, and one window a stream
        case = {"path": memory_data, "columns": ["id", "name"], "batch_size": 8, "split_bytes": 1,
                "shuffle": True, "shuffle_memory_bytes": budget, "num_workers": 2}  # fmt: skip
        _harness.assert_resume_exact(case, 5)
