"""Shared fixtures: small datasets with many splits, and a modest hypothesis profile."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from _data import write_dataset, write_token_documents
from hypothesis import HealthCheck, settings

# Each multi-worker example forks DataLoader workers; keep property tests few and deadline-free.
settings.register_profile(
    "tdu",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("tdu")


def _no_stack_walk_per_measured_process() -> None:
    """coverage (7.17, ``Collector.__init__``) keeps ``inspect.stack()`` of every process it
    starts measuring, only to print it if its collectors end out of order: under pytest's deep
    stack and thousands of loaded modules, 0.07-0.13 s of each DataLoader worker's start, and the
    suite forks thousands of them (``test_resume_at_start_middle_and_end`` with --cov: 22.2 s ->
    16.6 s). What is measured is unchanged."""
    try:
        import coverage.collector
    except ImportError:  # the suite runs without coverage too
        return
    coverage.collector.short_stack = lambda *args, **kwargs: ""


_no_stack_walk_per_measured_process()

_SESSION_CACHE = tempfile.mkdtemp(prefix="tdu-test-index-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    # One index cache for this test process, not the user's ~/.cache (tests may override it);
    # an xdist worker has its own, not the one it inherits from the controller.
    if "TDU_CACHE_DIR" not in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
        os.environ["TDU_CACHE_DIR"] = _SESSION_CACHE
    # The machine has 2 cores; 3 workers are still what the tests mean to run.
    config.addinivalue_line(
        "filterwarnings", "ignore:This DataLoader will create .* worker processes:UserWarning"
    )


# 3 files of 230/170/300 rows in row groups of 16 rows: 44 row groups, split_bytes small
# enough that most splits hold one or two row groups.
ROWS_PER_FILE = (230, 170, 300)
TOTAL_ROWS = sum(ROWS_PER_FILE)


@pytest.fixture(scope="session")
def parquet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parquet")
    write_dataset(root, ROWS_PER_FILE, row_group_size=16)
    return root


@pytest.fixture(scope="session")
def arrow_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("arrow")
    write_dataset(root, ROWS_PER_FILE, row_group_size=16, format="arrow")
    return root


@pytest.fixture(scope="session")
def small_split(parquet_dir: Path) -> int:
    """A split_bytes that puts about two row groups of ``parquet_dir`` in each split."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(next(parquet_dir.glob("*.parquet"))).metadata
    group = meta.row_group(0)
    one = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
    return 2 * one + 1


@pytest.fixture(scope="session")
def few_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token documents that make about 30 batches an epoch of ``trainers._common.packed_case``."""
    return write_token_documents(tmp_path_factory.mktemp("few_tokens"), docs=120)
