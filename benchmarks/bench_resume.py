"""Resume cost: time to first batch after ``load_state_dict`` and the exactness of the resume.

Four measurements on local Parquet (columns id int64, x float64, y float32):

1. **Time to first batch after resume** at 0/10/50/90 % of an epoch, for ``num_workers`` 0 and 2
   (shuffle on). States come from one uninterrupted reference run; each timing builds a fresh
   dataset (``create_dataloader``, timed separately as *construction*), then times
   ``load_state_dict`` + ``iter`` + the first ``next`` (for 2 workers this includes starting
   them). Target: 90 % ≤ 1.5 x 0 %.
2. **Rows re-delivered**: the resumed remainder is compared id by id with the reference run
   (target 0 re-delivered, 0 lost, same order).
3. **A 10x longer file list** (same rows per file, 10x the files), resumed at 50 %:
   construction and first-batch time against the short list (target ≤ 1.5x).
4. **State size** at 50 % of a 100,000-split plan with 8 workers (tiny row groups and
   ``split_bytes=1``, so each row group is a split): ``len(pickle.dumps(state))`` and JSON bytes
   (target ≤ 64 KiB pickled).

    python benchmarks/bench_resume.py [--data DIR] [--repeats K] [--plot out.png]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from _bench_util import ensure_dataset, machine_note, plot_bars, timed

from torch_dataloader_utils import StructuredDataset

BATCH = 4096
POINTS = (0.0, 0.1, 0.5, 0.9)
TARGET_LATE = 1.5
TARGET_FILES = 1.5
TARGET_STATE = 64 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default="bench_output/resume", help="directory for the datasets")
    p.add_argument("--rows", type=int, default=8_000_000, help="rows of the main dataset")
    p.add_argument("--files", type=int, default=16, help="files of the main dataset")
    p.add_argument("--row-group-rows", type=int, default=65_536)
    p.add_argument("--split-bytes", type=int, default=8 * 2**20, help="split_bytes (main)")
    p.add_argument("--repeats", type=int, default=9, help="timings per point (median)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--list-files", type=int, default=20, help="short list; the long one is 10x")
    p.add_argument("--list-file-rows", type=int, default=25_000)
    p.add_argument("--state-splits", type=int, default=100_000)
    p.add_argument("--state-workers", type=int, default=8)
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


def make_loader(data: str | list[str], workers: int, **kwargs: Any) -> Any:
    return StructuredDataset.create_dataloader(
        data, batch_size=BATCH, num_workers=workers, shuffle=True, shuffle_seed=7, **kwargs
    )[0]


def state_splits(dataset: StructuredDataset) -> int:
    """Splits in the plan, from the state's documented ``num_splits`` field."""
    return int(dataset.state_dict()["num_splits"])


def json_copy(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a checkpoint file would hold it (also proves it is JSON-safe)."""
    return json.loads(json.dumps(state))  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- 1 and 2


def reference_run(
    data: str, workers: int, split_bytes: int
) -> tuple[np.ndarray, dict[float, tuple[int, dict[str, Any]]]]:
    """Ids in delivery order and, per point, ``(rows delivered, state)`` from one full epoch."""
    loader = make_loader(data, workers, split_bytes=split_bytes)
    total = len(loader)
    at = {round(p * total): p for p in POINTS}
    states: dict[float, tuple[int, dict[str, Any]]] = {}
    ids: list[np.ndarray] = []
    rows = 0
    if 0 in at:
        states[at[0]] = (0, json_copy(loader.state_dict()))
    for number, batch in enumerate(loader, start=1):
        ids.append(batch["id"].numpy().copy())
        rows += len(ids[-1])
        if number in at:
            states[at[number]] = (rows, json_copy(loader.state_dict()))
    return np.concatenate(ids), states


def first_batch_after_resume(
    data: str | list[str], workers: int, state: dict[str, Any], split_bytes: int, *, rest: bool
) -> tuple[float, float, np.ndarray | None]:
    """``(construction s, load + first batch s, ids of the remainder if rest)``."""
    build, loader = timed(lambda: make_loader(data, workers, split_bytes=split_bytes))
    start = time.perf_counter()
    loader.load_state_dict(state)
    batches = iter(loader)
    first = next(batches)
    seconds = time.perf_counter() - start
    ids = None
    if rest:
        ids = np.concatenate([first["id"].numpy(), *(b["id"].numpy() for b in batches)])
    if hasattr(batches, "close"):  # our generator over the worker iterator
        batches.close()
    del batches, loader
    gc.collect()  # shut the workers down before the next timing
    return build, seconds, ids


def check_exact(reference: np.ndarray, delivered_rows: int, resumed: np.ndarray) -> dict[str, Any]:
    """Ids are 0..rows-1, so counting with bincount is exact and O(rows)."""
    before = reference[:delivered_rows]
    delivered_before = np.zeros(reference.size, dtype=bool)
    delivered_before[before] = True
    counts = np.bincount(np.concatenate([before, resumed]), minlength=reference.size)
    return {
        "redelivered": int(delivered_before[resumed].sum()),
        "lost": int((counts == 0).sum()),
        "same_order": bool(np.array_equal(resumed, reference[delivered_rows:])),
    }


def resume_points(args: argparse.Namespace, data: str) -> dict[int, dict[float, dict[str, Any]]]:
    results: dict[int, dict[float, dict[str, Any]]] = {}
    for workers in args.workers:
        reference, states = reference_run(data, workers, args.split_bytes)
        out: dict[float, dict[str, Any]] = {}
        for p in POINTS:  # the exactness check, with a full remainder, once per point
            rows, state = states[p]
            _, _, ids = first_batch_after_resume(data, workers, state, args.split_bytes, rest=True)
            assert ids is not None
            out[p] = {
                "rows_before": rows,
                "builds": [],
                "firsts": [],
                **check_exact(reference, rows, ids),
            }
        for _ in range(args.repeats):  # interleaved: 0, 10, 50, 90, 0, 10, ...
            for p in POINTS:
                build, first, _ = first_batch_after_resume(
                    data, workers, states[p][1], args.split_bytes, rest=False
                )
                out[p]["builds"].append(build)
                out[p]["firsts"].append(first)
        for p in POINTS:
            out[p]["build"] = statistics.median(out[p]["builds"])
            out[p]["first"] = statistics.median(out[p]["firsts"])
            out[p]["first_min"] = min(out[p]["firsts"])
        results[workers] = out
        print_points(workers, out)
    return results


def print_points(workers: int, out: dict[float, dict[str, Any]]) -> None:
    print(f"\nnum_workers={workers}: resume at p % of the epoch (median of runs; min in brackets)")
    print("     p   construction   first batch           re-delivered  lost  same order")
    for p, r in out.items():
        print(
            f"  {p * 100:4.0f}%   {r['build'] * 1e3:8.1f} ms   {r['first'] * 1e3:8.1f} ms"
            f" [{r['first_min'] * 1e3:6.1f}]   {r['redelivered']:12d}  {r['lost']:4d}"
            f"  {r['same_order']}"
        )
    ratio = out[0.9]["first"] / out[0.0]["first"]
    best = out[0.9]["first_min"] / out[0.0]["first_min"]
    print(
        f"  first batch 90 % / 0 % = {ratio:.2f}  ({verdict(ratio, TARGET_LATE)}; "
        f"min/min {best:.2f})"
    )


def verdict(value: float, target: float) -> str:
    return f"{'meets' if value <= target else 'MISSES'} target ≤ {target:g}"


# ----------------------------------------------------------------------------- 3


def file_list_scaling(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Resume at 50 % on N files and on 10 N files of the same size, interleaved."""
    lists = {}
    for name, count in (("short", args.list_files), ("long", 10 * args.list_files)):
        lists[name] = ensure_dataset(
            root / f"files{count}",
            rows=count * args.list_file_rows,
            files=count,
            row_group_rows=args.list_file_rows // 5,
            quiet=True,
        )
    results = {}
    for workers in args.workers:
        states = {name: half_epoch_state(files, workers) for name, files in lists.items()}
        results[f"w{workers}"] = time_lists(args, lists, states, workers)
    return results


def half_epoch_state(files: list[str], workers: int) -> dict[str, Any]:
    loader = make_loader(files, workers)
    batches = iter(loader)
    for _ in range(len(loader) // 2):
        next(batches)
    state = json_copy(loader.state_dict())
    if hasattr(batches, "close"):
        batches.close()
    del batches, loader
    gc.collect()
    return state


def time_lists(
    args: argparse.Namespace, lists: dict[str, list[str]], states: dict[str, Any], workers: int
) -> dict[str, Any]:
    """Interleaved resumes of the short and the long list (3x the repeats: they are quick)."""
    timings: dict[str, dict[str, list[float]]] = {n: {"build": [], "first": []} for n in lists}
    for _ in range(3 * args.repeats):
        for name, files in lists.items():
            build, first, _ = first_batch_after_resume(
                files, workers, states[name], 2**27, rest=False
            )
            timings[name]["build"].append(build)
            timings[name]["first"].append(first)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in timings.items()}
    print(
        f"\nfile list {len(lists['short'])} vs {len(lists['long'])} files "
        f"({args.list_file_rows:,} rows each), resume at 50 %, num_workers={workers} "
        f"(median of {3 * args.repeats}):"
    )
    for name in lists:
        m = med[name]
        print(
            f"  {len(lists[name]):5d} files: construction {m['build'] * 1e3:8.1f} ms, "
            f"first batch {m['first'] * 1e3:7.1f} ms [min {min(timings[name]['first']) * 1e3:.1f}]"
        )
    total = {n: m["build"] + m["first"] for n, m in med.items()}
    ratios = {"first": med["long"]["first"] / med["short"]["first"]}
    ratios["total"] = total["long"] / total["short"]
    ratios["first_min"] = min(timings["long"]["first"]) / min(timings["short"]["first"])
    print(
        f"  10x files / 1x files: first batch {ratios['first']:.2f} "
        f"({verdict(ratios['first'], TARGET_FILES)}; min/min {ratios['first_min']:.2f}); "
        f"construction + first batch {ratios['total']:.2f}"
    )
    return {"median_s": med, **ratios}


# ----------------------------------------------------------------------------- 4


def state_size(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """State at 50 % of an epoch of ``--state-splits`` one-row-group splits, 8 workers."""
    files, groups_per_file = 100, args.state_splits // 100
    data = ensure_dataset(
        root / f"splits{args.state_splits}",
        rows=files * groups_per_file * 8,
        files=files,
        row_group_rows=8,
        quiet=True,
    )
    build, loader = timed(lambda: make_loader(data, args.state_workers, split_bytes=1))
    dataset = loader.dataset
    splits = state_splits(dataset)
    total = len(loader)
    start = time.perf_counter()
    state: dict[str, Any] = {}
    for number, _ in enumerate(loader, start=1):
        if number == total // 2:
            state = loader.state_dict()
            break
    walk = time.perf_counter() - start
    pickled, as_json = len(pickle.dumps(state)), len(json.dumps(state).encode())
    ok = "meets" if pickled <= TARGET_STATE else "MISSES"
    print(
        f"\nstate size at 50 % of {splits:,} splits, {args.state_workers} workers "
        f"(construction {build:.1f} s, reaching 50 % {walk:.1f} s):"
    )
    print(f"  pickle {pickled:,} bytes, JSON {as_json:,} bytes  ({ok} target ≤ 64 KiB pickled)")
    return {"splits": splits, "pickle_bytes": pickled, "json_bytes": as_json}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The package's index cache (parsed footers) lives beside the data, not in ~/.cache.
    os.environ.setdefault("TDU_CACHE_DIR", str(Path(args.data) / "index_cache"))
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    root = Path(args.data)
    files = ensure_dataset(
        root / "main", rows=args.rows, files=args.files, row_group_rows=args.row_group_rows
    )
    data = str(root / "main")
    splits = state_splits(StructuredDataset(data, split_bytes=args.split_bytes))
    print(
        f"dataset: {data}: {len(files)} files, {args.rows:,} rows, {splits} splits "
        f"(split_bytes={args.split_bytes:,}), batch_size={BATCH}, shuffle=True"
    )
    print(f"machine: {machine_note()}")
    began = time.perf_counter()
    points = resume_points(args, data)
    print(f"  (resume points took {time.perf_counter() - began:.0f} s)")
    began = time.perf_counter()
    scaling = file_list_scaling(args, root)
    print(f"  (file lists took {time.perf_counter() - began:.0f} s)")
    began = time.perf_counter()
    size = state_size(args, root)
    print(f"  (state size took {time.perf_counter() - began:.0f} s)")
    failed = [
        f"w{w} at {p:.0%}" for w, out in points.items() for p, r in out.items()
        if r["redelivered"] or r["lost"] or not r["same_order"]
    ]  # fmt: skip
    print(
        f"\nexact resume: {'all points exact' if not failed else 'NOT EXACT: ' + ', '.join(failed)}"
    )
    if args.plot:
        labels = [f"w{w} {p:.0%}" for w in points for p in POINTS]
        values = [points[w][p]["first"] * 1e3 for w in points for p in POINTS]
        plot_bars(
            args.plot,
            "Time to first batch after resume",
            labels,
            values,
            "ms (median)",
            [machine_note()],
        )
    if args.json:
        with open(args.json, "w") as out:
            points_json = {w: {str(p): r for p, r in o.items()} for w, o in points.items()}
            json.dump({"points": points_json, "files": scaling, "state": size}, out, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
