"""Fine-tune a tiny causal language model straight from chat Parquet: the template rendered in
the loader, the loss on the assistant's tokens only, whole conversations packed, crashed,
resumed to the token.

The data: Parquet files with a ``messages`` column (``list<struct<role, content>>``, as the
Hugging Face chat sets ship; generated here). A byte-level BPE is trained on them in a fraction
of a second and a ChatML-style template marks the assistant's turns with ``{% generation %}``
(a real run passes its tokenizer, a transformers one with its own template:
``chat_template=True``). ``Tokenize`` renders and tokenizes each conversation inside the
DataLoader workers into ``input_ids`` and ``labels`` (the token in an assistant's turn, -100
elsewhere); ``TokenPacking(..., whole_documents=True)`` packs whole conversations best-fit into
sequences of ``SEQ_LEN`` tokens, the labels beside their tokens (``companions``), -100 at every
padded place. The loss (``train_tiny_lm.loss_of``) is the usual shifted cross-entropy over the
labels that are not -100; ``position_ids`` restart at every conversation, so attention stays
within it (``cu_seqlens`` for flash attention's variable-length kernel: docs/sft.md).

The run (``train_tiny_lm.train``) checkpoints (model, optimizer, ``dataset.state_dict()``)
every ``--every`` steps, is "killed" after ``--crash-at`` steps, and resumes from its last
checkpoint in a fresh loader. It checks that the resumed run trains on exactly the batches of
the uninterrupted run from there (``input_ids``, ``labels`` and ``position_ids``, token for
token), ends with the same weights, and that every conversation was trained on once, whole, its
labels intact. A resume under another template is refused.

    python examples/sft_chat.py [--workdir DIR] [--num-workers 2]
"""

from __future__ import annotations

import itertools
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

VOCAB, SEQ_LEN, SEQUENCES, WINDOW = 400, 256, 4, 64
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]  # <pad> is id 0
WORDS = (
    "the", "a", "data", "loader", "resumes", "every", "token", "once", "why", "how",
    "café", "naïve", "東京", "straße", "ω", "λόγος", "?", "!",
)  # fmt: skip
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.")
# ChatML: each message between <|im_start|>role and <|im_end|>; the assistant's text and its
# <|im_end|> are what it learns to write ({% generation %}), its header is not
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
)


def write_chats(directory: Path, files: int = 3, rows: int = 100) -> list[list[dict[str, str]]]:
    """Parquet files of conversations: a system prompt in one of three, then 1-3 user/assistant
    exchanges of 1-16 words a message; returns them in storage order."""
    directory.mkdir(parents=True, exist_ok=True)
    everything = []
    for number in range(files):
        rng = np.random.default_rng(number)
        chats = []
        for _ in range(rows):
            system = [{"role": "system", "content": str(rng.choice(SYSTEMS))}]
            turns = [
                {"role": role, "content": " ".join(rng.choice(WORDS, rng.integers(1, 17)))}
                for _ in range(rng.integers(1, 4))
                for role in ("user", "assistant")
            ]
            chats.append((system if rng.random() < 1 / 3 else []) + turns)  # fmt: skip
        pq.write_table(pa.table({"messages": chats}), directory / f"chats-{number}.parquet",
                       row_group_size=25)  # fmt: skip
        everything += chats
    return everything


def train_tokenizer(chats: list[list[dict[str, str]]]) -> Tokenizer:
    """A byte-level BPE of ``VOCAB`` ids with the template's special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator((m["content"] for c in chats for m in c), trainer)
    return tokenizer


def loader_of(data: Path, tokenize: Tokenize, num_workers: int) -> tuple[Any, StructuredDataset]:
    """The conversations of ``data``, shuffled, rendered, tokenized and packed whole."""
    packing = TokenPacking(
        "input_ids", seq_len=SEQ_LEN, pad_id=0, companions={"labels": -100},
        whole_documents=True, window=WINDOW,
    )  # fmt: skip
    return StructuredDataset.create_dataloader(
        str(data), batch_size=SEQUENCES, num_workers=num_workers, shuffle=True,
        tokenize=tokenize, packing=packing,
    )  # fmt: skip


def batch_of(batch: dict[str, Any]) -> torch.Tensor:
    """What a step trains on: input_ids, labels and position_ids, (3, SEQUENCES, SEQ_LEN)."""
    return torch.stack([batch["input_ids"].long(), batch["labels"], batch["position_ids"].long()])


def conversations_in(batches: list[torch.Tensor]) -> list[tuple[tuple[int, ...], ...]]:
    """Each packed conversation's (tokens, labels), cut where its positions restart; the
    padding (a part of its own, all ``<pad>``) left out; sorted."""
    parts = []
    for ids, labels, positions in (row for b in batches for row in b.unbind(1)):
        starts = [*torch.nonzero(positions == 0).flatten().tolist(), len(ids)]
        for start, end in itertools.pairwise(starts):
            if ids[start:end].any():  # not the sequence's padding
                parts.append((tuple(ids[start:end].tolist()), tuple(labels[start:end].tolist())))
    return sorted(parts)


def main() -> None:
    args = run_args(__doc__, every=8, crash_at=13)
    data = args.workdir / "data"
    chats = write_chats(data)
    tokenizer = train_tokenizer(chats)
    tokenize = Tokenize("messages", tokenizer, chat_template=TEMPLATE)

    def make_loader() -> tuple[Any, StructuredDataset]:
        return loader_of(data, tokenize, args.num_workers)

    uninterrupted, trained_on, saved = crash_and_resume(
        make_loader, args.workdir, every=args.every, crash_at=args.crash_at, vocab=VOCAB,
        record=batch_of,
    )  # fmt: skip
    # every conversation once and whole: its tokens and labels as the loader gives them unpacked
    unpacked, _ = StructuredDataset.create_dataloader(
        str(data), batch_size=50, tokenize=tokenize, columns=["input_ids", "labels"]
    )
    expected = sorted(
        (tuple(ids.tolist()), tuple(labels.tolist()))
        for batch in unpacked
        for ids, labels in zip(batch["input_ids"].unbind(), batch["labels"].unbind(), strict=True)
    )
    assert len(expected) == len(chats)
    assert conversations_in(trained_on) == expected, "each conversation once, whole"
    trained = torch.cat(uninterrupted, dim=1)
    tokens = int((trained[0] != 0).sum())
    learned = int((trained[1] != -100).sum())
    assert learned == sum(sum(t != -100 for t in labels) for _, labels in expected)
    other = Tokenize("messages", tokenizer, chat_template=TEMPLATE.replace("'\\n'", "'\\n\\n'"))
    try:
        loader_of(data, other, args.num_workers)[1].load_state_dict(torch.load(
            args.workdir / "checkpoint.pt", weights_only=True)["data"])  # fmt: skip
        raise AssertionError("a resume under another chat template must be refused")
    except CheckpointMismatchError as exc:
        assert exc.field == "tokenizer" and "chat template" in str(exc), exc
    print(
        f"sft_chat: {len(chats)} conversations, {len(uninterrupted)} steps of {SEQUENCES} x "
        f"{SEQ_LEN} tokens, {tokens} tokens ({trained[0].numel() - tokens} padding), "
        f"{learned} of them the assistant's (the loss's); crashed at step {args.crash_at}, "
        f"resumed from step {saved}: the same {len(uninterrupted) - saved} batches (input_ids "
        f"and labels), the same weights, every conversation once and whole; another template "
        f"refused"
    )


if __name__ == "__main__":
    main()
