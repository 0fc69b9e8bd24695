"""The data of ``bench_shuffle.py``: issue 15's layouts, sorted inside each file, and token lists.

The sorted layout and its metrics live in ``tests/_shuffle_metrics.py``, shared with
``tests/test_shuffle_quality.py``; this module puts that folder on ``sys.path``. Every dataset
is cached under its own folder and rewritten only when its parameters change (``cached_files``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _bench_util import cached_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _shuffle_metrics import decoded_bytes, write_sorted_inside

__all__ = ["COLUMNS", "EOS", "FULL", "QUICK", "Data", "Scale", "all_data", "describe",
           "token_totals"]  # fmt: skip

FEATURES = 4
COLUMNS = ["id", "pos", "label", *(f"f{i}" for i in range(FEATURES))]
EOS = 50_257  # the packing separator: an id the generated tokens never take
TOKEN_LENGTHS = (64, 512)  # tokens per row, high exclusive


@dataclass(frozen=True)
class Scale:
    files: int
    rows_per_file: int
    row_group_rows: int
    large_row_group_rows: int
    big_group_files: int  # files of one row group of 1 Mi rows
    token_files: int
    token_rows: int
    rounds: int  # interleaved cost rounds


FULL = Scale(64, 100_000, 10_000, 100_000, 4, 8, 25_000, 5)
QUICK = Scale(64, 20_000, 2_000, 20_000, 2, 4, 10_000, 3)


@dataclass(frozen=True)
class Data:
    """One cached dataset: its files, rows (ids ``0..total-1``) and the columns to read."""

    root: str
    paths: list[str]
    rows_per_file: int
    total: int
    columns: list[str]

    def stream_bytes(self, workers: int) -> int:
        """Decoded bytes of the columns read, per stream (``max(1, workers)`` streams)."""
        return self.decoded // max(1, workers)

    @property
    def decoded(self) -> int:
        return _decoded(tuple(self.paths), tuple(self.columns))


_DECODED: dict[tuple[tuple[str, ...], tuple[str, ...]], int] = {}


def _decoded(paths: tuple[str, ...], columns: tuple[str, ...]) -> int:
    if (paths, columns) not in _DECODED:
        _DECODED[paths, columns] = decoded_bytes(paths, columns)
    return _DECODED[paths, columns]


def sorted_data(root: Path, *, files: int, rows_per_file: int, row_group_rows: int) -> Data:
    wanted = {"layout": "sorted_inside", "files": files, "rows_per_file": rows_per_file,
              "row_group_rows": row_group_rows, "features": FEATURES}  # fmt: skip
    paths = cached_files(root, wanted, files, lambda r: write_sorted_inside(
        r, files=files, rows_per_file=rows_per_file, row_group_rows=row_group_rows,
        features=FEATURES))  # fmt: skip
    return Data(str(root), paths, rows_per_file, files * rows_per_file, COLUMNS)


def token_data(root: Path, files: int, rows: int) -> Data:
    wanted = {"layout": "tokens", "files": files, "rows": rows, "lengths": list(TOKEN_LENGTHS)}

    def write(root: Path) -> None:
        for number in range(files):
            rng = np.random.default_rng([1, number])
            lengths = rng.integers(*TOKEN_LENGTHS, rows)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            values = rng.integers(0, EOS, int(offsets[-1]), dtype=np.int32)
            table = pa.table({
                "id": np.arange(rows, dtype=np.int64) + number * rows,
                "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            })  # fmt: skip
            path = root / f"part-{number:05d}.parquet"
            tmp = path.with_name("." + path.name + ".tmp")
            pq.write_table(table, tmp, row_group_size=5_000)
            os.replace(tmp, path)

    paths = cached_files(root, wanted, files, write)
    return Data(str(root), paths, rows, files * rows, ["id", "input_ids"])


def all_data(root: Path, s: Scale) -> dict[str, Data]:
    """The four datasets under ``root``: ``main``, ``large_file``, ``big_groups``, ``tokens``."""
    total = s.files * s.rows_per_file
    return {
        "main": sorted_data(root / "main", files=s.files, rows_per_file=s.rows_per_file,
                            row_group_rows=s.row_group_rows),
        "large_file": sorted_data(root / "large_file", files=1, rows_per_file=total,
                                  row_group_rows=s.large_row_group_rows),
        "big_groups": sorted_data(root / "big_groups", files=s.big_group_files,
                                  rows_per_file=2**20, row_group_rows=2**20),
        "tokens": token_data(root / "tokens", s.token_files, s.token_rows),
    }  # fmt: skip


def token_totals(data: Data) -> tuple[int, int]:
    """(tokens, sum of the token ids) of the token data."""
    tokens = total = 0
    for path in data.paths:
        values = pq.read_table(path, columns=["input_ids"]).column(0).combine_chunks().flatten()
        tokens += len(values)
        total += int(np.sum(values.to_numpy(), dtype=np.int64))
    return tokens, total


def describe(datas: dict[str, Data]) -> None:
    """One line per dataset: files, rows, stored and decoded sizes."""
    for name, data in datas.items():
        size = sum(os.path.getsize(p) for p in data.paths)
        print(f"  {name:<11}{len(data.paths):>3} file(s), {data.total:>10,} rows, "
              f"{size / 2**20:6.0f} MiB stored, {data.decoded / 2**20:6.0f} MiB decoded "
              f"({', '.join(data.columns)})")  # fmt: skip
