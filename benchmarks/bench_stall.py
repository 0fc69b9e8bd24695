"""Data stall: a training loop whose step keeps the main thread busy, against the compute alone.

Every step runs single-threaded torch work (``torch.set_num_threads(1)``; a loop of 128 x 128
float32 matmuls, calibrated at start-up to ``--step-ms``) and touches the batch. The dataset is
sized so that a loader faster than the step rate can hide all of its reading behind the steps;
the figure is epoch time / compute-only time (the same number of steps with no data), measured
in interleaved rounds, each ratio against the compute time of its own round:

* ``raw inline``: ``pq.ParquetFile(f).iter_batches(4096, use_threads=False)`` → torch in the
  loop (reading is never hidden: the floor a loader has to beat);
* ``ours w0`` / ``ours w1`` / ``ours w2``: ``create_dataloader(dir, batch_size=4096,
  num_workers=0 | 1 | 2)``, from ``iter(loader)`` (worker start-up included) to the last step;
* ``hf w2``: Hugging Face ``datasets`` streaming Parquet, ``.with_format("numpy").batch(4096)``
  (its fastest resumable set-up), under torchdata's ``StatefulDataLoader(num_workers=2)``.

Target (SPEC): ours with ``num_workers >= 1`` ≤ 1.05 x the compute alone.

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python benchmarks/bench_stall.py [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow.parquet as pq
import torch
from _bench_util import ensure_dataset, machine_note, plot_bars, quiet_setup

from torch_dataloader_utils import StructuredDataset

BATCH = 4096
TARGET = 1.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default="bench_output/stall", help="dataset directory")
    p.add_argument("--rows", type=int, default=3_000_000, help="rows in the dataset")
    p.add_argument("--files", type=int, default=8, help="Parquet files")
    p.add_argument("--row-group-rows", type=int, default=65_536, help="rows per row group")
    p.add_argument("--step-ms", type=float, default=4.0, help="compute per step (calibrated)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face contender")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the step


class Step:
    """Single-threaded matmuls for about ``ms`` milliseconds, plus a touch of the batch."""

    def __init__(self, ms: float) -> None:
        torch.manual_seed(0)
        self.a = torch.randn(128, 128)
        self.b = torch.randn(128, 128) / 128
        self.matmuls = 1
        for _ in range(3):  # settle the estimate
            per = self._time(50) / 50
            self.matmuls = max(1, round(ms / 1e3 / per))
        self.sink = 0.0

    def _time(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            self.a = torch.tanh(self.a @ self.b)
        return time.perf_counter() - start

    def __call__(self, batch: dict[str, torch.Tensor] | None) -> None:
        self._time(self.matmuls)
        if batch is not None:
            self.sink += float(batch["x"][0])

    def measured_ms(self) -> float:
        return statistics.median(self._time(self.matmuls) for _ in range(20)) * 1e3


FIRST_BATCH: list[float] = []  # seconds from the loop's start to its first batch, per run
MAIN_CPU: dict[str, list[float]] = {}  # CPU seconds of the main thread per epoch


def run(batches: Iterable[Any], step: Step) -> int:
    """The training loop: one step per batch; returns the steps taken."""
    steps, start = 0, time.perf_counter()
    for batch in batches:
        if not steps:
            FIRST_BATCH.append(time.perf_counter() - start)
        step(batch)
        steps += 1
    return steps


# ----------------------------------------------------------------------------- contenders


def raw_batches(files: list[str]) -> Iterable[dict[str, torch.Tensor]]:
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH, use_threads=False):
            yield {
                name: torch.from_numpy(batch.column(i).to_numpy())
                for i, name in enumerate(batch.schema.names)
            }


def ours(data: str, workers: int) -> Callable[[Step], int]:
    def go(step: Step) -> int:
        loader, _ = StructuredDataset.create_dataloader(data, batch_size=BATCH, num_workers=workers)
        return run(loader, step)

    return go


def hf(files: list[str], hf_home: str) -> Callable[[Step], int]:
    os.environ.setdefault("HF_HOME", hf_home)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    from torchdata.stateful_dataloader import StatefulDataLoader

    datasets.disable_progress_bars()

    def go(step: Step) -> int:
        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        loader = StatefulDataLoader(
            ds.with_format("numpy").batch(BATCH), batch_size=None, num_workers=2
        )
        return run(loader, step)

    return go


def hf_missing() -> str | None:
    try:
        import datasets  # noqa: F401
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError as exc:
        return f"{exc.name or exc} is not installed"
    return None


# ----------------------------------------------------------------------------- main


def rounds(
    contenders: dict[str, Callable[[Step], int]], step: Step, steps: int, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per epoch of every contender, ``repeats`` interleaved rounds (compute first)."""
    times: dict[str, list[float]] = {"compute only": [], **{name: [] for name in contenders}}
    firsts: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(repeats):
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            step(None)
        times["compute only"].append(time.perf_counter() - start)
        MAIN_CPU.setdefault("compute only", []).append(time.thread_time() - cpu)
        for name, go in contenders.items():
            start, cpu = time.perf_counter(), time.thread_time()
            taken = go(step)
            times[name].append(time.perf_counter() - start)
            MAIN_CPU.setdefault(name, []).append(time.thread_time() - cpu)
            firsts[name].append(FIRST_BATCH.pop())
            if abs(taken - steps) > 16:  # the last batch of each file may be short
                raise SystemExit(f"{name} took {taken} steps, expected about {steps}")
        line = "  ".join(f"{n}={t[-1]:.2f}s" for n, t in times.items())
        print(f"  round {repeat + 1}/{repeats}: {line}", flush=True)
    return times, firsts


def report(
    times: dict[str, list[float]], firsts: dict[str, list[float]], steps: int
) -> dict[str, dict[str, float]]:
    """Ratios to the compute alone; also leaving out the wait for the first batch (start-up),
    and the main thread's CPU time per step beyond the compute (what the loader costs it)."""
    compute = times["compute only"]
    step_s = statistics.median(compute) / steps
    print("\nepoch time / compute-only time (median of per-round ratios; best in brackets);")
    print("'steady': leaving out the time to the first batch, against the compute minus one step;")
    print("'main': the main thread's CPU per step beyond the compute (the loader's share of it):")
    out = {}
    for name, values in times.items():
        ratios = [t / c for t, c in zip(values, compute, strict=True)]
        first = firsts.get(name, [0.0] * len(values))
        steady = [
            (t - f) / (c - step_s) if f else t / c
            for t, f, c in zip(values, first, compute, strict=True)
        ]
        out[name] = {"ratio": statistics.median(ratios), "best": min(ratios)}
        out[name] |= {"seconds": statistics.median(values), "first_s": statistics.median(first)}
        out[name]["steady"] = statistics.median(steady)
        extra = statistics.median(MAIN_CPU[name]) - statistics.median(MAIN_CPU["compute only"])
        out[name]["main_cpu_us"] = extra / steps * 1e6
        mark = ""
        if name in ("ours w1", "ours w2"):
            ok = out[name]["ratio"] <= TARGET
            mark = f"   {'meets' if ok else 'MISSES'} target ≤ {TARGET}"
        print(
            f"  {name:<14}{out[name]['ratio']:6.3f}  [{out[name]['best']:.3f}]"
            f"   {out[name]['seconds']:6.2f} s   first batch {out[name]['first_s'] * 1e3:5.0f} ms"
            f"   steady {out[name]['steady']:.3f}   main {out[name]['main_cpu_us']:4.0f} us{mark}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_setup(args.data)
    torch.set_num_threads(1)
    files = ensure_dataset(
        args.data, rows=args.rows, files=args.files, row_group_rows=args.row_group_rows
    )
    size = sum(os.path.getsize(f) for f in files)
    step = Step(args.step_ms)
    steps = sum(-(-pq.ParquetFile(f).metadata.num_rows // BATCH) for f in files)
    print(f"dataset: {args.data}: {len(files)} files, {args.rows:,} rows, {size / 2**20:.0f} MiB")
    print(
        f"step: {step.matmuls} matmuls 128x128, {step.measured_ms():.2f} ms (1 thread); "
        f"{steps} steps of {BATCH} rows per epoch = {steps * args.step_ms / 1e3:.1f} s compute"
    )
    print(f"machine: {machine_note()}")
    run(raw_batches(files), step)  # warm the page cache and the index cache
    StructuredDataset(args.data)
    contenders: dict[str, Callable[[Step], int]] = {
        "raw inline": lambda s: run(raw_batches(files), s),
        "ours w0": ours(args.data, 0),
        "ours w1": ours(args.data, 1),
        "ours w2": ours(args.data, 2),
    }
    missing = "skipped (--no-hf)" if args.no_hf else hf_missing()
    if missing:
        print(f"Hugging Face contender: {missing}")
    else:
        hf_home = os.path.join(os.path.dirname(os.path.abspath(args.data)), "hf_home")
        contenders["hf w2"] = hf(files, hf_home)
    print(f"\n{args.repeats} interleaved rounds:")
    times, firsts = rounds(contenders, step, steps, args.repeats)
    figures = report(times, firsts, steps)
    if args.plot:
        plot_bars(
            args.plot,
            f"Data stall: epoch / compute-only, {steps} steps of ~{args.step_ms:g} ms",
            list(figures),
            [f["ratio"] for f in figures.values()],
            "epoch time / compute-only time (median)",
            [machine_note()],
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"times": times, "first_batch": firsts, "figures": figures}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
