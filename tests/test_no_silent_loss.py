"""Nothing a worker reads vanishes on the way to the training loop.

A batch that cannot be pickled raises in the training process, naming the worker, the split and
the column (the DataLoader queue's thread would only print it); packets are numbered, so a lost
one is an error naming the worker and the gap; transforms may add per-batch scalars; and a
worker error leaves nothing behind that a later loader would print.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from torch_dataloader_utils import (
    DataLoaderUtilsError,
    LostBatchesError,
    StructuredDataset,
    UnsendableBatchError,
)
from torch_dataloader_utils.reading import reader as reader_module
from torch_dataloader_utils.reading.packets import _lengths
from torch_dataloader_utils.transport.packet import Derived, Packet, Unjoined, pack
from torch_dataloader_utils.transport.slots import SharedSlots

FORK = {"multiprocessing_context": "fork"}  # workers inherit the test's monkeypatches


class _Tagged(pa.ExtensionType):
    """An extension type, re-registered below under a class no pickle can find by name."""

    def __init__(self) -> None:
        super().__init__(pa.int64(), "tdu-test.tagged")

    def __arrow_ext_serialize__(self) -> bytes:
        return b""

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type: pa.DataType, serialized: bytes) -> _Tagged:
        return cls()


@pytest.fixture
def tagged_dir(tmp_path: Path) -> Iterator[Path]:
    """17 rows in an Arrow IPC file whose column ``tag`` reads as an unpicklable type."""

    class Local(_Tagged):  # a local class: pickle cannot name it
        pass

    pa.register_extension_type(Local())
    try:
        ids = pa.array(range(17), pa.int64())
        tag = pa.ExtensionArray.from_storage(Local(), ids)
        feather.write_feather(pa.table({"id": ids, "tag": tag}), tmp_path / "tagged.arrow")
        yield tmp_path
    finally:
        pa.unregister_extension_type("tdu-test.tagged")


# ---------------------------------------------------------------------------- unpicklable batches


def test_unpicklable_arrow_column_raises_naming_worker_file_and_column(
    tagged_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    local, _ = StructuredDataset.create_dataloader(str(tagged_dir), format="arrow", output="arrow")
    assert sum(b.num_rows for b in local) == 17  # fine without workers
    loader, _ = StructuredDataset.create_dataloader(
        str(tagged_dir), format="arrow", output="arrow", num_workers=2, **FORK
    )
    with pytest.raises(UnsendableBatchError) as info:
        list(loader)
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith("DataLoader worker 0 cannot send a batch of split ")
    assert "tagged.arrow rows [0, 17)" in first_line
    assert "column 'tag' (extension<tdu-test.tagged" in first_line
    assert "cannot be pickled" in first_line and "num_workers=0" in first_line
    assert isinstance(info.value, TypeError) and isinstance(info.value, DataLoaderUtilsError)
    assert "Traceback" not in capfd.readouterr().err  # nothing printed by the queue's thread


def _with_lambda(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "f": lambda: 1}


def _with_generator(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "g": (i for i in range(3))}


def _as_generator(batch: dict[str, Any]) -> Any:
    return (v for v in batch.values())


@pytest.mark.parametrize(
    ("transform", "what"),
    [
        (_with_lambda, "column 'f' (per-batch values of type function)"),
        (_with_generator, "column 'g' (per-batch values of type generator)"),
        (_as_generator, "a batch of type generator"),
    ],
)
def test_unpicklable_transform_output_raises(
    parquet_dir: Path, transform: Callable[[Any], Any], what: str
) -> None:
    loader, _ = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=64, num_workers=2, transform=transform
    )
    with pytest.raises(UnsendableBatchError, match=r"^DataLoader worker 0 cannot send") as info:
        list(loader)
    assert "part-00000.parquet rows [0, " in str(info.value)
    assert f"{what} cannot be pickled" in str(info.value)


def _unpicklable_at_333(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "f": lambda: 1} if 333 in batch["id"].tolist() else batch


def test_an_unpicklable_batch_loses_and_repeats_nothing(parquet_dir: Path, small_split: int):
    """Batches before the failing packet arrive in order; the state resumes right after them."""
    case = {"path": str(parquet_dir), "batch_size": 10, "split_bytes": small_split,
            "shuffle": True, "num_workers": 2}  # fmt: skip
    full = _harness.run_epoch(case)
    failing = next(k for k, b in enumerate(full) if 333 in b["id"][1])
    loader, _ = _harness.make_loader({**case, "transform": _unpicklable_at_333})
    got = []
    with pytest.raises(UnsendableBatchError, match=r"column 'f' \(function\) cannot be pickled"):
        for batch in loader:
            got.append(_harness.canonical(batch))
    # The batches before the failing one's packet, in stream order (a packet fails whole).
    assert 0 < len(got) <= failing and got == full[: len(got)]
    state = _harness.json_round_trip(loader.state_dict())
    assert _harness.resume(case, state) == full[len(got) :]


def test_worker_errors_keep_their_type_and_message_first(tmp_path: Path) -> None:
    """An error a worker raises while reading reaches the loop as itself, not torch's wrapper."""

    def fail(batch: dict[str, Any]) -> dict[str, Any]:
        raise ValueError(f"bad batch starting at id {batch['id'][0]}")

    _write_ids(tmp_path, 40)
    loader, _ = StructuredDataset.create_dataloader(
        str(tmp_path), batch_size=10, num_workers=2, transform=fail, **FORK
    )
    with pytest.raises(ValueError) as info:
        list(loader)
    assert str(info.value) == "bad batch starting at id 0"
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised in DataLoader worker 0" in notes and "in fail" in notes


# ---------------------------------------------------------------------------- lost packets


def _dropping(monkeypatch: pytest.MonkeyPatch, drops: Callable[[Packet], bool]) -> None:
    """Make workers skip the packets ``drops`` picks (their slots freed), as a lost one would."""
    real = reader_module.send

    def send(parts: Any, slots: SharedSlots, worker: int) -> Iterator[Packet]:
        for packet in real(parts, slots, worker):
            if drops(packet):
                slots.free(packet.worker, packet.slot)
                continue
            yield packet

    monkeypatch.setattr(reader_module, "send", send)


def test_a_lost_packet_raises_naming_the_worker_and_the_gap(
    parquet_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dropping(monkeypatch, lambda p: (p.worker, p.seq) == (1, 1))
    loader, _ = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=10, num_workers=2, **FORK
    )
    got = []
    with pytest.raises(LostBatchesError) as info:
        for batch in loader:
            got.append(batch["id"])
    message = str(info.value)
    assert message.startswith(
        "DataLoader worker 1 sent packet 2, but packet 1 never arrived: its batches after "
        "row 10 of its share of the epoch ("
    )
    assert ".parquet rows [" in message and "resume from state_dict()" in message
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, DataLoaderUtilsError)
    # Handed out: worker 0's packets 0 and 1 (1 + 2 batches) interleaved with worker 1's packet 0.
    assert [int(ids[0]) for ids in got] == [0, 350, 10]


def test_a_lost_last_packet_raises(parquet_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _dropping(monkeypatch, lambda p: p.worker == 1 and p.last)
    loader, _ = StructuredDataset.create_dataloader(
        str(parquet_dir), batch_size=10, num_workers=2, **FORK
    )
    with pytest.raises(LostBatchesError, match=r"worker\(s\) \[1\] stopped before their last"):
        list(loader)


# ---------------------------------------------------------------------------- per-batch scalars


def _with_scalars(batch: dict[str, Any]) -> dict[str, Any]:
    ids = batch["id"]
    first = ids[0]
    return {
        **batch,
        "n": len(ids),
        "mean": float(batch["x"].mean()),
        "sum0d": ids.sum() if isinstance(ids, torch.Tensor) else np.array(ids.sum()),  # 0-d
        "first": np.int64(first),  # a numpy scalar
        "tag": None,
    }


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray):
        return (type(value).__name__, str(value.dtype), tuple(value.shape), value.tolist())
    return (type(value).__name__, value)


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_scalar_and_0d_transform_outputs_pass_through_workers(parquet_dir: Path, output: str):
    """Each batch arrives with the per-batch values the transform gave it, as without workers."""
    case = {"path": str(parquet_dir), "batch_size": 100, "output": output, "num_workers": 2}
    plain, _ = StructuredDataset.create_dataloader(**case)
    expected = [{k: _plain(v) for k, v in _with_scalars(b).items()} for b in plain]
    loader, _ = StructuredDataset.create_dataloader(**case, transform=_with_scalars)
    got = [{k: _plain(v) for k, v in b.items()} for b in loader]
    assert got == expected
    assert got[0]["n"] == ("int", 100) and got[0]["sum0d"][2] == ()
    assert got[-1]["n"] == ("int", 50)  # the last batch of a worker: its own value
    inline, _ = StructuredDataset.create_dataloader(**{**case, "num_workers": 0})
    local = [{k: _plain(v) for k, v in _with_scalars(b).items()} for b in inline]
    assert {k: v[:2] for k, v in got[0].items()} == {k: v[:2] for k, v in local[0].items()}


def test_a_0d_tensor_as_the_whole_batch(parquet_dir: Path) -> None:
    case = {"path": str(parquet_dir), "batch_size": 100, "num_workers": 2}
    plain, _ = StructuredDataset.create_dataloader(**case)
    expected = [int(_batch_sum(b)) for b in plain]
    loader, _ = StructuredDataset.create_dataloader(**case, transform=_batch_sum)
    got = list(loader)
    assert all(isinstance(t, torch.Tensor) and t.ndim == 0 for t in got)
    assert [int(t) for t in got] == expected


def _batch_sum(batch: dict[str, Any]) -> torch.Tensor:
    return batch["id"].sum()


def test_pack_keeps_scalars_one_per_batch() -> None:
    slots = SharedSlots(1)
    parts = [{"id": torch.arange(3), "n": 3}, {"id": torch.arange(3, 5), "n": 2}]
    assert _lengths(parts) == [{"id": 3, "n": 0}, {"id": 2, "n": 0}]
    packet = pack(slots, 0, 0, parts, _lengths(parts), [3, 5], last=True, seq=4)
    assert packet.payload["n"] == Unjoined([3, 2]) and packet.seq == 4
    (a, _), (b, _) = packet.unpack(slots)
    assert a["n"] == 3 and b["n"] == 2 and b["id"].tolist() == [3, 4]


def _twice_id(batch: dict[str, Any]) -> torch.Tensor:
    return batch["id"] * 2


@pytest.mark.parametrize("same_keys", [True, False])
def test_derived_columns_are_computed_on_arrival_whatever_the_packet_form(same_keys) -> None:
    """A column a worker leaves to the main process never reaches the loop as a placeholder:
    in a joined packet, or in one of batches as they were (dicts with differing keys)."""
    slots = SharedSlots(1)
    extra = {} if same_keys else {"only_here": 1}
    parts = [
        {"id": torch.arange(3), "twice": Derived(_twice_id), **extra},
        {"id": torch.arange(3, 5), "twice": Derived(_twice_id)},
    ]
    packet = pack(slots, 0, 0, parts, _lengths(parts), [3, 5], last=True)
    (a, _), (b, _) = packet.unpack(slots)
    assert list(a)[:2] == ["id", "twice"]
    assert a["twice"].tolist() == [0, 2, 4] and b["twice"].tolist() == [6, 8]


# ---------------------------------------------------------------------------- after an error


def _failing_init(worker: int) -> None:
    raise RuntimeError("worker_init_fn failed")


def _failing_transform(batch: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("transform failed")


@pytest.mark.parametrize("failure", ["worker_init_fn", "transform"])
def test_nothing_printed_by_later_loaders_after_a_worker_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], failure: str
) -> None:
    """The failed iteration's workers are stopped when it raises, so its iterator is not
    collected later inside a forked worker of the next loader (``Exception ignored in
    _MultiProcessingDataLoaderIter.__del__``: "can only test a child process")."""
    _write_ids(tmp_path, 40)
    kwargs = {"path": str(tmp_path), "batch_size": 4, "num_workers": 2}
    bad = {"worker_init_fn": _failing_init} if failure == "worker_init_fn" else {
        "transform": _failing_transform}  # fmt: skip
    loader, _ = StructuredDataset.create_dataloader(**kwargs, **bad, **FORK)
    # As in a training loop: the failed iteration's garbage outlives the next fork, and the
    # forked workers collect it.
    gc.disable()
    try:
        for _ in range(2):
            # torch reports the init error, or (a race it has) the worker exiting first
            with pytest.raises(RuntimeError, match=r"failed|exited unexpectedly"):
                list(loader)
        assert not _running_iterators()  # the cause: workers left to the iterator's __del__
        fresh, _ = StructuredDataset.create_dataloader(
            **kwargs, worker_init_fn=_collect_garbage, **FORK
        )
        assert [len(list(fresh)) for _ in range(2)] == [10, 10]
    finally:
        gc.enable()
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err


def _running_iterators() -> list[object]:
    return [
        o for o in gc.get_objects() if type(o) is _MultiProcessingDataLoaderIter and not o._shutdown
    ]


def _collect_garbage(worker: int) -> None:
    gc.enable()
    gc.collect()


def _write_ids(root: Path, rows: int) -> None:
    pq.write_table(pa.table({"id": pa.array(range(rows), pa.int64())}), root / "ids.parquet")
