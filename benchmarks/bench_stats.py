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

Then (``--cases``, on by default) the verdict in four constructed cases, at each of
``--workers``, each read for ``--case-seconds`` by a loop that does nothing with its batches
unless said: slow storage (the files in an fsspec memory store behind a wrapper that serves
``--storage-mb-s`` MB/s after ``--latency-ms`` per request), a slow transform (``--transform-ms``
per batch, a sleep as a tokenizer's C code that holds the worker), a slow consumer (a step of
``--slow-step-ms``), many tiny batches (``--tiny-batch`` rows). Expected: ``storage``,
``transform``, ``trainer``, ``transport``.

    python benchmarks/bench_stats.py [--workers 0 2] [--step-ms 0 1] [--batch 1024] [--repeats 3]
        [--no-overhead] [--no-cases]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import fsspec
from _bench_util import ensure_dataset, machine_note, paired, quiet_setup
from fsspec.implementations.memory import MemoryFileSystem

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
    p.add_argument("--overhead", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cases", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--case-seconds", type=float, default=4.0, help="reading per case")
    p.add_argument("--latency-ms", type=float, default=50.0, help="slow storage: per request")
    p.add_argument("--storage-mb-s", type=float, default=5.0, help="slow storage: bandwidth")
    p.add_argument("--transform-ms", type=float, default=5.0, help="slow transform: per batch")
    p.add_argument("--slow-step-ms", type=float, default=50.0, help="slow consumer: its step")
    p.add_argument("--tiny-batch", type=int, default=4, help="many tiny batches: rows each")
    return p.parse_args(argv)


class SlowMemory(MemoryFileSystem):
    """An object store far away: ``latency`` seconds per request, then ``rate`` bytes/s."""

    protocol = "slowmem"
    latency, rate = 0.02, 20e6

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return str(super()._strip_protocol(path.removeprefix("slowmem://")))

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        data = super().cat_file(path, start=start, end=end, **kwargs)
        time.sleep(self.latency + len(data) / self.rate)
        return data


def slow_store(data: str, args: argparse.Namespace) -> str:
    """The files of ``data`` in ``slowmem://stats``, served slowly (workers fork with them)."""
    SlowMemory.latency, SlowMemory.rate = args.latency_ms / 1e3, args.storage_mb_s * 1e6
    fsspec.register_implementation("slowmem", SlowMemory, clobber=True)
    fs = fsspec.filesystem("slowmem")
    for path in sorted(Path(data).glob("*.parquet")):
        fs.pipe_file(f"/stats/{path.name}", path.read_bytes())
    return "slowmem://stats"


def case(
    path: str, workers: int, seconds: float, *, batch: int, step_s: float = 0.0,
    transform: Any = None,
) -> Any:  # fmt: skip
    """Read ``path`` for ``seconds`` (or an epoch); the loader's stats at the end."""
    loader, _ = StructuredDataset.create_dataloader(
        path, batch_size=batch, num_workers=workers, columns=["id", "x"], transform=transform
    )
    began = time.perf_counter()
    for _ in loader:
        if step_s:
            time.sleep(step_s)
        if time.perf_counter() - began >= seconds:
            break
    return loader.stats(recent_seconds=seconds)


def slept(seconds: float) -> Any:
    def transform(batch: Any) -> Any:
        time.sleep(seconds)
        return batch

    return transform


def cases(args: argparse.Namespace) -> dict[str, Any]:
    """The four constructed cases at each of ``--workers``: the verdict each gets."""
    store = slow_store(args.data, args)
    kinds: dict[str, tuple[str, str, dict[str, Any]]] = {
        "slow storage": ("storage", store, {"batch": args.batch}),
        "slow transform": ("transform", args.data, {
            "batch": args.batch, "transform": slept(args.transform_ms / 1e3)}),
        "slow consumer": ("trainer", args.data, {
            "batch": args.batch, "step_s": args.slow_step_ms / 1e3}),
        "many tiny batches": ("transport", args.data, {"batch": args.tiny_batch}),
    }  # fmt: skip
    out: dict[str, Any] = {}
    for (name, (expected, path, options)), workers in itertools.product(
        kinds.items(), args.workers
    ):
        stats = case(path, workers, args.case_seconds, **options)
        right = stats.bottleneck == expected
        print(
            f"case {name}, w{workers}: verdict {stats.bottleneck!r} "
            f"({'right' if right else f'WRONG, expected {expected!r}'}): {stats.advice}",
            flush=True,
        )
        out[f"{name} w{workers}"] = {"expected": expected, "right": right, **stats.as_dict()}
    return out


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
    if args.cases:
        out["cases"] = cases(args)
    for workers, step_ms in itertools.product(args.workers, args.step_ms if args.overhead else []):
        label = f"w{workers} step {step_ms:g} ms"
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
                f"  {label} round {repeat + 1}/{args.repeats}: "
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
            f"{label}: without {statistics.median(rates['without']) / 1e6:.2f} M "
            f"rows/s, with stats every step {statistics.median(rates['with stats']) / 1e6:.2f} "
            f"M rows/s, ratio {ratio['paired_median']:.3f} (of medians "
            f"{ratio['of_medians']:.3f}) {'meets' if ok else 'MISSES'} target ≥ {TARGET}; "
            f"stats() {statistics.median(call_us):.1f} us per call (median in the loop), "
            f"{per_batch_us:.0f} us per batch without: implied ratio {implied:.3f}; "
            f"verdict {stats.bottleneck!r}: {stats.advice}"
        )
        out[label] = {"rows_per_s": rates, **ratio, "stats_call_us": call_us, "implied": implied}
        out[label]["last_stats"] = stats.as_dict()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
