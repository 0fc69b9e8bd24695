"""Shuffle quality on data sorted by file: the data, and the metrics the test and benchmark share.

Shared by ``tests/test_shuffle_quality.py`` and ``benchmarks/bench_shuffle.py`` (which puts this
folder on ``sys.path``). Pure numpy/pyarrow: nothing here touches the library under test.

The data: ``files`` Parquet files of ``rows_per_file`` rows each, sorted by file. Column ``label``
(int64) is the file's index, the same for every row of the file; ``row`` (int64) is the row's
global storage index, ``file * rows_per_file + row in file``; ``f0``… are float32 features.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "adjacent_fraction",
    "distinct_per_batch",
    "spearman",
    "write_sorted_by_file",
]


def write_sorted_by_file(
    root: str | os.PathLike[str],
    *,
    files: int,
    rows_per_file: int,
    row_group_rows: int,
    features: int = 4,
    seed: int = 0,
) -> list[str]:
    """Write ``part-00000.parquet``… under ``root`` (each renamed into place when complete);
    returns the sorted paths."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(files):
        rng = np.random.default_rng([seed, number])
        columns = {
            "label": np.full(rows_per_file, number, dtype=np.int64),
            "row": np.arange(rows_per_file, dtype=np.int64) + number * rows_per_file,
        }
        for f in range(features):
            columns[f"f{f}"] = rng.standard_normal(rows_per_file, dtype=np.float32)
        path = root / f"part-{number:05d}.parquet"
        tmp = path.with_name("." + path.name + ".tmp")  # hidden from the listing until complete
        pq.write_table(pa.table(columns), tmp, row_group_size=row_group_rows)
        os.replace(tmp, path)
        paths.append(str(path))
    return paths


def distinct_per_batch(labels: Iterable[Sequence[int] | np.ndarray]) -> float:
    """Mean number of distinct labels (= files of origin) per batch; 0.0 for no batches."""
    counts = [len(np.unique(np.asarray(batch))) for batch in labels]
    return float(np.mean(counts)) if counts else 0.0


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 (ties broken by position: the inputs here are distinct row indices)."""
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[np.argsort(values, kind="stable")] = np.arange(len(values), dtype=np.float64)
    return ranks


def spearman(x: Sequence[int] | np.ndarray, y: Sequence[int] | np.ndarray) -> float:
    """Spearman rank correlation of ``x`` and ``y`` (Pearson correlation of their ranks).

    With ``x`` the delivery position and ``y`` the storage index: 1.0 is storage order, -1.0 the
    reverse, about 0 no monotone relation. Over a whole epoch this is blind to order *within*
    batches and to a shuffled order of files read one at a time (see ``adjacent_fraction``)."""
    a, b = np.asarray(x), np.asarray(y)
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(
            f"spearman needs two sequences of equal length >= 2, got {len(a)}, {len(b)}"
        )
    ra, rb = _ranks(a), _ranks(b)
    ra -= ra.mean()
    rb -= rb.mean()
    denominator = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator else 0.0


def adjacent_fraction(rows: Sequence[int] | np.ndarray) -> float:
    """Fraction of consecutive deliveries that are consecutive in storage (``row[i+1] ==
    row[i] + 1``): about 1.0 when files or splits are read in runs, about 0 when rows are mixed."""
    r = np.asarray(rows, dtype=np.int64)
    if len(r) < 2:
        return 0.0
    return float(np.mean(np.diff(r) == 1))
