"""Arrow -> torch / numpy / arrow, column by column, as documented in ``reading/convert.py``."""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torch_dataloader_utils import StructuredDataset

N = 6
TS = [datetime.datetime(2020, 1, 1, 0, 0, i) for i in range(N)]
DAYS = [datetime.date(2020, 1, 1 + i) for i in range(N)]


@pytest.fixture(scope="module")
def typed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("typed")
    table = pa.table(
        {
            "i8": pa.array(range(N), pa.int8()),
            "i16": pa.array(range(N), pa.int16()),
            "i32": pa.array(range(N), pa.int32()),
            "i64": pa.array(range(N), pa.int64()),
            "u8": pa.array(range(N), pa.uint8()),
            "f32": pa.array(np.arange(N, dtype=np.float32) / 2),
            "f64": pa.array([1.0, None, 3.0, None, 5.0, 6.0]),
            "b": pa.array([True, False, False, True, True, False]),
            "ts": pa.array(TS, pa.timestamp("us")),
            "ts_ms": pa.array(TS, pa.timestamp("ms", tz="UTC")),
            "d": pa.array(DAYS, pa.date32()),
            "fsl": pa.array([[i, i + 0.5, i + 1.0] for i in range(N)], pa.list_(pa.float32(), 3)),
            "dict_s": pa.array(["a", "b", "a", "c", "b", "a"]).dictionary_encode(),
            "dict_i": pa.array([10, 20, 10, 30, 20, 10], pa.int64()).dictionary_encode(),
            "s": pa.array([f"s{i}" for i in range(N)]),
            "ls": pa.array([f"L{i}" for i in range(N)], pa.large_string()),
            "lst": pa.array([[i] * i for i in range(N)], pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, root / "a.parquet", row_group_size=4)
    return root


def _batch(root: Path, output: str, num_workers: int = 0):
    loader, _ = StructuredDataset.create_dataloader(
        str(root), batch_size=N, output=output, num_workers=num_workers
    )
    batches = list(loader)
    assert len(batches) == 1
    return batches[0]


DTYPES = {
    "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
    "u8": torch.uint8, "f32": torch.float32, "f64": torch.float64, "b": torch.bool,
    "ts": torch.int64, "ts_ms": torch.int64, "d": torch.int32, "fsl": torch.float32,
    "dict_i": torch.int64,
}  # fmt: skip
EPOCH_US = [int(t.replace(tzinfo=datetime.timezone.utc).timestamp() * 10**6) for t in TS]


def _check_values(batch, array=lambda v: v.tolist()):
    assert array(batch["i8"]) == list(range(N))
    assert array(batch["u8"]) == list(range(N))
    assert array(batch["f32"]) == [i / 2 for i in range(N)]
    f64 = array(batch["f64"])
    assert [v for i, v in enumerate(f64) if i not in (1, 3)] == [1.0, 3.0, 5.0, 6.0]
    assert np.isnan(f64[1]) and np.isnan(f64[3])  # float nulls become NaN
    assert array(batch["b"]) == [True, False, False, True, True, False]
    assert array(batch["ts"]) == EPOCH_US  # stored unit (us)
    assert array(batch["ts_ms"]) == [t // 1000 for t in EPOCH_US]  # stored unit (ms)
    assert array(batch["d"]) == [(d - datetime.date(1970, 1, 1)).days for d in DAYS]
    assert array(batch["fsl"]) == [[i, i + 0.5, i + 1.0] for i in range(N)]
    assert array(batch["dict_i"]) == [10, 20, 10, 30, 20, 10]
    assert list(batch["dict_s"]) == ["a", "b", "a", "c", "b", "a"]
    assert list(batch["s"]) == [f"s{i}" for i in range(N)]
    assert list(batch["ls"]) == [f"L{i}" for i in range(N)]
    lst = batch["lst"]
    rows = [t.tolist() for t in lst.unbind()] if isinstance(lst, torch.Tensor) else lst.tolist()
    assert rows == [[i] * i for i in range(N)]


def test_torch_output(typed_dir: Path):
    batch = _batch(typed_dir, "torch")
    for name, dtype in DTYPES.items():
        assert isinstance(batch[name], torch.Tensor), name
        assert batch[name].dtype == dtype, name
        assert batch[name].shape[0] == N
    assert batch["fsl"].shape == (N, 3)
    for name in ("s", "ls", "dict_s"):
        assert isinstance(batch[name], list), name
    assert batch["lst"].is_nested and batch["lst"].layout == torch.jagged  # list<int64>
    _check_values(batch)


def test_numpy_output(typed_dir: Path):
    batch = _batch(typed_dir, "numpy")
    for name, dtype in DTYPES.items():
        assert isinstance(batch[name], np.ndarray), name
        assert batch[name].dtype == np.dtype(str(dtype).removeprefix("torch.")), name
    assert batch["fsl"].shape == (N, 3)
    for name in ("s", "ls"):  # strings: object arrays
        assert isinstance(batch[name], np.ndarray) and batch[name].dtype == object, name
    assert batch["lst"].values.dtype == np.int64 and len(batch["lst"]) == N  # JaggedArray
    _check_values(batch)


def test_arrow_output(typed_dir: Path):
    batch = _batch(typed_dir, "arrow")
    assert isinstance(batch, pa.RecordBatch)
    expected = pq.read_table(typed_dir / "a.parquet")
    assert batch.schema.names == expected.schema.names
    assert pa.Table.from_batches([batch]).equals(expected.combine_chunks())


def test_tensors_own_their_memory(typed_dir: Path):
    """The training loop may write into a batch; that must not corrupt later reads."""
    first = _batch(typed_dir, "torch")
    first["i64"].add_(100)
    first["fsl"].zero_()
    second = _batch(typed_dir, "torch")
    assert second["i64"].tolist() == list(range(N))
    assert second["fsl"][1].tolist() == [1.0, 1.5, 2.0]


@pytest.mark.parametrize("column", ["n_int", "n_bool", "n_fsl"])
def test_nulls_without_tensor_value_name_the_column(tmp_path: Path, column: str):
    values = {
        "n_int": pa.array([1, None, 3], pa.int32()),
        "n_bool": pa.array([True, None, False]),
        "n_fsl": pa.array([[1.0, 2.0], None, [3.0, 4.0]], pa.list_(pa.float32(), 2)),
    }[column]
    pq.write_table(pa.table({"ok": [1, 2, 3], column: values}), tmp_path / "a.parquet")
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=3)
    with pytest.raises(ValueError, match=rf"column '{column}' .*1 null"):
        list(loader)
    # output="arrow" hands the nulls over untouched.
    arrow, _ = StructuredDataset.create_dataloader(str(tmp_path), batch_size=3, output="arrow")
    assert [b.column(column).null_count for b in arrow] == [1]


def test_unknown_output_is_rejected(typed_dir: Path):
    with pytest.raises(ValueError, match=r"unknown output 'pandas'.*'torch', 'numpy', 'arrow'"):
        StructuredDataset(str(typed_dir), output="pandas")


def _convert_error(column: pa.Array, output: str, name: str = "c") -> str:
    from torch_dataloader_utils.reading.convert import convert

    with pytest.raises(ValueError) as exc:
        convert(pa.record_batch({name: column}), output, copy=True)
    return str(exc.value)


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_unconvertible_columns_name_the_column_and_its_type(output: str):
    interval = pa.array([pa.MonthDayNano([1, 2, 3])], pa.month_day_nano_interval())
    message = _convert_error(interval, output, "every")
    assert message.startswith("column 'every' (month_day_nano_interval) has no tensor")
    assert "output='arrow'" in message
    far = pa.array([2**62], pa.int64()).view(pa.timestamp("s"))  # past the year 9999
    message = _convert_error(pa.StructArray.from_arrays([far], ["t"]), output, "s")
    assert message.startswith("column 's' (struct<t: timestamp[s]>) holds values Python cannot")
    assert "OverflowError" in message
    nulls = pa.array([1, None], pa.timestamp("ns"))
    assert _convert_error(nulls, output, "t").startswith("column 't' (timestamp[ns]) has 1 null")


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_two_columns_of_one_name_are_refused_not_merged(tmp_path: Path, output: str):
    table = pa.Table.from_arrays(
        [pa.array([1, 2]), pa.array([3, 4]), pa.array([5, 6])], names=["x", "x", "y"]
    )
    pq.write_table(table, tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"split .*a\.parquet rows \[0, 2\): column\(s\) \['x'\] "):
        list(StructuredDataset(str(tmp_path), output=output))
    assert [b["y"].tolist() for b in StructuredDataset(str(tmp_path), columns=["y"])] == [[5, 6]]
    arrow = list(StructuredDataset(str(tmp_path), output="arrow"))
    assert arrow[0].schema.names == ["x", "x", "y"]


def test_selecting_a_column_named_twice_names_it(tmp_path: Path):
    from torch_dataloader_utils import SchemaMismatchError

    table = pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["x", "x"])
    pq.write_table(table, tmp_path / "a.parquet")
    with pytest.raises(SchemaMismatchError, match=r"a\.parquet has more than one column named 'x'"):
        StructuredDataset(str(tmp_path), columns=["x"])
