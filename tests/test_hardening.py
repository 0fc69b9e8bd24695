"""Regressions of issue 17 (review and black-box tests): each test failed before its fix."""

from __future__ import annotations

import copy
import gc
import itertools
import json
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _data import ids_of, write_dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_dataloader_utils import (
    CheckpointMismatchError,
    DataSourceError,
    InvalidStateError,
    StructuredDataset,
    TokenPacking,
    UnsendableBatchError,
)
from torch_dataloader_utils.cli import main


@pytest.fixture(scope="module")
def two_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """110 rows (ids 0..109) in two files of 50 and 60 rows, row groups of 10."""
    root = tmp_path_factory.mktemp("two_files")
    write_dataset(root, [50, 60], row_group_size=10)
    return root


def write_docs(root: Path, lengths: Sequence[int], row_group: int = 4) -> Path:
    """One Parquet file of documents (``tokens``: list<int64>); document d holds the tokens
    ``100 * d + 3 ..`` (never the separator 2 or the pad 0)."""
    root.mkdir(parents=True, exist_ok=True)
    tokens = [list(range(100 * d + 3, 100 * d + 3 + n)) for d, n in enumerate(lengths)]
    table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int64()))})
    pq.write_table(table, root / "docs.parquet", row_group_size=row_group)
    return root


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 documents of 0..16 tokens."""
    lengths = [(7 * d) % 17 for d in range(30)]
    return write_docs(tmp_path_factory.mktemp("docs"), lengths)


# ----------------------------------------------------------------- 1: persistent workers


@pytest.mark.parametrize("how", ["del", "cycle"])
def test_an_older_iterator_closed_late_does_not_end_the_running_epoch(two_files: Path, how: str):
    """Closing an older iterator after a newer one began bumped the generation of the slots
    the newer one owns: ``LostBatchesError: DataLoader worker(s) [0, 1] stopped before ...``."""
    loader, dataset = StructuredDataset.create_dataloader(
        str(two_files), batch_size=8, num_workers=2, persistent_workers=True
    )
    old = iter(loader)
    next(old)
    new = iter(loader)
    got = ids_of(next(new))
    if how == "cycle":
        cycle: list[object] = [old]
        cycle.append(cycle)
        del cycle
    del old
    gc.collect()
    got += [i for batch in new for i in ids_of(batch)]
    assert sorted(got) == list(range(110))
    assert dataset.state_dict()["epoch"] == 0
    again = [i for batch in loader for i in ids_of(batch)]  # the same workers serve on
    assert sorted(again) == list(range(110))


# ----------------------------------------------------------------- 2: numpy scalars


def _builtins_only(value: object, where: str = "state") -> None:
    """Every value of ``value`` is of a builtin JSON type (not a subclass such as np.bool_)."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str, f"{where}: key {key!r}"
            _builtins_only(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _builtins_only(item, f"{where}[{i}]")
    else:
        assert type(value) in (str, int, float, bool, type(None)), f"{where}: {type(value)}"


def test_numpy_scalars_become_builtins_in_the_state(docs_dir: Path, tmp_path: Path):
    """``separator=np.int64(2)``, ``set_epoch(np.int64(1))``, ``rank=np.int64(0)`` went into
    the state as numpy scalars: ``json.dumps`` and ``torch.load(weights_only=True)`` refused it."""
    packing = TokenPacking("tokens", seq_len=np.int64(8), separator=np.int64(2), pad_id=np.int32(0))
    assert type(packing.seq_len) is int and type(packing.separator) is int
    assert type(packing.pad_id) is int
    loader, dataset = StructuredDataset.create_dataloader(
        str(docs_dir), batch_size=np.int64(2), rank=np.int64(0), world_size=np.int64(2),
        shuffle=True, shuffle_seed=np.int64(3), split_bytes=np.int64(300), packing=packing,
    )  # fmt: skip
    dataset.set_epoch(np.int64(1))
    assert type(dataset.epoch) is int
    it = iter(loader)
    next(it)
    state = dataset.state_dict()
    del it
    _builtins_only(state)
    assert json.loads(json.dumps(state)) == state
    torch.save(state, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True) == state


# ----------------------------------------------------------------- 3: float and negative epochs


@pytest.mark.parametrize(
    ("epoch", "error", "match"),
    [
        (1.0, TypeError, r"epoch must be an int, got 1\.0 \(float\)"),
        (-1, ValueError, "epoch must be a non-negative int, got -1"),
        ("1", TypeError, r"epoch must be an int, got '1' \(str\); convert .*int\('1'\)"),
    ],
)
def test_set_epoch_refuses_what_is_not_an_epoch(
    two_files: Path, epoch: object, error: type[Exception], match: str
):
    """``set_epoch(1.0)`` keyed the order by "0:1.0" (not epoch 1's order) and ``set_epoch(-1)``
    made a state that ``load_state_dict`` refused."""
    dataset = StructuredDataset(str(two_files), batch_size=16, shuffle=True)
    dataset.set_epoch(2)
    with pytest.raises(error, match=match):
        dataset.set_epoch(epoch)  # type: ignore[arg-type]
    assert dataset.epoch == 2 and dataset.state_dict()["epoch"] == 2


# ----------------------------------------------------------------- 4: a config file's strings


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"shuffle": "false"}, TypeError, r"shuffle must be True or False, got 'false' \(str\)"),
        ({"even_batches": "false"}, TypeError, r"even_batches must be True or False, got 'fa"),
        ({"drop_last": "no"}, TypeError, r"drop_last must be True or False, got 'no'"),
        ({"num_workers": "2"}, TypeError, r"num_workers must be an int, got '2' \(str\)"),
        ({"num_workers": -1}, ValueError, r"num_workers must be a non-negative int, got -1"),
        ({"persistent_workers": "false", "num_workers": 1}, TypeError, "persistent_workers"),
        ({"batch_size": "8"}, TypeError, r"batch_size must be an int, got '8' \(str\)"),
        ({"world_size": "2", "rank": 0}, TypeError, r"world_size must be an int, got '2'"),
    ],
)
def test_strings_from_a_config_file_are_refused_by_name(
    two_files: Path, kwargs: dict[str, object], error: type[Exception], match: str
):
    """``even_batches="false"`` and ``shuffle="false"`` meant True; ``num_workers="2"`` failed
    inside torch with ``'<' not supported between instances of 'str' and 'int'``."""
    with pytest.raises(error, match=match):
        StructuredDataset.create_dataloader(str(two_files), **kwargs)  # type: ignore[arg-type]


def test_numpy_booleans_are_taken_as_booleans(two_files: Path):
    loader, dataset = StructuredDataset.create_dataloader(
        str(two_files), batch_size=16, shuffle=np.bool_(True), drop_last=np.bool_(True),
        even_batches=np.bool_(False), rank=0, world_size=2, num_workers=np.int64(0),
    )  # fmt: skip
    assert type(loader.num_workers) is int
    state = dataset.state_dict()
    assert state["_shuffle"] is True and state["_even_batches"] is False
    with pytest.raises(TypeError, match=r"elastic must be True or False, got 'yes'"):
        dataset.load_state_dict(state, elastic="yes")  # type: ignore[arg-type]


# ----------------------------------------------------------------- 6, 7: packing


def _check_parts(batch: dict[str, np.ndarray], seq_len: int) -> None:
    """``cu_seqlens`` rises strictly from 0 to the batch's tokens, every sequence boundary is
    one of its bounds, and ``position_ids`` restart at each bound."""
    bounds = batch["cu_seqlens"].tolist()
    size = batch["input_ids"].size
    assert bounds[0] == 0 and bounds[-1] == size
    assert all(b > a for a, b in itertools.pairwise(bounds)), bounds
    assert set(range(0, size, seq_len)) <= set(bounds)
    flat = batch["position_ids"].reshape(-1).tolist()
    expected = [i - lo for lo, hi in itertools.pairwise(bounds) for i in range(lo, hi)]
    assert flat == expected


def test_a_stream_that_fills_its_last_batch_exactly_has_no_empty_part(tmp_path: Path):
    """Documents of 3, 11 and 15 tokens + separators fill 2 sequences of 16 exactly:
    ``cu_seqlens`` was ``[0, 4, 16, 32, 32]`` (a zero-length part) while ``position_ids``
    showed three parts."""
    root = write_docs(tmp_path, [3, 11, 15])
    packing = TokenPacking("tokens", seq_len=16, separator=2)
    (batch,) = StructuredDataset(str(root), batch_size=4, packing=packing, output="numpy")
    assert batch["cu_seqlens"].tolist() == [0, 4, 16, 32]
    assert batch["num_tokens"] == 32
    _check_parts(batch, 16)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=12),
    seq_len=st.integers(1, 8),
    batch_size=st.integers(1, 3),
    separator=st.sampled_from([None, 2]),
    drop_last=st.booleans(),
)
def test_every_packed_part_holds_a_token(
    tmp_path: Path, lengths: list[int], seq_len: int, batch_size: int, separator: int | None,
    drop_last: bool,
):  # fmt: skip
    root = write_docs(Path(tempfile.mkdtemp(dir=tmp_path)), lengths, row_group=3)
    packing = TokenPacking("tokens", seq_len=seq_len, separator=separator)
    dataset = StructuredDataset(str(root), batch_size=batch_size, packing=packing,
                                output="numpy", drop_last=drop_last)  # fmt: skip
    for batch in dataset:
        _check_parts(batch, seq_len)
        assert batch["input_ids"].flags.writeable


@pytest.mark.parametrize(("output", "num_workers"), [("torch", 2), ("torch", 0), ("numpy", 0)])
def test_packing_without_a_separator_hands_out_writable_batches(
    docs_dir: Path, output: str, num_workers: int
):
    """Without a separator the batches viewed Arrow's read-only buffers: torch warned "The
    given NumPy array is not writable" (an error under ``-W error``, as in this suite), in the
    main process or in a worker (workers first: torch warns once per process)."""
    packing = TokenPacking("tokens", seq_len=8)
    loader, _ = StructuredDataset.create_dataloader(
        str(docs_dir), batch_size=2, packing=packing, output=output, num_workers=num_workers
    )
    batches = list(loader)
    assert sum(b["num_tokens"] for b in batches) == sum((7 * d) % 17 for d in range(30))
    for batch in batches:
        ids = batch["input_ids"]
        if output == "numpy":
            assert ids.flags.writeable
        ids[0, 0] = 1  # writable: the user may edit a batch in place


# ----------------------------------------------------------------- 8: CLI, packed checkpoints


def test_cli_verifies_and_inspects_a_packed_checkpoint(
    docs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """``verify`` and ``inspect --data`` built the dataset without packing: every packed
    checkpoint exited 1 with ``packing changed: checkpoint=['tokens', 2], current=None``."""
    packing = TokenPacking("tokens", seq_len=4, separator=2)
    loader, dataset = StructuredDataset.create_dataloader(
        str(docs_dir), batch_size=2, packing=packing, num_workers=2, split_bytes=300
    )
    it = iter(loader)
    for _ in range(5):
        next(it)
    (tmp_path / "state.json").write_text(json.dumps(dataset.state_dict()))
    del it
    code = main(["verify", str(tmp_path / "state.json"), str(docs_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith(f"OK: {tmp_path / 'state.json'} resumes cleanly against {docs_dir}")
    code = main(["inspect", str(tmp_path / "state.json"), "--data", str(docs_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "packing=['tokens', 2]" in out.splitlines()[1]
    other = write_docs(tmp_path / "other", [5, 6, 7])
    assert main(["verify", str(tmp_path / "state.json"), str(other)]) == 1
    assert "Likely cause: files changed" in capsys.readouterr().out


# ----------------------------------------------------------------- 5: corrupt nested state


@pytest.fixture(scope="module")
def elastic_state(two_files: Path) -> dict[str, object]:
    """A state after 2 batches of an elastic resume (it holds ``generations``) from 3 batches."""
    loader, dataset = StructuredDataset.create_dataloader(str(two_files), batch_size=8)
    it = iter(loader)
    for _ in range(3):
        next(it)
    first = dataset.state_dict()
    del it
    loader, dataset = StructuredDataset.create_dataloader(str(two_files), batch_size=8)
    dataset.load_state_dict([first], elastic=True)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = json.loads(json.dumps(dataset.state_dict()))
    del it
    assert state["generations"]
    return state


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("generations", 5, r"state key 'generations' must be list, got int"),
        ("generations", [[1, 2]], r"state key 'generations\[0\]' must be \[world_size"),
        ("generations", [[1, 0, False, "eJwDAAAAAAE=", 7]], r"state key 'generations\[0\]'"),
        ("streams", [[1, 2]], r"state key 'streams\[0\]' must be \[position"),
        ("streams", 7, r"state key 'streams' must be list, got int"),
        ("files.digest", 3, r"state key 'files.digest' must be str, got int"),
        ("_packing", ["tokens"], r"state key '_packing' must be null or \[column, separator\]"),
        ("version", {}, r"unknown state version \{\}"),
    ],
)
@pytest.mark.parametrize("elastic", [False, True])
def test_a_corrupt_nested_key_is_an_invalid_state_naming_it(
    two_files: Path, elastic_state: dict[str, object], key: str, value: object, match: str,
    elastic: bool,
):  # fmt: skip
    """Before state version 4, ``base.done = 5`` raised ``AttributeError: 'int' object has no
    attribute 'encode'`` and ``base.partial = 7`` ``TypeError: 'int' object is not iterable``:
    ``decode`` validated the top-level keys only. Every nested key of v4 is checked by name."""
    state = copy.deepcopy(elastic_state)
    *parents, last = key.split(".")
    node: Any = state
    for parent in parents:
        node = node[parent]
    node[last] = value
    _, dataset = StructuredDataset.create_dataloader(str(two_files), batch_size=8)
    with pytest.raises(InvalidStateError, match=match):
        dataset.load_state_dict([state] if elastic else state, elastic=elastic)


# ----------------------------------------------------------------- 9: real and hostile files


def _interval_batch(rows: int) -> pa.RecordBatch:
    """``id`` and two interval columns of types pyarrow has no Python class for (as in
    arrow-testing's ``generated_interval``): made through the C data interface, by renaming
    the format of int32/int64 columns of the same layout."""
    from pyarrow.cffi import ffi

    batch = pa.record_batch({
        "id": pa.array(np.arange(rows)),
        "months": pa.array(np.arange(rows, dtype=np.int32)),
        "day_time": pa.array(np.arange(rows, dtype=np.int64)),
    })  # fmt: skip
    c_schema, c_array = ffi.new("struct ArrowSchema*"), ffi.new("struct ArrowArray*")
    schema_ptr, array_ptr = (int(ffi.cast("uintptr_t", c)) for c in (c_schema, c_array))
    batch._export_to_c(array_ptr, schema_ptr)
    formats = [ffi.new("char[]", b"tiM"), ffi.new("char[]", b"tiD")]
    c_schema.children[1].format, c_schema.children[2].format = formats
    return pa.RecordBatch._import_from_c(array_ptr, schema_ptr)


@pytest.fixture(scope="module")
def interval_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("intervals")
    batch = _interval_batch(10)
    with pa.ipc.new_file(root / "interval.arrow", batch.schema) as writer:
        writer.write_batch(batch)
    return root


@pytest.mark.parametrize(
    ("output", "num_workers", "error"),
    [("torch", 0, ValueError), ("numpy", 0, ValueError), ("torch", 2, ValueError),
     ("arrow", 2, UnsendableBatchError)],
)  # fmt: skip
def test_interval_columns_name_the_file_column_and_type(
    interval_dir: Path, output: str, num_workers: int, error: type[Exception]
):
    """A bare ``KeyError: 21`` from inside pyarrow named neither file, column nor type."""
    loader, _ = StructuredDataset.create_dataloader(
        str(interval_dir), format="arrow", batch_size=4, output=output, num_workers=num_workers
    )
    with pytest.raises(error, match=r"interval\.arrow rows \[0, 10\).*'months' \(month_interval\)"):
        list(loader)


def test_interval_columns_are_delivered_as_arrow_or_left_out(interval_dir: Path):
    loader, _ = StructuredDataset.create_dataloader(
        str(interval_dir), format="arrow", batch_size=4, output="arrow"
    )
    assert [b.num_rows for b in loader] == [4, 4, 2]
    loader, _ = StructuredDataset.create_dataloader(
        str(interval_dir), format="arrow", batch_size=4, columns=["id"], num_workers=2
    )
    assert sorted(i for b in loader for i in ids_of(b)) == list(range(10))


def test_a_corrupt_record_batch_header_is_not_an_empty_batch(tmp_path: Path):
    """A header corrupted where its row count was read as 0 rows (a flatbuffer leaves a
    default out): the batch was never read, its 10 rows lost without an error, where pyarrow
    refuses the file ("Invalid flatbuffers message")."""
    from torch_dataloader_utils.formats.ipc_footer import read_footer

    path = tmp_path / "corrupt.arrow"
    table = pa.table({"id": pa.array(np.arange(20))})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table.slice(0, 10))
        writer.write_table(table.slice(10, 10))
    raw = bytearray(path.read_bytes())
    raw[read_footer(lambda at, n: bytes(raw[at : at + n]), len(raw)).blocks[0].offset + 24] = 1
    path.write_bytes(raw)
    with pytest.raises((OSError, pa.ArrowException), match="Invalid flatbuffers message"):
        pa.ipc.open_file(path).read_all()
    with pytest.raises(DataSourceError, match=r"corrupt\.arrow as arrow.*Invalid flatbuffers"):
        StructuredDataset(str(path), format="arrow")


def test_values_that_pyarrow_reads_are_not_refused(tmp_path: Path):
    """Batches were validated with ``full=True``, which also rules on values: arrow-testing's
    ``generated_decimal`` and ``generated_datetime`` were refused ("Decimal value 12810 does
    not fit in precision of decimal128(3, 2)", "date64 ... not a whole number of days")."""
    decimal = pa.Array.from_buffers(
        pa.decimal128(3, 2), 2, [None, pa.py_buffer(np.array([12810, 0, 5, 0], np.int64))]
    )
    batch = pa.record_batch({
        "id": pa.array([0, 1]),
        "d": decimal,
        "date": pa.array(np.array([1, 86_400_000], np.int64)).view(pa.date64()),
        "time": pa.array(np.array([-1, 10**6], np.int32)).view(pa.time32("s")),
        "s": pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(np.array([0, 1, 2],
                                   np.int32)), pa.py_buffer(b"a\xff")]),
    })  # fmt: skip
    with pytest.raises(pa.ArrowInvalid):
        batch.validate(full=True)
    with pa.ipc.new_file(tmp_path / "values.arrow", batch.schema) as writer:
        writer.write_batch(batch)
    expected = pa.ipc.open_file(tmp_path / "values.arrow").read_all()
    (got,) = StructuredDataset(str(tmp_path), format="arrow", output="arrow", batch_size=8)
    assert pa.Table.from_batches([got]).equals(expected)
    loader, _ = StructuredDataset.create_dataloader(
        str(tmp_path), format="arrow", batch_size=8, columns=["id", "date", "time"]
    )
    (batch_t,) = list(loader)
    assert batch_t["date"].tolist() == [1, 86_400_000] and batch_t["time"].tolist() == [-1, 10**6]


# ----------------------------------------------------------------- 10: the demo's warning


def test_a_sigkilled_training_process_leaves_no_semaphore_to_report(
    two_files: Path, tmp_path: Path
):
    """After ``make demo``'s SIGKILL the resource tracker printed "There appear to be 2 leaked
    semaphore objects to clean up at shutdown": the slots' wake-up semaphores were named."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from torch_dataloader_utils import StructuredDataset
        loader, _ = StructuredDataset.create_dataloader(
            {str(two_files)!r}, batch_size=8, num_workers=2, persistent_workers=True)
        it = iter(loader)
        next(it)
        print("delivered", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    # Files, not pipes: the killed process's workers (and a resource tracker) hold them open.
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", script], stdout=stdout, stderr=stderr)
        assert child.wait(timeout=120) == -signal.SIGKILL, err.read_text()
    time.sleep(3)  # a resource tracker reports once the workers are gone (they exit in < 1 s)
    assert out.read_text() == "delivered\n", err.read_text()
    assert "leaked semaphore" not in err.read_text(), err.read_text()


# ----------------------------------------------------------------- 12: secrets in URLs


@pytest.fixture
def http_server(two_files: Path):
    """A plain HTTP server on loopback over ``two_files`` (it ignores query strings)."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(two_files))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_presigned_url_s_signature_never_reaches_the_state(http_server: str):
    """The query of a presigned URL (signature, credential) became part of the file names in
    the state: ``files.groups`` held ``part-00000.parquet?X-Amz-Signature=...``."""
    query = "?X-Amz-Signature=SECRETSIG&X-Amz-Credential=AKIAFAKE"
    urls = [f"{http_server}/part-0000{i}.parquet{query}" for i in range(2)]
    state = StructuredDataset(urls, batch_size=8).state_dict()
    text = json.dumps(state)
    assert "SECRETSIG" not in text and "AKIAFAKE" not in text, text
    assert [g[0] for g in state["files"]["groups"]] == ["part-00000.parquet", "part-00001.parquet"]
    resigned = [url.replace("SECRETSIG", "OTHERSIG") for url in urls]  # the same objects
    StructuredDataset(resigned, batch_size=8).load_state_dict(state)


# ----------------------------------------------------------------- 12: chained elastic resumes


def _ranks_until(root: Path, world: int, states: object, steps: int | None) -> tuple[list, list]:
    """Every rank of a ``world``-rank job (even_batches) loads ``states`` elastically (if any)
    and takes ``steps`` batches (``None``: the rest of the epoch); their states, the rows."""
    out, rows = [], []
    for rank in range(world):
        loader, dataset = StructuredDataset.create_dataloader(
            str(root), batch_size=5, split_bytes=1, rank=rank, world_size=world,
            even_batches=True,
        )  # fmt: skip
        if states is not None:
            dataset.load_state_dict(states, elastic=True)
        it = iter(loader)
        for n, batch in enumerate(it, start=1):
            rows += ids_of(batch)
            if steps is not None and n >= steps:
                break
        out.append(dataset.state_dict())
        del it
    return out, rows


def test_a_chain_of_elastic_resumes_leaves_out_fewer_than_s_rows(tmp_path: Path):
    """The SPEC's bound is per epoch: fewer than S = world_size x max(1, num_workers) rows
    left out. 97 rows, 2 ranks -> 3 -> 2 -> 3 -> 2 -> 3 (S at most 3): 6 were left out before
    state version 4 (each resume evened its rows out again); a deal now takes in what the one
    before left out."""
    write_dataset(tmp_path, [37, 29, 31], row_group_size=4)
    states, seen = _ranks_until(tmp_path, 2, None, 2)
    for world in (3, 2, 3, 2):
        states, rows = _ranks_until(tmp_path, world, states, 1)
        seen += rows
    states, rows = _ranks_until(tmp_path, 3, states, None)
    seen += rows
    assert len(seen) == len(set(seen)), "a row delivered twice"
    assert 97 - len(seen) < 3, f"{97 - len(seen)} rows left out of the epoch"


def test_an_elastic_load_refuses_a_position_moved_back(
    two_files: Path, elastic_state: dict[str, Any]
):
    """The fuzzer's find before state version 4: a state that lost rows its base delivered was
    re-dealt, delivering them again. In v4 a stream's position moved back (its rows would be
    dealt again) no longer names the row the plan puts there: refused, elastic or not."""
    state = copy.deepcopy(elastic_state)
    entry = state["streams"][0]
    assert entry[0] > 0
    entry[0] -= 1
    for elastic in (True, False):
        _, dataset = StructuredDataset.create_dataloader(str(two_files), batch_size=8)
        with pytest.raises(CheckpointMismatchError, match="out of order"):
            dataset.load_state_dict([state] if elastic else state, elastic=elastic)
