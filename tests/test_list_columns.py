"""Variable-length list columns (token ids) as jagged tensors, in process and through workers."""

from __future__ import annotations

import pickle
from pathlib import Path

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.base.jagged import JaggedArray, JaggedTensorParts, is_jagged
from torch_dataloader_utils.base.row_bytes import converted_row_bytes
from torch_dataloader_utils.reading.convert import convert
from torch_dataloader_utils.reading.packets import _lengths
from torch_dataloader_utils.transport.packet import pack, tensor_bytes
from torch_dataloader_utils.transport.slots import SharedSlots

ROWS = 600  # over two files
ITEMS = {
    "i32": pa.int32(),
    "i64": pa.int64(),
    "f32": pa.float32(),
    "b": pa.bool_(),
}


def _items(i: int, kind: pa.DataType) -> list:
    """Row ``i``'s list: 0..7 items (empty ones included), a pure function of ``i``."""
    n = (i * 7) % 8
    if pa.types.is_boolean(kind):
        return [(i + k) % 3 == 0 for k in range(n)]
    if pa.types.is_floating(kind):
        return [i + k / 4 for k in range(n)]
    return [i * 10 + k for k in range(n)]


def _table(ids: np.ndarray) -> pa.Table:
    columns: dict[str, pa.Array] = {"id": pa.array(ids)}
    for name, kind in ITEMS.items():
        rows = [_items(i, kind) for i in ids.tolist()]
        columns[name] = pa.array(rows, pa.list_(kind))
        columns[f"L{name}"] = pa.array(rows, pa.large_list(kind))
    return pa.table(columns)


def _write_lists(root: Path, files: int = 2, rows: int = ROWS) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, files + 1).astype(np.int64)
    for f in range(files):
        pq.write_table(_table(np.arange(bounds[f], bounds[f + 1])), root / f"{f}.parquet",
                       row_group_size=37)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def lists_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_lists(tmp_path_factory.mktemp("lists"))


def _rows(value) -> list[list]:
    if isinstance(value, JaggedArray):
        return value.tolist()
    assert value.layout == torch.jagged and value.offsets().dtype == torch.int64
    assert int(value.offsets()[0]) == 0
    return [row.tolist() for row in value.unbind()]


# ---------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("kind", list(ITEMS.values()), ids=list(ITEMS))
@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_values_equal_to_pylist_also_when_sliced(kind, large, output):
    rows = [_items(i, kind) for i in range(40)]
    array = pa.array(rows, pa.large_list(kind) if large else pa.list_(kind))
    for start, length in ((0, 40), (3, 17), (39, 1), (5, 0)):
        part = array.slice(start, length)
        got = convert(pa.record_batch({"c": part}), output, copy=False)["c"]
        assert len(got) == length
        assert _rows(got) == part.to_pylist()
        dtype = got.values.dtype if output == "numpy" else got.dtype
        expected = pa.array([], kind).to_numpy(zero_copy_only=False).dtype
        assert str(dtype).removeprefix("torch.") == str(expected)


def test_torch_values_view_arrow_unless_copied():
    array = pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int64())).slice(1)
    shared = convert(pa.record_batch({"c": array}), "torch", copy=False)["c"]
    assert shared.values().data_ptr() == array.values.buffers()[1].address + 2 * 8  # zero-copy
    copied = convert(pa.record_batch({"c": array}), "torch", copy=True)["c"]
    assert copied.values().data_ptr() != shared.values().data_ptr()
    assert _rows(copied) == [[3], [4, 5, 6]]


def test_numpy_form_is_documented_jagged_array():
    array = pa.array([[1, 2], [], [3]], pa.list_(pa.int32()))
    got = convert(pa.record_batch({"c": array}), "numpy", copy=False)["c"]
    assert isinstance(got, JaggedArray)
    assert got.values.tolist() == [1, 2, 3] and got.offsets.tolist() == [0, 2, 2, 3]
    assert got.offsets.dtype == np.int64
    assert got[0].tolist() == [1, 2] and got[-1].tolist() == [3] and len(got) == 3
    with pytest.raises(IndexError, match="row 3 of a JaggedArray of 3 rows"):
        got[3]
    back = pickle.loads(pickle.dumps(got))
    assert back.tolist() == got.tolist()


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_empty_lists_and_empty_batches(output):
    for rows in ([[], [], []], []):
        array = pa.array(rows, pa.list_(pa.float32()))
        got = convert(pa.record_batch({"c": array}), output, copy=False)["c"]
        assert len(got) == len(rows) and _rows(got) == rows


@pytest.mark.parametrize(
    ("values", "what"),
    [
        (pa.array([[1], None, [2, 3], None], pa.list_(pa.int32())), "2 null list"),
        (pa.array([[1.0, None], [2.0]], pa.large_list(pa.float32())), "1 null value"),
        (pa.array([[True, None, None]], pa.list_(pa.bool_())), "2 null value"),
    ],
)
def test_nulls_raise_naming_split_column_type_and_count(tmp_path: Path, values, what):
    pq.write_table(pa.table({"id": range(len(values)), "c": values}), tmp_path / "a.parquet")
    for output in ("torch", "numpy"):
        loader, _ = StructuredDataset.create_dataloader(str(tmp_path), output=output)
        kind = rf"\(.*list<element: {values.type.value_type}>\)"
        pattern = rf"split .*a\.parquet.*column 'c' {kind} has {what}"
        with pytest.raises(ValueError, match=pattern):
            list(loader)
    arrow, _ = StructuredDataset.create_dataloader(str(tmp_path), output="arrow")
    assert next(iter(arrow)).column("c").to_pylist() == values.to_pylist()


def test_nested_lists_and_lists_of_strings_fall_back_to_python_lists():
    nested = pa.array([[[1], [2, 3]], [], None], pa.list_(pa.list_(pa.int32())))
    strings = pa.array([["a", None], None, []], pa.large_list(pa.string()))
    batch = pa.record_batch({"n": nested, "s": strings})
    for output in ("torch", "numpy"):
        got = convert(batch, output, copy=False)
        assert got["n"] == nested.to_pylist() and got["s"] == strings.to_pylist()


def test_lists_of_fixed_size_lists_and_intervals_are_refused_by_name():
    fsl = pa.array([[[1.0, 2.0]], []], pa.list_(pa.list_(pa.float32(), 2)))
    with pytest.raises(ValueError, match=r"column 'v' \(list<.*fixed_size_list.*no tensor form"):
        convert(pa.record_batch({"v": fsl}), "torch", copy=False)
    months = pa.array([[pa.scalar((1, 2, 3), pa.month_day_nano_interval()).as_py()]],
                      pa.list_(pa.month_day_nano_interval()))  # fmt: skip
    with pytest.raises(ValueError, match=r"column 'm' .*month_day_nano_interval"):
        convert(pa.record_batch({"m": months}), "numpy", copy=False)


def test_dictionary_and_temporal_items_are_decoded():
    dict_items = pa.ListArray.from_arrays([0, 2, 3], pa.array([5, 6, 5]).dictionary_encode())
    dates = pa.array([[0, 1], [2]], pa.list_(pa.date32()))
    got = convert(pa.record_batch({"d": dict_items, "t": dates}), "torch", copy=False)
    assert _rows(got["d"]) == [[5, 6], [5]] and _rows(got["t"]) == [[0, 1], [2]]
    assert got["t"].dtype == torch.int32


def test_converted_row_bytes_counts_offsets_and_an_assumed_width():
    schema = pa.schema([("t", pa.list_(pa.int32())), ("s", pa.list_(pa.string()))])
    assert converted_row_bytes(schema) == 8 + 256 * 4


def test_batch_lengths_and_bytes_count_rows_not_values():
    array = pa.array([[1, 2, 3], [], [4]], pa.list_(pa.int64()))
    for output in ("torch", "numpy"):
        batch = convert(pa.record_batch({"c": array}), output, copy=False)
        assert _lengths([batch]) == [{"c": 3}]
        assert tensor_bytes(batch) == 4 * 8 + 4 * 8 + 2 * 64


@pytest.mark.parametrize("items", [[pa.int32(), pa.int32()], [pa.int32(), pa.int64()]])
def test_worker_form_arrives_as_nested_tensors(items):
    """A worker converts list columns to values + offsets (no nested tensor); the main process
    builds one per batch from the slot, or, for parts of different item types, from each."""
    parts = [
        convert(pa.record_batch({"c": pa.array(rows, pa.list_(kind))}), "torch", copy=False,
                nested=False)
        for rows, kind in zip([[[1, 2], [3]], [[], [4, 5, 6]]], items, strict=True)
    ]  # fmt: skip
    assert all(isinstance(p["c"], JaggedTensorParts) for p in parts)
    slots = SharedSlots(1)
    packet = pack(slots, 0, 0, parts, _lengths(parts), [2, 4], last=True)
    (a, _), (b, _) = packet.unpack(slots)
    assert is_jagged(a["c"]) and is_jagged(b["c"])
    assert [r.tolist() for r in a["c"].unbind()] == [[1, 2], [3]]
    assert [r.tolist() for r in b["c"].unbind()] == [[], [4, 5, 6]]
    assert (a["c"].dtype, b["c"].dtype) == tuple(torch.from_numpy(
        np.empty(0, k.to_pandas_dtype())).dtype for k in items)  # fmt: skip


# ---------------------------------------------------------------------------- loaders


def _expected(root: Path) -> dict[str, list]:
    return pq.read_table(root).to_pydict()


@pytest.mark.parametrize("output", ["torch", "numpy"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_values_equal_pylist_across_files(lists_dir, output, num_workers):
    loader, _ = StructuredDataset.create_dataloader(
        str(lists_dir), batch_size=64, output=output, num_workers=num_workers, split_bytes=1
    )
    expected = _expected(lists_dir)
    got: dict[str, dict[int, list]] = {name: {} for name in expected if name != "id"}
    sizes = []
    for batch in loader:
        ids = batch["id"].tolist()
        sizes.append(len(ids))
        for name in got:
            assert len(batch[name]) == len(ids), name
            got[name].update(zip(ids, _rows(batch[name]), strict=True))
    assert sizes[:-1] == [64] * (len(sizes) - 1) or num_workers  # a batch spans files
    for name, rows in got.items():
        assert [rows[i] for i in range(ROWS)] == expected[name], name


def _tokens_only(batch: dict) -> dict:
    """A transform: keeps the list columns (each batch goes through the transform path)."""
    return {"id": batch["id"], "i32": batch["i32"], "Lf32": batch["Lf32"]}


def test_transformed_batches_and_copies_through_workers(lists_dir):
    """With a transform, packets join per-batch jagged tensors; kept batches become copies."""
    loader, _ = StructuredDataset.create_dataloader(
        str(lists_dir), batch_size=16, num_workers=2, split_bytes=1, transform=_tokens_only
    )
    expected = _expected(lists_dir)
    kept = list(loader)  # keeping every batch forces copies beyond the lent slots
    rows = {i: r for b in kept for i, r in zip(b["id"].tolist(), _rows(b["i32"]), strict=True)}
    assert [rows[i] for i in range(ROWS)] == expected["i32"]
    floats = {i: r for b in kept for i, r in zip(b["id"].tolist(), _rows(b["Lf32"]), strict=True)}
    assert [floats[i] for i in range(ROWS)] == expected["Lf32"]


def test_batches_larger_than_a_slot_still_arrive(tmp_path: Path):
    ids = np.arange(64)
    rows = [list(range(i, i + 20_000)) for i in ids.tolist()]  # 5 MB of int32: over a slot
    pq.write_table(pa.table({"id": ids, "t": pa.array(rows, pa.list_(pa.int32()))}),
                   tmp_path / "a.parquet", row_group_size=16)  # fmt: skip
    for output in ("torch", "numpy"):
        loader, _ = StructuredDataset.create_dataloader(
            str(tmp_path), batch_size=32, num_workers=2, output=output
        )
        got = {i: r for b in loader for i, r in zip(b["id"].tolist(), _rows(b["t"]), strict=True)}
        assert [got[i] for i in range(64)] == rows


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact_with_list_columns(lists_dir, num_workers):
    case = {"path": str(lists_dir), "batch_size": 48, "num_workers": num_workers,
            "split_bytes": 2048, "shuffle": True}  # fmt: skip
    full = _harness.run_epoch(case)
    assert full[0]["i32"][0] == "jagged torch.int32"
    for k in (1, len(full) // 2):
        _harness.assert_resume_exact(case, k, full=full)


def test_resume_is_exact_with_numpy_list_columns(lists_dir):
    case = {"path": str(lists_dir), "batch_size": 50, "num_workers": 2, "output": "numpy"}
    full = _harness.run_epoch(case)
    assert full[0]["Li64"][0] == "jagged int64"
    _harness.assert_resume_exact(case, 3, full=full)
