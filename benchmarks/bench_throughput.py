"""Local Parquet throughput: torch_dataloader_utils against raw pyarrow in the same run.

Measures rows/s over the same files (columns id int64, x float64, y float32; batches of 4,096):

* ``raw``: ``pq.ParquetFile(f).iter_batches(batch_size=4096, use_threads=T)`` and
  ``torch.from_numpy(col.to_numpy())`` per column, with T = True and T = False; the faster of
  the two (by median) is the baseline;
* ``ours w0`` / ``ours w2``: ``StructuredDataset.create_dataloader(dir, batch_size=4096,
  num_workers=0 | 2)``, timed from ``iter(loader)`` to the last batch (worker start-up included;
  dataset construction, i.e. indexing, is timed separately);
* optionally Hugging Face ``datasets`` streaming Parquet under torchdata's
  ``StatefulDataLoader`` (its resumable path), on a prefix of the rows (rows/s extrapolated; the
  first batch is excluded from its timing, which favours it). Skipped when ``datasets`` is not
  importable.

Runs are interleaved (raw T, raw F, w0, w2, raw T, …) and every ratio uses figures from this run.

    python benchmarks/bench_throughput.py [--data DIR] [--rows N] [--repeats K] [--plot out.png]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import pyarrow.parquet as pq
import torch
from _bench_util import ensure_dataset, machine_note, paired, plot_bars, quiet_setup, summary, timed

from torch_dataloader_utils import StructuredDataset

BATCH = 4096
TARGET_W0 = 0.9
TARGET_W2 = 1.1  # SPEC: num_workers=2 on 2 cores >= 1.1 x num_workers=0
TARGET_HF = 50.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default="bench_output/throughput", help="dataset directory")
    p.add_argument("--rows", type=int, default=16_000_000, help="rows in the dataset")
    p.add_argument("--files", type=int, default=8, help="Parquet files")
    p.add_argument("--row-group-rows", type=int, default=131_072, help="rows per row group")
    p.add_argument("--compression", default="snappy", help="Parquet codec of generated data")
    p.add_argument("--repeats", type=int, default=7, help="interleaved runs per contender")
    p.add_argument("--hf-rows", type=int, default=200_000, help="rows for the per-row HF path")
    p.add_argument("--hf-batched-rows", type=int, default=2_000_000, help="rows, batched HF path")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- contenders


def raw_pyarrow(files: list[str], use_threads: bool) -> int:
    """The baseline: what a user would write by hand. Returns rows consumed."""
    rows = 0
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH, use_threads=use_threads):
            tensors = {
                name: torch.from_numpy(batch.column(i).to_numpy())
                for i, name in enumerate(batch.schema.names)
            }
            rows += len(tensors["id"])
    return rows


def ours(data: str, num_workers: int) -> tuple[float, float, float, int]:
    """``(construction s, first batch s, iteration s, rows)`` for one epoch through our loader."""
    build, (loader, _) = timed(
        lambda: StructuredDataset.create_dataloader(data, batch_size=BATCH, num_workers=num_workers)
    )
    start = time.perf_counter()
    first, rows = 0.0, 0
    for batch in loader:
        rows += len(batch["id"])
        first = first or time.perf_counter() - start
    return build, first, time.perf_counter() - start, rows


def cpu_seconds() -> tuple[float, float]:
    """CPU time (user + system) of this process and of its reaped children (the workers)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def interleaved(
    contenders: dict[str, Callable[[], tuple[float, int]]],
    repeats: int,
    expected_rows: int,
    cpu: dict[str, list[tuple[float, float]]],
) -> dict[str, list[float]]:
    """rows/s of every contender, run in turn ``repeats`` times; CPU s per run into ``cpu``."""
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(repeats):
        for name, run in contenders.items():
            main0, kids0 = cpu_seconds()
            seconds, rows = run()
            gc.collect()  # the loader's workers are joined (and counted) once it is collected
            main1, kids1 = cpu_seconds()
            if rows != expected_rows:
                raise SystemExit(f"{name} delivered {rows:,} rows, expected {expected_rows:,}")
            rates[name].append(rows / seconds)
            cpu.setdefault(name, []).append((main1 - main0, kids1 - kids0))
        line = "  ".join(f"{n}={r[-1] / 1e6:6.2f}M" for n, r in rates.items())
        print(f"  run {repeat + 1}/{repeats}: {line} rows/s", flush=True)
    return rates


def cpu_report(
    cpu: dict[str, list[tuple[float, float]]], runs: dict[str, list[float]], rows: int
) -> dict[str, Any]:
    """Median CPU seconds per million rows (main process, workers) and cores kept busy."""
    print("\nCPU seconds per million rows (median; main process incl. its threads + workers)")
    print("and cores kept busy (CPU time / wall time, median):")
    out: dict[str, Any] = {}
    for name, samples in cpu.items():
        main = statistics.median(m for m, _ in samples) * 1e6 / rows
        workers = statistics.median(w for _, w in samples) * 1e6 / rows
        cores = statistics.median(
            (m + w) * rate / rows for (m, w), rate in zip(samples, runs[name], strict=True)
        )
        out[name] = {"main": main, "workers": workers, "cores": cores}
        print(
            f"  {name:<22}main {main:6.3f}   workers {workers:6.3f}   total {main + workers:6.3f}"
            f"   cores {cores:4.2f}"
        )
    cores = os.cpu_count() or 1
    w0, w2 = out["ours w0"], out["ours w2"]
    ceiling = cores / (w2["main"] + w2["workers"]) / statistics.median(runs["ours w0"]) * 1e6
    out["w2_over_w0_ceiling"] = ceiling
    print(
        f"  ceiling for ours(w2) / ours(w0) with {cores} idle cores at these CPU costs: "
        f"{ceiling:.2f} (ours w0 already keeps {w0['cores']:.2f} cores busy)"
    )
    return out


# ----------------------------------------------------------------------------- Hugging Face


def hf_available() -> str | None:
    """``None`` if ``datasets`` and torchdata import, else why not."""
    try:
        import datasets  # noqa: F401
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError as exc:
        return f"{exc.name or exc} is not installed"
    return None


def hf_rate(files: list[str], hf_home: str, rows_wanted: int, batched: bool) -> float:
    """rows/s of ``datasets`` streaming Parquet + ``StatefulDataLoader`` over a prefix.

    ``batched=False`` is the documented per-example path (``StatefulDataLoader(ds,
    batch_size=4096)``, default collate); ``batched=True`` is the fastest resumable set-up we
    found (``ds.with_format("numpy").batch(4096)``, ``batch_size=None``).
    """
    os.environ.setdefault("HF_HOME", hf_home)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    from torchdata.stateful_dataloader import StatefulDataLoader

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    if batched:
        loader = StatefulDataLoader(ds.with_format("numpy").batch(BATCH), batch_size=None)
    else:
        loader = StatefulDataLoader(ds, batch_size=BATCH)
    batches = iter(loader)
    first = next(batches)  # set-up excluded from the timing
    assert isinstance(first["id"], torch.Tensor) and len(first["id"]) == BATCH, type(first["id"])
    rows, start = 0, time.perf_counter()
    for batch in batches:
        rows += len(batch["id"])
        if rows >= rows_wanted:
            break
    return rows / (time.perf_counter() - start)


# ----------------------------------------------------------------------------- report


def fmt_rate(value: float) -> str:
    return f"{value / 1e6:8.2f} M rows/s"


def verdict(value: float, target: float, higher: bool = True) -> str:
    ok = value >= target if higher else value <= target
    return f"{'meets' if ok else 'MISSES'} target {'≥' if higher else '≤'} {target:g}"


def ratio_line(label: str, r: dict[str, float], target: float) -> str:
    return (
        f"  {label:<22}= {r['paired_median']:6.2f}   ({verdict(r['paired_median'], target)}; "
        f"ratio of medians {r['of_medians']:.2f}, best/best {r['best_over_best']:.2f})"
    )


def report(
    runs: dict[str, list[float]], hf: dict[str, float], seconds: dict[str, float]
) -> dict[str, Any]:
    rates = {name: summary(values) for name, values in runs.items()}
    print("\nrows/s (median of runs; best in brackets)")
    for name, s in rates.items():
        print(f"  {name:<22}{fmt_rate(s['median'])}   [best {fmt_rate(s['best']).strip()}]")
    raw_name = max(("raw threads=True", "raw threads=False"), key=lambda n: rates[n]["median"])
    ratios: dict[str, Any] = {
        "baseline": raw_name,
        "w0_over_raw": paired(runs, "ours w0", raw_name),
        "w2_over_w0": paired(runs, "ours w2", "ours w0"),
    }
    print(f"\nbaseline = {raw_name} (the faster raw variant by median)")
    print("ratios: median of per-round ratios (each round runs every contender back to back)")
    print(ratio_line("ours(w0) / raw", ratios["w0_over_raw"], TARGET_W0))
    print(ratio_line("ours(w2) / ours(w0)", ratios["w2_over_w0"], TARGET_W2))
    w0 = rates["ours w0"]["median"]
    for name, rate in hf.items():
        ratios[f"w0_over_{name}"] = w0 / rate
        print(
            f"  {'ours(w0) / ' + name:<22}= {w0 / rate:6.1f}   ({verdict(w0 / rate, TARGET_HF)}; "
            f"median ours(w0) over {name} at {rate:,.0f} rows/s)"
        )
    print(
        f"\nmedian dataset construction (listing + footers, not in the rows/s above): "
        f"w0 {seconds['build_w0']:.3f} s, w2 {seconds['build_w2']:.3f} s"
    )
    print(
        f"median time to first batch (in the rows/s above; w2 includes starting the workers): "
        f"w0 {seconds['first_w0']:.3f} s, w2 {seconds['first_w2']:.3f} s"
    )
    ratios["rates"] = rates
    return ratios


def after_first_batch(
    runs: dict[str, list[float]], firsts: dict[int, list[float]], rows: int
) -> dict[str, float]:
    """Informational: our rates with the time to the first batch (worker start-up) left out."""
    steady = {}
    for workers, first in firsts.items():
        name = f"ours w{workers}"
        steady[name] = [rows / (rows / r - f) for r, f in zip(runs[name], first, strict=True)]
    result = paired(steady, "ours w2", "ours w0")
    print(
        f"\ninformational, leaving out the time to the first batch: ours(w2) / ours(w0) = "
        f"{result['paired_median']:.2f} (w0 {statistics.median(steady['ours w0']) / 1e6:.2f} M, "
        f"w2 {statistics.median(steady['ours w2']) / 1e6:.2f} M rows/s, medians)"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_setup(args.data)
    files = ensure_dataset(
        args.data,
        rows=args.rows,
        files=args.files,
        row_group_rows=args.row_group_rows,
        compression=args.compression,
    )
    size = sum(os.path.getsize(f) for f in files)
    print(f"dataset: {args.data}: {len(files)} files, {args.rows:,} rows, {size / 2**20:.0f} MiB")
    print(f"compression={args.compression}, batch_size={BATCH}")
    print(f"machine: {machine_note()}")
    raw_pyarrow(files, True)  # warm the page cache
    builds: dict[int, list[float]] = {0: [], 2: []}
    firsts: dict[int, list[float]] = {0: [], 2: []}

    def run_ours(workers: int) -> tuple[float, int]:
        build, first, seconds, rows = ours(args.data, workers)
        builds[workers].append(build)
        firsts[workers].append(first)
        return seconds, rows

    contenders: dict[str, Callable[[], tuple[float, int]]] = {
        "raw threads=True": lambda: timed(lambda: raw_pyarrow(files, True)),
        "raw threads=False": lambda: timed(lambda: raw_pyarrow(files, False)),
        "ours w0": lambda: run_ours(0),
        "ours w2": lambda: run_ours(2),
    }
    print(f"\n{args.repeats} interleaved runs per contender:")
    cpu: dict[str, list[tuple[float, float]]] = {}
    runs = interleaved(contenders, args.repeats, args.rows, cpu)
    hf = run_hf(args, files)
    extra = {
        f"{k}_w{w}": summary(v[w])["median"]
        for k, v in (("build", builds), ("first", firsts))
        for w in v
    }
    ratios = report(runs, hf, extra)
    ratios["cpu_per_million_rows"] = cpu_report(cpu, runs, args.rows)
    ratios["after_first_batch"] = after_first_batch(runs, firsts, args.rows)
    if args.plot:
        labels = [*runs, *hf]
        values = [statistics.median(v) for v in runs.values()] + list(hf.values())
        plot_bars(
            args.plot,
            f"Local Parquet throughput, batch {BATCH} ({args.rows:,} rows)",
            labels,
            values,
            "rows/s (median)",
            [machine_note()],
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"runs": runs, "hf": hf, "ratios": ratios, "seconds": extra}, out, indent=2)
    return 0


def run_hf(args: argparse.Namespace, files: list[str]) -> dict[str, float]:
    if args.no_hf:
        print("\nHugging Face comparison skipped (--no-hf)")
        return {}
    missing = hf_available()
    if missing:
        print(f"\nHugging Face comparison skipped: {missing} (pip install datasets to run it)")
        return {}
    hf_home = os.path.join(os.path.dirname(os.path.abspath(args.data)), "hf_home")
    print("\nHugging Face datasets streaming + StatefulDataLoader (a prefix of the rows):")
    result = {}
    for name, batched, rows in (
        ("hf", False, args.hf_rows),
        ("hf-batch", True, args.hf_batched_rows),
    ):
        result[name] = hf_rate(files, hf_home, rows, batched)
        print(f"  {name:<9} {fmt_rate(result[name])} over {rows:,} rows", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
