"""Fuzzing with hypothesis: mutated states and mutated file bytes.

(a) States: real states (JSON round trip) with random mutations — keys deleted or renamed,
values of other types, negative and huge numbers, stream entries (positions, tokens, split
keys, rows) altered or truncated, other versions. ``load_state_dict`` plus one iteration either
raises the library's error (``InvalidStateError`` naming the key, or ``CheckpointMismatchError``
with its likely cause), never a raw ``TypeError``/``ValueError``, or delivers exactly
the rows the (mutated, still valid) state says are left: disjoint from the rows its positions
stand for, and together every row of the epoch. Never a crash, hang or a silent wrong resume.

(b) File bytes: truncations and flipped bytes in the footers and pages of small Parquet and
Arrow files. Building the dataset and reading an epoch raises ``DataSourceError`` (or
``SchemaMismatchError``) naming the file, or delivers rows. Each example (a batch of mutated
files) is read in a subprocess with a timeout, so a segfault or an abort is a test failure that
names the file and the falsifying example, not a dead pytest.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _data import rows_table, write_arrow, write_dataset, write_parquet
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st

from torch_dataloader_utils import (
    CheckpointMismatchError,
    InvalidStateError,
    StructuredDataset,
)

HERE = Path(__file__).resolve().parent
ROWS = (60, 45, 75)
TOTAL = sum(ROWS)
ARGS = {"batch_size": 7, "split_bytes": 1, "shuffle_seed": 5}
LIBRARY_ERRORS = (InvalidStateError, CheckpointMismatchError)


# ----------------------------------------------------------------------------- (a) states


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-states")
    write_dataset(root, ROWS, row_group_size=8)
    return root


def _loader(data: Path, shuffle: bool, num_workers: int = 0) -> tuple[Any, StructuredDataset]:
    return StructuredDataset.create_dataloader(
        str(data), shuffle=shuffle, num_workers=num_workers, **ARGS
    )


def _ids(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch["id"].tolist()]


def _real_states(data: Path, num_workers: int) -> dict[bool, list[dict[str, Any]]]:
    """States after 0, 1, 5, 13 batches and at the end of epoch 1, shuffled and not; and one
    taken 4 batches after an elastic resume of the 5-batch one (it holds ``generations``)."""
    states: dict[bool, list[dict[str, Any]]] = {}
    for shuffle in (False, True):
        states[shuffle] = []
        for k in (0, 1, 5, 13, None):
            states[shuffle].append(_state_after(data, shuffle, num_workers, k))
        states[shuffle].append(
            _state_after(data, shuffle, num_workers, 4, elastic_from=states[shuffle][2])
        )
    return states


def _state_after(
    data: Path, shuffle: bool, num_workers: int, k: int | None, elastic_from: Any = None
) -> dict[str, Any]:
    loader, dataset = _loader(data, shuffle, num_workers)
    dataset.set_epoch(1)
    if elastic_from is not None:
        loader.load_state_dict([elastic_from], elastic=True)
    it = iter(loader)
    for _ in range(k if k is not None else 10**6):
        if next(it, None) is None:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return state


@pytest.fixture(scope="module")
def real_states(data: Path) -> dict[bool, list[dict[str, Any]]]:
    return _real_states(data, num_workers=0)


@pytest.fixture(scope="module")
def real_states_w2(data: Path) -> dict[bool, list[dict[str, Any]]]:
    return _real_states(data, num_workers=2)


def claimed_rows(dataset: StructuredDataset, num_workers: int) -> set[int]:
    """Row ids the loaded state stands for as delivered: every row but those its streams have
    yet to hand out (after an elastic resume, the earlier deals' rows are delivered too).

    Reads the plan through the dataset's private ``_epochs`` and ``_next_start`` (split id ->
    file, row range; a stream's order): what this test relies on. One rank.
    """
    from _orders import stream_rows

    epochs, start = dataset._epochs, dataset._next_start
    index = epochs.index
    starts = dict(zip((f.name for f in index.files), np.cumsum((0, *ROWS)), strict=False))
    progress = epochs.begin(start, num_workers)
    left: set[int] = set()
    for worker, order in progress.orders.items():
        for split_id, row in stream_rows(order)[int(progress.positions[worker]) :]:
            split = index.splits[split_id]
            left.add(int(starts[index.files[split.file].name]) + split.row_offset + row)
    return set(range(TOTAL)) - left


# Values that replace a node: wrong types, negative and huge numbers, near misses.
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-1, -(2**63), 2**63, 2**64 + 1, 10**30, 0, 1, 2, 3]),
    st.integers(min_value=-1000, max_value=1000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "AAAA", "eJxjYGAAAAADAAE=", "not base64!", "2"]),
    st.lists(st.integers(min_value=-5, max_value=100), max_size=6),
    st.builds(dict),  # a fresh one each time: a mutation may append to it
    st.builds(list),
)


def _nodes(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _nodes(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _nodes(child, (*path, i))


def _get(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state


def mutate(state: dict[str, Any], draw: Any) -> dict[str, Any]:
    """One to three random mutations of a deep copy of ``state``."""
    state = copy.deepcopy(state)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _nodes(state) if p]
        path = draw(st.sampled_from(paths))
        parent, key, value = _get(state, path[:-1]), path[-1], _get(state, path)
        ops = ["replace", "delete"]
        if isinstance(parent, dict):
            ops.append("rename")
        if isinstance(value, int) and not isinstance(value, bool):
            ops += ["shift", "shift"]
        if isinstance(value, str):
            ops += ["truncate-text"]
        if isinstance(value, list):
            ops += ["truncate-list", "duplicate", "append"]
        op = draw(st.sampled_from(ops))
        if op == "replace":
            parent[key] = draw(ODD_VALUES)
        elif op == "delete":
            del parent[key]
        elif op == "rename":
            parent[draw(st.sampled_from([f"{key}_", str(key).upper(), "x", ""]))] = parent.pop(key)
        elif op == "shift":
            parent[key] = value + draw(st.sampled_from([-1, 1, 2, 7, -(2**40), 2**62, 2**80]))
        elif op == "truncate-text" or op == "truncate-list":
            parent[key] = value[: draw(st.integers(0, max(0, len(value) - 1)))]
        elif op == "duplicate" and value:
            value.append(copy.deepcopy(value[draw(st.integers(0, len(value) - 1))]))
        elif op == "append":
            value.append(draw(ODD_VALUES))
    return state


def check_mutated(data: Path, state: dict[str, Any], shuffle: bool, num_workers: int) -> str:
    """Load + one iteration: a library error with a message, or exactly the rows left."""
    loader, dataset = _loader(data, shuffle, num_workers)
    try:
        loader.load_state_dict(state)
        claimed = claimed_rows(dataset, num_workers)
        rest = _ids(loader)
    except LIBRARY_ERRORS as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return f"refused: {type(exc).__name__}"
    assert len(rest) == len(set(rest)), "a row delivered twice after the resume"
    assert not set(rest) & claimed, "rows the state claims delivered were delivered again"
    assert set(rest) | claimed == set(range(TOTAL)), (
        f"{TOTAL - len(set(rest) | claimed)} rows lost by the resume"
    )
    return "resumed"


def fuzz_states(data: Path, states: dict[bool, list[dict]], choice: Any, workers: int) -> None:
    shuffle = choice.draw(st.booleans(), label="shuffle")
    base = choice.draw(st.sampled_from(states[shuffle]), label="real state")
    event(check_mutated(data, mutate(base, choice.draw), shuffle, num_workers=workers))


@pytest.mark.timeout(120)
@settings(max_examples=300)
@given(choice=st.data())
def test_mutated_states_are_refused_or_resume_exactly(data: Path, real_states, choice):
    fuzz_states(data, real_states, choice, workers=0)


@pytest.mark.slow
@pytest.mark.timeout(180)
@settings(max_examples=15)
@given(choice=st.data())
def test_mutated_states_with_workers(data: Path, real_states_w2, choice):
    """The same with two workers, where positions are checked as the workers start."""
    fuzz_states(data, real_states_w2, choice, workers=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unmutated_states_resume_exactly(data: Path, num_workers: int):
    """The oracle itself: every real state resumes to exactly the rows it has left."""
    for shuffle, states in _real_states(data, num_workers).items():
        for state in states:
            assert check_mutated(data, state, shuffle, num_workers) == "resumed"


def test_malformed_file_group_with_other_digest_is_an_invalid_state(
    data: Path, real_states: dict[bool, list[dict[str, Any]]]
):
    state = copy.deepcopy(real_states[False][2])
    state["files"]["digest"] = "0000000000000000"
    del state["files"]["groups"][0][0]  # [path, path, count, digest] -> 3 items
    loader, _ = _loader(data, shuffle=False)
    with pytest.raises(InvalidStateError, match="groups"):
        loader.load_state_dict(state)


# ----------------------------------------------------------------------------- (b) file bytes


def _base_files(root: Path) -> dict[str, tuple[str, bytes]]:
    """Small intact files: name -> (format, bytes)."""
    table = rows_table(0, 50)
    paths = {
        "plain.parquet": write_parquet(root / "plain.parquet", table, 10, compression="none"),
        "snappy.parquet": write_parquet(
            root / "snappy.parquet", table, 16, compression="snappy", write_page_index=True
        ),
        "dict.parquet": write_parquet(
            root / "dict.parquet", table, 25, compression="zstd", data_page_size=64
        ),
        "plain.arrow": write_arrow(root / "plain.arrow", table, 10),
    }
    return {
        name: ("arrow" if name.endswith(".arrow") else "parquet", Path(path).read_bytes())
        for name, path in paths.items()
    }


_BASE_DIR = Path(tempfile.mkdtemp(prefix="tdu-fuzz-files-"))
BASE_FILES = _base_files(_BASE_DIR)
shutil.rmtree(_BASE_DIR, ignore_errors=True)


@st.composite
def mutated_file(draw: Any) -> dict[str, Any]:
    """One base file with a truncation, or 1-4 bytes set, in its footer or its pages."""
    name = draw(st.sampled_from(sorted(BASE_FILES)))
    size = len(BASE_FILES[name][1])
    footer = min(size, draw(st.sampled_from([8, 64, 256, 1024])))
    where = draw(st.sampled_from(["footer", "pages", "anywhere"]))
    lo, hi = {"footer": (size - footer, size), "pages": (0, size - footer)}.get(where, (0, size))
    if draw(st.booleans()):
        return {"name": name, "truncate": draw(st.integers(0, size - 1))}
    edits = draw(
        st.lists(
            st.tuples(st.integers(lo, max(lo, hi - 1)), st.integers(0, 255)),
            min_size=1,
            max_size=4,
        )
    )
    return {"name": name, "set": edits}


def _apply(mutation: dict[str, Any]) -> bytes:
    raw = bytearray(BASE_FILES[mutation["name"]][1])
    if "truncate" in mutation:
        return bytes(raw[: mutation["truncate"]])
    for position, value in mutation["set"]:
        raw[position] = value if raw[position] != value else value ^ 0xFF
    return bytes(raw)


def read_files_in_subprocess(jobs: list[dict[str, Any]], timeout: float = 90) -> list[dict]:
    """Each job's file read in one child process: an outcome per file (see ``_read_main``)."""
    spec = Path(tempfile.mkdtemp(prefix="tdu-fuzz-job-")) / "jobs.json"
    spec.write_text(json.dumps(jobs))
    try:
        return _run_reader(spec, jobs, timeout)
    finally:
        shutil.rmtree(spec.parent, ignore_errors=True)


def _run_reader(spec: Path, jobs: list[dict[str, Any]], timeout: float) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    try:
        done = subprocess.run(
            [sys.executable, __file__, str(spec)], env=env, timeout=timeout, capture_output=True,
            text=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        began = [json.loads(x) for x in (exc.stdout or b"").decode().splitlines() if x]
        raise AssertionError(f"reading hung; last file begun: {began[-1:]}") from None
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert done.returncode == 0, (
        f"the reading process died (exit {done.returncode}) on {lines[-1:]}:\n{done.stderr[-3000:]}"
    )
    return [line for line in lines if "outcome" in line]


def _read_main(spec: str) -> None:
    """Child: build and read each job's file, print one JSON line per file."""
    from torch_dataloader_utils import DataSourceError, SchemaMismatchError

    for job in json.loads(Path(spec).read_text()):
        print(json.dumps({"begin": job["path"]}), flush=True)
        try:
            loader, _ = StructuredDataset.create_dataloader(
                job["path"], format=job["format"], batch_size=16, split_bytes=1
            )
            rows = sum(len(next(iter(b.values()))) for b in loader)  # names may be mutated
            outcome = {"outcome": "rows", "rows": rows}
        except (DataSourceError, SchemaMismatchError) as exc:
            outcome = {"outcome": "error", "type": type(exc).__name__, "message": str(exc)}
        except Exception as exc:
            outcome = {"outcome": "other", "type": type(exc).__name__, "message": str(exc)}
        print(json.dumps({**outcome, "path": job["path"]}), flush=True)


def check_file_outcomes(mutations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="tdu-fuzz-bytes-"))
    try:
        jobs = []
        for number, mutation in enumerate(mutations):
            fmt, _ = BASE_FILES[mutation["name"]]
            path = root / f"case{number:02d}" / mutation["name"]
            path.parent.mkdir()
            path.write_bytes(_apply(mutation))
            jobs.append({"path": str(path), "format": fmt, "mutation": mutation})
        outcomes = read_files_in_subprocess(jobs)
        assert len(outcomes) == len(jobs)
        for job, outcome in zip(jobs, outcomes, strict=True):
            context = f"{job['mutation']} -> {outcome}"
            assert outcome["outcome"] != "other", f"not a DataSourceError: {context}"
            if outcome["outcome"] == "error":
                assert job["mutation"]["name"] in outcome["message"], f"file not named: {context}"
        return outcomes
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
# No shrinking: every example costs a process; the failing batch is reported as drawn.
@settings(max_examples=8, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(mutations=st.lists(mutated_file(), min_size=10, max_size=10))
def test_mutated_file_bytes_raise_naming_the_file_or_deliver_rows(mutations: list[dict]):
    check_file_outcomes(mutations)


def test_intact_and_truncated_files_in_a_subprocess():
    """The harness itself, quickly: intact files deliver all rows, an empty file is refused."""
    mutations = [{"name": name, "set": []} for name in sorted(BASE_FILES)]
    mutations += [{"name": "plain.parquet", "truncate": 0}, {"name": "plain.arrow", "truncate": 9}]
    outcomes = check_file_outcomes(mutations)
    assert [o.get("rows") for o in outcomes[:4]] == [50] * 4
    assert [o["outcome"] for o in outcomes[4:]] == ["error", "error"]


def test_invalid_utf8_in_a_string_page_is_a_data_source_error(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torch_dataloader_utils import DataSourceError

    offsets = pa.array(["r0", "r1"]).buffers()[1]
    names = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"r0\xed\xa0")])
    path = tmp_path / "bad-utf8.parquet"
    pq.write_table(pa.table({"id": pa.array([0, 1], pa.int64()), "name": names}), path)
    loader, _ = StructuredDataset.create_dataloader(str(path), batch_size=4)
    with pytest.raises(DataSourceError, match=r"bad-utf8\.parquet"):
        list(loader)


# Corruptions this fuzz found that once surfaced as other errors (now: validated record batches,
# a sanity bound on rows per split).
CORRUPT_ARROW = [
    pytest.param(
        [(573, 0)],
        id="null-count",
    ),
    pytest.param(
        [(205, 128), (366, 34), (189, 59), (256, 177)],
        id="batch-length",
    ),
    pytest.param(
        [(129, 160), (3287, 167)],
        id="string-offsets",
    ),
]


@pytest.mark.parametrize("edits", CORRUPT_ARROW)
def test_corrupted_arrow_file_is_a_data_source_error(tmp_path: Path, edits: list):
    path = tmp_path / "corrupt.arrow"
    path.write_bytes(_apply({"name": "plain.arrow", "set": edits}))
    outcome = read_files_in_subprocess([{"path": str(path), "format": "arrow"}])[0]
    assert outcome.get("type") == "DataSourceError", outcome
    assert "corrupt.arrow" in outcome["message"], outcome


if __name__ == "__main__":
    _read_main(sys.argv[1])
