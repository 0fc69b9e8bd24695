"""The cost of ``loader.stats()``: throughput with stats read every step against without.

Both contenders iterate ``create_dataloader(dir, batch_size=--batch, num_workers=N)`` over the
same files, touch each batch and run a step that keeps the main thread busy for ``--step-ms``
(a spin on the clock; 0: no step at all, the worst case for any per-step cost); ``with stats``
also calls ``loader.stats()`` after every step and reads its verdict (the heaviest use: a
logger or a callback each step). Small batches (default 1,024 rows) make the per-batch costs
show. Rounds are interleaved and the ratio is the median of the per-round ratios (runs
adjacent in time; the machine is shared). Also printed: the median ``stats()`` call in the loop
in microseconds, the ratio it implies (1 - call / time per batch without; robust where the
rounds' ratio is noise), and the verdict of the last run (a loop with no step waits on data:
expect a data-side verdict; with a step longer than a batch's reading, ``trainer``).

Target (SPEC): rows/s with stats read every step ≥ 0.99 x without.

    python benchmarks/bench_stats.py [--workers 0 2] [--step-ms 0 1] [--batch 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

from _bench_util import ensure_dataset, machine_note, paired, quiet_setup

from torch_dataloader_utils import StructuredDataset

TARGET = 0.99


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default="bench_output/stats", help="dataset directory")
    p.add_argument("--rows", type=int, default=2_000_000, help="rows in the dataset")
    p.add_argument("--files", type=int, default=4, help="Parquet files")
    p.add_argument("--row-group-rows", type=int, default=65_536, help="rows per row group")
    p.add_argument("--batch", type=int, default=1024, help="rows per batch")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers values")
    p.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 1.0], help="step times")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


def epoch(
    data: str, batch: int, workers: int, step_s: float, read_stats: bool
) -> tuple[float, int, Any, list[float]]:
    """``(seconds, rows, loader, calls)`` of one epoch from ``iter(loader)`` to the last batch;
    ``calls``: the seconds of each ``stats()`` call."""
    loader, _ = StructuredDataset.create_dataloader(
        data, batch_size=batch, num_workers=workers, columns=["id", "x"]
    )
    rows, calls = 0, []
    start = time.perf_counter()
    for b in loader:
        rows += len(b["id"])
        until = time.perf_counter() + step_s
        while time.perf_counter() < until:
            pass
        if read_stats:
            called = time.perf_counter()
            loader.stats().bottleneck  # noqa: B018 (read as a logger would)
            calls.append(time.perf_counter() - called)
    return time.perf_counter() - start, rows, loader, calls


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_setup(args.data)
    ensure_dataset(args.data, rows=args.rows, files=args.files, row_group_rows=args.row_group_rows)
    print(f"dataset: {args.data}: {args.rows:,} rows in {args.files} files; batch {args.batch}")
    print(f"machine: {machine_note()}")
    epoch(args.data, args.batch, 0, 0.0, False)  # warm the page cache and the index cache
    out: dict[str, Any] = {}
    for workers, step_ms in itertools.product(args.workers, args.step_ms):
        case = f"w{workers} step {step_ms:g} ms"
        rates: dict[str, list[float]] = {"without": [], "with stats": []}
        call_us: list[float] = []
        for repeat in range(args.repeats):
            for name in rates:
                seconds, rows, loader, calls = epoch(
                    args.data, args.batch, workers, step_ms / 1e3, name != "without"
                )
                rates[name].append(rows / seconds)
            call_us.append(statistics.median(calls) * 1e6)
            print(
                f"  {case} round {repeat + 1}/{args.repeats}: "
                + "  ".join(f"{n} {r[-1] / 1e6:.2f} M rows/s" for n, r in rates.items()),
                flush=True,
            )
        ratio = paired(rates, "with stats", "without")
        stats = loader.stats()
        ok = ratio["paired_median"] >= TARGET
        # What one call costs a step of this loop: robust where the rounds' ratio is noise.
        per_batch_us = 1e6 * args.batch / statistics.median(rates["without"])
        implied = 1 - statistics.median(call_us) / per_batch_us
        print(
            f"{case}: without {statistics.median(rates['without']) / 1e6:.2f} M "
            f"rows/s, with stats every step {statistics.median(rates['with stats']) / 1e6:.2f} "
            f"M rows/s, ratio {ratio['paired_median']:.3f} (of medians "
            f"{ratio['of_medians']:.3f}) {'meets' if ok else 'MISSES'} target ≥ {TARGET}; "
            f"stats() {statistics.median(call_us):.1f} us per call (median in the loop), "
            f"{per_batch_us:.0f} us per batch without: implied ratio {implied:.3f}; "
            f"verdict {stats.bottleneck!r}: {stats.advice}"
        )
        out[case] = {"rows_per_s": rates, **ratio, "stats_call_us": call_us, "implied": implied}
        out[case]["last_stats"] = stats.as_dict()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
