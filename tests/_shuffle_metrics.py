"""Shuffle quality on data sorted inside each file: the data, and the metrics test and bench share.

Shared by ``tests/test_shuffle_quality.py`` and ``benchmarks/bench_shuffle.py`` (which puts this
folder on ``sys.path``). Pure numpy/pyarrow: nothing here touches the library under test.

The data (issue 15's layout): ``files`` Parquet files of ``rows_per_file`` rows each, every file
sorted by ``pos`` (0..rows_per_file-1, a timestamp, a length, a crawl order), with
``label = pos * 10 // rows_per_file`` (ten contiguous blocks per file, as when a file is written
class by class) and ``id`` the row's global storage index, ``file * rows_per_file + pos``; then
``f0``… float32 features. Every figure below is computed from the delivered ``id`` alone
(``pos = id % rows_per_file``), so a contender only has to hand back its ids, batch by batch.

Per batch, averaged over the batches: distinct labels, the standard deviation of
``pos / rows_per_file``, the fraction of the batch's rows whose storage neighbour (``id - 1``) is
in the same batch. Over the epoch: Spearman's correlation of delivery order with storage order.
A uniform random permutation scores 10 / 0.289 / (batch - 1) / rows / about 0.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "LABELS",
    "Quality",
    "decoded_bytes",
    "exactly_once",
    "quality",
    "spearman",
    "uniform_batches",
    "write_sorted_inside",
]

LABELS = 10  # contiguous label blocks per file


def sorted_inside_table(number: int, *, rows_per_file: int, features: int, seed: int) -> pa.Table:
    """File ``number`` of the layout: ``id``, ``pos``, ``label``, ``f0``… (see the module)."""
    pos = np.arange(rows_per_file, dtype=np.int64)
    columns = {
        "id": pos + number * rows_per_file,
        "pos": pos,
        "label": pos * LABELS // rows_per_file,
    }
    rng = np.random.default_rng([seed, number])
    for f in range(features):
        columns[f"f{f}"] = rng.standard_normal(rows_per_file, dtype=np.float32)
    return pa.table(columns)


def write_sorted_inside(
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
        table = sorted_inside_table(
            number, rows_per_file=rows_per_file, features=features, seed=seed
        )
        path = root / f"part-{number:05d}.parquet"
        tmp = path.with_name("." + path.name + ".tmp")  # hidden from the listing until complete
        pq.write_table(table, tmp, row_group_size=row_group_rows)
        os.replace(tmp, path)
        paths.append(str(path))
    return paths


def decoded_bytes(paths: Sequence[str], columns: Sequence[str] | None = None) -> int:
    """Bytes of ``columns`` (all if None) of ``paths`` once decoded into Arrow memory."""
    total = 0
    for path in paths:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            total += parquet.read_row_group(group, columns=columns).nbytes
    return total


def uniform_batches(total: int, batch: int, seed: int = 0) -> list[np.ndarray]:
    """A uniform random permutation of ``0..total-1`` (numpy), cut into batches: the reference."""
    order = np.random.default_rng(seed).permutation(total)
    return [order[start : start + batch] for start in range(0, total, batch)]


# ----------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Quality:
    """The four figures of one epoch (see the module docstring)."""

    labels: float  # distinct labels per batch, mean (uniform: 10)
    spread: float  # std of pos / rows_per_file per batch, mean (uniform: 0.289)
    neighbours: float  # fraction of a batch's rows with id - 1 in the batch, mean (uniform: ~0)
    spearman: float  # delivery order vs storage order over the epoch (uniform: ~0)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def quality(batches: Sequence[np.ndarray], rows_per_file: int) -> Quality:
    """The figures of ``batches`` of ids in delivery order (an epoch, or a prefix of one)."""
    ids = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    batch_of = np.repeat(np.arange(len(batches)), sizes)
    pos = ids % rows_per_file
    return Quality(
        labels=_distinct_labels(batch_of, pos * LABELS // rows_per_file, len(batches)),
        spread=_position_spread(sizes, pos / rows_per_file),
        neighbours=_neighbour_fraction(ids, batch_of, sizes),
        spearman=spearman(np.arange(len(ids)), ids),
    )


def _distinct_labels(batch_of: np.ndarray, labels: np.ndarray, batches: int) -> float:
    pairs = np.unique(batch_of * LABELS + labels)  # one entry per (batch, label) seen
    return len(pairs) / batches


def _position_spread(sizes: np.ndarray, x: np.ndarray) -> float:
    """Mean over batches of the population standard deviation of ``x`` inside each batch."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    mean = np.add.reduceat(x, starts) / sizes
    square = np.add.reduceat(x * x, starts) / sizes
    return float(np.mean(np.sqrt(np.maximum(square - mean * mean, 0.0))))


def _neighbour_fraction(ids: np.ndarray, batch_of: np.ndarray, sizes: np.ndarray) -> float:
    """Mean over batches of the fraction of rows whose ``id - 1`` was delivered in the batch."""
    where = np.full(int(ids.max()) + 2, -1, dtype=np.int64)  # batch of each id; -1: not seen
    where[ids + 1] = batch_of  # shifted by one: where[id] is the batch of id - 1
    together = where[ids] == batch_of
    per_batch = np.bincount(batch_of, weights=together, minlength=len(sizes)) / sizes
    return float(per_batch.mean())


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 (ties broken by position: the inputs here are distinct ids)."""
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[np.argsort(values, kind="stable")] = np.arange(len(values), dtype=np.float64)
    return ranks


def spearman(x: Sequence[int] | np.ndarray, y: Sequence[int] | np.ndarray) -> float:
    """Spearman rank correlation of ``x`` and ``y`` (Pearson correlation of their ranks).

    With ``x`` the delivery position and ``y`` the storage index: 1.0 is storage order, -1.0 the
    reverse, about 0 no monotone relation. Over a whole epoch it is blind to order *within*
    batches and to files read one at a time in a shuffled order: read it with the others."""
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


def exactly_once(batches: Sequence[np.ndarray], total: int) -> str | None:
    """``None`` when the batches hold every id of ``0..total-1`` exactly once; else what is
    wrong (missing, repeated, out-of-range ids), for an error message."""
    ids = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches]) if batches else []
    ids = np.asarray(ids, dtype=np.int64)
    outside = int(((ids < 0) | (ids >= total)).sum())
    counts = np.bincount(ids[(ids >= 0) & (ids < total)], minlength=total)
    missing, repeated = int((counts == 0).sum()), int((counts > 1).sum())
    if not (outside or missing or repeated):
        return None
    return (
        f"{len(ids):,} ids delivered for {total:,} rows: {missing:,} missing, {repeated:,} "
        f"repeated, {outside:,} out of range"
    )
