"""Weighted mixing (issue 16's targets): a 3-source mixture against one source of the same data.

Data (``bench_output/mixing``): three sources written by ``ensure_dataset`` (``id`` int64,
``x`` float64, ``y`` float32; row groups of 50,000): ``web`` 1.2 M rows in 6 files, ``code``
0.6 M in 3, ``math`` 0.2 M in 1. Figures, each beside its baseline from the same run:

1. **throughput**: rows/s of the mixture ``{"web": 6, "code": 3, "math": 1}`` (weights as the
   sizes, so an epoch reads every row about once) over one epoch, against ONE dataset of the
   same ten files (the same rows): median of per-round ratios over interleaved rounds, each
   contender one loader (persistent workers) warmed by one untimed epoch; unshuffled and
   shuffled, ``num_workers`` 0 and 2; both at the default ``shuffle_memory_bytes`` (the
   mixture's sources share it: a third each, as the default / 3 each gave before issue 32).
   Target ≥ 0.9.
   Beside it, each epoch's first batch (a mixture decodes a first chunk of every source before
   it) and the ratio of the rows after it (the rate a long epoch runs at: an epoch here lasts
   0.1-0.3 s, so its start weighs on the epoch's figure as it does not on a training run's).
   The same for rows of token lists
   (``bench_shuffle``'s ``tokens`` data, 64-511 ``int32`` a row: 8 files as sources of 4, 3
   and 1 files, weights 4:3:1), the layout language models are mixed from;
2. **state**: ``state_dict()`` of a mixture of 3 and of 30 sources (30: each file of the pool a
   source, named ``s00``…) at 50 % of its epoch with 8 workers: pickled and JSON bytes (≤ 64
   KiB) and the cost of one call after one stream moved a batch (≤ 1 ms), beside the same for
   one source;
3. **resume**: time to the first batch after loading a state at 90 % of the epoch against a
   fresh start (≤ 1.5x), the resumed batches checked against the uninterrupted epoch.

    python benchmarks/bench_mixing.py [--quick] [--rounds K] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _bench_util import ensure_dataset, machine_note, paired, per_call, quiet_setup
from _shuffle_data import FULL, QUICK, token_data

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.mixing.state import encode_mixture
from torch_dataloader_utils.planning.epochs import Start

BATCH = 1024
WEIGHTS = {"web": 6, "code": 3, "math": 1}
SIZES = {"web": (1_200_000, 6), "code": (600_000, 3), "math": (200_000, 1)}
TARGET_RATIO, STATE_BYTES, STATE_SECONDS, RESUME_RATIO = 0.9, 64 * 1024, 1e-3, 1.5


def make_data(root: Path, scale: float) -> dict[str, list[str]]:
    return {
        name: ensure_dataset(
            root / name, rows=int(rows * scale), files=files, row_group_rows=50_000,
            seed=number, quiet=True,
        )
        for number, (name, (rows, files)) in enumerate(SIZES.items())
    }  # fmt: skip


def token_sources(quick: bool) -> dict[str, list[str]]:
    """``bench_shuffle``'s token files (shared cache) as three sources of 4:3:1 of them."""
    scale = QUICK if quick else FULL
    paths = token_data(
        Path("bench_output/shuffle/tokens"), scale.token_files, scale.token_rows
    ).paths
    cut = [len(paths) * 4 // 8, len(paths) * 7 // 8]
    return {"web": paths[: cut[0]], "code": paths[cut[0] : cut[1]], "math": paths[cut[1] :]}


def epoch_rows(
    loader: Any, dataset: StructuredDataset, epoch: int
) -> tuple[float, float, int, int]:
    """Seconds of one epoch, seconds to its first batch, its rows, and the first batch's."""
    dataset.set_epoch(epoch)
    start = time.perf_counter()
    batches = iter(loader)
    first_rows = len(next(batches)["id"])
    first = time.perf_counter() - start
    rows = first_rows + sum(len(batch["id"]) for batch in batches)
    return time.perf_counter() - start, first, rows, first_rows


def throughput(
    layout: str, sources: dict[str, list[str]], weights: dict[str, int], rounds: int
) -> list[dict[str, Any]]:
    every = [f for files in sources.values() for f in files]
    out = []
    for shuffle in (False, True):
        for workers in (0, 2):
            common = {"batch_size": BATCH, "shuffle": shuffle, "num_workers": workers,
                      "persistent_workers": workers > 0}  # fmt: skip
            loaders = {
                "mixture": StructuredDataset.create_dataloader(sources, weights=weights, **common),
                "one source": StructuredDataset.create_dataloader(every, **common),
            }
            runs: dict[str, list[float]] = {name: [] for name in loaders}
            after: dict[str, list[float]] = {name: [] for name in loaders}
            firsts: dict[str, list[float]] = {name: [] for name in loaders}
            for loader, ds in loaders.values():
                epoch_rows(loader, ds, 0)  # warm: workers, caches
            for r in range(rounds):
                for name, (loader, ds) in loaders.items():
                    seconds, first, rows, first_rows = epoch_rows(loader, ds, r + 1)
                    runs[name].append(rows / seconds)
                    after[name].append((rows - first_rows) / (seconds - first))
                    firsts[name].append(first)
            ratio = paired(runs, "mixture", "one source")["paired_median"]
            out.append({
                "layout": layout, "shuffle": shuffle, "workers": workers, "ratio": ratio,
                "mixture_rows_s": statistics.median(runs["mixture"]),
                "one_rows_s": statistics.median(runs["one source"]),
                "after_first_ratio": paired(after, "mixture", "one source")["paired_median"],
                "mixture_first_s": statistics.median(firsts["mixture"]),
                "one_first_s": statistics.median(firsts["one source"]),
            })  # fmt: skip
            verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
            print(
                f"throughput {layout:7} shuffle={shuffle!s:5} workers={workers}: mixture "
                f"{out[-1]['mixture_rows_s'] / 1e6:6.2f} M rows/s, one source "
                f"{out[-1]['one_rows_s'] / 1e6:6.2f} M rows/s, ratio {ratio:.2f} "
                f"(target >= {TARGET_RATIO}: {verdict}); first batch "
                f"{out[-1]['mixture_first_s'] * 1e3:.0f} / {out[-1]['one_first_s'] * 1e3:.0f} ms, "
                f"after it {out[-1]['after_first_ratio']:.2f}"
            )
            del loaders
    return out


def state_figures(paths: Any, weights: dict[str, int] | None, label: str) -> dict[str, Any]:
    """A state at 50 % of the epoch with 8 workers: sizes, and the cost of one call after a
    stream moved a batch."""
    ds = StructuredDataset(paths, weights=weights, batch_size=BATCH, shuffle=True)
    workers = 8
    progress = ds._epochs.begin(Start.fresh(0), workers)
    if weights is None:
        lengths = progress.plan.rank_shares(0).tolist()
    else:
        lengths = ds._epochs.epoch_lengths(workers).tolist()
    for w in range(workers):
        progress.positions[w] = lengths[w] // 2 // BATCH * BATCH
    state = _encode(ds, progress)
    step = [0]

    def moved() -> Any:  # worker w moves a batch forward, then back on its next turn
        w, turn = divmod(step[0], workers)[1], step[0] // workers
        step[0] += 1
        progress.positions[w] += BATCH if turn % 2 == 0 else -BATCH
        return _encode(ds, progress)

    seconds = per_call(moved, 200)
    figures = {
        "label": label, "pickled": len(pickle.dumps(state)), "json": len(json.dumps(state)),
        "state_dict_s": seconds,
    }  # fmt: skip
    size_verdict = "met" if figures["pickled"] <= STATE_BYTES else "MISSED"
    cost_verdict = "met" if seconds <= STATE_SECONDS else "MISSED"
    print(
        f"state {label:22}: {figures['pickled'] / 1024:6.1f} KiB pickled "
        f"({figures['json'] / 1024:6.1f} KiB JSON; <= 64 KiB: {size_verdict}), state_dict() "
        f"{seconds * 1e3:6.3f} ms after a stream moved (<= 1 ms: {cost_verdict})"
    )
    return figures


def _encode(ds: StructuredDataset, progress: Any) -> dict[str, Any]:
    if hasattr(progress, "mix"):
        return encode_mixture(progress.mix, progress)
    return ds._epochs.encode(progress)


def resume_latency(sources: dict[str, list[str]], rounds: int) -> dict[str, Any]:
    kwargs = {"weights": WEIGHTS, "batch_size": BATCH, "shuffle": True}
    loader, _ = StructuredDataset.create_dataloader(sources, **kwargs)
    batches = len(loader)
    stop = batches * 9 // 10
    it = iter(loader)
    for _ in range(stop):
        next(it)
    state = loader.state_dict()
    expected = [b["id"].tolist() for b in it]
    fresh, resumed = [], []
    for _ in range(rounds):
        loader, _ = StructuredDataset.create_dataloader(sources, **kwargs)
        start = time.perf_counter()
        next(iter(loader))
        fresh.append(time.perf_counter() - start)
        loader, _ = StructuredDataset.create_dataloader(sources, **kwargs)
        loader.load_state_dict(state)
        start = time.perf_counter()
        it = iter(loader)
        first = next(it)
        resumed.append(time.perf_counter() - start)
    rest = [first["id"].tolist()] + [b["id"].tolist() for b in it]
    if rest != expected:
        sys.exit("resumed batches differ from the uninterrupted epoch")
    ratio = statistics.median(resumed) / statistics.median(fresh)
    verdict = "met" if ratio <= RESUME_RATIO else "MISSED"
    print(
        f"resume at 90 %: first batch {statistics.median(resumed) * 1e3:6.1f} ms, fresh start "
        f"{statistics.median(fresh) * 1e3:6.1f} ms, ratio {ratio:.2f} (<= 1.5: {verdict}); "
        f"the {len(expected)} resumed batches equal the uninterrupted ones"
    )
    return {"fresh_s": statistics.median(fresh), "resumed_s": statistics.median(resumed),
            "ratio": ratio}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the rows, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    root = Path("bench_output/mixing_quick" if args.quick else "bench_output/mixing")
    quiet_setup(str(root))
    rounds = args.rounds or (2 if args.quick else 4)
    print(machine_note())
    sources = make_data(root, 0.1 if args.quick else 1.0)
    tokens = token_sources(args.quick)
    report: dict[str, Any] = {
        "throughput": throughput("numeric", sources, WEIGHTS, rounds)
        + throughput("tokens", tokens, {"web": 4, "code": 3, "math": 1}, rounds)
    }
    pool = [f for files in sources.values() for f in files]
    many = {f"s{i:02d}": pool[i % len(pool)] for i in range(30)}
    report["state"] = [
        state_figures([f for files in sources.values() for f in files], None, "one source"),
        state_figures(sources, WEIGHTS, "3 sources"),
        state_figures(many, dict.fromkeys(many, 1), "30 sources"),
    ]
    report["resume"] = resume_latency(sources, rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
