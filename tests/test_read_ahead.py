"""Read-ahead through the dataset: every byte fetched is read, the next piece is in flight early.

Bytes and requests are counted where they leave the filesystem (``cat_file`` of fsspec's memory
filesystem, ``_cat_file`` of s3fs against moto), over whole epochs read through
``StructuredDataset``, so the real order of opens and reads is exercised.
"""

from __future__ import annotations

import io
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest
from _s3server import S3Env, s3_fixture, s3_server_fixture  # noqa: F401
from fsspec.implementations.memory import MemoryFileSystem

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.index.footers import TAIL
from torch_dataloader_utils.storage import remote as _remote

FILES = 4
ROWS = 40_000  # per file: 8 float64/int64 columns, ~2.5 MB of barely compressible values
GROUP_ROWS = 5_000  # 8 row groups per file
SPLIT_BYTES = 1_000_000  # 2 row groups per split (366 kB each), so pieces read several
LIMIT = 1.10


def _table(seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    columns: dict[str, Any] = {"id": np.arange(ROWS, dtype=np.int64) + seed * ROWS}
    columns.update({f"f{i}": rng.random(ROWS) for i in range(7)})
    return pa.table(columns)


def _parquet(seed: int) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(_table(seed), buffer, row_group_size=GROUP_ROWS)
    return buffer.getvalue()


def _ipc(seed: int) -> bytes:
    sink = io.BytesIO()
    table = _table(seed)
    with pyarrow.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=GROUP_ROWS):
            writer.write_batch(batch)
    return sink.getvalue()


def _projected_parquet_bytes(data: bytes, columns: list[str] | None) -> int:
    footer = pq.ParquetFile(pa.BufferReader(data)).metadata
    return sum(
        footer.row_group(r).column(c).total_compressed_size
        for r in range(footer.num_row_groups)
        for c in range(footer.num_columns)
        if columns is None or footer.row_group(r).column(c).path_in_schema in columns
    )


class Counter:
    """Ranged reads leaving the filesystem: ``(path, start, stop)`` each."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def add(self, path: str, start: int, stop: int) -> None:
        with self.lock:
            self.reads.append((path, start, stop))

    @property
    def bytes(self) -> int:
        return sum(b - a for _, a, b in self.reads)

    def clear(self) -> None:
        self.reads.clear()


@pytest.fixture
def memory_counter(monkeypatch: pytest.MonkeyPatch) -> Counter:
    counter = Counter()
    original = MemoryFileSystem.cat_file

    def cat_file(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        data = original(self, path, start=start, end=end, **kw)
        counter.add(path, start or 0, (start or 0) + len(data))
        return bytes(data)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    return counter


@pytest.fixture(autouse=True)
def _private_index_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "index-cache"))


def _in_memory(write: Callable[[int], bytes], ext: str) -> Iterator[tuple[str, list[bytes]]]:
    """``FILES`` files written by ``write(i)`` under a fresh ``memory://`` root, then removed."""
    fs = fsspec.filesystem("memory")
    root = f"/tdu-ahead-{uuid.uuid4().hex}"
    datas = [write(i) for i in range(FILES)]
    for i, data in enumerate(datas):
        fs.pipe(f"{root}/part-{i}.{ext}", data)
    yield f"memory://{root}", datas
    fs.rm(root, recursive=True)


@pytest.fixture
def memory_files() -> Iterator[tuple[str, list[bytes]]]:
    yield from _in_memory(_parquet, "parquet")


def _ids(dataset: StructuredDataset) -> list[int]:
    return sorted(int(i) for batch in dataset for i in batch["id"])


@pytest.mark.parametrize(
    ("columns", "shuffle"), [(None, False), (["id", "f3"], False), (["f5", "id"], True)]
)
def test_an_epoch_fetches_the_projected_bytes_once(
    memory_files: tuple[str, list[bytes]],
    memory_counter: Counter,
    columns: list[str] | None,
    shuffle: bool,
):
    """Shuffled with the default budget, a window holds whole row groups: read once too."""
    url, datas = memory_files
    dataset = StructuredDataset(url, columns=columns, split_bytes=SPLIT_BYTES, batch_size=1000,
                                shuffle=shuffle)  # fmt: skip
    splits = dataset._epochs.index.splits
    assert len(splits) >= 12 and any(len(s.units) > 1 for s in splits)
    stored = sum(_projected_parquet_bytes(d, columns) for d in datas)
    for _ in range(2):  # a second epoch costs the same
        memory_counter.clear()
        assert _ids(dataset) == list(range(FILES * ROWS))
        assert stored <= memory_counter.bytes <= LIMIT * stored, (memory_counter.bytes, stored)
        ranges = [(p, a, b) for p, a, b in memory_counter.reads]
        assert len(set(ranges)) == len(ranges)  # nothing fetched twice
        # one GET per piece (split), more only where projection leaves holes between columns
        assert len(ranges) <= len(splits) * (1 if columns is None else 8)


def test_the_next_piece_is_in_flight_before_it_is_opened(
    memory_files: tuple[str, list[bytes]], memory_counter: Counter, monkeypatch: pytest.MonkeyPatch
):
    url, _ = memory_files
    ready: list[tuple[tuple[int, int], bool]] = []
    original = _remote.ReadAhead.take

    def take(self: _remote.ReadAhead, key: tuple[int, int]) -> Any:
        queued = {p.key: p.fetching is not None for p in self._queue}
        ready.append((key, queued.get(key, False)))
        return original(self, key)

    monkeypatch.setattr(_remote.ReadAhead, "take", take)
    dataset = StructuredDataset(url, columns=["id", "f1"], split_bytes=SPLIT_BYTES, batch_size=999)
    assert _ids(dataset) == list(range(FILES * ROWS))
    pieces = sorted({key[0] for key, _ in ready})
    assert len(pieces) == len(dataset._epochs.index.splits)
    assert ready[0] == ((0, 0), False)  # the very first group is asked for at the first read
    assert all(started for _, started in ready[1:])  # every later one was already travelling


def test_resume_mid_piece_fetches_only_what_is_left(
    memory_files: tuple[str, list[bytes]], memory_counter: Counter
):
    url, datas = memory_files
    columns = ["id", "f2"]
    dataset = StructuredDataset(url, columns=columns, split_bytes=SPLIT_BYTES, batch_size=1000)
    batches = iter(dataset)
    for _ in range(30):  # into the middle of the stream
        next(batches)
    state = dataset.state_dict()
    del batches
    resumed = StructuredDataset(url, columns=columns, split_bytes=SPLIT_BYTES, batch_size=1000)
    resumed.load_state_dict(state)
    memory_counter.clear()
    rest = _ids(resumed)
    assert len(rest) == FILES * ROWS - 30 * 1000
    stored = sum(_projected_parquet_bytes(d, columns) for d in datas)
    assert memory_counter.bytes <= LIMIT * stored * (len(rest) + GROUP_ROWS) / (FILES * ROWS)


# ---------------------------------------------------------------------------- Arrow IPC


@pytest.fixture
def memory_ipc_files() -> Iterator[tuple[str, list[bytes]]]:
    yield from _in_memory(_ipc, "arrow")


def _ipc_layout(data: bytes) -> tuple[int, list[tuple[int, int, int]]]:
    """The footer's offset and each batch's (offset, header length, body length)."""
    from torch_dataloader_utils.formats.ipc_footer import read_footer

    footer = read_footer(lambda at, n: data[at : at + n], len(data))
    return footer.offset, [(b.offset, b.header, b.body) for b in footer.blocks]


def test_ipc_index_reads_only_footers_and_headers(
    memory_ipc_files: tuple[str, list[bytes]], memory_counter: Counter
):
    url, datas = memory_ipc_files
    StructuredDataset(url, format="arrow", split_bytes=SPLIT_BYTES)
    expected = 0
    for data in datas:
        # the last TAIL bytes in one read (pyarrow's footer read: one GET), then the headers
        # of the batches below them
        footer_at, blocks = _ipc_layout(data)
        tail = max(TAIL, len(data) - footer_at)
        below = [header for at, header, _ in blocks if at + header <= len(data) - tail]
        expected += tail + sum(below)
    assert memory_counter.bytes <= expected
    assert expected < 0.05 * sum(len(d) for d in datas)
    memory_counter.clear()
    StructuredDataset(url, format="arrow", split_bytes=SPLIT_BYTES)  # from the index cache
    assert memory_counter.reads == []


@pytest.mark.parametrize("columns", [None, ["f1", "id"]])
def test_ipc_epoch_reads_projected_buffers_and_never_the_footer(
    memory_ipc_files: tuple[str, list[bytes]], memory_counter: Counter, columns: list[str] | None
):
    url, datas = memory_ipc_files
    dataset = StructuredDataset(url, format="arrow", columns=columns, split_bytes=SPLIT_BYTES,
                                batch_size=1000)  # fmt: skip
    memory_counter.clear()
    assert _ids(dataset) == list(range(FILES * ROWS))
    wanted = 8 if columns is None else len(columns)
    needed = 0
    footers = []
    for data in datas:
        footer_at, blocks = _ipc_layout(data)
        footers.append(footer_at)
        # every column's data is 8 bytes per row; headers are read whole
        needed += sum(header for _, header, _ in blocks) + ROWS * 8 * wanted
    assert needed <= memory_counter.bytes <= LIMIT * needed, (memory_counter.bytes, needed)
    paths = sorted({p for p, _, _ in memory_counter.reads})
    for path, footer_at in zip(paths, footers, strict=True):
        assert all(b <= footer_at for p, _, b in memory_counter.reads if p == path)


# ---------------------------------------------------------------------------- S3 (moto)


@pytest.mark.s3
def test_s3_epoch_fetches_the_projected_bytes_once(s3: S3Env, monkeypatch: pytest.MonkeyPatch):
    import s3fs

    datas = [_parquet(i) for i in range(FILES)]
    for i, data in enumerate(datas):
        s3.put_bytes(f"data/part-{i}.parquet", data)
    counter = Counter()
    original = s3fs.S3FileSystem._cat_file

    async def cat_file(self: Any, path: str, version_id: Any = None, start: Any = None,
                       end: Any = None) -> bytes:  # fmt: skip
        data = await original(self, path, version_id=version_id, start=start, end=end)
        counter.add(path, start or 0, (start or 0) + len(data))
        return bytes(data)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", cat_file)
    columns = ["id", "f4"]
    dataset = StructuredDataset(s3.url("data"), storage_options=s3.options, columns=columns,
                                split_bytes=SPLIT_BYTES, batch_size=1000)  # fmt: skip
    counter.clear()
    assert _ids(dataset) == list(range(FILES * ROWS))
    stored = sum(_projected_parquet_bytes(d, columns) for d in datas)
    assert stored <= counter.bytes <= LIMIT * stored, (counter.bytes, stored)
    assert len(counter.reads) == len(set(counter.reads))
