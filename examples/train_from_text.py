"""Train a tiny language model straight from text Parquet: tokenized in the loader, packed,
crashed, resumed to the token.

The data: Parquet files with a ``text`` column (generated here, multi-byte UTF-8 included),
as FineWeb ships. A byte-level BPE tokenizer is trained on them in a fraction of a second
(a real run loads its own: ``Tokenizer.from_file``). ``Tokenize`` turns every row's text into
``tokens(text) + [EOS]`` inside the loader; ``TokenPacking`` packs them into sequences of
``SEQ_LEN`` tokens. No offline tokenization pass, and no token buffer in the checkpoint: the
state records each stream's row and the tokens of it delivered, with the tokenizer's
fingerprint.

The run (``train_tiny_lm.train``: the same model and loop as for pre-tokenized data)
checkpoints (model, optimizer, ``dataset.state_dict()``) every ``--every`` steps, is "killed"
after ``--crash-at`` steps, and resumes from its last checkpoint in a fresh loader.
It checks that the resumed run trains on exactly the batches the uninterrupted run did from
there, ends with the same weights, and that every token of every text (each tokenized alone,
then EOS) was trained on once. A resume under another tokenizer is refused.

    python examples/train_from_text.py [--workdir DIR] [--num-workers 2]
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from train_tiny_lm import crash_and_resume, run_args

from torch_dataloader_utils import (
    CheckpointMismatchError,
    StructuredDataset,
    Tokenize,
    TokenPacking,
)

VOCAB, SEQ_LEN, SEQUENCES = 400, 64, 4
WORDS = (
    "the", "a", "data", "loader", "resumes", "every", "token", "once",
    "café", "naïve", "東京", "straße", "ω", "λόγος",
)  # fmt: skip


def write_texts(directory: Path, files: int = 4, rows: int = 100) -> list[str]:
    """Parquet files of texts of 0-40 words; returns the texts in storage order."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for number in range(files):
        rng = np.random.default_rng(number)
        part = [" ".join(rng.choice(WORDS, rng.integers(0, 40))) for _ in range(rows)]
        pq.write_table(pa.table({"text": part}), directory / f"texts-{number}.parquet",
                       row_group_size=20)  # fmt: skip
        texts += part
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A byte-level BPE of ``VOCAB`` ids; id 0 is ``<eos>``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def loader_of(data: Path, tokenize: Tokenize, num_workers: int) -> tuple[Any, StructuredDataset]:
    return StructuredDataset.create_dataloader(
        str(data), batch_size=SEQUENCES, num_workers=num_workers, shuffle=True,
        tokenize=tokenize, packing=TokenPacking("input_ids", seq_len=SEQ_LEN),
    )  # fmt: skip


def main() -> None:
    args = run_args(__doc__, every=10, crash_at=17)
    data = args.workdir / "data"
    texts = write_texts(data)
    tokenizer = train_tokenizer(texts)
    eos = tokenizer.token_to_id("<eos>")
    tokenize = Tokenize("text", tokenizer, eos_id=eos)

    def make_loader() -> tuple[Any, StructuredDataset]:
        return loader_of(data, tokenize, args.num_workers)

    uninterrupted, trained_on, saved = crash_and_resume(
        make_loader, args.workdir, every=args.every, crash_at=args.crash_at, vocab=VOCAB
    )
    alone = [[*tokenizer.encode(t, add_special_tokens=False).ids, eos] for t in texts]
    expected = Counter(token for ids in alone for token in ids)
    trained = Counter(torch.cat(trained_on).tolist())
    assert trained == expected, "every token of every text, once"
    other = Tokenize("text", train_tokenizer(texts[:30]), eos_id=eos)  # another vocabulary
    try:
        loader_of(data, other, args.num_workers)[1].load_state_dict(torch.load(
            args.workdir / "checkpoint.pt", weights_only=True)["data"])  # fmt: skip
        raise AssertionError("a resume under another tokenizer must be refused")
    except CheckpointMismatchError as exc:
        assert exc.field == "tokenizer"
    print(
        f"train_from_text: {len(texts)} texts, {len(uninterrupted)} steps of {SEQUENCES} x "
        f"{SEQ_LEN} tokens; crashed at step {args.crash_at}, resumed from step {saved}: the "
        f"same {len(uninterrupted) - saved} batches, the same weights, {expected.total()} "
        f"tokens each trained on once; another tokenizer refused"
    )


if __name__ == "__main__":
    main()
