"""Regressions: each test reproduces a bug found and fixed in the package."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import _harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _data import rows_table, write_dataset, write_parquet

from torch_dataloader_utils import CheckpointMismatchError, InvalidStateError, StructuredDataset
from torch_dataloader_utils.checkpoint.distributed import scatter_states
from torch_dataloader_utils.reading.prefetch import prefetch


def test_recursive_glob_skips_hidden_and_underscore_directories(tmp_path: Path):
    (tmp_path / "data" / "_temporary" / "0").mkdir(parents=True)
    write_parquet(tmp_path / "data" / "part-0.parquet", rows_table(0, 2), 2)
    write_parquet(tmp_path / "data" / "_temporary" / "0" / "part-0.parquet", rows_table(2, 1), 1)
    loader, _ = StructuredDataset.create_dataloader(
        str(tmp_path / "data" / "**" / "*.parquet"), batch_size=10
    )
    assert [b["id"].tolist() for b in loader] == [[0, 1]]


@pytest.mark.parametrize("name", ["exp[1]", "a?b"])
def test_existing_directory_with_glob_characters_is_taken_literally(tmp_path: Path, name: str):
    write_dataset(tmp_path / name, [10], row_group_size=5)
    loader, _ = StructuredDataset.create_dataloader(str(tmp_path / name), batch_size=100)
    assert [len(b["id"]) for b in loader] == [10]


def test_numpy_dictionary_strings_are_object_arrays(tmp_path: Path):
    table = pa.table({"s": ["a", "b"], "d": pa.array(["a", "b"]).dictionary_encode()})
    pq.write_table(table, tmp_path / "a.parquet")
    (batch,) = StructuredDataset(str(tmp_path), output="numpy")
    assert isinstance(batch["s"], np.ndarray)
    assert isinstance(batch["d"], np.ndarray) and batch["d"].dtype == object


@pytest.mark.parametrize("cursor", [5, -1, 2])
def test_corrupted_cursor_names_the_key(parquet_dir: Path, small_split: int, cursor: int):
    case = {"path": str(parquet_dir), "batch_size": 7, "split_bytes": small_split,
            "shuffle": True, "num_workers": 2}  # fmt: skip
    state, _ = _harness.checkpoint_after(case, 23)
    bad = {**copy.deepcopy(state), "cursor": cursor}
    with pytest.raises(InvalidStateError, match="cursor"):
        _harness.resume(case, bad)


def test_corrupted_num_splits_names_the_key(parquet_dir: Path, small_split: int):
    case = {"path": str(parquet_dir), "batch_size": 7, "split_bytes": small_split}
    state, _ = _harness.checkpoint_after(case, 23)
    bad = {**state, "num_splits": state["num_splits"] + 1}
    with pytest.raises(InvalidStateError, match="num_splits"):
        _harness.resume(case, bad)


def test_rewriting_a_file_in_place_after_reading_does_not_crash(tmp_path: Path):
    """Files are read, not memory-mapped: truncating one under a reader must not SIGBUS."""
    script = textwrap.dedent(
        f"""
        import time, numpy as np, pyarrow as pa, pyarrow.parquet as pq
        from torch_dataloader_utils import StructuredDataset
        path = {str(tmp_path / "a.parquet")!r}
        pq.write_table(pa.table({{"x": np.arange(400_000.0)}}), path, row_group_size=100_000,
                       compression="none")
        loader, _ = StructuredDataset.create_dataloader(path, batch_size=10)
        it = iter(loader)
        next(it)
        del it
        open(path, "wb").write(b"PAR1")
        time.sleep(0.5)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_abandoned_prefetch_leaves_no_thread_behind():
    for _ in range(5):
        items = prefetch(iter(range(3)), depth=2)
        next(items)
        items.close()  # the consumer goes while the producer waits on a full buffer
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _prefetch_threads():
        time.sleep(0.05)
    assert _prefetch_threads() == 0


def test_a_producer_closes_its_items_when_the_consumer_goes():
    """The clean-up of what a producer runs (a nested read-ahead, a thread pool) happens when
    the consumer goes, not whenever the generator is collected."""
    closed = threading.Event()

    def items():
        try:
            yield from range(10)
        finally:
            closed.set()

    source = items()  # held here: garbage collection would not close it
    consumer = prefetch(source, depth=1)
    next(consumer)
    consumer.close()
    assert closed.wait(5)


def test_prefetch_tells_its_producer_when_the_consumer_waited():
    waited, go = threading.Event(), threading.Event()

    def items():
        go.wait(5)
        yield 1
        yield 2

    consumer = prefetch(items(), depth=2, waited=waited)
    threading.Timer(0.2, go.set).start()
    assert next(consumer) == 1
    assert waited.is_set()  # the producer was slower
    waited.clear()
    time.sleep(0.2)  # item 2 is ready by now
    assert next(consumer) == 2
    assert not waited.is_set()
    consumer.close()


def test_an_iterator_abandoned_in_a_cycle_leaves_no_reader_running_at_exit(tmp_path: Path):
    """An error mid-epoch left the iterator in a reference cycle, freed only during interpreter
    finalization; its producer thread then died inside pyarrow's C++ and the process aborted
    ("terminate called without an active exception", SIGABRT) about half the time.

    The hook below is registered before the library is imported, so it runs after the
    library's own exit hook and sees what finalization would meet.
    """
    script = textwrap.dedent(
        f"""
        import atexit, threading
        atexit.register(lambda: print("running at exit:", sum(
            t.name == "tdu-prefetch" and t.is_alive() for t in threading.enumerate())))
        import numpy as np, pyarrow as pa, pyarrow.parquet as pq
        from torch_dataloader_utils import StructuredDataset
        path = {str(tmp_path / "a.parquet")!r}
        pq.write_table(pa.table({{"x": np.arange(200_000)}}), path, row_group_size=1_000)
        loader, _ = StructuredDataset.create_dataloader(path, batch_size=10)
        it = iter(loader)
        next(it)
        cycle = [it]
        cycle.append(cycle)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().splitlines()[-1] == "running at exit: 0"


def _prefetch_threads() -> int:
    return sum(t.name == "tdu-prefetch" and t.is_alive() for t in threading.enumerate())


def test_non_elastic_global_restore_refuses_states_of_different_epochs(
    parquet_dir: Path, small_split: int
):
    states = []
    for rank, epoch in ((0, 3), (1, 4)):
        _, dataset = StructuredDataset.create_dataloader(
            str(parquet_dir), split_bytes=small_split, rank=rank, world_size=2,
            even_batches=False,
        )  # fmt: skip
        dataset.set_epoch(epoch)
        states.append(dataset.state_dict())
    with pytest.raises(CheckpointMismatchError, match="different epochs") as err:
        scatter_states(states, None, 1, 2, elastic=False)
    assert err.value.field == "epoch"


def test_stream_entry_of_wrong_types_names_the_key(parquet_dir: Path, small_split: int):
    case = {"path": str(parquet_dir), "batch_size": 7, "split_bytes": small_split}
    state, _ = _harness.checkpoint_after(case, 23)
    entry = state["streams"][0]
    assert len(entry) == 8, "the checkpoint should hold a stream in progress"
    bad = {**state, "streams": [[*entry[:4], str(entry[4]), *entry[5:]]]}
    with pytest.raises(InvalidStateError, match=r"state key 'streams\[0\]'"):
        _harness.resume(case, bad)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_null_in_an_integer_column_names_the_split(tmp_path: Path, num_workers: int):
    table = pa.table({"id": pa.array([1, None, 3], type=pa.int64())})
    pq.write_table(table, tmp_path / "nulls.parquet")
    loader, _ = StructuredDataset.create_dataloader(
        str(tmp_path), batch_size=2, num_workers=num_workers
    )
    with pytest.raises(ValueError, match=r"nulls\.parquet rows \[0, 3\).*'id'"):
        list(loader)
