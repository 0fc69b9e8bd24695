"""A shuffle window's gather (``reading.window``): the rows of Arrow's ``take``, whatever the
types."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from torch_dataloader_utils.reading.convert import convert
from torch_dataloader_utils.reading.window import Window, owned


def _batch(rows: int) -> pa.RecordBatch:
    rng = np.random.default_rng(0)
    return pa.record_batch({
        "id": pa.array(np.arange(rows, dtype=np.int64)),
        "small": pa.array(rng.integers(0, 200, rows).astype(np.uint8)),
        "half": pa.array(rng.random(rows).astype(np.float16)),
        "f": pa.array(rng.random(rows).astype(np.float32)),
        "nulls": pa.array([None if i % 3 == 0 else float(i) for i in range(rows)]),
        "flag": pa.array(rng.random(rows) < 0.5),
        "text": pa.array([f"row {i}" for i in range(rows)]),
        "tokens": pa.array([list(range(i % 5)) for i in range(rows)], pa.list_(pa.int32())),
        "floats": pa.array([[i / 2] * (i % 3) for i in range(rows)], pa.large_list(pa.float32())),
        "holes": pa.array([[i, None] if i % 4 == 1 else [i] for i in range(rows)],
                          pa.list_(pa.int64())),
    })  # fmt: skip


def _window(parts: list[pa.RecordBatch], order: list[int] | None = None) -> Window:
    """A window of ``parts`` one after another, put in ``order`` (default: in turn)."""
    firsts = np.cumsum([0] + [part.num_rows for part in parts]).tolist()
    window = Window(firsts[-1], "a test")
    for number in order or range(len(parts)):
        window.put(firsts[number], parts[number])
    window.finish()
    return window


def test_take_is_arrows_take_over_parts() -> None:
    batch = _batch(100)
    parts = [batch.slice(0, 7), batch.slice(7, 50), batch.slice(57)]
    index = np.random.default_rng(1).permutation(100)
    rows = _window(parts, order=[2, 0, 1]).take(index)
    assert rows.batch().equals(batch.take(pa.array(index)))
    assert rows.slice(10, 25).batch().equals(batch.take(pa.array(index[10:35])))
    assert rows.slice(90).num_rows == 10


def test_without_plain_columns() -> None:
    batch = _batch(10).select(["text", "nulls"])
    rows = _window([batch]).take(np.array([3, 1]))
    assert rows.records is None
    assert rows.batch().equals(batch.take(pa.array([3, 1])))


def test_a_column_of_numbers_is_plain_until_a_part_brings_nulls() -> None:
    batch = pa.record_batch({
        "id": pa.array(np.arange(30, dtype=np.int64)),
        "late": pa.array([float(i) for i in range(20)] + [None] * 5 + [1.5] * 5),
    })  # fmt: skip
    parts = [batch.slice(0, 10), batch.slice(10, 10), batch.slice(20, 10)]
    index = np.random.default_rng(3).permutation(30)
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        window = _window(parts, order)
        assert window.take(index).batch().equals(batch.take(pa.array(index)))
        assert sorted(window.take(index).others) == [1]  # "late" is no longer a record field


def test_a_small_slice_is_copied_out_of_the_buffers_it_would_keep() -> None:
    whole = pa.array(np.arange(100_000, dtype=np.int64))
    assert owned(whole) is whole
    most = whole.slice(1_000, 60_000)
    assert owned(most) is most
    small = owned(whole.slice(10, 100))
    assert small.equals(whole.slice(10, 100))
    assert small.get_total_buffer_size() <= 2 * small.nbytes
    lists = pa.array([[1, 2, 3]] * 10_000, pa.list_(pa.int32())).slice(5, 10)
    assert owned(lists).equals(lists)
    assert owned(lists).get_total_buffer_size() <= 2 * owned(lists).nbytes


@pytest.mark.parametrize("puts", [[0], [0, 5], [0, 10, 10]])
def test_a_window_not_given_each_row_once_is_refused(puts: list[int]) -> None:
    """Rows missing, overlapping or put twice: the reader's bug is loud, never a window that
    repeats some rows and loses others."""
    window = Window(20, "splits a.parquet[0]")
    for row in puts:
        window.put(row, _batch(10))
    with pytest.raises(RuntimeError, match=r"20 rows \(splits a.parquet\[0\]\).*each row once"):
        window.finish()


@pytest.mark.parametrize("output", ["torch", "numpy", "arrow"])
def test_converted_rows_equal_converted_batch(output: str) -> None:
    batch = _batch(40).drop_columns(["nulls", "flag", "holes"])  # no tensor form
    index = np.random.default_rng(2).permutation(40)[:30]
    rows = _window([batch.slice(0, 13), batch.slice(13)]).take(index)
    got = convert(rows, output, copy=False, nested=False)
    want = convert(batch.take(pa.array(index)), output, copy=False, nested=False)
    if output == "arrow":
        assert got.equals(want)
        return
    assert list(got) == list(want)
    for name, value in want.items():
        if name in ("tokens", "floats"):
            assert np.array_equal(np.asarray(got[name].values), np.asarray(value.values))
            assert np.array_equal(got[name].offsets, value.offsets)
        elif isinstance(value, torch.Tensor | np.ndarray):
            assert np.array_equal(np.asarray(got[name]), np.asarray(value)), name
            assert got[name].dtype == value.dtype
        else:
            assert list(got[name]) == list(value)
