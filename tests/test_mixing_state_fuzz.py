"""A corrupted mixture state: refused by name when it is loaded, or resumed exactly.

A valid mixture state (JSON; alone, or the second of an elastic list) gets one field
corrupted -- removed, of another type, or out of range -- and is loaded into a fresh loader of
the same mixture. Either the load (or, for what only the iteration can tell, the iteration)
raises ``InvalidStateError`` naming a key, or ``CheckpointMismatchError`` naming what differs,
or the loader delivers exactly what the uncorrupted state delivers. Never a raw ``KeyError``,
``TypeError`` or ``IndexError``.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fuzz import _get as field
from test_fuzz import _nodes
from test_mixing import write_documents, write_source

from torch_dataloader_utils import (
    CheckpointMismatchError,
    InvalidStateError,
    StructuredDataset,
    TokenPacking,
)
from torch_dataloader_utils.mixing.state import expanded

LIBRARY_ERRORS = (InvalidStateError, CheckpointMismatchError)
KWARGS: dict[str, Any] = {"weights": {"web": 2, "code": 1}, "batch_size": 4, "shuffle": True}
Path_ = tuple[str | int, ...]


def loader_of(paths: dict[str, str], workers: int) -> Any:
    return StructuredDataset.create_dataloader(paths, num_workers=workers, **KWARGS)[0]


def rest(loader: Any) -> list[int]:
    """Row ids the loader delivers (at most 200 batches: a resume never loops)."""
    return [i for batch in itertools.islice(loader, 200) for i in batch["id"].tolist()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Sources; per worker count a state after 3 batches with the rest it resumes into; and
    the states of 2 ranks after 2 and 3 batches with the rest they resume into on 1 rank."""
    root = tmp_path_factory.mktemp("mix-state-fuzz")
    # code of one file: its state's compact form (``mixing.compact``) is fuzzed too
    paths = {"web": write_source(root, "web", 0, 50), "code": write_source(root, "code", 1, 30, 1)}
    states = {}
    for workers in (0, 2):
        loader = loader_of(paths, workers)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        resumed = loader_of(paths, workers)
        resumed.load_state_dict(state)
        states[workers] = (state, rest(resumed))
    ranks = []
    for rank in range(2):
        loader, _ = StructuredDataset.create_dataloader(paths, rank=rank, world_size=2, **KWARGS)
        it = iter(loader)
        for _ in range(2 + rank):
            next(it)
        ranks.append(json.loads(json.dumps(loader.state_dict())))
        del it
    resumed = loader_of(paths, 0)
    resumed.load_state_dict(ranks, elastic=True)
    return {"paths": paths, "states": states, "elastic": (ranks, rest(resumed))}


def corruptions(value: Any) -> list[Any]:
    """Values of another type, and (for numbers, texts, lists) out of their range."""
    kinds: list[Any] = ["x", None, 1.5, [], {}, True, 3]
    other = [v for v in kinds if type(v) is not type(value)]
    if type(value) is int:
        return [*other, -1, value + 7, value + 1, 2**63, 2**80]
    if isinstance(value, str):
        return [*other, "", value[:-1], value + "0"]
    if isinstance(value, list):
        return [*other, value[:-1], [*value, copy.deepcopy(value[-1]) if value else 0]]
    return other


def named(error: Exception, path: Path_) -> bool:
    """Whether ``error`` says what is wrong: a mismatch names the setting or content that
    differs (``field``); a refused state names a key on ``path`` or, where two keys disagree
    (a position past the epoch the segment gives), the other one."""
    if isinstance(error, CheckpointMismatchError):
        return error.field is not None
    keys = [p for p in path if isinstance(p, str)]
    return "state key '" in str(error) or any(key in str(error) for key in keys)


REMOVE = "<the field removed>"
# Corruptions that escaped as raw errors or unnamed before: tried first, every run.
KNOWN = [
    (("cursor",), 7),  # KeyError(7) at the first iteration with 2 workers
    (("_mixture", "segment", 1), 1.5),  # TypeError: object of type 'float' has no len()
    (("_mixture", "segment", 0), 7),  # a segment after the state's epoch
    (("epoch",), 2**63),  # OverflowError: Python int too large to convert to C long
    (("streams", 0), None),  # "no position for worker 0", naming no key
]


# ... and in the second of two ranks' states resumed elastically onto one rank
KNOWN_ELASTIC = [
    (("_mixture", "segment", 3), [0]),  # loaded: 20 rows delivered of the 60 left
    (("sources", "code", "streams", 0, 1), 2**63),  # "(OverflowError: ...)", naming no key
    (("streams", 0), 2**63),  # refused naming 'sources.web.epochs' and '.fresh', not it
]


def fuzz(
    state: dict[str, Any],
    resumed: Callable[[dict[str, Any]], list[int]],
    expected: list[int],
    known: list[tuple[Path_, Any]],
    examples: int,
) -> None:
    """Corrupt one field of ``state`` (the ``known`` corruptions, then ``examples`` drawn):
    ``resumed(corrupted)`` is refused naming a key, or delivers ``expected``."""

    def options(path: Path_) -> list[Any]:
        parent = field(state, path[:-1])
        return [*([REMOVE] if isinstance(parent, dict) else []), *corruptions(parent[path[-1]])]

    def check(corruption: tuple[Path_, Any]) -> None:
        path, value = corruption
        corrupt = copy.deepcopy(state)
        parent = field(corrupt, path[:-1])
        if value == REMOVE:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        try:
            got = resumed(corrupt)
        except LIBRARY_ERRORS as exc:
            assert named(exc, path), f"{path}: {exc}"
            return
        assert got == expected, f"{path}: loaded and delivered other rows"

    fields = sorted((p for p in _nodes(state) if p), key=repr)  # every field but the state
    corruption = st.sampled_from(fields).flatmap(
        lambda path: st.tuples(st.just(path), st.sampled_from(options(path)))
    )
    for case in known:
        check(case)
    settings(max_examples=examples, deadline=None)(given(corruption)(check))()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("workers", "examples"), [(0, 100), (2, 25)])
def test_a_corrupted_field_is_refused_by_name_or_resumes_exactly(
    saved: dict[str, Any], workers: int, examples: int
) -> None:
    state, expected = saved["states"][workers]

    def resumed(corrupt: dict[str, Any]) -> list[int]:
        loader = loader_of(saved["paths"], workers)
        loader.load_state_dict(corrupt)
        return rest(loader)

    fuzz(state, resumed, expected, KNOWN, examples)


@pytest.mark.timeout(300)
def test_a_corrupted_field_of_an_elastic_list_is_refused_by_name_or_resumes_exactly(
    saved: dict[str, Any],
) -> None:
    states, expected = saved["elastic"]

    def resumed(corrupt: dict[str, Any]) -> list[int]:
        loader = loader_of(saved["paths"], 0)
        loader.load_state_dict([states[0], corrupt], elastic=True)
        return rest(loader)

    fuzz(states[1], resumed, expected, KNOWN_ELASTIC, 60)


@pytest.mark.parametrize("mixture", [True, False])
def test_a_cursor_past_the_workers_is_refused_when_loaded(
    saved: dict[str, Any], parquet_dir: Path, mixture: bool
) -> None:
    """``cursor = 7`` with 2 workers: refused by ``load_state_dict``, naming ``cursor`` (a
    mixture raised ``KeyError(7)`` at the first iteration)."""
    if mixture:
        state = copy.deepcopy(saved["states"][2][0])
        loader = loader_of(saved["paths"], 2)
    else:
        loader, _ = StructuredDataset.create_dataloader(str(parquet_dir), num_workers=2)
        state = loader.state_dict()
    state["cursor"] = 7
    with pytest.raises(InvalidStateError, match=r"state key 'cursor' is 7, but 'streams' holds 2"):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    ("field_of_code", "value", "message"),
    [
        # OverflowError: Python int too large to convert to C long, at the first iteration
        ("fresh", 2**63, r"'sources.code.rests' and '.fresh' .* fresh 9223372036854775808"),
        # "its parts do not fit together (KeyError: 0)"
        ("streams", [None], r"'sources.code.streams\[0\]' is null, but 'streams\[0\]' holds"),
    ],
)  # fmt: skip
def test_a_packed_source_out_of_step_is_refused_by_name(
    tmp_path: Path, field_of_code: str, value: Any, message: str
) -> None:
    """A packed mixture's place in a source is its stored one (by tokens): a source whose
    place contradicts the mixture's position is refused when loaded, naming both keys.
    (What the state claims of tokens -- a position, the tokens of a row delivered -- cannot be
    checked without reading: such an edit loads, and delivers what it claims.)"""
    paths = {"web": write_documents(tmp_path, "web", 0, 40)}
    paths["code"] = write_documents(tmp_path, "code", 1, 25)
    kwargs = {**KWARGS, "batch_size": 2, "epoch_size": 30}
    loader, _ = StructuredDataset.create_dataloader(
        paths, packing=TokenPacking("tokens", seq_len=8), **kwargs
    )
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = expanded(json.loads(json.dumps(loader.state_dict())))  # each key written
    del it
    state["sources"]["code"][field_of_code] = value
    fresh, _ = StructuredDataset.create_dataloader(
        paths, packing=TokenPacking("tokens", seq_len=8), **kwargs
    )
    with pytest.raises(InvalidStateError, match=message):
        fresh.load_state_dict(state)


@pytest.fixture(scope="module")
def after_elastic(saved: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """A state saved 2 batches after the 2 ranks' states resumed elastically onto 1 rank of
    2 workers (each source's ``rests`` and ``fresh``, the segment's positions dealt), with
    what the uninterrupted iteration delivers after it."""
    loader = loader_of(saved["paths"], 2)
    loader.load_state_dict(saved["elastic"][0], elastic=True)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = expanded(json.loads(json.dumps(loader.state_dict())))  # each key written
    return state, rest(it)


def test_a_state_saved_after_an_elastic_resume_resumes_exactly(
    after_elastic: tuple[dict[str, Any], list[int]], saved: dict[str, Any]
) -> None:
    state, expected = after_elastic
    for name in ("web", "code"):  # each source's epoch 0 left, its epoch 1 the next dealt
        rests = state["sources"][name]["rests"]
        assert ([e for e, _ in rests], state["sources"][name]["fresh"]) == ([0], 1)
    assert state["_mixture"]["segment"] == [0, [], {}, [30, 30]]  # 60 positions left
    loader = loader_of(saved["paths"], 2)
    loader.load_state_dict(state)
    assert rest(loader) == expected
    assert len(expected) == 52


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("sources", "web", "fresh"), 2, r"'sources.web.rests' .* got epochs \[0\] and fresh 2"),
        (("sources", "web", "fresh"), 0, r"'sources.web.rests' .* got epochs \[0\] and fresh 0"),
        (("sources", "web", "rests"), "twice", r"'sources.web.rests' .* got epochs \[0, 0\]"),
        (("_mixture", "segment", 3), [29, 30], r"'_mixture.segment' gives the streams \[29, 30\]"),
        (("_mixture", "segment", 3), [30, 31], r"'_mixture.segment' gives the streams \[30, 31\]"),
        (("_mixture", "segment", 3), [34, 30], r"'_mixture.segment' gives the streams \[34, 30\]"),
    ],
)  # fmt: skip
def test_a_state_edited_after_an_elastic_resume_is_refused_by_name(
    after_elastic: tuple[dict[str, Any], list[int]],
    saved: dict[str, Any],
    path: Path_,
    value: Any,
    message: str,
) -> None:
    """Each edit loaded and delivered other rows (other ids of web in the 52, or one more or
    fewer): the rest epochs increase, ``fresh`` is the one after the last, and the positions
    an elastic resume dealt are one deal (the larger first, at most one apart, or a batch).
    (A deal of another number of positions left -- [31, 30], [30, 29], or one stream's any
    number -- is a valid state of another old job: the state does not keep that number.)"""
    corrupt = copy.deepcopy(after_elastic[0])
    parent = field(corrupt, path[:-1])
    parent[path[-1]] = [*parent[path[-1]]] * 2 if value == "twice" else value
    loader = loader_of(saved["paths"], 2)
    with pytest.raises(InvalidStateError, match=message + r".*: the state is corrupted"):
        loader.load_state_dict(corrupt)
