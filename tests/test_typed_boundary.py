"""Every public argument given a value of the wrong type: refused with an error that names the
argument (never a traceback from inside torch or pyarrow), or, for numpy scalars, taken and
turned into builtins (a state that will not serialize is never made)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset, TokenPacking


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
    ("timeout", -1),
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
