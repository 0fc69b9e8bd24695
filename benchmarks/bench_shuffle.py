"""Shuffle quality, cost, latency and memory on data sorted inside each file (issue 15's targets).

Data (``tests/_shuffle_metrics.py``, cached under ``bench_output/shuffle[_quick]``): files sorted
inside by ``pos``, ``label = pos * 10 // rows`` (ten contiguous blocks a file), ``id`` the global
storage index, four float32 features. Layouts: ``main`` 64 files x 100,000 rows, row groups of
10,000; ``large_file`` the same rows in one file (row groups of 100,000); ``big_groups`` 4 files
of one row group of 1 Mi rows each; ``tokens`` 8 files x 25,000 rows of ``list<int32>`` (64-511
tokens) beside ``id``. Batches of 1,024 rows. Each figure is printed beside baselines measured in
the same run, with its target and whether it is met:

1. **quality** (``main``, defaults, ``num_workers`` 0 and 2): distinct labels per batch, std of
   ``pos / rows`` per batch, fraction of a batch's rows whose storage neighbour (``id - 1``) is in
   the batch, |Spearman(delivery, storage)| over the epoch; beside a uniform random permutation
   of the same ids (numpy), ours unshuffled, and Hugging Face ``datasets`` streaming Parquet
   ``.shuffle(seed=0, buffer_size=10_000 | 1_000)`` (in-process; ``--no-hf`` skips it). Targets:
   ≥ 9.5 labels, spread ≥ 0.27, ≤ 1 % neighbours, |Spearman| < 0.05;
2. **budget** that binds: ``shuffle_memory_bytes`` = 1/16 of a stream's decoded data (of the
   columns read, over ``max(1, num_workers)`` streams): ≥ 9 labels, ≥ 0.25, ≤ 2 %; and the curve
   of quality and first-batch latency against the budget, 1/64 … 1 of a stream (``--plot``);
3. **layouts** ``large_file`` and ``big_groups``, defaults: the targets of 1;
4. **cost**: shuffled / unshuffled rows/s, median of per-round ratios over interleaved rounds,
   each contender one loader (persistent workers) warmed by one untimed epoch, then one epoch per
   round (``set_epoch``), with the CPU time of an epoch (process and workers) beside it, since
   the shuffled path decodes a window with two threads: ``main`` all columns (≥ 0.65 with 0
   workers, ≥ 0.85 with 2), ``tokens`` unpacked and packed (``TokenPacking``, 128 x 2,048
   tokens a batch) (≥ 0.85). Beside it, how long a shuffled epoch waited for its first batch:
   an epoch here is 1.4-4 windows of the default budget a stream, so the wait for its first
   window (the latency of 5, once an epoch) is a large part of it, where an epoch of many
   windows (training on more data than the budget) spreads it over all of them;
5. **latency**: time to the first batch of an epoch (a new loader: ``iter`` + ``next``, workers'
   start included), shuffled, beside unshuffled (≤ 1 s); and after a resume at 90 % vs at 0 % of
   the epoch (≤ 1.5x), the resumed epoch checked row for row;
6. **memory**: peak RSS (``VmHWM``) per worker, ``num_workers=2``, persistent workers, unshuffled
   beside shuffled with the default budget and with the binding one, ``main`` and ``tokens``,
   each case in a new interpreter (workers are forked, so they count the pages of the process
   they fork from).

Every epoch of ours is checked: its ids are exactly the dataset's (packed: the token count and
sum); the script exits non-zero otherwise. Targets are reported, not enforced.

    python benchmarks/bench_shuffle.py [--quick] [--no-hf] [--plot out.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from _bench_util import (
    cpu_seconds,
    forked_children,
    machine_note,
    paired,
    quiet_setup,
    status_kib,
)
from _shuffle_data import EOS, FULL, QUICK, Data, all_data, describe, token_totals  # tests/ on path
from _shuffle_metrics import Quality, exactly_once, quality, uniform_batches
from _shuffle_report import (
    BOUND,
    DEFAULTS,
    FIRST_BATCH_S,
    HEADER,
    RATIO_TARGETS,
    RESUME_RATIO,
    Verdicts,
    plot,
    row,
)

from torch_dataloader_utils import StructuredDataset, TokenPacking

BATCH = 1024
WORKERS = (0, 2)
HF_BUFFERS = (10_000, 1_000)
CURVE = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1.0)  # budget as a fraction of a stream's data
BINDING = 1 / 16
PARTS = ("memory", "quality", "budget", "layouts", "cost", "latency")  # in the order they run
MIN_BUDGET = 4096  # the library refuses less per stream
SEQ_LEN, SEQUENCES = 2048, 128  # packed batches: 262,144 tokens, about a 1,024-row batch's
PACKING = TokenPacking("input_ids", seq_len=SEQ_LEN, separator=EOS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", help="data directory (default bench_output/shuffle[_quick])")
    p.add_argument("--quick", action="store_true",
                   help="64 x 20,000 rows (row groups of 2,000), 2 big-group files, 4 token "
                        "files of 10,000 rows, 3 rounds (1-2 min)")  # fmt: skip
    p.add_argument("--rounds", type=int, help="interleaved cost rounds (default 5, quick 3)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    p.add_argument("--only", metavar="PARTS", default=",".join(PARTS),
                   help=f"comma-separated parts to run (default: {','.join(PARTS)})")  # fmt: skip
    p.add_argument("--plot", metavar="PATH", help="write the budget curve as a PNG")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    args.only = [part.strip() for part in args.only.split(",")]
    if unknown := sorted(set(args.only) - set(PARTS)):
        p.error(f"--only: unknown part(s) {unknown}; parts: {', '.join(PARTS)}")
    args.scale = QUICK if args.quick else FULL
    args.rounds = args.rounds or args.scale.rounds
    args.data = args.data or "bench_output/shuffle" + ("_quick" if args.quick else "")
    return args


# ----------------------------------------------------------------------------- ours


def has_budget() -> bool:
    return "shuffle_memory_bytes" in inspect.signature(StructuredDataset).parameters


def default_budget() -> int | None:
    if not has_budget():
        return None
    default = inspect.signature(StructuredDataset).parameters["shuffle_memory_bytes"].default
    return default if isinstance(default, int) else None


def budget_for(data: Data, workers: int, fraction: float) -> int:
    """``fraction`` of a stream's decoded data, at least the library's floor."""
    return max(MIN_BUDGET, round(data.stream_bytes(workers) * fraction))


def make_loader(data: Data, *, workers: int, shuffle: bool = True, **options: Any) -> Any:
    """``(loader, dataset)`` over ``data``; ``options``: ``shuffle_memory_bytes``, packing, …"""
    if options.get("packing") is None:
        options.setdefault("batch_size", BATCH)
        options.setdefault("columns", data.columns)
    else:
        options.setdefault("batch_size", SEQUENCES)
    return StructuredDataset.create_dataloader(
        data.root, format="parquet", shuffle=shuffle, num_workers=workers, **options
    )


@dataclass
class Run:
    """One epoch of ours: ids per batch (copied), seconds to the first batch and to the end."""

    batches: list[np.ndarray] = field(default_factory=list)
    first_s: float = 0.0
    seconds: float = 0.0
    tokens: int = 0
    token_sum: int = 0

    @property
    def rows(self) -> int:
        return sum(len(b) for b in self.batches)


def run_epoch(loader: Any, *, packed: bool = False, limit: int | None = None) -> Run:
    """Iterate ``loader`` (at most ``limit`` batches), timed from ``iter``."""
    run = Run()
    start = time.perf_counter()
    batches = iter(loader)
    for number, batch in enumerate(batches):
        if number == 0:
            run.first_s = time.perf_counter() - start
        if packed:
            real = int(batch["num_tokens"])
            run.tokens += real
            tokens = batch["input_ids"].numpy().reshape(-1)[:real]
            run.token_sum += int(tokens.sum(dtype=np.int64))  # numpy: torch's sum is slow here
        else:
            run.batches.append(batch["id"].numpy().copy())
        if limit is not None and number + 1 >= limit:
            break
    run.seconds = time.perf_counter() - start
    close(batches)
    return run


def close(batches: Iterator[Any]) -> None:
    """End an iteration early (our generator over the workers) and join what it started."""
    if hasattr(batches, "close"):
        batches.close()
    gc.collect()


def check(run: Run, data: Data, name: str, packed_totals: tuple[int, int] | None = None) -> None:
    """Exit non-zero unless ``run`` delivered the dataset exactly (packed: every token once)."""
    if packed_totals is not None:
        tokens, token_sum = packed_totals
        rows = data.total  # one separator per document
        if (run.tokens, run.token_sum) != (tokens + rows, token_sum + rows * EOS):
            raise SystemExit(f"{name}: {run.tokens:,} tokens (sum {run.token_sum:,}), expected "
                             f"{tokens + rows:,} (sum {token_sum + rows * EOS:,})")  # fmt: skip
        return
    wrong = exactly_once(run.batches, data.total)
    if wrong is not None:
        raise SystemExit(f"{name}: the epoch is not the dataset: {wrong}")


def ours_quality(data: Data, workers: int, name: str, **options: Any) -> dict[str, float]:
    """Quality of one checked epoch, with its speed and first-batch latency."""
    loader, _ = make_loader(data, workers=workers, **options)
    run = run_epoch(loader)
    del loader
    gc.collect()
    check(run, data, name)
    return figures(quality(run.batches, data.rows_per_file), run)


def figures(q: Quality, run: Run | None = None) -> dict[str, float]:
    out = q.as_dict()
    if run is not None:
        out |= {"rows_per_s": run.rows / run.seconds, "first_batch_s": run.first_s}
    return out


# ----------------------------------------------------------------------------- Hugging Face


def hf_quality(data: Data, buffer: int, hf_home: str) -> dict[str, float]:
    """HF streaming Parquet, ``.shuffle(seed=0, buffer_size=buffer)``, batches of ``BATCH``."""
    os.environ.setdefault("HF_HOME", hf_home)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("parquet", data_files=data.paths, streaming=True, split="train")
    ds = ds.select_columns(["id"]).shuffle(seed=0, buffer_size=buffer)
    run = Run()
    start = time.perf_counter()
    for batch in ds.with_format("numpy").iter(batch_size=BATCH):
        run.first_s = run.first_s or time.perf_counter() - start
        run.batches.append(np.asarray(batch["id"]))
    run.seconds = time.perf_counter() - start
    wrong = exactly_once(run.batches, data.total)
    if wrong is not None:
        print(f"  (hf buffer {buffer}: {wrong})")
    return figures(quality(run.batches, data.rows_per_file), run)


def hf_available(args: argparse.Namespace) -> bool:
    if args.no_hf:
        print("  Hugging Face skipped (--no-hf)")
        return False
    try:
        import datasets  # noqa: F401
    except ImportError:
        print("  Hugging Face skipped: datasets is not installed (pip install datasets)")
        return False
    return True


# ----------------------------------------------------------------------------- 1-3 quality


def run_quality(args: argparse.Namespace, data: Data, verdicts: Verdicts) -> dict[str, Any]:
    print(f"\n1. quality, {data.total:,} rows in {len(data.paths)} files, defaults, batches "
          f"of {BATCH:,} (labels / spread / neighbours per batch, spearman: epoch):")  # fmt: skip
    print(HEADER)
    out: dict[str, Any] = {"uniform": figures(uniform(data))}
    row("uniform permutation (numpy)", out["uniform"])
    out["unshuffled w0"] = ours_quality(data, 0, "unshuffled w0", shuffle=False)
    row("ours unshuffled w0", out["unshuffled w0"])
    for workers in WORKERS:
        name = f"shuffled w{workers}"
        out[name] = ours_quality(data, workers, name)
        row(f"ours shuffled w{workers}", out[name])
        verdicts.quality(f"quality main {name}", out[name], out["uniform"], DEFAULTS)
    if hf_available(args):
        hf_home = os.path.join(os.path.dirname(os.path.abspath(args.data)), "hf_home")
        for buffer in HF_BUFFERS:
            out[f"hf buffer {buffer}"] = hf_quality(data, buffer, hf_home)
            row(f"hf streaming, buffer {buffer:,}", out[f"hf buffer {buffer}"])
    return out


def uniform(data: Data) -> Quality:
    return quality(uniform_batches(data.total, BATCH), data.rows_per_file)


def run_budget(data: Data, verdicts: Verdicts) -> dict[str, Any]:
    """The binding budget with 0 and 2 workers, and the curve of quality against the budget."""
    if not has_budget():
        print("\n2. budget: skipped, the installed StructuredDataset has no shuffle_memory_bytes")
        return {}
    base = figures(uniform(data))
    print(f"\n2. the budget binds: shuffle_memory_bytes = 1/16 of a stream's decoded data "
          f"({data.decoded / 2**20:.0f} MiB of columns read / streams):")  # fmt: skip
    print(HEADER)
    out: dict[str, Any] = {"binding": {}, "curve": []}
    for workers in WORKERS:
        budget = budget_for(data, workers, BINDING)
        f = ours_quality(data, workers, f"budget w{workers}", shuffle_memory_bytes=budget)
        out["binding"][f"w{workers}"] = f | {"budget": budget}
        row(f"ours w{workers}, {budget / 2**20:.1f} MiB", f)
        verdicts.quality(f"quality, budget 1/16, w{workers}", f, base, BOUND)
    print("\n   quality against the budget, num_workers=0 (fraction of the stream's data):")
    print(HEADER.replace("contender", "budget   "))
    for fraction in CURVE:
        budget = budget_for(data, 0, fraction)
        f = out["binding"]["w0"] if fraction == BINDING else ours_quality(
            data, 0, f"curve {fraction:g}", shuffle_memory_bytes=budget)  # fmt: skip
        floor = " (floor)" if budget == MIN_BUDGET else ""
        out["curve"].append(f | {"fraction": fraction, "budget": budget})
        row(f"1/{round(1 / fraction)}: {budget / 2**20:.1f} MiB{floor}", f)
    return out


def run_layouts(datas: dict[str, Data], verdicts: Verdicts) -> dict[str, Any]:
    print("\n3. other layouts, defaults:")
    print(HEADER)
    out: dict[str, Any] = {}
    for layout in ("large_file", "big_groups"):
        data = datas[layout]
        files, groups = len(data.paths), pq.ParquetFile(data.paths[0]).num_row_groups
        print(f"  {layout}: {files} file(s) x {data.rows_per_file:,} rows, {groups} row "
              f"group(s) a file")  # fmt: skip
        out[layout] = {"uniform": figures(uniform(data))}
        row("  uniform permutation", out[layout]["uniform"])
        for workers in WORKERS:
            f = ours_quality(data, workers, f"{layout} w{workers}")
            out[layout][f"shuffled w{workers}"] = f
            row(f"  ours shuffled w{workers}", f)
            verdicts.quality(f"quality {layout} w{workers}", f, out[layout]["uniform"], DEFAULTS)
    return out


# ----------------------------------------------------------------------------- 4 cost


def steady_loader(data: Data, workers: int, shuffle: bool, packed: bool) -> Callable[[int], Run]:
    """An epoch function of one loader (persistent workers), warmed by one untimed epoch."""
    extra: dict[str, Any] = {"persistent_workers": True} if workers else {}
    if packed:
        extra["packing"] = PACKING
    loader, dataset = make_loader(data, workers=workers, shuffle=shuffle, **extra)

    def epoch(number: int) -> Run:
        dataset.set_epoch(number)
        return run_epoch(loader, packed=packed)

    epoch(0)
    return epoch


def cost_pair(
    data: Data, workers: int, rounds: int, packed_totals: tuple[int, int] | None, label: str
) -> dict[str, Any]:
    packed = packed_totals is not None
    runs: dict[str, list[float]] = {"shuffled": [], "unshuffled": []}
    first: list[float] = []
    cpu: dict[str, list[float]] = {"shuffled": [], "unshuffled": []}
    epochs = {name: steady_loader(data, workers, name == "shuffled", packed) for name in runs}
    for number in range(1, rounds + 1):
        for name, epoch in epochs.items():
            before = cpu_seconds()
            run = epoch(number)
            cpu[name].append(cpu_seconds() - before)
            check(run, data, f"{label} {name} epoch {number}", packed_totals)
            runs[name].append(data.total / run.seconds)
            if name == "shuffled":
                first.append(run.first_s / run.seconds)
    del epochs
    gc.collect()
    cpu_ratio = statistics.median(cpu["unshuffled"]) / statistics.median(cpu["shuffled"])
    waited = statistics.median(first)
    return {"runs": runs, "cpu_s": cpu, "cpu_ratio": cpu_ratio, "first_batch_share": waited} | (
        paired(runs, "shuffled", "unshuffled")
    )


def run_cost(args: argparse.Namespace, datas: dict[str, Data], verdicts: Verdicts) -> dict:
    print(f"\n4. cost: shuffled / unshuffled rows/s, {args.rounds} interleaved rounds, one "
          f"warmed loader each (persistent workers), one epoch a round:")  # fmt: skip
    totals = token_totals(datas["tokens"])
    cases = [(f"{kind} w{w}", kind, w) for kind in ("main", "tokens", "packed") for w in WORKERS]
    out: dict[str, Any] = {}
    for label, kind, workers in cases:
        data = datas["main" if kind == "main" else "tokens"]
        r = cost_pair(data, workers, args.rounds, totals if kind == "packed" else None, label)
        out[label] = r
        target = RATIO_TARGETS[label]
        medians = [statistics.median(r["runs"][n]) / 1e6 for n in ("shuffled", "unshuffled")]
        print(f"  {label:<10} {r['paired_median']:5.2f}  (target ≥ {target}; shuffled epoch "
              f"waited {r['first_batch_share']:.0%} of its time for its first batch; of medians "
              f"{r['of_medians']:.2f}, best/best {r['best_over_best']:.2f}; "
              f"{medians[0]:.2f}M / {medians[1]:.2f}M rows/s; CPU time unshuffled / "
              f"shuffled {r['cpu_ratio']:.2f})", flush=True)  # fmt: skip
        verdicts.add(f"cost {label}", f"{r['paired_median']:.2f}",
                     f"unshuffled {medians[1]:.2f}M rows/s", f"≥ {target}",
                     r["paired_median"] >= target)  # fmt: skip
    return out


# ----------------------------------------------------------------------------- 5 latency


def first_batch(data: Data, workers: int, shuffle: bool, state: dict | None = None) -> float:
    """Seconds from a new loader's ``iter`` (after ``load_state_dict(state)``) to a batch."""
    loader, _ = make_loader(data, workers=workers, shuffle=shuffle)
    start = time.perf_counter()
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - start
    close(batches)
    del loader
    gc.collect()
    return seconds


def state_at(data: Data, workers: int, fraction: float) -> tuple[dict, list[np.ndarray]]:
    """The state after ``fraction`` of a shuffled epoch, and the ids delivered until then."""
    loader, _ = make_loader(data, workers=workers)
    run = run_epoch(loader, limit=round(len(loader) * fraction)) if fraction else Run()
    state = json.loads(json.dumps(loader.state_dict()))
    del loader
    gc.collect()
    return state, run.batches


def resumed_rest(data: Data, workers: int, state: dict, before: list[np.ndarray]) -> None:
    """Resume ``state`` to the end of the epoch; exit unless before + rest is the dataset."""
    loader, _ = make_loader(data, workers=workers)
    loader.load_state_dict(state)
    rest = run_epoch(loader)
    check(Run(batches=before + rest.batches), data, f"resume w{workers}")


def run_latency(data: Data, verdicts: Verdicts, repeats: int = 3) -> dict[str, Any]:
    print(f"\n5. latency: first batch of an epoch, new loader (median of {repeats}); resume:")
    out: dict[str, Any] = {}
    for workers in WORKERS:
        for shuffle in (False, True):
            name = f"{'shuffled' if shuffle else 'unshuffled'} w{workers}"
            out[name] = statistics.median(
                first_batch(data, workers, shuffle) for _ in range(repeats)
            )
        unshuffled, shuffled = out[f"unshuffled w{workers}"], out[f"shuffled w{workers}"]
        at: dict[float, float] = {}
        for fraction in (0.0, 0.9):
            state, before = state_at(data, workers, fraction)
            at[fraction] = statistics.median(
                first_batch(data, workers, True, state) for _ in range(repeats)
            )
            if fraction:
                resumed_rest(data, workers, state, before)
        out[f"resume w{workers}"] = at
        ratio = at[0.9] / at[0.0]
        print(f"  w{workers}: shuffled {shuffled * 1e3:.0f} ms (unshuffled {unshuffled * 1e3:.0f}"
              f" ms; target ≤ {FIRST_BATCH_S:g} s); after a resume at 0 % {at[0.0] * 1e3:.0f} "
              f"ms, at 90 % {at[0.9] * 1e3:.0f} ms: {ratio:.2f}x (target ≤ {RESUME_RATIO}); "
              f"the resumed epoch is exact", flush=True)  # fmt: skip
        verdicts.add(f"first batch shuffled w{workers}", f"{shuffled * 1e3:.0f} ms",
                     f"unshuffled {unshuffled * 1e3:.0f} ms", f"≤ {FIRST_BATCH_S:g} s",
                     shuffled <= FIRST_BATCH_S)  # fmt: skip
        verdicts.add(f"first batch after resume w{workers}", f"{at[0.9] * 1e3:.0f} ms",
                     f"at 0 %: {at[0.0] * 1e3:.0f} ms", f"≤ {FIRST_BATCH_S:g} s",
                     at[0.9] <= FIRST_BATCH_S)  # fmt: skip
        verdicts.add(f"resume 90 % / 0 % w{workers}", f"{ratio:.2f}x",
                     f"at 0 %: {at[0.0] * 1e3:.0f} ms", f"≤ {RESUME_RATIO}",
                     ratio <= RESUME_RATIO)  # fmt: skip
    return out


# ----------------------------------------------------------------------------- 6 memory


def fresh_worker_peaks(data: Data, workers: int, **options: Any) -> list[int]:
    """``worker_peaks`` in a new interpreter: every case's workers fork the same parent (this
    process grows with each epoch it checks, and a forked worker's RSS counts its parent's
    pages: measured in one process, the later cases came out 40-60 MiB heavier)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_forked_worker_peaks, data, workers, **options).result()


def _forked_worker_peaks(data: Data, workers: int, **options: Any) -> list[int]:
    multiprocessing.set_start_method("fork", force=True)  # a spawned process inherits spawn
    return worker_peaks(data, workers, **options)


def worker_peaks(data: Data, workers: int, **options: Any) -> list[int]:
    """``VmHWM`` (bytes) of each persistent worker after one checked epoch."""
    loader, _ = make_loader(data, workers=workers, persistent_workers=True, **options)
    before = forked_children()
    batches, pids = [], []
    for batch in loader:
        batches.append(batch["id"].numpy().copy())
        pids = pids or sorted(forked_children() - before)
    peaks = [status_kib(pid, "VmHWM") * 1024 for pid in pids]
    check(Run(batches=batches), data, f"memory {options or 'unshuffled'}")
    del loader
    gc.collect()
    return peaks


def run_memory(datas: dict[str, Data], verdicts: Verdicts) -> dict[str, Any]:
    workers = max(WORKERS)
    print(f"\n6. memory: peak RSS (VmHWM) per worker, num_workers={workers}, persistent workers:")
    out: dict[str, Any] = {}
    for layout in ("main", "tokens"):
        out[layout] = memory_cases(datas[layout], layout, workers, verdicts)
    return out


def memory_cases(data: Data, layout: str, workers: int, verdicts: Verdicts) -> dict[str, Any]:
    """Peaks of ``layout`` unshuffled, shuffled and (with a budget) shuffled at 1/16."""
    cases: dict[str, dict[str, Any]] = {"unshuffled": {"shuffle": False}, "shuffled": {}}
    default = default_budget()
    if has_budget():
        cases["shuffled, budget 1/16"] = {
            "shuffle_memory_bytes": budget_for(data, workers, BINDING)
        }
    out: dict[str, Any] = {}
    for name, options in cases.items():
        out[name] = fresh_worker_peaks(data, workers, **options)
    base = max(out["unshuffled"], default=0)
    for name, options in cases.items():
        budget = options.get("shuffle_memory_bytes", default if name != "unshuffled" else None)
        extra = max(out[name], default=0) - base
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in out[name]) or "none found"
        beside = f"; budget {budget / 2**20:.1f} MiB" if budget else ""
        label = f"{layout} {name}"
        print(f"  {label:<31} {peaks} MiB   ({extra / 2**20:+.0f} MiB over unshuffled{beside})")
        if budget and name != "unshuffled":
            verdicts.add(f"memory {label} w{workers}", f"{extra / 2**20:+.0f} MiB",
                         f"unshuffled {base / 2**20:.0f} MiB", f"≤ budget {budget / 2**20:.1f} "
                         f"MiB + docs", extra <= budget)  # fmt: skip
    return out


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    quiet_setup(args.data)
    datas = all_data(Path(args.data), args.scale)
    print(f"data under {args.data} ({'quick' if args.quick else 'full'}):")
    describe(datas)
    print(f"shuffle_memory_bytes: {'default ' + str(default_budget()) if has_budget() else 'none'}"
          f"; machine: {machine_note()}")  # fmt: skip
    verdicts = Verdicts()
    parts: dict[str, Callable[[], Any]] = {
        "memory": lambda: run_memory(datas, verdicts),
        "quality": lambda: run_quality(args, datas["main"], verdicts),
        "budget": lambda: run_budget(datas["main"], verdicts),
        "layouts": lambda: run_layouts(datas, verdicts),
        "cost": lambda: run_cost(args, datas, verdicts),
        "latency": lambda: run_latency(datas["main"], verdicts),
    }
    out: dict[str, Any] = {part: run() for part, run in parts.items() if part in args.only}
    verdicts.show()
    out["verdicts"], out["seconds"] = verdicts.rows, time.perf_counter() - started
    print(f"\nwhole run: {out['seconds']:.0f} s; machine after: {machine_note()}")
    if args.plot and out.get("budget"):
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        note = f"{datas['main'].total:,} rows, {len(datas['main'].paths)} files. {machine_note()}"
        base = figures(uniform(datas["main"]))
        plot(args.plot, out["budget"]["curve"], base, BINDING, note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
