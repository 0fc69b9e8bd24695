"""Variable-length token columns (``input_ids: list<int32>``) to tensors, ours vs raw pyarrow.

Generated data (cached under ``bench_output/tokens``): 4 Parquet files x 50,000 rows, each row
16-511 random token ids (about 53 M tokens, 200 MiB decoded). Contenders, batches of 1,024 rows:

* ``raw threads=T|F``: ``pq.ParquetFile(f).iter_batches(batch_size=1024, use_threads=T)``, then
  the column's values (``flatten()``, DLPack) and its offsets rebased to 0
  (``torch.from_numpy``): what a user writes by hand; the faster variant (by median) is the
  baseline;
* ``ours w0`` / ``ours w2``: ``StructuredDataset.create_dataloader(dir, batch_size=1024,
  num_workers=0 | 2)``, each batch's ``input_ids`` a ``torch.jagged`` nested tensor; timed from
  ``iter(loader)`` to the last batch (worker start-up included);
* ``packed w0`` / ``packed w2``: the same with ``packing=TokenPacking("input_ids",
  seq_len=2048, separator=50257)`` and ``batch_size=128`` sequences (262,144 tokens a batch,
  as many as a 1,024-row batch holds); the separators counted as documents;
* ``packed+labels w0`` / ``w2``: packed as above, with a companion column ``labels``
  (``list<int64>``, one value per token, ~30 % of them -100) cut and padded in lockstep
  (``companions={"labels": -100}``), from a copy of the files with that column (cached under
  ``bench_output/tokens-labels``); the figure to hold beside ``packed w0`` / ``w2``;
* ``ours w2 steady`` / ``packed w2 steady``: one loader each with ``num_workers=2,
  persistent_workers=True``, made and run once untimed; each timed run is one more epoch. The
  steady state of a long run, where workers start once (here the epoch is ~0.4 s, and starting
  two workers takes 50-100 ms of it);
* ``hf datasets`` (if installed): ``load_dataset("parquet", streaming=True).iter(1024)`` over
  the first file only (Python lists; a full epoch would take minutes), as tokens/s.

Runs are interleaved (raw T, raw F, w0, w2, ...); ratios are medians of per-round ratios. Then
the time to the first packed batch after resuming at 90 % of the epoch vs at 0 %.

    python benchmarks/bench_tokens.py [--data DIR] [--repeats K] [--plot out.png]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from _bench_util import cached_files, machine_note, paired, plot_bars, quiet_setup, summary, timed
from torch.utils.dlpack import from_dlpack

from torch_dataloader_utils import StructuredDataset, TokenPacking

BATCH = 1024
TARGET = 0.8
# 128 sequences of 2,048: 262,144 tokens a batch, as many as a 1,024-row batch holds (~263 a
# row), so both paths pay the same per-batch costs (the DataLoader's own are ~30 us a batch).
SEQ_LEN, SEQUENCES, EOS = 2048, 128, 50_257  # an id the generated tokens never take
PACKING = TokenPacking("input_ids", seq_len=SEQ_LEN, separator=EOS)
LABELED = TokenPacking("input_ids", seq_len=SEQ_LEN, separator=EOS, companions={"labels": -100})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default="bench_output/tokens", help="dataset directory")
    p.add_argument("--files", type=int, default=4, help="Parquet files")
    p.add_argument("--rows", type=int, default=50_000, help="rows per file")
    p.add_argument("--row-group-rows", type=int, default=10_000, help="rows per row group")
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per contender")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


def token_files(args: argparse.Namespace, labels: bool = False) -> list[str]:
    """The generated files (``labels``: with the companion column, in their own directory)."""
    wanted = {"kind": "tokens", "files": args.files, "rows": args.rows, "lengths": [16, 511],
              "row_group_rows": args.row_group_rows, "seed": 0,
              **({"labels": True} if labels else {})}  # fmt: skip

    def write(root: Path) -> None:
        for number in range(args.files):
            rng = np.random.default_rng([0, number])
            lengths = rng.integers(16, 512, args.rows)
            offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            values = rng.integers(0, 50_257, int(offsets[-1].as_py()), dtype=np.int32)
            columns = {"input_ids": pa.ListArray.from_arrays(offsets, pa.array(values))}
            if labels:
                masked = np.where(values % 10 < 3, -100, values).astype(np.int64)
                columns["labels"] = pa.ListArray.from_arrays(offsets, pa.array(masked))
            path = root / f"part-{number:05d}.parquet"
            tmp = path.with_name("." + path.name + ".tmp")
            pq.write_table(pa.table(columns), tmp, row_group_size=args.row_group_rows)
            os.replace(tmp, path)

    return cached_files(args.data + ("-labels" if labels else ""), wanted, args.files, write)


# ----------------------------------------------------------------------------- contenders


def raw_pyarrow(files: list[str], use_threads: bool) -> tuple[int, int]:
    """The baseline: values + offsets -> tensors by hand. Returns (rows, tokens)."""
    rows = tokens = 0
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH, use_threads=use_threads):
            column = batch.column(0)
            values = from_dlpack(column.flatten())
            offsets = column.offsets.to_numpy()
            offsets = torch.from_numpy(np.subtract(offsets, offsets[0], dtype=np.int64))
            rows += len(offsets) - 1
            tokens += len(values)
    return rows, tokens


def ours(data: str, num_workers: int) -> tuple[int, int]:
    loader, _ = StructuredDataset.create_dataloader(data, batch_size=BATCH, num_workers=num_workers)
    return unpacked_epoch(loader)


def unpacked_epoch(loader: Any) -> tuple[int, int]:
    rows = tokens = 0
    for batch in loader:
        ids = batch["input_ids"]
        rows += len(ids)
        tokens += len(ids.values())
    return rows, tokens


def packed(
    data: str, num_workers: int, rows: int, count: bool = False, packing: TokenPacking = PACKING
) -> tuple[int, int]:
    """Ours, packed: (documents, tokens without separators); the documents counted from the
    separators when ``count`` (untimed: a training loop does not), else taken as ``rows``."""
    loader, _ = StructuredDataset.create_dataloader(
        data, batch_size=SEQUENCES, num_workers=num_workers, packing=packing
    )
    return packed_epoch(loader, rows, count)


def packed_epoch(loader: Any, rows: int, count: bool = False) -> tuple[int, int]:
    separators = tokens = 0
    for batch in loader:
        real = int(batch["num_tokens"])
        if count:
            separators += int((batch["input_ids"].view(-1)[:real] == EOS).sum())
        tokens += real
    rows = separators if count else rows
    return rows, tokens - rows


def steady(
    epoch: Callable[[Any], tuple[int, int]], data: str, **options: Any
) -> Callable[[], tuple[int, int]]:
    """One more epoch of a loader with 2 persistent workers, made (and run once) untimed: the
    steady state of a long run, where workers start once."""
    loader, _ = StructuredDataset.create_dataloader(
        data, num_workers=2, persistent_workers=True, **options
    )
    epoch(loader)
    return lambda: epoch(loader)


def hf_datasets(files: list[str]) -> tuple[float, int] | None:
    """Tokens/s of Hugging Face ``datasets`` streaming the first file, or None if absent."""
    try:
        from datasets import load_dataset
    except ImportError:
        return None
    stream = load_dataset("parquet", data_files=files[:1], split="train", streaming=True)
    start, tokens = time.perf_counter(), 0
    for batch in stream.iter(batch_size=BATCH):
        tokens += sum(len(ids) for ids in batch["input_ids"])
    return tokens / (time.perf_counter() - start), tokens


def first_batch_after_resume(data: str, fraction: float) -> float:
    """Seconds from a new packed loader resumed at ``fraction`` of the epoch to its first batch."""
    loader, dataset = StructuredDataset.create_dataloader(
        data, batch_size=SEQUENCES, packing=PACKING
    )
    batches = sum(1 for _ in loader) if fraction else 0
    it = iter(loader)
    for _ in range(int(batches * fraction)):
        next(it)
    state = dataset.state_dict()
    del it
    start = time.perf_counter()
    loader, dataset = StructuredDataset.create_dataloader(
        data, batch_size=SEQUENCES, packing=PACKING
    )
    dataset.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start


def interleaved(
    contenders: dict[str, Callable[[], tuple[int, int]]], repeats: int, expected: tuple[int, int]
) -> dict[str, list[float]]:
    """Seconds per epoch of every contender, run in turn ``repeats`` times."""
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(repeats):
        for name, run in contenders.items():
            took, counts = timed(run)
            gc.collect()
            if counts != expected:
                raise SystemExit(f"{name} delivered {counts}, expected {expected}")
            seconds[name].append(took)
        line = "  ".join(f"{n}={expected[1] / s[-1] / 1e6:6.1f}M" for n, s in seconds.items())
        print(f"  run {repeat + 1}/{repeats}: {line} tokens/s", flush=True)
    return seconds


def report(seconds: dict[str, list[float]], rows: int, tokens: int) -> dict[str, Any]:
    speed = {name: [1 / s for s in values] for name, values in seconds.items()}
    print("\nmedian of runs (best in brackets)")
    for name, values in speed.items():
        s = summary(values)
        print(
            f"  {name:<18}{s['median'] * tokens / 1e6:7.1f} M tokens/s "
            f"{s['median'] * rows / 1e3:7.1f} k rows/s   [best {s['best'] * tokens / 1e6:.1f} M]"
        )
    raw = max(("raw threads=T", "raw threads=F"), key=lambda n: statistics.median(speed[n]))
    print(f"\nbaseline = {raw} (the faster raw variant by median)")
    ratios: dict[str, Any] = {"baseline": raw}
    pairs = [
        ("ours w0", raw),
        ("ours w2", raw),
        ("ours w2 steady", raw),
        ("packed w0", "ours w0"),
        ("packed w2", "ours w2"),
        ("packed w2 steady", "ours w2 steady"),
        ("packed+labels w0", "packed w0"),  # no target: the cost of a companion
        ("packed+labels w2", "packed w2"),
    ]
    for mine, theirs in pairs:
        r = paired(speed, mine, theirs)
        ratios[f"{mine.replace(' ', '_')}_over_{theirs.split()[0]}"] = r
        ok = "meets" if r["paired_median"] >= TARGET else "MISSES"
        target = "" if "labels" in mine else f"{ok} target ≥ {TARGET}; "
        print(
            f"  {mine + ' / ' + theirs:<35}= {r['paired_median']:5.2f}   ({target}ratio of "
            f"medians {r['of_medians']:.2f}, best/best {r['best_over_best']:.2f})"
        )
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_setup(args.data)
    torch.set_num_threads(1)  # the docs' advice with workers on few cores
    took, files = timed(lambda: token_files(args))
    labeled = str(Path(token_files(args, labels=True)[0]).parent)
    rows, tokens = raw_pyarrow(files, True)  # also warms the page cache
    # Untimed: the first jagged tensor of a process imports torch's symbolic shapes (~0.4 s,
    # once); forked workers inherit the imports.
    first, _ = timed(lambda: ours(args.data, 0))
    if packed(args.data, 0, rows, count=True) != (rows, tokens):  # every token, once
        raise SystemExit("packed w0 did not deliver every document's tokens and separator")
    size = sum(os.path.getsize(f) for f in files)
    print(
        f"dataset: {args.data}: {len(files)} files, {rows:,} rows, {tokens:,} tokens "
        f"(list<int32>, 16-511 per row), {size / 2**20:.0f} MiB stored; ready in {took:.1f} s"
    )
    print(f"untimed warm-up epoch of ours w0 (imports included): {first:.2f} s")
    print(f"batch_size={BATCH}; run at {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"machine: {machine_note()}")
    contenders: dict[str, Callable[[], tuple[int, int]]] = {
        "raw threads=T": lambda: raw_pyarrow(files, True),
        "raw threads=F": lambda: raw_pyarrow(files, False),
        "ours w0": lambda: ours(args.data, 0),
        "ours w2": lambda: ours(args.data, 2),
        "packed w0": lambda: packed(args.data, 0, rows),
        "packed w2": lambda: packed(args.data, 2, rows),
        "packed+labels w0": lambda: packed(labeled, 0, rows, packing=LABELED),
        "packed+labels w2": lambda: packed(labeled, 2, rows, packing=LABELED),
        "ours w2 steady": steady(unpacked_epoch, args.data, batch_size=BATCH),
        "packed w2 steady": steady(
            lambda loader: packed_epoch(loader, rows),
            args.data,
            batch_size=SEQUENCES,
            packing=PACKING,
        ),
    }
    print(f"\n{args.repeats} interleaved runs per contender:")
    seconds = interleaved(contenders, args.repeats, (rows, tokens))
    ratios = report(seconds, rows, tokens)
    hf = hf_datasets(files)
    if hf is not None:
        best = tokens / min(seconds["packed w0"])
        print(f"\n  hf datasets (first file): {hf[0] / 1e6:6.2f} M tokens/s; packed w0 / hf = "
              f"{best / hf[0]:.1f}")  # fmt: skip
        ratios["hf_tokens_per_s"] = hf[0]
    at = {f: statistics.median(first_batch_after_resume(args.data, f) for _ in range(3))
          for f in (0.0, 0.9)}  # fmt: skip
    ratios["packed_resume_s"] = at
    print(f"  packed, first batch after resume: at 0 % {at[0.0] * 1e3:.0f} ms, at 90 % "
          f"{at[0.9] * 1e3:.0f} ms: ratio {at[0.9] / at[0.0]:.2f} (target ≤ 1.5)")  # fmt: skip
    print(f"machine after the runs: {machine_note()}")
    if args.plot:
        labels = list(seconds)
        values = [tokens / statistics.median(v) for v in seconds.values()]
        plot_bars(
            args.plot,
            f"list<int32> tokens to tensors, batch {BATCH} ({tokens / 1e6:.0f} M tokens)",
            labels,
            values,
            "tokens/s (median)",
            [machine_note()],
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"seconds": seconds, "rows": rows, "tokens": tokens, "ratios": ratios},
                      out, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
