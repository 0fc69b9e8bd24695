"""Fuzzing with hypothesis: mutated states and mutated file bytes.

(a) States: real states (JSON round trip) with random mutations — keys deleted or renamed,
values of other types, negative and huge numbers, bits flipped in the bitmap, partial entries
and their row intervals altered or truncated, other versions — of plain states, of states
after an elastic resume (their ``base``) and of packed states (their ``tokens`` entries and
``_packing``), loaded as they were saved or elastically. ``load_state_dict`` plus one iteration
either raises the library's error — ``InvalidStateError`` naming the key, or
``CheckpointMismatchError`` with its likely cause; never a bare ``TypeError``/``ValueError`` —
or delivers exactly the rows (tokens) the (mutated, still valid) state says are left: disjoint
from the rows it claims delivered, and together every row of the epoch. Never a crash, hang or
a silent wrong resume.

(b) File bytes: truncations and flipped bytes in the footers and pages of small Parquet and
Arrow files. Building the dataset and reading an epoch raises ``DataSourceError`` (or
``SchemaMismatchError``) naming the file, or delivers rows. Each example (a batch of mutated
files) is read in a subprocess with a timeout, so a segfault or an abort is a test failure that
names the file and the falsifying example, not a dead pytest.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _data import rows_table, write_arrow, write_dataset, write_parquet
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st

from torch_dataloader_utils import (
    CheckpointMismatchError,
    InvalidStateError,
    StructuredDataset,
    TokenPacking,
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


def _state_after(loader: Any, batches: int | None) -> dict[str, Any]:
    """The loader's state (JSON round trip) after ``batches`` (``None``: all) of an epoch."""
    it = iter(loader)
    for _ in range(batches if batches is not None else 10**6):
        if next(it, None) is None:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return state


def _real_states(data: Path, num_workers: int) -> dict[bool, list[dict[str, Any]]]:
    """States after 0, 1, 5, 13 batches and at the end of epoch 1, shuffled and not; and one
    after 3 batches of an elastic resume from 5 batches (it holds a ``base``)."""
    states: dict[bool, list[dict[str, Any]]] = {}
    for shuffle in (False, True):
        states[shuffle] = []
        for k in (0, 1, 5, 13, None):
            loader, dataset = _loader(data, shuffle, num_workers)
            dataset.set_epoch(1)
            states[shuffle].append(_state_after(loader, k))
        loader, _ = _loader(data, shuffle, num_workers)
        loader.load_state_dict([states[shuffle][2]], elastic=True)
        states[shuffle].append(_state_after(loader, 3))
        assert states[shuffle][-1]["base"] is not None
    return states


@pytest.fixture(scope="module")
def real_states(data: Path) -> dict[bool, list[dict[str, Any]]]:
    return _real_states(data, num_workers=0)


@pytest.fixture(scope="module")
def real_states_w2(data: Path) -> dict[bool, list[dict[str, Any]]]:
    return _real_states(data, num_workers=2)


def claimed_rows(state: dict[str, Any], dataset: StructuredDataset) -> set[int]:
    """Row ids a state says were delivered: its done splits, partial intervals and base.

    Reads the plan through ``dataset._index`` (split id -> file, row range): the one private
    attribute this test relies on.
    """
    starts = dict(zip((f.name for f in dataset._index.files), np.cumsum((0, *ROWS)), strict=False))
    return claimed_rows_of(state, dataset, starts)


def claimed_rows_of(
    state: dict[str, Any], dataset: StructuredDataset, starts: dict[str, int]
) -> set[int]:
    """``claimed_rows`` for files whose first rows are numbered ``starts[name]``."""
    index = dataset._index
    rows: set[int] = set()
    parts = [state] + ([state["base"]] if state.get("base") else [])
    for part in parts:
        raw = zlib.decompress(base64.b64decode(part["done"]))
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[: len(index.splits)]
        for split_id in np.flatnonzero(bits):
            split = index.splits[split_id]
            first = int(starts[index.files[split.file].name]) + split.row_offset
            rows.update(range(first, first + split.row_length))
        for path, offset, _length, _fingerprint, bounds in part["partial"]:
            for lo, hi in zip(bounds[::2], bounds[1::2], strict=True):
                rows.update(range(int(starts[path]) + offset + lo, int(starts[path]) + offset + hi))
    return rows


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


def _flip_bitmap_bit(text: str, draw: Any) -> str:
    """A valid encoding of the bitmap with one split's bit flipped (if it decodes)."""
    try:
        raw = bytearray(zlib.decompress(base64.b64decode(text)))
    except Exception:
        return text
    if raw:
        bit = draw(st.integers(0, len(raw) * 8 - 1))
        raw[bit // 8] ^= 0x80 >> (bit % 8)
    return base64.b64encode(zlib.compress(bytes(raw))).decode()


def _flip_encoded_bit(text: str, draw: Any) -> str:
    """A bit flipped in the base64-decoded bytes (usually breaks zlib's checksum)."""
    raw = bytearray(base64.b64decode(text + "=" * (-len(text) % 4), validate=False) or b"\0")
    bit = draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    return base64.b64encode(bytes(raw)).decode()


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
        if isinstance(value, str) and key == "done":
            ops += ["flip-split", "flip-split", "flip-encoded", "truncate-text"]
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
        elif op == "flip-split":
            parent[key] = _flip_bitmap_bit(value, draw)
        elif op == "flip-encoded":
            parent[key] = _flip_encoded_bit(value, draw)
        elif op == "truncate-text" or op == "truncate-list":
            parent[key] = value[: draw(st.integers(0, max(0, len(value) - 1)))]
        elif op == "duplicate" and value:
            value.append(copy.deepcopy(value[draw(st.integers(0, len(value) - 1))]))
        elif op == "append":
            value.append(draw(ODD_VALUES))
    return state


def refusal(exc: Exception) -> str:
    """What a refused state raised, checked: an ``InvalidStateError`` names the key (or the
    version), a ``CheckpointMismatchError`` its likely cause."""
    message = str(exc)
    if isinstance(exc, InvalidStateError):
        assert re.search(r"key '[^']+'|state version|version \d+", message), message
    else:
        assert "\nLikely cause: " in message, f"no likely cause: {message}"
    return f"refused: {type(exc).__name__}"


def check_mutated(
    data: Path, state: dict[str, Any], shuffle: bool, num_workers: int, elastic: bool = False
) -> str:
    """Load + one iteration: a library error naming the key, or exactly the rows left."""
    loader, dataset = _loader(data, shuffle, num_workers)
    try:
        loader.load_state_dict([state] if elastic else state, elastic=elastic)
        rest = _ids(loader)
    except LIBRARY_ERRORS as exc:
        return refusal(exc)
    claimed = claimed_rows(state, dataset)
    assert len(rest) == len(set(rest)), "a row delivered twice after the resume"
    assert not set(rest) & claimed, "rows the state claims delivered were delivered again"
    assert set(rest) | claimed == set(range(TOTAL)), (
        f"{TOTAL - len(set(rest) | claimed)} rows lost by the resume"
    )
    return "resumed"


def fuzz_states(data: Path, states: dict[bool, list[dict]], choice: Any, workers: int) -> None:
    shuffle = choice.draw(st.booleans(), label="shuffle")
    base = choice.draw(st.sampled_from(states[shuffle]), label="real state")
    elastic = choice.draw(st.booleans(), label="elastic")
    mutated = mutate(base, choice.draw)
    event(check_mutated(data, mutated, shuffle, num_workers=workers, elastic=elastic))


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
            assert check_mutated(data, state, shuffle, num_workers, elastic=True) == "resumed"


# Packed states: documents of 0..12 tokens ``doc * 1000 + i`` (no separator, padding -1), so
# every delivered token says where it comes from.
DOC_LENGTHS = [(5 * d) % 13 for d in range(40)]
PACKED = {"batch_size": 2, "split_bytes": 1, "shuffle_seed": 5}


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-packed")
    tokens = [[d * 1000 + i for i in range(n)] for d, n in enumerate(DOC_LENGTHS)]
    for number, lo in enumerate((0, 25)):
        table = pa.table({"tokens": pa.array(tokens[lo : lo + 25], pa.list_(pa.int64()))})
        pq.write_table(table, root / f"part-{number}.parquet", row_group_size=4)
    return root


def _packed_loader(docs: Path, shuffle: bool) -> tuple[Any, StructuredDataset]:
    packing = TokenPacking("tokens", seq_len=5, pad_id=-1)
    return StructuredDataset.create_dataloader(
        str(docs), shuffle=shuffle, packing=packing, output="numpy", **PACKED
    )


@pytest.fixture(scope="module")
def packed_states(docs: Path) -> dict[bool, list[dict[str, Any]]]:
    """Packed states after 3 and 9 batches, and after 2 batches of an elastic resume."""
    states: dict[bool, list[dict[str, Any]]] = {}
    for shuffle in (False, True):
        states[shuffle] = [_state_after(_packed_loader(docs, shuffle)[0], k) for k in (3, 9)]
        loader, _ = _packed_loader(docs, shuffle)
        loader.load_state_dict([states[shuffle][0]], elastic=True)
        states[shuffle].append(_state_after(loader, 2))
        assert any(s["tokens"] for s in states[shuffle]), "a document cut in a state"
    return states


def claimed_tokens(state: dict[str, Any], dataset: StructuredDataset) -> set[int]:
    """Tokens a packed state says were delivered: whole documents, and cut ones' heads."""
    starts = {"part-0.parquet": 0, "part-1.parquet": 25}
    rows = claimed_rows_of(state, dataset, starts)
    tokens = {d * 1000 + i for d in rows for i in range(DOC_LENGTHS[d])}
    for path, offset, _length, _fingerprint, row, count in state["tokens"]:
        doc = starts[path] + offset + row
        tokens.update(doc * 1000 + i for i in range(count))
    return tokens


def check_mutated_packed(docs: Path, state: dict[str, Any], shuffle: bool, elastic: bool) -> str:
    loader, dataset = _packed_loader(docs, shuffle)
    try:
        loader.load_state_dict([state] if elastic else state, elastic=elastic)
        rest = [int(t) for b in loader for t in b["input_ids"].reshape(-1)[: b["num_tokens"]]]
    except LIBRARY_ERRORS as exc:
        return refusal(exc)
    claimed = claimed_tokens(state, dataset)
    every = {d * 1000 + i for d, n in enumerate(DOC_LENGTHS) for i in range(n)}
    assert len(rest) == len(set(rest)), "a token delivered twice after the resume"
    assert not set(rest) & claimed, "tokens the state claims delivered were delivered again"
    assert set(rest) | claimed == every, f"{len(every - set(rest) - claimed)} tokens lost"
    return "resumed"


def test_unmutated_packed_states_resume_exactly(docs: Path, packed_states):
    for shuffle, states in packed_states.items():
        for state in states:
            for elastic in (False, True):
                assert check_mutated_packed(docs, state, shuffle, elastic) == "resumed"


@pytest.mark.timeout(120)
@settings(max_examples=200)
@given(choice=st.data())
def test_mutated_packed_states_are_refused_or_resume_exactly(docs: Path, packed_states, choice):
    shuffle = choice.draw(st.booleans(), label="shuffle")
    state = choice.draw(st.sampled_from(packed_states[shuffle]), label="real state")
    elastic = choice.draw(st.booleans(), label="elastic")
    event(check_mutated_packed(docs, mutate(state, choice.draw), shuffle, elastic))


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
