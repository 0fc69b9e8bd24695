"""Exact resume at random checkpoints over local, ``memory://`` and moto S3 storage.

Hypothesis draws the layout (files of different row counts, row groups / record batches of
different sizes inside a file, ``split_bytes`` that cuts files into several splits with a short
tail) and the checkpoints; every example checks, through the public API only, that:

* the batches after checkpoint ``k`` from a fresh dataset and loader are, value for value, the
  uninterrupted run's batches after ``k``;
* a checkpoint taken after resuming (resume-from-a-resume) continues exactly as well;
* the epoch delivers every row once, each with the values written for its id.

Object stores read through planned ranged GETs (``storage.remote``) where local files read directly,
so a read plan that asks for a row group past the end of a file fails there only: the crash of
issue 15 (``IndexError`` on resume from a shuffled checkpoint) that this file reproduced.
"""

from __future__ import annotations

import io
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness
import fsspec
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from _data import rows_table
from _s3server import BUCKET, storage_options
from _s3server import s3_server_fixture as s3_server_fixture  # the session's moto server
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

MIB = 2**20

# ---------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """Files as lists of unit sizes (Parquet row groups / Arrow record batches), and how to read."""

    files: tuple[tuple[int, ...], ...]
    split_bytes: int
    batch_size: int
    shuffle: bool
    seed: int
    memory_bytes: int

    @property
    def total(self) -> int:
        return sum(sum(units) for units in self.files)


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    # Some units of a few rows: a short piece is wholly delivered early in a shuffled window.
    # Up to 48 units: more splits than a shuffle window mixes at once (32) now and then.
    unit = st.one_of(st.integers(1, 6), st.integers(1, 100))
    files = draw(st.lists(st.lists(unit, min_size=1, max_size=12), min_size=1, max_size=4))
    return Layout(
        files=tuple(tuple(units) for units in files),
        # 1: a split per unit; a few hundred bytes: one to a few units per split, a short tail.
        split_bytes=draw(st.sampled_from([1, 700, 2000, 5000, 2**30])),
        batch_size=draw(st.integers(1, 48)),
        shuffle=draw(st.sampled_from([True, True, False])),
        seed=draw(st.integers(0, 2**31)),
        memory_bytes=draw(st.sampled_from([MIB, 256 * MIB])),  # 1 MiB: the minimum
    )


def encode(units: tuple[int, ...], start: int, fmt: str) -> bytes:
    """A file of rows ``start ..`` (``_data.rows_table``) in units of ``units`` rows."""
    buffer = io.BytesIO()
    if fmt == "parquet":
        with pq.ParquetWriter(buffer, rows_table(0, 0).schema) as writer:
            for rows in units:
                writer.write_table(rows_table(start, rows), row_group_size=rows)
                start += rows
    else:
        with ipc.new_file(buffer, rows_table(0, 0).schema) as writer:
            for rows in units:
                writer.write_batch(rows_table(start, rows).combine_chunks().to_batches()[0])
                start += rows
    return buffer.getvalue()


def files_of(layout: Layout, fmt: str) -> Iterator[tuple[str, bytes]]:
    start = 0
    for number, units in enumerate(layout.files):
        yield f"part-{number:05d}.{fmt}", encode(units, start, fmt)
        start += sum(units)


# ---------------------------------------------------------------------------- storages

# A storage puts the files of one example under a fresh root: (url, storage_options, cleanup).
Put = Callable[[list[tuple[str, bytes]]], tuple[str, dict[str, Any], Callable[[], None]]]


def _put_local(files: list[tuple[str, bytes]]) -> tuple[str, dict[str, Any], Callable[[], None]]:
    root = Path(tempfile.mkdtemp(prefix="tdu-remote-resume-"))
    for name, data in files:
        (root / name).write_bytes(data)
    return f"file://{root}", {}, lambda: shutil.rmtree(root)


def _put_memory(files: list[tuple[str, bytes]]) -> tuple[str, dict[str, Any], Callable[[], None]]:
    fs = fsspec.filesystem("memory")
    root = f"memory://tdu-{uuid.uuid4().hex}/data"
    for name, data in files:
        fs.pipe_file(f"{root}/{name}", data)
    return root, {}, lambda: fs.rm(root, recursive=True)


def _put_s3(endpoint: str) -> Put:
    import s3fs

    options = storage_options(endpoint)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)

    def put(files: list[tuple[str, bytes]]) -> tuple[str, dict[str, Any], Callable[[], None]]:
        fs.invalidate_cache()
        if not fs.exists(BUCKET):  # another module's test may have reset the server
            fs.mkdir(BUCKET)
        root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        for name, data in files:
            fs.pipe_file(f"{root}/{name}", data)
        return root, options, lambda: fs.rm(root, recursive=True)

    return put


@pytest.fixture(params=["file", "memory", pytest.param("s3", marks=pytest.mark.s3)], name="put")
def put_fixture(request: pytest.FixtureRequest) -> Put:
    """Where an example's files go: a local directory, ``memory://`` or the moto S3 server."""
    if request.param == "file":
        return _put_local
    if request.param == "memory":
        return _put_memory
    return _put_s3(request.getfixturevalue("s3_server"))


@pytest.fixture(autouse=True)
def _private_index_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "index-cache"))


# ---------------------------------------------------------------------------- the property


def check_resume(
    put: Put, fmt: str, layout: Layout, data: st.DataObject, *, num_workers: int, checkpoints: int
) -> None:
    url, options, cleanup = put(list(files_of(layout, fmt)))
    try:
        case = {
            "path": url,
            "format": fmt,
            "storage_options": options,
            "batch_size": layout.batch_size,
            "split_bytes": layout.split_bytes,
            "shuffle": layout.shuffle,
            "shuffle_seed": layout.seed,
            "shuffle_memory_bytes": layout.memory_bytes,
            "num_workers": num_workers,
        }
        full = _harness.run_epoch(case)
        delivered = _harness.ids(full)
        assert sorted(delivered) == list(range(layout.total))  # every row once
        for batch in full:
            assert batch["x"][1] == [i * 0.5 for i in batch["id"][1]]
            assert batch["name"][1] == [f"r{i}" for i in batch["id"][1]]

        # Checkpoints after batches k1 <= k2 <= ...: the first from a fresh loader, each next
        # one from a loader resumed from the one before (a resume from a resume), which must
        # deliver the uninterrupted run's batches up to it; the last resumes to the end.
        points = st.lists(st.integers(0, len(full)), min_size=2, max_size=checkpoints)
        state, got = None, []
        for k in sorted(data.draw(points, label="checkpoints")):
            state, more = _harness.checkpoint_after(case, k - len(got), state=state)
            got += more
            assert got == full[:k]
        assert got + _harness.resume(case, state) == full
    finally:
        cleanup()


def _settings(examples: int) -> settings:
    """``examples`` examples, not shrunk: hypothesis prints the failing layout and checkpoints,
    and shrinking one re-reads the dataset through hundreds of loaders (minutes)."""
    return settings(
        max_examples=examples,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@_settings(12)
@given(layout=layouts(), data=st.data())
def test_resume_at_random_checkpoints(put: Put, fmt: str, layout: Layout, data: st.DataObject):
    check_resume(put, fmt, layout, data, num_workers=0, checkpoints=6)


@_settings(4)
@given(layout=layouts(), data=st.data())
def test_resume_with_two_workers_memory(layout: Layout, data: st.DataObject):
    check_resume(_put_memory, "parquet", layout, data, num_workers=2, checkpoints=3)


@pytest.mark.s3
@_settings(2)
@given(layout=layouts(), data=st.data())
def test_resume_with_two_workers_s3(s3_server: str, layout: Layout, data: st.DataObject):
    check_resume(_put_s3(s3_server), "parquet", layout, data, num_workers=2, checkpoints=3)


@st.composite
def sliced_layouts(draw: st.DrawFn) -> Layout:
    """Row groups of 800-2,000 rows, 19,200 rows or more, under the minimum budget (windows
    of about 17,500 rows): row groups longer than 1/24 of a window are sliced into parts dealt
    to consecutive windows, which a window's read decodes once and carries
    (``reading.shuffled._read_window``)."""
    unit = st.integers(800, 2000)
    files = draw(st.lists(st.lists(unit, min_size=8, max_size=12), min_size=3, max_size=3))
    return Layout(
        files=tuple(tuple(units) for units in files),
        split_bytes=draw(st.sampled_from([1, 2**30])),
        batch_size=draw(st.integers(16, 128)),
        shuffle=True,
        seed=draw(st.integers(0, 2**31)),
        memory_bytes=MIB,
    )


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@_settings(3)
@given(layout=sliced_layouts(), data=st.data())
def test_resume_where_row_groups_are_sliced(
    put: Put, fmt: str, layout: Layout, data: st.DataObject
):
    check_resume(put, fmt, layout, data, num_workers=0, checkpoints=4)


@_settings(2)
@given(layout=sliced_layouts(), data=st.data())
def test_resume_where_row_groups_are_sliced_two_workers(layout: Layout, data: st.DataObject):
    check_resume(_put_memory, "parquet", layout, data, num_workers=2, checkpoints=3)


# ---------------------------------------------------------------------------- regressions


@pytest.mark.parametrize(
    ("units", "first", "end", "expected"),
    [
        # A split of units 1..2 of a file of units of 10, 20 and 5 rows (file rows 10..35).
        ((1, 3), 12, 35, (range(1, 3), 2)),
        ((1, 3), 30, 35, (range(2, 3), 0)),  # from a unit's first row
        ((1, 3), 29, 30, (range(1, 2), 19)),  # up to a unit's last row
        # Nothing left to read: no unit, not the one after the split (past the file's end).
        ((1, 3), 35, 35, (range(3, 3), 0)),
        ((0, 2), 30, 30, (range(2, 2), 0)),  # the split ends before the file does
        ((0, 3), 10, 10, (range(3, 3), 0)),  # empty in the middle of a split
    ],
)
def test_units_for_reads_no_unit_for_no_rows(units, first, end, expected):
    from torch_dataloader_utils.reading.pieces import _units_for

    assert _units_for((10, 20, 5), range(*units), first, end) == expected


def test_resume_after_a_short_piece_is_delivered_on_memory():
    """An example the property found on main: 11 splits (one per row group) of 2..148 rows
    mixed in one window. After batch 26, 832 of 834 rows, every split but one or two is wholly
    delivered, among them the last of file 0; the resume planned a read of that file's row
    group 2 of 0..1 and raised ``IndexError: 2 out of bounds`` (a local file never ran it)."""
    layout = Layout(
        files=((40, 76), (6, 114, 61, 148), (2, 79, 83, 97, 128)),
        split_bytes=1,
        batch_size=32,
        shuffle=True,
        seed=0,
        memory_bytes=MIB,
    )
    url, _, cleanup = _put_memory(list(files_of(layout, "parquet")))
    try:
        case = {"path": url, "batch_size": 32, "split_bytes": 1, "shuffle": True,
                "shuffle_memory_bytes": MIB}  # fmt: skip
        full = _harness.run_epoch(case)
        assert len(full) == 27
        for k in (25, 26):
            _harness.assert_resume_exact(case, k, full=full)
    finally:
        cleanup()
