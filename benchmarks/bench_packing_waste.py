"""Whole-document packing (``TokenPacking(whole_documents=True)``): padding waste and throughput
beside greedy concatenation (the default packing) on a realistic SFT length distribution.

Generated data (cached under ``bench_output/sft_lengths``): 2 Parquet files of ``--rows``
conversations each, their lengths log-normal with median 600 tokens and sigma 1.0 (mean ~990,
2.7 % longer than 4,096), random token ids ``list<int32>``; ``seq_len=4,096``, the EOS id as
separator, batches of 8 sequences. Reported, one stream (``num_workers=0``, unshuffled):

* ``greedy``: the current packing: the documents concatenated and cut into sequences; its waste
  (padded tokens / all tokens) is only the last batch's, but documents are cut: the share of
  documents that span two sequences is printed;
* ``whole window=W``: best-fit decreasing within windows of ``W`` documents (512 is the
  default), overlong documents truncated; waste measured from the batches (``num_tokens``);
* ``offline BFD``: best-fit decreasing over the whole set at once (pure Python, lengths only:
  what TRL's offline ``pack_dataset(strategy="bfd")`` does), the lower bound for a window;
* throughput (tokens/s, median of ``--repeats`` interleaved epochs) of ``greedy`` and
  ``whole`` (default window), 0 and 2 workers, and their ratio.

    python benchmarks/bench_packing_waste.py [--rows N] [--repeats K] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _bench_util import cached_files, machine_note, quiet_setup

from torch_dataloader_utils import StructuredDataset, TokenPacking
from torch_dataloader_utils.reading.bestfit import best_fit

SEQ_LEN, SEQUENCES, EOS = 4096, 8, 50_257
MEDIAN, SIGMA = 600, 1.0
TARGET = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default="bench_output/sft_lengths", help="dataset directory")
    p.add_argument("--rows", type=int, default=10_000, help="conversations per file (2 files)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed epochs each")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


def sft_files(args: argparse.Namespace) -> list[str]:
    wanted = {"kind": "sft_lengths", "files": 2, "rows": args.rows, "median": MEDIAN,
              "sigma": SIGMA, "seed": 0}  # fmt: skip

    def write(root: Path) -> None:
        for number in range(2):
            lengths = lengths_of(number, args.rows)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            rng = np.random.default_rng([1, number])
            values = rng.integers(0, EOS, int(offsets[-1]), dtype=np.int32)
            ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            path = root / f"part-{number:05d}.parquet"
            tmp = path.with_name("." + path.name + ".tmp")
            pq.write_table(pa.table({"input_ids": ids}), tmp, row_group_size=2_000)
            os.replace(tmp, path)

    return cached_files(args.data, wanted, 2, write)


def lengths_of(number: int, rows: int) -> np.ndarray:
    rng = np.random.default_rng([0, number])
    return np.maximum(1, rng.lognormal(np.log(MEDIAN), SIGMA, rows)).astype(np.int64)


def packing(window: int | None) -> TokenPacking:
    if window is None:
        return TokenPacking("input_ids", seq_len=SEQ_LEN, separator=EOS)
    return TokenPacking("input_ids", seq_len=SEQ_LEN, separator=EOS, whole_documents=True,
                        window=window)  # fmt: skip


def epoch(data: str, window: int | None, num_workers: int = 0) -> dict[str, float]:
    """One epoch: tokens (real), all tokens, documents cut (greedy only), seconds."""
    loader, _ = StructuredDataset.create_dataloader(
        data, batch_size=SEQUENCES, num_workers=num_workers, packing=packing(window),
        output="numpy",
    )  # fmt: skip
    real = every = cut = 0
    last = EOS
    began = time.perf_counter()
    for batch in loader:
        ids = np.asarray(batch["input_ids"])
        real += int(batch["num_tokens"])
        every += ids.size
        if window is None and num_workers == 0:  # a sequence that starts inside a document
            before = np.concatenate(([last], ids[:-1, -1]))
            cut += int((before != EOS).sum())
            last = int(ids[-1, -1])
    return {"real": real, "all": every, "cut": cut, "seconds": time.perf_counter() - began}


def offline_bfd(lengths: np.ndarray) -> float:
    """Waste of best-fit decreasing over the whole set (documents + EOS, truncated)."""
    placed = np.minimum(lengths + 1, SEQ_LEN)
    sequences = len(best_fit(placed, SEQ_LEN))
    return 1 - placed.sum() / (sequences * SEQ_LEN)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_setup(args.data)
    files = sft_files(args)
    data = str(Path(files[0]).parent)
    lengths = np.concatenate([lengths_of(n, args.rows) for n in range(2)])
    print(f"{machine_note()}\n{len(lengths):,} conversations, median {np.median(lengths):.0f}, "
          f"mean {lengths.mean():.0f} tokens, {(lengths + 1 > SEQ_LEN).mean():.1%} longer than "
          f"seq_len={SEQ_LEN}")  # fmt: skip
    figures: dict[str, Any] = {}
    greedy = epoch(data, None)
    figures["greedy"] = {"waste": 1 - greedy["real"] / greedy["all"],
                         "documents_cut": greedy["cut"] / len(lengths)}  # fmt: skip
    print(f"greedy            waste {figures['greedy']['waste']:6.2%}   documents cut "
          f"{figures['greedy']['documents_cut']:.1%}")  # fmt: skip
    for window in (64, 128, 512, 2048):
        got = epoch(data, window)
        figures[f"whole window={window}"] = {"waste": 1 - got["real"] / got["all"]}
        print(f"whole window={window:<5} waste {1 - got['real'] / got['all']:6.2%}")
    began = time.perf_counter()
    figures["offline BFD"] = {"waste": offline_bfd(lengths),
                              "seconds": time.perf_counter() - began}  # fmt: skip
    print(
        f"offline BFD       waste {figures['offline BFD']['waste']:6.2%}   (whole set, "
        f"{figures['offline BFD']['seconds']:.1f} s in pure Python)"
    )
    rates: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for workers in (0, 2):
            for name, window in (("greedy", None), ("whole", 512)):
                got = epoch(data, window, workers)
                rates.setdefault(f"{name} w{workers}", []).append(got["real"] / got["seconds"])
    for name, values in rates.items():
        figures[name] = {"tokens_per_s": statistics.median(values)}
        print(f"{name:<10} {statistics.median(values) / 1e6:7.1f} M tokens/s")
    for workers in (0, 2):
        ratio = (
            figures[f"whole w{workers}"]["tokens_per_s"]
            / figures[f"greedy w{workers}"]["tokens_per_s"]
        )
        figures[f"whole/greedy w{workers}"] = ratio
        print(f"whole / greedy w{workers}: {ratio:.2f}")
    waste = figures["whole window=512"]["waste"]
    print(f"whole-document waste (default window) {waste:.2%}: target <= {TARGET:.0%} "
          f"{'met' if waste <= TARGET else 'NOT met'}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if waste <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
