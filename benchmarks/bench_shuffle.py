"""Shuffle quality, cost and memory on data sorted by file, beside unshuffled and Hugging Face.

Data: 64 Parquet files x 100,000 rows, sorted by file (row groups of 10,000): ``label`` (int64,
the file's index, one per file), ``row`` (int64, global storage index), ``f0``…``f3`` (float32).
Batches of 1,024 rows. Figures, each beside its baseline from the same run:

* **quality** over one whole epoch: mean distinct ``label`` values (= files) per batch, the
  Spearman rank correlation of delivery position with storage index ``row``, and the fraction of
  consecutive deliveries that are consecutive in storage; for ours ``shuffle=True`` (default
  knobs) and ``shuffle=False`` with ``num_workers`` 0 and 2, and Hugging Face ``datasets``
  streaming Parquet, ``.shuffle(seed=0, buffer_size=1000)`` (in-process);
* **cost**: rows/s of ours shuffled over ours unshuffled, all columns, ``num_workers`` 0 and 2,
  median of per-round ratios over interleaved rounds;
* **memory**: peak RSS (``VmHWM``) of each DataLoader worker (``num_workers=2``, persistent
  workers read after the epoch), shuffled beside unshuffled, and beside the per-stream budget
  when the installed ``StructuredDataset`` has a ``shuffle_memory_bytes`` argument.

Targets (``SPEC.md``): ≥ 16 distinct files per batch with the defaults, correlation near 0,
shuffled ≥ 0.8 x unshuffled, peak memory within the documented budget. They are reported, not
enforced: the script exits non-zero only when a loader delivers a wrong set of rows.

    python benchmarks/bench_shuffle.py [--data DIR] [--quick] [--no-hf] [--plot out.png]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _bench_util import cached_files, machine_note, paired, quiet_setup

from torch_dataloader_utils import StructuredDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _shuffle_metrics import (  # the metrics the shuffle-quality test checks
    adjacent_fraction,
    distinct_per_batch,
    spearman,
    write_sorted_by_file,
)

BATCH = 1024
FEATURES = 4
HF_BUFFER = 1000
TARGET_DISTINCT = 16.0
TARGET_RATIO = 0.8
TARGET_SPEARMAN = 0.05  # |rho| below this counts as "near 0"
WORKERS = (0, 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", help="dataset directory (default bench_output/shuffle[_quick])")
    p.add_argument("--files", type=int, default=64, help="Parquet files, one label each")
    p.add_argument("--rows-per-file", type=int, help="rows per file (default 100,000)")
    p.add_argument("--row-group-rows", type=int, help="rows per row group (default 10,000)")
    p.add_argument("--repeats", type=int, help="interleaved throughput rounds (default 5)")
    p.add_argument(
        "--hf-rows", type=int, default=0, help="rows of the HF epoch to read (default: all)"
    )
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    p.add_argument(
        "--quick",
        action="store_true",
        help="64 files x 20,000 rows, row groups of 2,000, 3 rounds (about 30 s)",
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    quick = args.quick
    args.rows_per_file = args.rows_per_file or (20_000 if quick else 100_000)
    args.row_group_rows = args.row_group_rows or (2_000 if quick else 10_000)
    args.repeats = args.repeats or (3 if quick else 5)
    args.data = args.data or ("bench_output/shuffle_quick" if quick else "bench_output/shuffle")
    return args


# ----------------------------------------------------------------------------- one epoch


@dataclass
class Epoch:
    seconds: float
    rows: int
    labels: list[np.ndarray] = field(default_factory=list)  # per batch (when recorded)
    order: np.ndarray | None = None  # storage index ``row`` in delivery order (when recorded)
    worker_peak_kib: list[int] = field(default_factory=list)  # VmHWM per worker (memory runs)
    worker_start_kib: list[int] = field(default_factory=list)  # VmRSS after the first batch


def children() -> set[int]:
    """Pids of this process's children (all its threads'), from ``/proc``."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:  # the thread ended meanwhile
            continue
    return pids


def status_kib(pid: int, key: str) -> int:
    """``VmHWM`` / ``VmRSS`` of ``pid`` in KiB (0 if the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def ours_epoch(
    data: str,
    *,
    shuffle: bool,
    workers: int,
    columns: list[str],
    record: bool = False,
    memory: bool = False,
) -> Epoch:
    """One epoch through ``create_dataloader``, timed from ``iter(loader)`` to the last batch.

    ``record``: keep each batch's labels and the delivery order of ``row``. ``memory``:
    persistent workers, whose peak RSS is read after the epoch, while they are still alive."""
    extra: dict[str, Any] = {"persistent_workers": True} if memory and workers else {}
    loader, _ = StructuredDataset.create_dataloader(
        data,
        format="parquet",
        batch_size=BATCH,
        shuffle=shuffle,
        num_workers=workers,
        columns=columns,
        **extra,
    )
    before = children()
    epoch = Epoch(0.0, 0)
    rows: list[np.ndarray] = []
    workers_pids: list[int] = []
    start = time.perf_counter()
    for batch in loader:
        epoch.rows += len(batch["row"])
        if record:
            epoch.labels.append(batch["label"].numpy().copy())
            rows.append(batch["row"].numpy().copy())
        if memory and not workers_pids:
            workers_pids = sorted(children() - before)
            epoch.worker_start_kib = [status_kib(p, "VmRSS") for p in workers_pids]
    epoch.seconds = time.perf_counter() - start
    if memory:
        epoch.worker_peak_kib = [status_kib(p, "VmHWM") for p in workers_pids]
    if record:
        epoch.order = np.concatenate(rows) if rows else np.empty(0, np.int64)
    del loader
    gc.collect()  # joins the workers before the next contender starts
    return epoch


def hf_epoch(files: list[str], hf_home: str, rows_wanted: int) -> Epoch:
    """Hugging Face streaming Parquet with its buffer shuffle, batches of ``BATCH``, in-process."""
    os.environ.setdefault("HF_HOME", hf_home)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("parquet", data_files=files, streaming=True, split="train")
    ds = ds.select_columns(["label", "row"]).shuffle(seed=0, buffer_size=HF_BUFFER)
    epoch = Epoch(0.0, 0)
    rows: list[np.ndarray] = []
    start = time.perf_counter()
    for batch in ds.with_format("numpy").iter(batch_size=BATCH):
        epoch.labels.append(np.asarray(batch["label"]))
        rows.append(np.asarray(batch["row"]))
        epoch.rows += len(rows[-1])
        if rows_wanted and epoch.rows >= rows_wanted:
            break
    epoch.seconds = time.perf_counter() - start
    epoch.order = np.concatenate(rows)
    return epoch


# ----------------------------------------------------------------------------- figures


def quality(epoch: Epoch, total_rows: int, name: str) -> dict[str, float]:
    """Quality figures of one recorded epoch; exits when a full epoch lost or repeated rows."""
    assert epoch.order is not None
    if epoch.rows == total_rows and not np.array_equal(np.sort(epoch.order), np.arange(total_rows)):
        raise SystemExit(f"{name}: the epoch does not hold every row exactly once")
    position = np.arange(len(epoch.order))
    return {
        "distinct_per_batch": distinct_per_batch(epoch.labels),
        "spearman": spearman(position, epoch.order),
        "adjacent": adjacent_fraction(epoch.order),
        "rows": float(epoch.rows),
        "rows_per_s": epoch.rows / epoch.seconds,
    }


def verdict(ok: bool, target: str) -> str:
    return f"{'meets' if ok else 'MISSES'} target {target}"


def shuffle_knobs() -> dict[str, Any]:
    """Defaults of the shuffle knobs the installed ``StructuredDataset`` accepts (may be none)."""
    parameters = inspect.signature(StructuredDataset).parameters
    return {
        name: parameters[name].default
        for name in ("shuffle_window", "shuffle_memory_bytes")
        if name in parameters
    }


def run_quality(
    args: argparse.Namespace, files: list[str], total: int, columns: list[str]
) -> dict[str, dict[str, float]]:
    print(f"\nquality over one epoch, batches of {BATCH:,} rows:")
    print(
        f"  {'contender':<24}{'files/batch':>12}{'spearman':>10}{'adjacent':>10}"
        f"{'rows':>12}{'rows/s':>10}"
    )
    out: dict[str, dict[str, float]] = {}

    def show(name: str, q: dict[str, float]) -> None:
        out[name] = q
        print(
            f"  {name:<24}{q['distinct_per_batch']:12.2f}{q['spearman']:10.3f}"
            f"{q['adjacent']:10.3f}{int(q['rows']):12,}{q['rows_per_s'] / 1e6:9.2f}M",
            flush=True,
        )

    for shuffle in (True, False):
        for workers in WORKERS:
            name = f"ours {'shuffled' if shuffle else 'unshuffled'} w{workers}"
            epoch = ours_epoch(
                args.data, shuffle=shuffle, workers=workers, columns=columns, record=True
            )
            show(name, quality(epoch, total, name))
    hf_name = f"hf buffer {HF_BUFFER} w0"
    if args.no_hf:
        print("  Hugging Face skipped (--no-hf)")
    else:
        try:
            import datasets  # noqa: F401
        except ImportError:
            print("  Hugging Face skipped: datasets is not installed (pip install datasets)")
        else:
            hf_home = os.path.join(os.path.dirname(os.path.abspath(args.data)), "hf_home")
            show(hf_name, quality(hf_epoch(files, hf_home, args.hf_rows), total, hf_name))
            if args.hf_rows and args.hf_rows < total:
                print(f"  (hf: first {args.hf_rows:,} rows only: its spearman is not an epoch's)")
    shuffled = out["ours shuffled w0"]["distinct_per_batch"]
    print(
        f"\n  ours shuffled w0: {shuffled:.2f} files per batch, "
        f"{verdict(shuffled >= TARGET_DISTINCT, f'≥ {TARGET_DISTINCT:g}')}; "
        f"= {shuffled / out['ours unshuffled w0']['distinct_per_batch']:.2f} x unshuffled"
        + (
            f", {shuffled / out[hf_name]['distinct_per_batch']:.2f} x HF buffer {HF_BUFFER}"
            if hf_name in out
            else ""
        )
    )
    rho = out["ours shuffled w0"]["spearman"]
    print(
        f"  ours shuffled w0: spearman {rho:.3f}, "
        f"{verdict(abs(rho) < TARGET_SPEARMAN, f'|rho| < {TARGET_SPEARMAN:g}')} "
        f"(over a whole epoch this is near 0 as soon as files come in a shuffled order, even one "
        f"file at a time: read it with files/batch and adjacent)"
    )
    return out


def run_cost(args: argparse.Namespace, total: int, columns: list[str]) -> dict[str, Any]:
    names = {(s, w): f"{'shuffled' if s else 'unshuffled'} w{w}" for w in WORKERS for s in (0, 1)}
    runs: dict[str, list[float]] = {name: [] for name in names.values()}
    print(f"\ncost: rows/s, all {len(columns)} columns, {args.repeats} interleaved rounds:")
    for round_ in range(args.repeats):
        for (shuffle, workers), name in names.items():
            epoch = ours_epoch(args.data, shuffle=bool(shuffle), workers=workers, columns=columns)
            if epoch.rows != total:
                raise SystemExit(f"{name} delivered {epoch.rows:,} rows, expected {total:,}")
            runs[name].append(epoch.rows / epoch.seconds)
        line = "  ".join(f"{n}={r[-1] / 1e6:5.2f}M" for n, r in runs.items())
        print(f"  round {round_ + 1}/{args.repeats}: {line}", flush=True)
    out: dict[str, Any] = {"runs": runs}
    print("  shuffled / unshuffled (median of per-round ratios; ratio of medians, best/best):")
    for workers in WORKERS:
        r = paired(runs, f"shuffled w{workers}", f"unshuffled w{workers}")
        out[f"ratio_w{workers}"] = r
        print(
            f"    w{workers}: {r['paired_median']:5.2f}   "
            f"({verdict(r['paired_median'] >= TARGET_RATIO, f'≥ {TARGET_RATIO:g}')}; "
            f"{r['of_medians']:.2f}, {r['best_over_best']:.2f}; medians "
            f"{statistics.median(runs[f'shuffled w{workers}']) / 1e6:.2f}M / "
            f"{statistics.median(runs[f'unshuffled w{workers}']) / 1e6:.2f}M rows/s)"
        )
    return out


def run_memory(args: argparse.Namespace, columns: list[str]) -> dict[str, Any]:
    workers = max(WORKERS)
    print(f"\nmemory: peak RSS (VmHWM) per DataLoader worker, num_workers={workers}, all columns:")
    out: dict[str, Any] = {}
    for shuffle in (False, True):
        name = "shuffled" if shuffle else "unshuffled"
        epoch = ours_epoch(
            args.data, shuffle=shuffle, workers=workers, columns=columns, memory=True
        )
        out[name] = {"peak_kib": epoch.worker_peak_kib, "start_kib": epoch.worker_start_kib}
        peaks = ", ".join(f"{k / 1024:.0f}" for k in epoch.worker_peak_kib) or "none found"
        starts = ", ".join(f"{k / 1024:.0f}" for k in epoch.worker_start_kib)
        print(f"  {name:<11} peak {peaks} MiB   (RSS after the first batch: {starts} MiB)")
    peak = max(out["shuffled"]["peak_kib"], default=0) * 1024
    base = max(out["unshuffled"]["peak_kib"], default=0) * 1024
    out["extra_bytes"] = peak - base
    knobs = shuffle_knobs()
    out["knobs"] = knobs
    print(f"  shuffled - unshuffled, largest worker: {round((peak - base) / 2**20):+d} MiB")
    budget = knobs.get("shuffle_memory_bytes")
    if "shuffle_memory_bytes" not in knobs:
        print(
            "  no per-stream budget to compare: the installed StructuredDataset has no "
            "shuffle_memory_bytes argument (split-level shuffle)"
        )
    elif isinstance(budget, int) and not isinstance(budget, bool):
        ok = peak - base <= budget  # one stream per worker
        out["budget_bytes"], out["within_budget"] = budget, ok
        print(
            f"  per-stream budget shuffle_memory_bytes = {budget / 2**20:.0f} MiB "
            f"(default; shuffle_window = {knobs.get('shuffle_window')}): shuffled - unshuffled "
            f"is {'within' if ok else 'OVER'} the budget"
        )
    else:
        print(f"  shuffle_memory_bytes defaults to {budget!r}, not a byte count: no comparison")
    return out


# ----------------------------------------------------------------------------- plot


def plot(path: str, q: dict[str, dict[str, float]], cost: dict[str, Any], note: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; no plot written")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5), width_ratios=(3, 2))
    names = [
        n for n in ("ours shuffled w0", "ours unshuffled w0", f"hf buffer {HF_BUFFER} w0") if n in q
    ]
    values = [q[n]["distinct_per_batch"] for n in names]
    bars = left.bar([n.removesuffix(" w0") for n in names], values, color="#4C72B0")
    left.axhline(
        TARGET_DISTINCT, color="#C44E52", linestyle="--", label=f"target {TARGET_DISTINCT:g}"
    )
    left.bar_label(bars, fmt="%.2f", fontsize=8)
    left.set_ylabel("distinct files per batch (mean)")
    left.set_title(f"Shuffle quality: batches of {BATCH:,}, files sorted by label", fontsize=10)
    left.legend(fontsize=8, loc="center left")
    ratios = [cost[f"ratio_w{w}"]["paired_median"] for w in WORKERS]
    bars = right.bar([f"num_workers={w}" for w in WORKERS], ratios, color="#55A868")
    right.axhline(TARGET_RATIO, color="#C44E52", linestyle="--", label=f"target {TARGET_RATIO:g}")
    right.bar_label(bars, fmt="%.2f", fontsize=8)
    right.set_ylabel("shuffled / unshuffled rows/s")
    right.set_title("Shuffle cost (median of per-round ratios)", fontsize=10)
    right.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, note, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    quiet_setup(args.data)
    wanted = {
        "layout": "sorted_by_file",
        "files": args.files,
        "rows_per_file": args.rows_per_file,
        "row_group_rows": args.row_group_rows,
        "features": FEATURES,
    }
    files = cached_files(
        args.data,
        wanted,
        args.files,
        lambda root: write_sorted_by_file(
            root,
            files=args.files,
            rows_per_file=args.rows_per_file,
            row_group_rows=args.row_group_rows,
            features=FEATURES,
        ),
    )
    total = args.files * args.rows_per_file
    size = sum(os.path.getsize(f) for f in files)
    print(
        f"dataset: {args.data}: {len(files)} files x {args.rows_per_file:,} rows sorted by file "
        f"(row groups of {args.row_group_rows:,}), {size / 2**20:.0f} MiB"
    )
    print(f"installed shuffle knobs (defaults): {shuffle_knobs() or 'none (split-level shuffle)'}")
    print(f"machine: {machine_note()}")
    columns = ["label", "row", *(f"f{i}" for i in range(FEATURES))]
    # Memory first: workers are forked, so their RSS includes what this process holds by then.
    memory = run_memory(args, columns)
    q = run_quality(args, files, total, ["label", "row"])
    cost = run_cost(args, total, columns)
    seconds = time.perf_counter() - started
    print(f"\nwhole run: {seconds:.0f} s")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(args.plot, q, cost, f"{total:,} rows, {len(files)} files. {machine_note()}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"quality": q, "cost": cost, "memory": memory, "seconds": seconds},
                out,
                indent=2,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
