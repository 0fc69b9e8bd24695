"""Text in, tokens out: tokenizing raw-text Parquet in the loader, against the tokenizer alone
and against the on-the-fly path users run today (issue 29, item 5).

Generated data (cached under ``bench_output/text``): ``--mb`` MB of text (256 by default) in
``--files`` Parquet files, one ``text`` column (``string``); row lengths log-normal (median
2 KB, clipped to 200 B .. 50 KB), words drawn Zipf-like from a synthetic vocabulary of 50,000
words, 8 % of them holding a multi-byte UTF-8 character (2, 3 or 4 bytes). The tokenizer: a
byte-level BPE of 32,000 tokens (``<|endoftext|>`` its end-of-text id) trained with
``tokenizers`` on the first 16 MB of the data, cached beside it; nothing is downloaded.

Everything runs with ``TOKENIZERS_PARALLELISM=false`` (set here before ``tokenizers`` is
imported; the training alone re-enables it): every tokenizer call runs on one thread, so
``num_workers`` is the parallelism. Contenders, each an epoch over all the text:

* ``encode_batch_fast``: the baseline: the texts read into Python lists beforehand (untimed),
  then ``Tokenizer.encode_batch_fast(texts, add_special_tokens=False)`` per ~4 MiB chunk of
  rows, only those calls timed;
* ``ours w0`` / ``ours w2``: ``StructuredDataset.create_dataloader(dir, tokenize=Tokenize("text",
  tok, eos_id=eos), packing=TokenPacking("input_ids", seq_len=2048), batch_size=8,
  num_workers=0 | 2)``, unshuffled, from ``iter(loader)`` (workers' start included) to the last
  batch; every token checked delivered once (count and sum of ids against the baseline);
* ``peer w0`` / ``peer w2``: Hugging Face ``datasets`` streaming the same files
  (``load_dataset("parquet", data_files=..., streaming=True)``), each document tokenized alone
  (``encode(text, add_special_tokens=False).ids + [eos]``) into a token buffer cut into
  ``seq_len + 1`` slices (torchtitan's ``HuggingFaceDataset``: its state is the buffer and the
  HF dataset's state), under torchdata's ``StatefulDataLoader(batch_size=8)``;
* ``ours w2 shuffled``: ``ours w2`` with ``shuffle=True, shuffle_memory_bytes=--budget-mib``,
  for the memory figure (each worker's peak RSS over its RSS at start, beside the budget plus a
  chunk of text and its tokens).

Tokens/s counts the tokens of the corpus delivered (with the end-of-text ids); tokens per CPU
second (the main process's and each worker's, from ``/proc``) is the same work's cost whatever
share of the cores it got. Then the first
batch after a resume at 90 % of an epoch vs at 0 %, 0 workers, for ours (``state_dict`` /
``load_state_dict``; the resumed batch checked equal to the uninterrupted run's) and for the
peer (``StatefulDataLoader.state_dict`` / ``load_state_dict``).

    python benchmarks/bench_text.py [--quick] [--repeats K] [--json out.json]
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one thread
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import functools
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from _bench_util import (
    cached_files,
    forked_children,
    machine_note,
    paired,
    quiet_setup,
    rss_bytes,
    status_kib,
    summary,
    timed,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torch_dataloader_utils import StructuredDataset, Tokenize, TokenPacking

SEQ_LEN, SEQUENCES, VOCAB = 2048, 8, 32_000
EOS_TEXT = "<|endoftext|>"
CHUNK_BYTES = 4 * 2**20  # the library's chunk of rows read in order (about 4 MiB decoded)
TARGETS = {"w0_over_encode": 0.9, "w2_over_w0": 1.6, "over_peer": 3.0, "resume": 1.5}
WORDS, MULTIBYTE_SHARE = 50_000, 0.08
MULTIBYTE = "éüñçøåßждлщλωπ中文日本語한국😀🚀🎉"  # 2, 3 and 4 bytes in UTF-8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=None, help="dataset directory (default bench_output/text)")
    p.add_argument("--mb", type=int, default=256, help="MB of text in all")
    p.add_argument("--files", type=int, default=8, help="Parquet files")
    p.add_argument("--row-group-rows", type=int, default=2048, help="rows per row group")
    p.add_argument("--budget-mib", type=int, default=64, help="shuffle budget per stream")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds")
    p.add_argument("--quick", action="store_true", help="16 MB in 4 files: a smoke run")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.mb, args.files, args.budget_mib = 16, 4, 4
    args.data = args.data or ("bench_output/text_quick" if args.quick else "bench_output/text")
    return args


# ----------------------------------------------------------------------------- data


def vocabulary(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The words (each with its trailing space, some with punctuation or a newline) as one
    byte array and their offsets; built once, ``WORDS`` of them (not per row)."""
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    lengths = np.minimum(rng.geometric(0.2, WORDS), 14)
    pool = letters[rng.integers(0, 26, int(lengths.sum()))].tobytes().decode()
    ends = np.cumsum(lengths)
    tails = rng.choice([" ", ", ", ". ", ".\n", "\n\n"], WORDS, p=[0.86, 0.06, 0.05, 0.02, 0.01])
    special = rng.random(WORDS) < MULTIBYTE_SHARE
    extra = rng.choice(list(MULTIBYTE), WORDS)
    words = []
    for i in range(WORDS):
        word = pool[ends[i] - lengths[i] : ends[i]]
        if special[i]:
            cut = int(rng.integers(0, len(word) + 1))
            word = word[:cut] + str(extra[i]) + word[cut:]
        words.append((word + str(tails[i])).encode())
    blob = np.frombuffer(b"".join(words), dtype=np.uint8)
    offsets = np.concatenate(([0], np.cumsum([len(w) for w in words]))).astype(np.int64)
    return blob, offsets


def text_table(
    rng: np.random.Generator, blob: np.ndarray, offsets: np.ndarray, size: int
) -> pa.Table:
    """About ``size`` bytes of text: Zipf-like words gathered with numpy, cut into rows of
    log-normal lengths at word ends (so every row is valid UTF-8)."""
    word_bytes = np.diff(offsets)
    weights = 1.0 / (np.arange(WORDS) + 2.7) ** 1.05
    count = int(size / float(word_bytes @ (weights / weights.sum()))) + 1
    ids = rng.choice(WORDS, count, p=weights / weights.sum())
    lengths = word_bytes[ids]
    ends = np.cumsum(lengths)
    gather = np.repeat(offsets[ids] - (ends - lengths), lengths) + np.arange(int(ends[-1]))
    data = blob[gather]
    rows = np.clip(rng.lognormal(np.log(2000), 1.0, 4 * count // 300 + 16), 200, 50_000)
    targets = np.cumsum(rows)
    targets = targets[targets < ends[-1]]
    cuts = np.unique(ends[np.minimum(np.searchsorted(ends, targets), len(ends) - 1)])
    bounds = np.concatenate(([0], cuts[cuts < ends[-1]], [ends[-1]])).astype(np.int32)
    text = pa.Array.from_buffers(
        pa.string(), len(bounds) - 1, [None, pa.py_buffer(bounds), pa.py_buffer(data)]
    )
    text.validate(full=True)
    return pa.table({"text": text})


def text_files(args: argparse.Namespace) -> list[str]:
    wanted = {"kind": "text", "mb": args.mb, "files": args.files, "words": WORDS,
              "row_group_rows": args.row_group_rows, "seed": 0}  # fmt: skip

    def write(root: Path) -> None:
        blob, offsets = vocabulary(np.random.default_rng(0))
        for number in range(args.files):
            table = text_table(
                np.random.default_rng([1, number]), blob, offsets, args.mb * 10**6 // args.files
            )
            path = root / f"part-{number:05d}.parquet"
            tmp = path.with_name("." + path.name + ".tmp")
            pq.write_table(table, tmp, row_group_size=args.row_group_rows)
            os.replace(tmp, path)

    return cached_files(args.data, wanted, args.files, write)


@contextmanager
def parallel_tokenizers() -> Iterator[None]:
    """``tokenizers`` on all cores for the training (it reads the variable at each call)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"


def tokenizer(files: list[str], data: str) -> Tokenizer:
    """A byte-level BPE of ``VOCAB`` tokens trained on the first 16 MB of text (cached)."""
    path = Path(data) / f"_bpe{VOCAB}.json"
    stamp = Path(data) / "_bench_dataset.json"
    key = Path(data) / f"_bpe{VOCAB}.key"
    if path.exists() and key.exists() and key.read_text() == stamp.read_text():
        return Tokenizer.from_file(str(path))
    sample: list[str] = []
    taken = 0
    for batch in pq.ParquetFile(files[0]).iter_batches(batch_size=1024):
        sample.extend(batch.column(0).to_pylist())
        taken += batch.nbytes
        if taken >= 16 * 10**6:
            break
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with parallel_tokenizers():
        took, _ = timed(lambda: bpe.train_from_iterator(sample, trainer, length=len(sample)))
    print(f"trained a byte-level BPE of {bpe.get_vocab_size()} tokens on {taken / 1e6:.0f} MB "
          f"in {took:.1f} s")  # fmt: skip
    bpe.save(str(path))
    key.write_text(stamp.read_text())
    return bpe


# ----------------------------------------------------------------------------- contenders


def encode_alone(files: list[str], tok: Tokenizer, chunk_rows: int) -> dict[str, Any]:
    """The baseline: seconds (and CPU seconds) in ``encode_batch_fast`` alone, chunk by chunk;
    tokens, rows and the sum of the ids (untimed) to check the loader against."""
    seconds = cpu = 0.0
    tokens = rows = total = 0
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=chunk_rows):
            texts = batch.column(0).to_pylist()
            start, used = time.perf_counter(), time.thread_time()
            encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
            seconds += time.perf_counter() - start
            cpu += time.thread_time() - used
            lengths = [len(e) for e in encodings]
            tokens += sum(lengths)
            rows += len(texts)
            total += sum(sum(e.ids) for e in encodings)
            del texts, encodings
    return {"seconds": seconds, "cpu": {"main": cpu, "workers": []}, "tokens": tokens,
            "rows": rows, "id_sum": total}  # fmt: skip


class Peaks:
    """Peak RSS of the DataLoader workers over their RSS at start (``worker_init_fn`` notes
    it), or of this process over its RSS when made (no workers); and the workers' CPU seconds
    (the last reading before they end)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.dir = tempfile.TemporaryDirectory(prefix="bench_text_")
        self.before = rss_bytes()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := RSS now
        self.peaks: dict[int, int] = {}
        self.cpu: dict[int, float] = {}

    def init_fn(self) -> Callable[[int], None] | None:
        return functools.partial(_note_start, self.dir.name) if self.workers else None

    def poll(self) -> None:
        children = forked_children()
        self.peaks |= {pid: status_kib(pid, "VmHWM") * 1024 for pid in children}
        self.cpu |= {pid: _cpu_seconds(pid) for pid in children}

    def result(self) -> list[int]:
        """Each worker's peak over its start (or this process's), bytes."""
        if not self.workers:
            return [status_kib(os.getpid(), "VmHWM") * 1024 - self.before]
        root = Path(self.dir.name)
        starts = {int(p.name): int(p.read_text()) for p in root.iterdir()}
        self.dir.cleanup()
        return [peak - starts[pid] for pid, peak in self.peaks.items() if pid in starts]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _note_start(directory: str, worker: int) -> None:
    Path(directory, str(os.getpid())).write_text(str(rss_bytes()))


def ours_loader(data: str, tok: Tokenizer, workers: int, **options: Any) -> tuple[Any, Any]:
    eos = tok.token_to_id(EOS_TEXT)
    return StructuredDataset.create_dataloader(
        data,
        tokenize=Tokenize("text", tok, eos_id=eos),
        packing=TokenPacking("input_ids", seq_len=SEQ_LEN),
        batch_size=SEQUENCES,
        num_workers=workers,
        **options,
    )


def ours(
    data: str, tok: Tokenizer, workers: int, capture: int | None = None, **options: Any
) -> dict[str, Any]:
    """An epoch of ours: tokens, sum of ids, batches, peak RSS; with ``capture``, the state
    before batch ``capture`` and that batch."""
    peaks = Peaks(workers)
    loader, _ = ours_loader(data, tok, workers, worker_init_fn=peaks.init_fn(), **options)

    def count(batch: dict[str, Any]) -> tuple[int, int]:
        real = int(batch["num_tokens"])
        return real, int(batch["input_ids"].view(-1)[:real].sum())

    return epoch(loader, peaks, capture, count)


def epoch(
    loader: Any,
    peaks: Peaks,
    capture: int | None,
    count: Callable[[dict[str, Any]], tuple[int, int]],
) -> dict[str, Any]:
    """Seconds, CPU seconds, tokens and sum of ids (``count`` of each batch), batches and peak
    RSS of an epoch of ``loader``; with ``capture``, the state before batch ``capture`` and
    that batch."""
    out: dict[str, Any] = {}
    tokens = total = batches = 0
    start, cpu = time.perf_counter(), time.process_time()
    for batch in loader:
        if batches == capture:
            out["state"] = loader.state_dict()
            out["batch"] = batch["input_ids"].clone()
        counted, summed = count(batch)
        tokens += counted
        total += summed
        batches += 1
        if batches % 16 == 1:
            peaks.poll()
    out["seconds"] = time.perf_counter() - start
    out["cpu"] = {"main": time.process_time() - cpu, "workers": sorted(peaks.cpu.values())}
    peaks.poll()
    return out | {"tokens": tokens, "id_sum": total, "batches": batches, "peaks": peaks.result()}


class TokenBuffer(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """torchtitan's ``HuggingFaceDataset``: each document tokenized alone, its ids and the
    end-of-text id appended to a buffer, ``seq_len + 1`` tokens cut off the front at a time;
    its state is the buffer and the HF dataset's own state."""

    def __init__(self, files: list[str], tok: Tokenizer) -> None:
        from datasets import load_dataset

        self._data = load_dataset("parquet", data_files=files, split="train", streaming=True)
        self._tok = tok
        self._eos = tok.token_to_id(EOS_TEXT)
        self._buffer: list[int] = []

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        need = SEQ_LEN + 1
        for sample in self._data:
            self._buffer.extend(self._tok.encode(sample["text"], add_special_tokens=False).ids)
            self._buffer.append(self._eos)
            while len(self._buffer) >= need:
                x = torch.LongTensor(self._buffer[:need])
                self._buffer = self._buffer[need:]
                yield {"input_ids": x[:-1], "labels": x[1:]}

    def state_dict(self) -> dict[str, Any]:
        return {"token_buffer": list(self._buffer), "data": self._data.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._buffer = list(state["token_buffer"])
        self._data.load_state_dict(state["data"])


def peer_loader(files: list[str], tok: Tokenizer, workers: int, **options: Any) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = TokenBuffer(files, tok)
    return StatefulDataLoader(dataset, batch_size=SEQUENCES, num_workers=workers, **options)


def peer(
    files: list[str], tok: Tokenizer, workers: int, capture: int | None = None
) -> dict[str, Any]:
    """An epoch of the peer: tokens delivered (``seq_len + 1`` a sequence), batches, peak RSS."""
    peaks = Peaks(workers)
    loader = peer_loader(files, tok, workers, worker_init_fn=peaks.init_fn())
    return epoch(loader, peaks, capture, lambda batch: (len(batch["input_ids"]) * (SEQ_LEN + 1), 0))


# ----------------------------------------------------------------------------- resume


def ours_first_batch(data: str, tok: Tokenizer, state: dict[str, Any]) -> tuple[float, Any]:
    """Seconds from a new loader (0 workers) loading ``state`` to its first batch, and it."""
    start = time.perf_counter()
    loader, _ = ours_loader(data, tok, 0)
    loader.load_state_dict(state)
    batch = next(iter(loader))
    return time.perf_counter() - start, batch["input_ids"]


def peer_first_batch(files: list[str], tok: Tokenizer, state: dict[str, Any]) -> float:
    start = time.perf_counter()
    loader = peer_loader(files, tok, 0)
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start


def resumes(
    data: str, files: list[str], tok: Tokenizer, states: dict[str, Any], expected: Any
) -> dict[str, dict[str, float]]:
    """Median of 3 first batches after a resume at 0 % and at 90 %, ours and the peer."""
    ours_at: dict[str, list[float]] = {"0": [], "90": []}
    peer_at: dict[str, list[float]] = {"0": [], "90": []}
    for _ in range(3):
        for at in ("0", "90"):
            took, batch = ours_first_batch(data, tok, states[f"ours_{at}"])
            if at == "90" and not torch.equal(batch, expected):
                raise SystemExit("ours: the batch after a resume at 90 % differs from the run's")
            ours_at[at].append(took)
            peer_at[at].append(peer_first_batch(files, tok, states[f"peer_{at}"]))
            gc.collect()
    return {
        "ours": {at: statistics.median(v) for at, v in ours_at.items()},
        "peer": {at: statistics.median(v) for at, v in peer_at.items()},
    }


# ----------------------------------------------------------------------------- report


def verdict(value: float, target: float, at_most: bool = False) -> str:
    met = value <= target if at_most else value >= target
    return f"{'meets' if met else 'MISSES'} target {'≤' if at_most else '≥'} {target}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_setup(args.data)
    torch.set_num_threads(1)
    took, files = timed(lambda: text_files(args))
    tok = tokenizer(files, args.data)
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    text_bytes = sum(
        pq.ParquetFile(f).read(columns=["text"]).column(0).combine_chunks().buffers()[2].size
        for f in files
    )
    chunk_rows = max(256, int(CHUNK_BYTES / (text_bytes / rows)))
    stored = sum(os.path.getsize(f) for f in files)
    print(f"dataset: {args.data}: {len(files)} files, {rows:,} rows, {text_bytes / 1e6:.0f} MB "
          f"of text ({stored / 1e6:.0f} MB stored), mean row {text_bytes / rows:,.0f} B; "
          f"ready in {took:.1f} s")  # fmt: skip
    print(f"tokenizer: byte-level BPE, {tok.get_vocab_size():,} tokens; "
          f"TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}")  # fmt: skip
    print(f"seq_len={SEQ_LEN}, batch_size={SEQUENCES}; run at {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"machine: {machine_note()}")
    base = encode_alone(files, tok, chunk_rows)  # also warms the page cache
    expected_tokens = base["tokens"] + base["rows"]
    expected_sum = base["id_sum"] + base["rows"] * tok.token_to_id(EOS_TEXT)
    batches = -(-expected_tokens // (SEQ_LEN * SEQUENCES))
    at90 = int(batches * 0.9)
    print(f"{base['tokens']:,} tokens ({text_bytes / base['tokens']:.2f} B a token) "
          f"+ {base['rows']:,} eos; {batches:,} packed batches an epoch")  # fmt: skip

    speed: dict[str, list[float]] = {}
    cpu: dict[str, list[dict[str, Any]]] = {}
    peaks: dict[str, list[int]] = {}
    states: dict[str, Any] = {}
    budget = args.budget_mib * 2**20

    def record(name: str, result: dict[str, Any]) -> None:
        speed.setdefault(name, []).append(result["tokens"] / result["seconds"])
        used = result["cpu"] | {"wall": result["seconds"], "tokens": result["tokens"]}
        cpu.setdefault(name, []).append(used)
        if "peaks" in result:
            peaks[name] = [max(a, b) for a, b in zip(peaks.get(name, result["peaks"]),
                                                     result["peaks"], strict=True)]  # fmt: skip

    def check(name: str, result: dict[str, Any]) -> None:
        got = (result["tokens"], result["id_sum"])
        if got != (expected_tokens, expected_sum):
            raise SystemExit(f"{name} delivered {got} (tokens, sum of ids), expected "
                             f"{(expected_tokens, expected_sum)}")  # fmt: skip

    print(f"\n{args.repeats} interleaved round(s):")
    for repeat in range(args.repeats):
        first = repeat == 0
        base = base if first else encode_alone(files, tok, chunk_rows)  # round 1: the warm-up's
        record("encode_batch_fast", base | {"tokens": expected_tokens})
        for name, workers in (("ours w0", 0), ("ours w2", 2)):
            result = ours(args.data, tok, workers, capture=at90 if first and not workers else None)
            check(name, result)
            record(name, result)
            if "state" in result:
                states["ours_90"], expected_batch = result.pop("state"), result.pop("batch")
        for name, workers in (("peer w0", 0), ("peer w2", 2)):
            result = peer(files, tok, workers, capture=at90 if first and not workers else None)
            if (
                not expected_tokens - 2 * (SEQ_LEN + 1) * SEQUENCES
                <= result["tokens"]
                <= expected_tokens
            ):
                raise SystemExit(f"{name} delivered {result['tokens']:,} of {expected_tokens:,}")
            record(name, result)
            if "state" in result:
                states["peer_90"] = result.pop("state")
                del result["batch"]
        result = ours(args.data, tok, 2, shuffle=True, shuffle_memory_bytes=budget)
        check("ours w2 shuffled", result)
        record("ours w2 shuffled", result)
        gc.collect()
        line = "  ".join(f"{n}={v[-1] / 1e6:.2f}M" for n, v in speed.items())
        print(f"  round {repeat + 1}: {line} tokens/s", flush=True)

    print("\nmedian of rounds (best in brackets)")
    for name, values in speed.items():
        s = summary(values)
        mb = s["median"] * text_bytes / expected_tokens / 1e6
        print(f"  {name:<18}{s['median'] / 1e6:7.2f} M tokens/s {mb:6.1f} MB/s of text"
              f"   [best {s['best'] / 1e6:.2f} M]")  # fmt: skip
    ratios: dict[str, Any] = {}
    pairs = [
        ("ours w0", "encode_batch_fast", "w0_over_encode"),
        ("ours w2", "ours w0", "w2_over_w0"),
        ("ours w0", "peer w0", "over_peer"),
        ("ours w2", "peer w2", "over_peer"),
        ("ours w2 shuffled", "ours w2", None),
    ]
    print()
    for mine, theirs, target in pairs:
        r = paired(speed, mine, theirs)
        ratios[f"{mine} / {theirs}"] = r
        judged = f"({verdict(r['paired_median'], TARGETS[target])})" if target else ""
        print(f"  {mine + ' / ' + theirs:<38}= {r['paired_median']:5.2f}  {judged}  "
              f"[best/best {r['best_over_best']:.2f}]")  # fmt: skip
    efficiency = {name: [r["tokens"] / (r["main"] + sum(r["workers"])) for r in rounds]
                  for name, rounds in cpu.items()}  # fmt: skip
    print(
        "\ntokens per CPU second (all the CPU of the main process and its workers; less "
        "sensitive to load than tokens/s)"
    )
    for name, values in efficiency.items():
        print(f"  {name:<18}{statistics.median(values) / 1e6:7.2f} M")
    for mine, theirs, _ in pairs[:4]:
        r = paired(efficiency, mine, theirs)
        ratios[f"{mine} / {theirs} per CPU second"] = r
        print(f"  {mine + ' / ' + theirs:<38}= {r['paired_median']:5.2f}")
    print("\nCPU seconds of the epoch (last round): the main process (the consumer, and with 0 "
          "workers the read-ahead thread that tokenizes), each worker; wall seconds")  # fmt: skip
    for name, rounds in cpu.items():
        used = rounds[-1]
        workers = ", ".join(f"{w:.1f}" for w in used["workers"]) or "-"
        print(f"  {name:<18} main {used['main']:6.1f}  workers {workers:<12} wall "
              f"{used['wall']:6.1f}  (main busy {used['main'] / used['wall']:.0%})")  # fmt: skip

    loader, _ = ours_loader(args.data, tok, 0)
    states["ours_0"] = loader.state_dict()
    states["peer_0"] = peer_loader(files, tok, 0).state_dict()
    resumed = resumes(args.data, files, tok, states, expected_batch)
    print("\nfirst batch after a resume (0 workers, median of 3):")
    for who in ("ours", "peer"):
        at = resumed[who]
        ratio = at["90"] / at["0"]
        resumed[who]["ratio"] = ratio
        judged = f"  ({verdict(ratio, TARGETS['resume'], at_most=True)})" if who == "ours" else ""
        print(f"  {who}: at 0 % {at['0'] * 1e3:6.0f} ms, at 90 % {at['90'] * 1e3:6.0f} ms: "
              f"ratio {ratio:.2f}{judged}")  # fmt: skip

    chunk_text = chunk_rows * text_bytes / rows
    chunk_tokens = chunk_rows * expected_tokens / rows * 4  # int32 ids
    group = args.row_group_rows * text_bytes / rows  # decoded text of a row group
    bound = budget + group + chunk_text + chunk_tokens
    print(f"\npeak RSS over start: the stated bound is a stream's shuffle budget "
          f"({args.budget_mib} MiB) + a row group decoded ({group / 2**20:.1f} MiB of text: "
          f"pyarrow's while it decodes) + a chunk ({chunk_rows:,} rows: "
          f"{chunk_text / 2**20:.1f} MiB of text + {chunk_tokens / 2**20:.1f} MiB of int32 ids)"
          f" = {bound / 2**20:.0f} MiB ({(bound - budget) / 2**20:.0f} unshuffled)")  # fmt: skip
    for name, values in peaks.items():
        listed = ", ".join(f"{v / 2**20:.0f}" for v in values)
        limit = bound if "shuffled" in name else bound - budget
        within = "within" if max(values) <= limit else "OVER"
        note = f"   (bound {limit / 2**20:.0f} MiB: {within})" if "ours w2" in name else ""
        print(f"  {name:<18} {listed} MiB{note}")
    print(f"machine after the runs: {machine_note()}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"tokens_per_s": speed, "ratios": ratios, "resume_s": resumed,
                       "peak_rss_over_start": peaks, "cpu_s": cpu,
                       "tokens_per_cpu_s": efficiency, "memory_bound_shuffled": bound,
                       "rows": rows,
                       "text_bytes": text_bytes, "tokens": expected_tokens,
                       "chunk_rows": chunk_rows}, out, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
