"""A shuffle window's gather (``_window``): the rows of Arrow's ``take``, whatever the types."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from torch_dataloader_utils._convert import convert
from torch_dataloader_utils._window import Window


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


def test_take_is_arrows_take_over_parts() -> None:
    batch = _batch(100)
    parts = [batch.slice(0, 7), batch.slice(7, 50), batch.slice(57)]
    index = np.random.default_rng(1).permutation(100)
    rows = Window(parts).take(index)
    assert rows.batch().equals(batch.take(pa.array(index)))
    assert rows.slice(10, 25).batch().equals(batch.take(pa.array(index[10:35])))
    assert rows.slice(90).num_rows == 10


def test_without_plain_columns() -> None:
    batch = _batch(10).select(["text", "nulls"])
    rows = Window([batch]).take(np.array([3, 1]))
    assert rows.records is None
    assert rows.batch().equals(batch.take(pa.array([3, 1])))


@pytest.mark.parametrize("output", ["torch", "numpy", "arrow"])
def test_converted_rows_equal_converted_batch(output: str) -> None:
    batch = _batch(40).drop_columns(["nulls", "flag", "holes"])  # no tensor form
    index = np.random.default_rng(2).permutation(40)[:30]
    rows = Window([batch.slice(0, 13), batch.slice(13)]).take(index)
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
