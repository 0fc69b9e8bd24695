"""Shuffle quality within each source of a mixture whose sources share one budget (issue 32).

Data (``bench_output/mixture_quality``): per case, sources of ``FILES`` Parquet files of
``ROWS_PER_FILE`` rows, each file sorted inside (``tests/_shuffle_metrics.py``: ten label
blocks a file, ``pos`` its row; ids unique over all sources), row groups of 1,000 rows: 20
and 100 sources. The mixture weighs each source 1 and shuffles with ``shuffle_memory_bytes``
16 MiB, which its sources share (100 sources: 164 KiB each); the contenders beside it, at the
same budget, one epoch each, ``num_workers=0``:

- **one dataset** over all the sources' files (its windows drawn from every file);
- **a source alone**: one dataset over the files of one source (the budget all its own).

Each source's rows in delivery order are cut into slices of ``BATCH`` (a batch of that
source alone), and the figures of ``_shuffle_metrics.quality`` averaged over the slices and
the sources: distinct labels per slice (uniform 10), spread of ``pos / rows`` (uniform 0.289),
fraction of a slice's rows whose storage neighbour is in it (uniform ~0). A uniform random
permutation of a source's rows is the reference.

    python benchmarks/bench_mixture_quality.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from _bench_util import machine_note, quiet_setup
from _shuffle_data import FULL  # noqa: F401  (puts tests/ on sys.path)
from _shuffle_metrics import quality, sorted_inside_table, uniform_batches

from torch_dataloader_utils import StructuredDataset

BATCH, MEMORY = 256, 16 * 2**20
FILES, ROWS_PER_FILE, ROW_GROUP = 4, 10_000, 1_000
SOURCE_ROWS = FILES * ROWS_PER_FILE
CASES = (20, 100)
FIGURES = ("labels", "spread", "neighbours")


def sources_of(root: Path, count: int) -> dict[str, list[str]]:
    """``count`` sources of ``FILES`` sorted files each (written once, reused)."""
    out = {}
    for s in range(count):
        folder = root / str(count) / f"s{s:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for f in range(FILES):
            path = folder / f"part-{f}.parquet"
            if not path.exists():
                table = sorted_inside_table(s * FILES + f, rows_per_file=ROWS_PER_FILE,
                                            features=2, seed=s)  # fmt: skip
                tmp = path.with_name(f".{path.name}.tmp")
                pq.write_table(table, tmp, row_group_size=ROW_GROUP)
                os.replace(tmp, path)
            paths.append(str(path))
        out[f"s{s:03d}"] = paths
    return out


def epoch_ids(paths: Any, **kwargs: Any) -> np.ndarray:
    """The ids of one shuffled epoch, in delivery order."""
    loader, _ = StructuredDataset.create_dataloader(
        paths, batch_size=1024, shuffle=True, shuffle_memory_bytes=MEMORY, columns=["id"],
        output="numpy", **kwargs,
    )  # fmt: skip
    return np.concatenate([batch["id"] for batch in loader])


def per_source(ids: np.ndarray, first: int, count: int) -> dict[str, float]:
    """The figures of sources ``first .. first + count - 1`` among ``ids``, each source's rows
    cut into slices of ``BATCH``, averaged over the sources."""
    source = ids // SOURCE_ROWS
    figures: dict[str, list[float]] = {f: [] for f in FIGURES}
    for s in range(first, first + count):
        mine = ids[source == s]
        slices = [mine[i : i + BATCH] for i in range(0, len(mine) - BATCH + 1, BATCH)]
        found = quality(slices, ROWS_PER_FILE).as_dict()
        for f in FIGURES:
            figures[f].append(found[f])
    return {f: statistics.mean(v) for f, v in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    root = Path("bench_output/mixture_quality")
    quiet_setup(str(root))
    print(machine_note())
    uniform = np.concatenate(uniform_batches(SOURCE_ROWS, BATCH))
    report: dict[str, Any] = {"uniform": per_source(uniform, 0, 1)}
    for count in CASES:
        sources = sources_of(root, count)
        mixed = epoch_ids(sources, weights=dict.fromkeys(sources, 1))
        one = epoch_ids([p for ps in sources.values() for p in ps])
        alone = epoch_ids(sources["s000"])
        report[str(count)] = {
            "mixture": per_source(mixed, 0, count),
            "one dataset": per_source(one, 0, count),
            "a source alone": per_source(alone, 0, 1),
        }
    print(f"\nper source, slices of {BATCH} of its rows: {' | '.join(FIGURES)}")
    print(f"  {'uniform permutation':32} " + _row(report["uniform"]))
    for count in CASES:
        for contender, figures in report[str(count)].items():
            print(f"  {count:3} sources, {contender:19} " + _row(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def _row(figures: dict[str, float]) -> str:
    return " | ".join(f"{figures[f]:6.3f}" for f in FIGURES)


if __name__ == "__main__":
    main()
