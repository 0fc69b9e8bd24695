"""Chat in, input_ids and labels out: rendering and tokenizing conversations in the loader,
against ``apply_chat_template`` alone and the offline route users take today (issue 30, item 4).

Generated data (cached under ``bench_output/chat``): ``--rows`` conversations (20,000 by
default) in ``--files`` Parquet files, one ``messages`` column (``list<struct<role: string,
content: string>>``): an optional system prompt (1 in 3), then 1 to 4 user/assistant exchanges;
each conversation's length log-normal (median ~600 tokens, sigma 0.9, clipped to 40 .. 12,000),
words drawn Zipf-like from a synthetic vocabulary of 20,000 words (8 % with a multi-byte
character). The tokenizer: a byte-level BPE of 16,000 tokens (``<|im_start|>`` and
``<|im_end|>`` special) trained on the first conversations, cached beside them, wrapped in a
``PreTrainedTokenizerFast`` with a ChatML template that marks the assistant's turns with
``{% generation %}``; nothing is downloaded.

Everything runs with ``TOKENIZERS_PARALLELISM=false``: one thread per tokenizer call, so
``num_workers`` is the parallelism. Contenders, each over every conversation:

* ``apply_chat_template``: the baseline: the conversations read into Python lists beforehand
  (untimed), then ``tokenizer.apply_chat_template(conversations, tokenize=True,
  return_dict=True, return_assistant_tokens_mask=True)`` on batches of 256 (one thread; its
  fastest form) — and, for reference, one conversation a call (``... one by one``);
* ``ours w0`` / ``ours w2``: ``StructuredDataset.create_dataloader(dir, tokenize=Tokenize(
  "messages", tokenizer, chat_template=True), batch_size=32, num_workers=0 | 2)``, unshuffled,
  from ``iter(loader)`` (workers' start included) to the last batch, unpacked (``input_ids``
  and ``labels`` as jagged tensors); every row checked: the count and sum of the tokens and of
  the assistant's tokens against the baseline's;
* ``datasets.map w0`` / ``w2``: the offline route: ``Dataset.from_parquet(files)``, then
  ``.map(apply_chat_template ..., batched=True, num_proc=None | 2)`` into an Arrow cache (in a
  temporary directory), timed to the end of the map (training would then read it).

    python benchmarks/bench_chat.py [--quick] [--repeats K] [--json out.json]
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one thread
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import gc
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from _bench_util import cached_files, machine_note, paired, quiet_setup, summary, timed
from bench_text import verdict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from torch_dataloader_utils import StructuredDataset, Tokenize

VOCAB, WORDS, BATCH, CALL = 16_000, 20_000, 32, 256
MEDIAN_WORDS = 320  # ~1.9 tokens a word with the template's markup: median ~600 tokens
TARGETS = {"w0_over_template": 0.9, "w2_over_w0": 1.6}
MULTIBYTE = "éüñçøåßждлщλωπ中文日本語한국😀🚀🎉"
SPECIAL = ["<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
)
SYSTEM = "You are a helpful assistant. Answer briefly and cite your sources."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=None, help="dataset directory (default bench_output/chat)")
    p.add_argument("--rows", type=int, default=20_000, help="conversations in all")
    p.add_argument("--files", type=int, default=4, help="Parquet files")
    p.add_argument("--row-group-rows", type=int, default=512, help="rows per row group")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds")
    p.add_argument("--no-offline", action="store_true", help="skip datasets.map")
    p.add_argument("--quick", action="store_true", help="2,000 conversations: a smoke run")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.files = 2_000, 2
    args.data = args.data or ("bench_output/chat_quick" if args.quick else "bench_output/chat")
    return args


# ----------------------------------------------------------------------------- data


def vocabulary(rng: np.random.Generator) -> np.ndarray:
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = []
    for _ in range(WORDS):
        word = "".join(rng.choice(letters, min(int(rng.geometric(0.2)), 12)))
        if rng.random() < 0.08:
            word += str(rng.choice(list(MULTIBYTE)))
        words.append(word + str(rng.choice(["", "", "", "", "", ",", ".", "?", ".\n"])))
    return np.array(words, dtype=object)


def conversations(rng: np.random.Generator, words: np.ndarray, rows: int) -> list[list[dict]]:
    """``rows`` conversations of log-normal length (in words: ~1.25 tokens a word)."""
    weights = 1.0 / (np.arange(WORDS) + 2.7) ** 1.05
    weights /= weights.sum()
    sizes = np.clip(rng.lognormal(np.log(MEDIAN_WORDS), 0.9, rows), 24, 20 * MEDIAN_WORDS).astype(
        int
    )
    out = []
    for size in sizes:
        exchanges = int(rng.integers(1, 5))
        shares = rng.dirichlet(np.ones(2 * exchanges)) * size
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
        for turn, share in enumerate(shares):
            text = " ".join(rng.choice(words, max(1, int(share)), p=weights))
            messages.append({"role": ("user", "assistant")[turn % 2], "content": text})
        out.append(messages)
    return out


def chat_files(args: argparse.Namespace) -> list[str]:
    wanted = {"kind": "chat", "rows": args.rows, "files": args.files, "words": WORDS,
              "row_group_rows": args.row_group_rows, "median_words": MEDIAN_WORDS,
              "seed": 0}  # fmt: skip

    def write(root: Path) -> None:
        words = vocabulary(np.random.default_rng(0))
        per_file = np.linspace(0, args.rows, args.files + 1).astype(int)
        for number in range(args.files):
            rows = conversations(np.random.default_rng([1, number]), words,
                                 int(per_file[number + 1] - per_file[number]))  # fmt: skip
            path = root / f"part-{number:05d}.parquet"
            tmp = path.with_name("." + path.name + ".tmp")
            pq.write_table(pa.table({"messages": rows}), tmp, row_group_size=args.row_group_rows)
            os.replace(tmp, path)

    return cached_files(args.data, wanted, args.files, write)


def tokenizer(rows: list[list[dict]], data: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``VOCAB`` tokens trained on the first 4,000 conversations (cached),
    as a transformers fast tokenizer with the ChatML template."""
    path = Path(data) / f"_bpe{VOCAB}.json"
    stamp, key = Path(data) / "_bench_dataset.json", Path(data) / f"_bpe{VOCAB}.key"
    if path.exists() and key.exists() and key.read_text() == stamp.read_text():
        bpe = Tokenizer.from_file(str(path))
    else:
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )  # fmt: skip
        texts = (m["content"] for row in rows[:4000] for m in row)
        took, _ = timed(lambda: bpe.train_from_iterator(texts, trainer))
        print(f"trained a byte-level BPE of {bpe.get_vocab_size():,} tokens in {took:.1f} s")
        bpe.save(str(path))
        key.write_text(stamp.read_text())
    return PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHATML)


# ----------------------------------------------------------------------------- contenders


def counted(ids: list[list[int]], masks: list[list[int]]) -> np.ndarray:
    """Tokens, sum of ids, assistant tokens, sum of their ids."""
    flat = np.fromiter((t for row in ids for t in row), dtype=np.int64)
    mask = np.fromiter((m for row in masks for m in row), dtype=bool, count=len(flat))
    return np.array([len(flat), flat.sum(), mask.sum(), flat[mask].sum()])


def template_alone(fast: PreTrainedTokenizerFast, rows: list[list[dict]], size: int) -> dict:
    """Seconds in ``apply_chat_template`` alone over ``rows``, ``size`` conversations a call."""
    seconds = cpu = 0.0
    totals = np.zeros(4, dtype=np.int64)
    for start in range(0, len(rows), size):
        part = rows[start : start + size]
        began, used = time.perf_counter(), time.thread_time()
        out = fast.apply_chat_template(
            part if size > 1 else part[0], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        seconds += time.perf_counter() - began
        cpu += time.thread_time() - used
        ids, masks = out["input_ids"], out["assistant_masks"]
        totals += counted(ids, masks) if size > 1 else counted([ids], [masks])
    return {"seconds": seconds, "check": totals, "cpu": cpu}


def cpu_now() -> float:
    """CPU seconds of this process and its ended children (the DataLoader workers, reaped)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def ours(data: str, fast: PreTrainedTokenizerFast, workers: int) -> dict:
    loader, _ = StructuredDataset.create_dataloader(
        data, tokenize=Tokenize("messages", fast, chat_template=True), batch_size=BATCH,
        num_workers=workers,
    )  # fmt: skip
    totals, rows = np.zeros(4, dtype=np.int64), 0
    start, used = time.perf_counter(), cpu_now()
    for batch in loader:
        ids = batch["input_ids"].values().numpy()
        labels = batch["labels"].values().numpy()
        mine = labels != -100
        totals += [len(ids), ids.sum(), mine.sum(), labels[mine].sum()]
        rows += len(batch["input_ids"])
    seconds = time.perf_counter() - start
    del batch, loader
    gc.collect()  # the workers ended and reaped: their CPU counted
    return {"seconds": seconds, "check": totals, "rows": rows, "cpu": cpu_now() - used}


def offline(files: list[str], fast: PreTrainedTokenizerFast, workers: int) -> dict:
    """``datasets``: the files loaded, then mapped through ``apply_chat_template`` into an
    Arrow cache, ``num_proc=workers``."""
    import datasets

    datasets.disable_progress_bars()

    def render(batch: dict[str, list[Any]]) -> dict[str, Any]:
        out = fast.apply_chat_template(
            batch["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    with tempfile.TemporaryDirectory(prefix="bench_chat_") as cache:
        start = time.perf_counter()
        data = datasets.Dataset.from_parquet(files, cache_dir=cache)
        mapped = data.map(
            render, batched=True, batch_size=CALL, num_proc=workers or None,
            remove_columns=["messages"], cache_file_name=os.path.join(cache, "mapped.arrow"),
        )  # fmt: skip
        seconds = time.perf_counter() - start
        rows = len(mapped)
        del data, mapped
    return {"seconds": seconds, "rows": rows}


# ----------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_setup(args.data)
    torch.set_num_threads(1)
    took, files = timed(lambda: chat_files(args))
    rows = [row for f in files for row in pq.read_table(f).column("messages").to_pylist()]
    fast = tokenizer(rows, args.data)
    lengths = [
        len(ids) for ids in fast.apply_chat_template(rows[:2000], tokenize=True)["input_ids"]
    ]
    print(f"dataset: {args.data}: {len(files)} files, {len(rows):,} conversations, "
          f"{np.mean([len(r) for r in rows]):.1f} messages each; tokens a conversation (first "
          f"2,000): median {np.median(lengths):.0f}, mean {np.mean(lengths):.0f}, p99 "
          f"{np.percentile(lengths, 99):.0f}; ready in {took:.1f} s")  # fmt: skip
    print(f"tokenizer: byte-level BPE, {fast.vocab_size:,} tokens, ChatML template; batch_size="
          f"{BATCH}; TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}")  # fmt: skip
    print(f"run at {time.strftime('%Y-%m-%d %H:%M:%S')}; machine: {machine_note()}")

    speed: dict[str, list[float]] = {}
    per_cpu: dict[str, list[float]] = {}
    print(f"\n{args.repeats} interleaved round(s), rows/s:")
    for _ in range(args.repeats):
        base = template_alone(fast, rows, CALL)
        speed.setdefault("apply_chat_template", []).append(len(rows) / base["seconds"])
        per_cpu.setdefault("apply_chat_template", []).append(len(rows) / base["cpu"])
        single = template_alone(fast, rows[: len(rows) // 4], 1)
        speed.setdefault("... one by one", []).append(len(rows) // 4 / single["seconds"])
        for name, workers in (("ours w0", 0), ("ours w2", 2)):
            result = ours(args.data, fast, workers)
            if result["rows"] != len(rows) or not np.array_equal(result["check"], base["check"]):
                raise SystemExit(f"{name}: {result['rows']} rows, (tokens, sum, assistant "
                                 f"tokens, sum) {result['check']} != {base['check']}")  # fmt: skip
            speed.setdefault(name, []).append(len(rows) / result["seconds"])
            per_cpu.setdefault(name, []).append(len(rows) / result["cpu"])
        if not args.no_offline:
            for name, workers in (("datasets.map w0", 0), ("datasets.map w2", 2)):
                result = offline(files, fast, workers)
                assert result["rows"] == len(rows)
                speed.setdefault(name, []).append(len(rows) / result["seconds"])
        gc.collect()
        print("  " + "  ".join(f"{n}={v[-1]:,.0f}" for n, v in speed.items()), flush=True)

    print("\nmedian of rounds (best in brackets)")
    for name, values in speed.items():
        s = summary(values)
        print(f"  {name:<22}{s['median']:9,.0f} rows/s   [best {s['best']:,.0f}]")
    ratios: dict[str, Any] = {}
    pairs = [
        ("ours w0", "apply_chat_template", "w0_over_template"),
        ("ours w0", "... one by one", None),
        ("ours w2", "ours w0", "w2_over_w0"),
    ]
    if not args.no_offline:
        pairs += [("ours w0", "datasets.map w0", None), ("ours w2", "datasets.map w2", None)]
    print()
    for mine, theirs, target in pairs:
        r = paired(speed, mine, theirs)
        ratios[f"{mine} / {theirs}"] = r
        judged = f"({verdict(r['paired_median'], TARGETS[target])})" if target else ""
        print(f"  {mine + ' / ' + theirs:<38}= {r['paired_median']:5.2f}  {judged}  "
              f"[best/best {r['best_over_best']:.2f}]")  # fmt: skip
    print("\nrows per CPU second (the main process's and its workers'; less sensitive to the "
          "machine's load than rows/s)")  # fmt: skip
    for name, values in per_cpu.items():
        print(f"  {name:<22}{summary(values)['median']:9,.0f}")
    for mine, theirs in (("ours w0", "apply_chat_template"), ("ours w2", "ours w0")):
        r = paired(per_cpu, mine, theirs)
        ratios[f"{mine} / {theirs} per CPU second"] = r
        print(f"  {mine + ' / ' + theirs:<38}= {r['paired_median']:5.2f}")
    print(f"machine after the runs: {machine_note()}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows_per_s": speed, "rows_per_cpu_s": per_cpu, "ratios": ratios,
                       "rows": len(rows), "median_tokens": float(np.median(lengths))}, out,
                      indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
