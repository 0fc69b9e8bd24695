"""Every public argument given a value of the wrong type: refused with an error that names the
argument (never a traceback from inside torch or pyarrow), or, for numpy scalars, taken and
turned into builtins (a state that will not serialize is never made)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _data import write_dataset

import torch_dataloader_utils
from torch_dataloader_utils import Source, StructuredDataset, TokenPacking
from torch_dataloader_utils.mixing.source import MAX_EPOCH_SIZE
from torch_dataloader_utils.planning.tokens import PACKED_KEYS

PACKAGE = Path(torch_dataloader_utils.__file__).parent


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("typed")
    write_dataset(root, [20, 20], row_group_size=5)
    return root


_INTS = {"batch_size": 1, "split_bytes": 1, "shuffle_seed": None, "shuffle_memory_bytes": 2**20,
         "num_workers": 0, "rank": 0, "world_size": 1, "prefetch_factor": 1}  # fmt: skip
_FLAGS = ("shuffle", "drop_last", "even_batches", "share_index", "persistent_workers",
          "pin_memory")  # fmt: skip
# What each argument is refused as, with a value that is wrong for it.
WRONG: list[tuple[str, object]] = [
    *[(name, value) for name in _INTS for value in ("2", 2.0, True)],
    *[(name, -1) for name, least in _INTS.items() if least is not None],
    *[(name, value) for name in _FLAGS for value in ("false", "true", 0, 1.0)],
    ("shuffle_window", "4"), ("shuffle_window", 0), ("format", 3), ("output", None),
    ("columns", "id"), ("transform", 3), ("packing", "tokens"), ("timeout", "5"),
    ("timeout", -1), ("storage_options", "anon=true"), ("storage_options", [("anon", True)]),
]  # fmt: skip


def _kwargs(name: str, value: object) -> dict[str, Any]:
    kwargs: dict[str, Any] = {name: value}
    if name in ("rank", "world_size"):
        kwargs.setdefault("rank", 0)
        kwargs.setdefault("world_size", 1)
    if name in ("persistent_workers", "prefetch_factor"):
        kwargs["num_workers"] = 1
    if name == "shuffle_window":
        kwargs["shuffle"] = True
    return kwargs


@pytest.mark.parametrize(("name", "value"), WRONG)
def test_a_wrong_value_is_refused_naming_the_argument(data: Path, name: str, value: object):
    with pytest.raises((TypeError, ValueError)) as info:
        StructuredDataset.create_dataloader(str(data), **_kwargs(name, value))
    assert name in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"seq_len": "8"}, "seq_len"), ({"seq_len": 8.0}, "seq_len"), ({"seq_len": 0}, "seq_len"),
     ({"seq_len": 8, "separator": "2"}, "separator"), ({"seq_len": 8, "pad_id": None}, "pad_id"),
     ({"seq_len": 8, "separator": True}, "separator")],
)  # fmt: skip
def test_token_packing_refuses_by_name(kwargs: dict[str, Any], name: str):
    with pytest.raises((TypeError, ValueError), match=name):
        TokenPacking("tokens", **kwargs)


@pytest.mark.parametrize("epoch", ["1", 1.0, -1, None, True])
def test_set_epoch_refuses_by_name(data: Path, epoch: object):
    dataset = StructuredDataset(str(data))
    with pytest.raises((TypeError, ValueError), match="epoch"):
        dataset.set_epoch(epoch)  # type: ignore[arg-type]


@pytest.mark.parametrize("state", [None, "state", 3, [[1]]])
def test_load_state_dict_refuses_what_is_not_a_state(data: Path, state: object):
    from torch_dataloader_utils import InvalidStateError

    dataset = StructuredDataset(str(data))
    with pytest.raises((TypeError, InvalidStateError), match="state"):
        dataset.load_state_dict(state)  # type: ignore[arg-type]


def test_numpy_scalars_are_taken_as_builtins(data: Path):
    loader, dataset = StructuredDataset.create_dataloader(
        str(data), batch_size=np.int32(4), split_bytes=np.int64(100), shuffle=np.bool_(True),
        shuffle_seed=np.int64(-3), num_workers=np.int64(0), rank=np.int64(1),
        world_size=np.int64(2), even_batches=np.bool_(True), drop_last=np.bool_(False),
    )  # fmt: skip
    dataset.set_epoch(np.uint8(2))
    next(iter(loader))
    state = dataset.state_dict()
    assert json.loads(json.dumps(state)) == state
    for key in ("epoch", "_shuffle_seed", "_rank", "_world_size", "_split_bytes"):
        assert type(state[key]) is int, key
    assert type(state["_shuffle"]) is bool and type(state["_even_batches"]) is bool


# ----------------------------------------------------------------------------- a mixture


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("typed_mixture")
    for name in "ab":
        (root / name).mkdir()
        table = pa.table({"id": np.arange(8), "tokens": pa.array([[1, 2, 3]] * 8)})
        pq.write_table(table, root / name / "0.parquet")
    return {name: str(root / name) for name in "ab"}


_PACKED = {"packing": TokenPacking("tokens", seq_len=4), "epoch_size": 4}
# (a source's Source arguments or the mixture's arguments, what the error names)
WRONG_IN_A_MIXTURE: list[tuple[dict[str, Any], str]] = [
    *[({"source": {"path": value}}, "path of source 'a'") for value in (3, [3], None, b"a")],
    *[({"source": {"format": value}}, "format of source 'a'") for value in (3, ["x"], "csv")],
    *[({"source": {"storage_options": value}}, "storage_options of source 'a'")
      for value in ("key=x", [("key", "x")], 3)],
    *[({"source": {name: value}}, f"{name} of source 'a'")
      for name in ("split_bytes", "shuffle_memory_bytes", "max_epochs")
      for value in ("2", 2.0, True, 0)],
    *[({"source": {"when_exhausted": value}}, "when_exhausted of source 'a'")
      for value in (None, 3, "Stop", ["stop"])],
    *[({"source": {"text_column": value}}, "text_column of source 'a'")
      for value in (3, b"text", "", ["text"])],
    *[({"weights": value}, "weights") for value in ("ab", [1, 1], {"a": 1}, {"a": 1, 2: 1})],
    *[({"weights": {"a": value, "b": 1}}, "weights['a']") for value in ("1", 1.5, True, 0, -2)],
    ({"weights": {"a": 2**40, "b": 1}}, "weights"),
    *[({"epoch_size": value}, "epoch_size") for value in ("4", 4.0, True, 0, 2**48 + 1,
                                                          sys.maxsize)],
    *[({"schedule_block": value}, "schedule_block") for value in ("4", 4.0, False, 0, 2**23)],
    *[({"source_column": value}, "source_column") for value in (1, b"source", "", ["s"])],
    ({"source_column": "id"}, "source_column"),
    *[({"source_column": key, **_PACKED}, "source_column") for key in PACKED_KEYS],
    ({"storage_options": "key=x"}, "storage_options"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "name"), WRONG_IN_A_MIXTURE, ids=[repr(k)[:60] for k, _ in WRONG_IN_A_MIXTURE]
)
def test_a_wrong_mixture_argument_is_refused_naming_it(
    sources: dict[str, str], kwargs: dict[str, Any], name: str
):
    kwargs = {"weights": {"a": 1, "b": 1}, **kwargs}
    paths: dict[str, Any] = dict(sources)
    if "source" in kwargs:
        paths["a"] = Source(**{"path": paths["a"], **kwargs.pop("source")})
    with pytest.raises((TypeError, ValueError)) as info:
        StructuredDataset.create_dataloader(paths, **kwargs)
    assert isinstance(info.value, TypeError | ValueError)
    assert name in str(info.value), str(info.value)
    # raised by the library, never by pyarrow or numpy inside it
    assert PACKAGE in Path(info.traceback[-1].path).parents, info.traceback[-1]


def test_the_largest_epoch_size_saves_a_state_that_loads(sources: dict[str, str]):
    """Regression: ``epoch_size=2**50`` was taken, and its state refused by its own loader."""
    kwargs: dict[str, Any] = {"weights": {"a": 1, "b": 1}, "batch_size": 4}
    loader, dataset = StructuredDataset.create_dataloader(
        sources, epoch_size=MAX_EPOCH_SIZE, **kwargs
    )
    first = next(iter(loader))
    state = json.loads(json.dumps(dataset.state_dict()))
    assert state["_mixture"]["epoch_size"] == MAX_EPOCH_SIZE
    again, resumed = StructuredDataset.create_dataloader(
        sources, epoch_size=MAX_EPOCH_SIZE, **kwargs
    )
    resumed.load_state_dict(state)
    assert first["id"].tolist() == [0, 0, 1, 1]
    assert next(iter(again))["id"].tolist() == [2, 2, 3, 3]


def test_packed_batch_keys_are_the_ones_source_column_may_not_take(sources: dict[str, str]):
    loader, _ = StructuredDataset.create_dataloader(
        sources, weights={"a": 1, "b": 1}, batch_size=2, source_column="from", **_PACKED
    )
    assert list(next(iter(loader))) == [*PACKED_KEYS, "from"]


@pytest.mark.parametrize("path", [3, b"data", ["a", 3], None])
def test_a_path_that_is_not_a_string_is_refused_by_name(path: object):
    """Before: ``'int' object is not iterable``, ``'PosixPath' object has no attribute
    'decode'`` (a list of paths), naming nothing."""
    with pytest.raises(TypeError, match=r"^path must be a path \(a str or os.PathLike\) or a list"):
        StructuredDataset(path)  # type: ignore[arg-type]


def test_a_pathlib_path_reads_as_its_string(data: Path):
    """``os.PathLike`` paths (``pathlib.Path``), alone or in a list, read as their strings."""
    by_string = StructuredDataset(str(data))
    for path in (data, [data]):
        dataset = StructuredDataset(path)  # type: ignore[arg-type]
        assert len(dataset) == len(by_string) > 0
