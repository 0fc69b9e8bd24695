"""Scale by simulation: one rank's planning time, memory and state size, without any I/O.

The index is built from synthetic footers (``FileMetadata`` values, one unit per split,
``split_bytes=1``), exactly as ``build_index`` cuts it after reading real ones; then one rank
(the middle one) of a ``ranks x workers`` job is simulated through the same pure calls the
dataset makes (``Epochs``: ``begin`` in the main process and in each worker, ``batches`` for
``len``, ``encode`` for ``state_dict``, ``load`` + ``begin`` to resume):

1. **Index**: time to cut the splits and build the index, memory it keeps (RSS delta), and its
   pickled size (what travels to spawned workers), per split.
2. **Per rank**, for every index x ``ranks`` x ``workers`` point: ``begin`` in the main
   process (cold: the epoch's sequence is recomputed) and in one worker (warm: a forked worker
   inherits the sequence), ``len`` (cold), the tracemalloc peak of ``begin`` and what the
   epoch's progress keeps, ``state_dict()`` per call and its pickled size at 50 % of the epoch,
   and a resume (``load`` + ``begin``, cold). Times are the fastest of ``--repeats`` (one at
   10^7 splits). The baseline is the shuffled sequence alone (``Epochs.sequence``, cold): the
   one part every rank must compute over all splits; ``begin`` is printed as a ratio of it.
3. **state_dict() at 100,000 splits** (1,000 files x 100 splits, 20 rows each, the
   ``tests/test_state.py`` fixture), 8 workers at 50 %: per call in the main process and in
   one worker (what StatefulDataLoader asks every step), target ≤ 1 ms.

Per-rank work must follow the rank's own share, not ``ranks x splits``: read each index's rows
top to bottom (8 -> 4,096 ranks): times and memory should stay flat (the O(splits) floor) while
the rank's share shrinks; the line under each index prints most-ranks / fewest-ranks ratios.
``docs/scale.md`` turns the figures into a cost model.

    python benchmarks/bench_scale.py [--points small|default|huge] [--plot out.png]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import pickle
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
from _bench_util import machine_note, per_call, plot_bars, rss_bytes, timed

from torch_dataloader_utils.checkpoint.schema import Generation
from torch_dataloader_utils.formats import FileMetadata
from torch_dataloader_utils.index.index import DatasetIndex, IndexedFile
from torch_dataloader_utils.index.splits import cut_splits
from torch_dataloader_utils.planning.config import DatasetConfig
from torch_dataloader_utils.planning.epochs import Epochs, Progress, Start

TARGET_STATE_S = 1e-3
TARGET_STATE_BYTES = 64 * 1024
TARGET_RANK_RATIO = 1.5  # per-rank cost at 4,096 ranks over 8 ranks, same index
SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float64())])

# (files, splits) of the index, and the (ranks, workers) simulated on it.
GRID = [(r, w) for r in (8, 64, 512, 4096) for w in (8, 16)]
POINTS: dict[str, list[tuple[int, int, list[tuple[int, int]]]]] = {
    "small": [(1_000, 100_000, [(8, 8), (4096, 16)])],
    "default": [
        (10_000, 100_000, GRID),
        (100_000, 1_000_000, GRID),
        (1_000_000, 1_000_000, [(8, 8), (4096, 16)]),
        (1_000_000, 10_000_000, [(4096, 16)]),
    ],
}
POINTS["huge"] = [*POINTS["default"][:-1], (1_000_000, 10_000_000, [(8, 8), (4096, 16)])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--points", choices=sorted(POINTS), default="default", help="the grid")
    p.add_argument("--rows", type=int, default=4096, help="mean rows per split")
    p.add_argument("--repeats", type=int, default=3, help="timings per figure below 10^7 splits")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the index


def synthetic_footers(files: int, splits: int, rows: int) -> list[IndexedFile]:
    """``files`` files of ``splits // files`` units each (rows ``rows`` ± 3 %): what reading
    their footers would give."""
    per_file = splits // files
    jitter = rows // 32
    out = []
    for number in range(files):
        unit_rows = tuple(rows - jitter + (number * 7 + u * 13) % (2 * jitter + 1)
                          for u in range(per_file))  # fmt: skip
        meta = FileMetadata(SCHEMA, unit_rows, tuple(r * 12 for r in unit_rows))
        name = f"part-{number:07d}.parquet"
        path = f"s3://bucket/corpus/{name}"
        fingerprint = f"{number * 0x9E3779B97F4A7C15 % 2**64:016x}"
        out.append(IndexedFile(path, path, name, fingerprint, meta))
    return out


def cut_index(files: list[IndexedFile]) -> DatasetIndex:
    """The index ``build_index`` makes of these footers with ``split_bytes=1`` (one split per
    unit), with what every rank derives from it once (split rows, digest, file groups)."""
    metas = [f.metadata for f in files]
    cut = cut_splits([m.unit_bytes for m in metas], [m.unit_rows for m in metas], 1)
    index = DatasetIndex(tuple(files), tuple(cut), SCHEMA, "s3://bucket/corpus")
    _ = index.split_rows, index.digest, index.file_groups()
    return index


def synthetic_index(files: int, splits: int, rows: int) -> DatasetIndex:
    return cut_index(synthetic_footers(files, splits, rows))


def measure_index(files: int, splits: int, rows: int) -> tuple[DatasetIndex, dict[str, Any]]:
    gc.collect()
    before = rss_bytes()
    footers = synthetic_footers(files, splits, rows)
    with_footers = rss_bytes()
    seconds, index = timed(lambda f=footers: cut_index(f))
    del footers
    after = rss_bytes()
    pickled = len(pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
    n = len(index.splits)
    figures = {
        "files": files,
        "splits": n,
        "build_s": seconds,
        "build_ns_per_split": seconds / n * 1e9,
        "footer_rss_bytes": with_footers - before,
        "rss_bytes": after - before,
        "rss_bytes_per_split": (after - before) / n,
        "pickle_bytes": pickled,
        "pickle_bytes_per_split": pickled / n,
    }
    print(
        f"\nindex: {files:,} files, {n:,} splits: cut in {seconds:.2f} s "
        f"({figures['build_ns_per_split']:.0f} ns/split); keeps {_mib(after - before)} "
        f"({figures['rss_bytes_per_split']:.0f} B/split, of which footers "
        f"{(with_footers - before) / n:.0f}); pickles to {_mib(pickled)} "
        f"({figures['pickle_bytes_per_split']:.0f} B/split)"
    )
    return index, figures


# ----------------------------------------------------------------------------- one rank


@dataclass(frozen=True)
class Rank:
    """One simulated rank: the middle one of ``ranks``, with ``workers`` DataLoader workers."""

    index: DatasetIndex
    ranks: int
    workers: int

    @cached_property
    def epochs(self) -> Epochs:
        config = DatasetConfig(shuffle=True, split_bytes=1, batch_size=1024)
        return Epochs(
            index=self.index, config=config, rank=self.ranks // 2, world_size=self.ranks,
            even_batches=True,
        )  # fmt: skip

    @property
    def fresh(self) -> Start:
        return Start.fresh(0)


def _cold(epochs: Epochs, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` after ``epochs`` forgets the sequence an earlier call kept."""

    def call() -> Any:
        epochs._sequences.clear()
        return fn()

    return call


def half_way(rank: Rank) -> Progress:
    """Every worker stream of the rank half way through its share."""
    progress = rank.epochs.begin(rank.fresh, rank.workers)
    for worker, order in progress.orders.items():
        progress.record(worker, order.total // 2, cursor=rank.workers - 1)
    return progress


def traced(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """``(peak bytes, bytes still held, result)`` of one call, by tracemalloc."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base, current - base, result


def measure_rank(rank: Rank, repeats: int) -> dict[str, Any]:
    epochs, fresh, workers = rank.epochs, rank.fresh, rank.workers
    seconds: dict[str, float] = {}
    seconds["perm"] = _fastest(repeats, _cold(epochs, lambda: epochs.sequence(0)))
    seconds["begin"] = _fastest(repeats, _cold(epochs, lambda: epochs.begin(fresh, workers)))
    # a forked worker inherits the sequence the main process has just computed
    seconds["worker"] = _fastest(repeats, lambda: epochs.begin(fresh, workers, workers=[0]))
    seconds["len"] = _fastest(repeats, _cold(epochs, lambda: epochs.batches(fresh, workers)))
    peak, kept, progress = traced(_cold(epochs, lambda: epochs.begin(fresh, workers)))
    del progress
    progress = half_way(rank)
    state = epochs.encode(progress)
    seconds["state"] = per_call(lambda: epochs.encode(progress), calls=max(3, 20 * repeats))
    stored = json.loads(json.dumps(state))
    seconds["load"] = _fastest(
        repeats, _cold(epochs, lambda: epochs.begin(epochs.load(stored, workers), workers))
    )
    own = sum(len(order.pieces) for order in progress.orders.values())
    return {
        "ranks": rank.ranks,
        "workers": workers,
        "own_pieces": own,
        "seconds": seconds,
        "peak_bytes": peak,
        "kept_bytes": kept,
        "state_pickle_bytes": len(pickle.dumps(state)),
        "state_json_bytes": len(json.dumps(state).encode()),
    }


def _fastest(repeats: int, fn: Callable[[], Any]) -> float:
    """The fastest of ``repeats`` timings: on a shared machine the least disturbed one."""
    return min(timed(fn)[0] for _ in range(repeats))


def print_rank_header() -> None:
    print(
        "   ranks x w   own pieces   perm ms  begin ms (/perm)  worker ms  len ms"
        "  peak MiB  kept MiB  state_dict µs  state B  resume ms"
    )


def print_rank(r: dict[str, Any]) -> None:
    s = r["seconds"]
    print(
        f"  {r['ranks']:5d} x {r['workers']:2d}  {r['own_pieces']:11,d}  {s['perm'] * 1e3:8.1f}"
        f"  {s['begin'] * 1e3:8.1f} ({s['begin'] / s['perm']:4.2f})  {s['worker'] * 1e3:9.1f}"
        f"  {s['len'] * 1e3:6.1f}  {r['peak_bytes'] / 2**20:8.1f}  {r['kept_bytes'] / 2**20:8.1f}"
        f"  {s['state'] * 1e6:13.0f}  {r['state_pickle_bytes']:7,d}  {s['load'] * 1e3:9.1f}"
    )


def rank_ratio(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> float:
    """``key`` at the most ranks over ``key`` at the fewest (same workers as the fewest)."""
    low = min(rows, key=lambda r: (r["ranks"], r["workers"]))
    high = max(rows, key=lambda r: (r["ranks"], -abs(r["workers"] - low["workers"])))
    return key(high) / key(low)


# ----------------------------------------------------------------------------- state_dict


def _moving(epochs: Epochs, progress: Progress) -> Callable[[], Any]:
    """``state_dict()`` as training calls it: one stream has moved a row since the last call
    (a stream's entry is kept until it moves, so calling twice in place would flatter it)."""
    streams = itertools.cycle(list(progress.positions))

    def call() -> Any:
        progress.positions[next(streams)] += 1
        return epochs.encode(progress)

    return call


# Shuffle budgets measured at 100,000 splits: the default (one window per stream there), 1 MiB
# (8 windows per stream of 16-byte rows) and the minimum (a window of 128 rows).
BUDGETS = {"256 MiB": 256 * 2**20, "1 MiB": 2**20, "4 KiB": 4096}


def state_dict_cost(repeats: int) -> dict[str, dict[str, float]]:
    """At 100,000 splits, 8 workers, 50 %, per shuffle budget: ``state_dict()`` per call (the
    issue's target ≤ 1 ms), the state's size (≤ 64 KiB), and resume planning (``load`` +
    ``begin``, cold: what ``load_state_dict`` and the first iteration compute)."""
    index = synthetic_index(1_000, 100_000, 20)
    out: dict[str, dict[str, float]] = {}
    for label, budget in BUDGETS.items():
        config = DatasetConfig(shuffle=True, split_bytes=1, shuffle_memory_bytes=budget)
        epochs = Epochs(index=index, config=config, rank=0, world_size=1, even_batches=False)
        rank = Rank(index, 1, 8)
        progress = epochs.begin(rank.fresh, 8)
        for worker, order in progress.orders.items():
            progress.record(worker, order.total // 2, cursor=7)
        one = epochs.begin(rank.fresh, 8, workers=[3])
        one.record(3, progress.positions[3], cursor=0)
        calls = 200 * repeats
        first, state = timed(lambda e=epochs, p=progress: e.encode(p))
        stored = json.loads(json.dumps(state))
        out[label] = {
            "window_rows": epochs.window_rows,
            "windows_per_stream": len(progress.orders[0].shuffled.ends),  # type: ignore[union-attr]
            "main_s": per_call(_moving(epochs, progress), calls=calls),
            "worker_s": per_call(_moving(epochs, one), calls=calls),
            "first_call_s": first,
            "state_pickle_bytes": len(pickle.dumps(state)),
            "state_json_bytes": len(json.dumps(state).encode()),
            "resume_s": _fastest(
                repeats, _cold(epochs, lambda e=epochs, st=stored: e.begin(e.load(st, 8), 8))
            ),
        }
    print(
        "\nat 100,000 splits (2,000,000 rows of 16 B), 8 workers, 50 %, per shuffle_memory_bytes:"
        "\n  budget    window rows  windows  state_dict main ms  one worker ms  first call ms"
        "  state B (pickle / JSON)  resume ms"
    )
    for label, f in out.items():
        ok = f["main_s"] <= TARGET_STATE_S and f["worker_s"] <= TARGET_STATE_S
        size_ok = max(f["state_pickle_bytes"], f["state_json_bytes"]) <= TARGET_STATE_BYTES
        print(
            f"  {label:8s}  {f['window_rows']:11,.0f}  {f['windows_per_stream']:7,.0f}"
            f"  {f['main_s'] * 1e3:18.3f}  {f['worker_s'] * 1e3:13.3f}"
            f"  {f['first_call_s'] * 1e3:13.1f}"
            f"  {f['state_pickle_bytes']:>10,.0f} / {f['state_json_bytes']:<10,.0f}"
            f"  {f['resume_s'] * 1e3:9.1f}"
            f"  ({'meets' if ok else 'MISSES'} ≤ 1 ms, {'meets' if size_ok else 'MISSES'} ≤ 64 KiB)"
        )
    return out


def elastic_state_bytes() -> dict[str, list[int]]:
    """A state's size after one elastic resume: it carries the old deal's position and tokens
    of every stream (``generations``), so it grows with the old job's ranks x workers."""
    index = synthetic_index(1_000, 100_000, 20)
    config = DatasetConfig(shuffle=True, split_bytes=1)
    out = {}
    print(
        "\nstate after one elastic resume (100,000 splits, 8 workers now), JSON bytes, the old"
        "\ndeal's streams each half way / each at a random row of its share:"
    )
    random = np.random.default_rng(0)
    for ranks, workers in ((8, 8), (64, 8), (512, 16), (4096, 16)):
        old = Epochs(index=index, config=config, rank=0, world_size=ranks, even_batches=True)
        shares = old.plan(Start.fresh(0), workers).deal.shares
        sizes = []
        for positions in (shares // 2, random.integers(0, shares + 1)):
            generation = Generation(
                ranks, workers, True, positions.astype(np.int64), np.zeros(len(shares), np.int64)
            )
            now = Epochs(index=index, config=config, rank=0, world_size=8, even_batches=True)
            progress = now.begin(Start(epoch=0, generations=(generation,)), 8)
            for worker, order in progress.orders.items():
                progress.record(worker, order.total // 2, cursor=0)
            sizes.append(len(json.dumps(now.encode(progress)).encode()))
        out[f"{ranks}x{workers}"] = sizes
        ok = "meets" if max(sizes) <= TARGET_STATE_BYTES else "MISSES"
        print(
            f"  old deal {ranks:5d} ranks x {workers:2d} workers: {sizes[0]:9,d} / {sizes[1]:9,d}"
            f"  ({ok} ≤ 64 KiB)"
        )
    return out


# ----------------------------------------------------------------------------- main


def run_index(
    files: int, splits: int, grid: list[tuple[int, int]], args: argparse.Namespace
) -> dict[str, Any]:
    index, figures = measure_index(files, splits, args.rows)
    repeats = args.repeats if splits < 10_000_000 else 1
    print_rank_header()
    ranks = []
    for world, workers in grid:
        ranks.append(measure_rank(Rank(index, world, workers), repeats))
        print_rank(ranks[-1])
    if len(ranks) > 1:
        ratios = {
            "begin": rank_ratio(ranks, lambda r: r["seconds"]["begin"] / r["seconds"]["perm"]),
            "peak": rank_ratio(ranks, lambda r: r["peak_bytes"]),
            "state_bytes": rank_ratio(ranks, lambda r: r["state_pickle_bytes"]),
        }
        ok = all(v <= TARGET_RANK_RATIO for v in ratios.values())
        print(
            f"  most ranks / fewest ranks: begin/perm {ratios['begin']:.2f}, peak memory "
            f"{ratios['peak']:.2f}, state bytes {ratios['state_bytes']:.2f}  "
            f"({'meets' if ok else 'MISSES'} target ≤ {TARGET_RANK_RATIO}: per-rank cost "
            f"does not grow with ranks)"
        )
        figures["rank_ratios"] = ratios
    largest = max(r["state_pickle_bytes"] for r in ranks)
    ok = "meets" if largest <= TARGET_STATE_BYTES else "MISSES"
    print(f"  largest state {largest:,} B pickled ({ok} target ≤ 64 KiB)")
    del index
    gc.collect()
    return {**figures, "ranks": ranks}


def constants(results: list[dict[str, Any]]) -> dict[str, float]:
    """Per-split constants of the cost model, from the largest index measured."""
    big = max(results, key=lambda r: r["splits"])
    n = big["splits"]
    at = max(big["ranks"], key=lambda r: (r["ranks"], r["workers"]))
    s = at["seconds"]
    model = {
        "index_build_ns": big["build_ns_per_split"],
        "index_rss_bytes": big["rss_bytes_per_split"],
        "index_pickle_bytes": big["pickle_bytes_per_split"],
        "perm_ns": s["perm"] / n * 1e9,
        "begin_ns": s["begin"] / n * 1e9,
        "worker_ns": s["worker"] / n * 1e9,
        "len_ns": s["len"] / n * 1e9,
        "state_dict_ns": s["state"] / n * 1e9,
        "resume_ns": s["load"] / n * 1e9,
        "peak_bytes": at["peak_bytes"] / n,
        "kept_bytes": at["kept_bytes"] / n,
    }
    print(f"\ncost model, per split of the whole index ({n:,} splits, "
          f"{at['ranks']} ranks x {at['workers']} workers):")  # fmt: skip
    for name, value in model.items():
        print(f"  {name:20s} {value:9.1f}")
    return model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"machine: {machine_note()}")
    cost = state_dict_cost(args.repeats)
    elastic = elastic_state_bytes()
    results = [run_index(f, s, grid, args) for f, s, grid in POINTS[args.points]]
    model = constants(results)
    if args.plot:
        labels = [f"{r['splits']:.0e} / {x['ranks']}x{x['workers']}"
                  for r in results for x in r["ranks"]]  # fmt: skip
        values = [x["seconds"]["begin"] * 1e3 for r in results for x in r["ranks"]]
        plot_bars(args.plot, "One rank's epoch plan (begin, main process)", labels, values,
                  "ms (median)", [machine_note()])  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"at_100k_splits": cost, "elastic_state_bytes": elastic, "indexes": results,
                       "model": model}, out, indent=2)  # fmt: skip
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
