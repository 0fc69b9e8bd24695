"""Supervised fine-tuning on chat Parquet inside Hugging Face's ``StructuredTrainer`` and
Lightning's ``Trainer``: the batches of ``Tokenize(..., chat_template=...)`` packed whole
(``TokenPacking(..., whole_documents=True, companions={"labels": -100})``) go to a model whose
``forward`` takes ``input_ids``, ``labels``, ``position_ids`` and ``cu_seqlens`` (attention
within each conversation, as flash attention's variable-length kernel gets it).

Each test checks that the loss the trainer optimizes is the cross-entropy over the shifted
labels that are not -100, computed here by hand from the model's logits; that those labels are
exactly the assistant's tokens of transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)``, every conversation once and whole; and that a run
crashed after a mid-epoch checkpoint and resumed in a new trainer, model and loader trains on
the uninterrupted run's batches (``input_ids``, ``labels``, ``position_ids``) from there.
A transformers causal LM takes the packed batch as it is: attention within each conversation
from the ``position_ids``, its own loss over the labels.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from torch_dataloader_utils import StructuredDataset, Tokenize, TokenPacking

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")
hf = pytest.importorskip("torch_dataloader_utils.integrations.hf")

# Lightning 2.6's, in-process here (tests/test_lightning_trainer.py runs jobs): torch's pytree
# deprecation, and the resume's checkpoint directory (the crashed run's) not being empty
pytestmark = [
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

VOCAB, SEQ_LEN, SEQUENCES, EVERY, CRASH_AT = 300, 128, 2, 4, 7
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
)
WORDS = ["hello", "world", "café", "東京", "the", "assistant", "says", "7", "why", "?"]


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 files of 40 conversations, 1-3 user/assistant exchanges, row groups of 10."""
    root = tmp_path_factory.mktemp("chats")
    rng = np.random.default_rng(3)
    for number in range(2):
        rows = [
            [{"role": role, "content": " ".join(rng.choice(WORDS, rng.integers(1, 10)))}
             for _ in range(rng.integers(1, 4)) for role in ("user", "assistant")]
            for _ in range(40)
        ]  # fmt: skip
        pq.write_table(pa.table({"messages": rows}), root / f"chats-{number}.parquet",
                       row_group_size=10)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def tokenizer(chats: Path) -> Any:
    """A byte-level BPE (``<pad>`` is id 0) with the ChatML template, as transformers'."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator(WORDS * 20, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", chat_template=CHATML
    )


def loader_of(chats: Path, tokenizer: Any, workers: int) -> Any:
    """Shuffled conversations, rendered in the loader, packed whole with their labels."""
    packing = TokenPacking("input_ids", seq_len=SEQ_LEN, companions={"labels": -100},
                           whole_documents=True, window=16)  # fmt: skip
    loader, _ = StructuredDataset.create_dataloader(
        str(chats), batch_size=SEQUENCES, shuffle=True, num_workers=workers, packing=packing,
        tokenize=Tokenize("messages", tokenizer, chat_template=True),
    )  # fmt: skip
    return loader


class ChatLM(nn.Module):
    """Embeddings, one causal attention within each part of ``cu_seqlens`` (what flash
    attention's ``flash_attn_varlen_func`` takes), a head; the loss over the shifted labels.
    Records each step's batch, logits and loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.position = nn.Embedding(SEQ_LEN, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, VOCAB)
        self.steps: list[dict[str, torch.Tensor]] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        num_tokens: int | None = None,
    ) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids.long()) + self.position(position_ids.long())
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        flat = torch.arange(input_ids.numel())  # each token's part, over the flattened batch
        part = torch.searchsorted(cu_seqlens[1:].long(), flat, right=True).view_as(input_ids)
        size = input_ids.shape[1]
        causal = torch.ones(size, size, dtype=torch.bool).tril()
        mask = (part[:, :, None] == part[:, None, :]) & causal
        logits = self.head(x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        # shifted as usual: position i predicts label i + 1; a part's first token never
        targets = labels[:, 1:].masked_fill(position_ids[:, 1:] == 0, -100)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)
        self.steps.append({"input_ids": input_ids.clone(), "labels": labels.clone(),
                           "position_ids": position_ids.clone(), "cu_seqlens": cu_seqlens.clone(),
                           "logits": logits.detach(), "loss": loss.detach()})  # fmt: skip
        return {"loss": loss, "logits": logits}


def by_hand(step: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean negative log-likelihood of the labels that are not -100, one position ahead."""
    labels = step["labels"][:, 1:]
    counted = labels != -100
    log_p = torch.log_softmax(step["logits"][:, :-1][counted].double(), dim=-1)
    return -log_p.gather(1, labels[counted][:, None]).mean()


def parts(steps: list[dict[str, torch.Tensor]]) -> Iterator[tuple[list[int], list[int]]]:
    """Each part of ``cu_seqlens`` of each step: its tokens and labels."""
    for step in steps:
        ids, labels = step["input_ids"].flatten(), step["labels"].flatten()
        for start, end in itertools.pairwise(step["cu_seqlens"].tolist()):
            yield ids[start:end].tolist(), labels[start:end].tolist()


def assert_assistant_only_loss(
    steps: list[dict[str, torch.Tensor]], chats: Path, tokenizer: Any
) -> None:
    """Every step's loss is ``by_hand``'s; the labels are the assistant's tokens of
    ``apply_chat_template``, each conversation once and whole (the rest is padding)."""
    for step in steps:
        torch.testing.assert_close(step["loss"], by_hand(step).float())
        starts = (step["position_ids"] == 0).flatten().nonzero().flatten()
        assert torch.equal(starts, step["cu_seqlens"][:-1].long())  # parts begin at position 0
    expected = []
    for messages in pq.read_table(chats).column("messages").to_pylist():
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = list(out["input_ids"])
        mask = out["assistant_masks"]
        expected.append((ids, [t if m else -100 for t, m in zip(ids, mask, strict=True)]))
    packed = [(ids, labels) for ids, labels in parts(steps) if any(ids)]  # padding: all <pad>
    assert sorted(packed) == sorted(expected)
    padding = [labels for ids, labels in parts(steps) if not any(ids)]
    assert all(set(labels) == {-100} for labels in padding)
    learned = sum(label != -100 for _, labels in expected for label in labels)
    assert 0 < learned < sum(len(ids) for ids, _ in expected) / 2  # the assistant's share


def assert_resumed_exactly(
    full: list[dict[str, torch.Tensor]], before: list[dict[str, torch.Tensor]],
    after: list[dict[str, torch.Tensor]],
) -> None:  # fmt: skip
    """The crashed run's steps to the checkpoint, then the resumed run's: the uninterrupted
    run's batches, key for key."""
    assert len(before) == CRASH_AT and len(full) == EVERY + len(after)
    for got, want in zip(before[:EVERY] + after, full, strict=True):
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(got[key], want[key]), key


def epoch_steps(chats: Path, tokenizer: Any) -> int:
    steps = sum(1 for _ in loader_of(chats, tokenizer, 2))
    assert steps > CRASH_AT + 2, steps  # the checkpoint and the crash mid-epoch
    return steps


def test_hf_structured_trainer_trains_on_the_assistants_tokens(
    chats: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """``StructuredTrainer`` with 2 workers: the loss it optimizes and logs (``logging_steps=1``)
    is the assistant-only cross-entropy; crashed at step 7, ``train(resume_from_checkpoint=True)``
    from checkpoint-4 continues with the uninterrupted batches."""
    steps = epoch_steps(chats, tokenizer)

    class CrashAt(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == CRASH_AT:
                raise Crash

    def run(output: Path, crash: bool = False, resume: bool = False) -> tuple[ChatLM, Any]:
        args = transformers.TrainingArguments(
            output_dir=str(output), max_steps=steps, save_steps=EVERY, learning_rate=1e-3,
            use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1,
        )  # fmt: skip
        model = ChatLM()
        trainer = hf.StructuredTrainer(
            model=model, args=args, train_dataloader=loader_of(chats, tokenizer, 2),
            callbacks=[CrashAt()] if crash else [],
        )  # fmt: skip
        with contextlib.suppress(Crash):
            trainer.train(resume_from_checkpoint=True if resume else None)
        return model, trainer

    full, trainer = run(tmp_path / "full")
    assert len(full.steps) == steps
    assert_assistant_only_loss(full.steps, chats, tokenizer)
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == pytest.approx([float(step["loss"]) for step in full.steps], abs=1e-4)
    crashed, _ = run(tmp_path / "ckpt", crash=True)
    resumed, _ = run(tmp_path / "ckpt", resume=True)
    assert_resumed_exactly(full.steps, crashed.steps, resumed.steps)


class ChatModule(L.LightningModule):
    def __init__(self, chats: Path, tokenizer: Any, crash_at: int | None = None) -> None:
        super().__init__()
        self.chats, self.tokenizer, self.crash_at = chats, tokenizer, crash_at
        self.model = ChatLM()

    def train_dataloader(self) -> Any:
        return loader_of(self.chats, self.tokenizer, 2)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.crash_at:
            raise Crash
        loss: torch.Tensor = self.model(**batch)["loss"]
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_trains_on_the_assistants_tokens(
    chats: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """Lightning with nothing added, 2 workers: ``training_step`` returns the model's loss
    (assistant-only, by hand); crashed at step 7, ``fit(ckpt_path="last")`` from the step-4
    checkpoint continues with the uninterrupted batches."""

    def trainer(checkpoints: Path) -> Any:
        return L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=True,
            callbacks=[L.pytorch.callbacks.ModelCheckpoint(
                dirpath=checkpoints, every_n_train_steps=EVERY, save_top_k=-1, save_last=True)],
        )  # fmt: skip

    full = ChatModule(chats, tokenizer)
    trainer(tmp_path / "full").fit(full)
    assert len(full.model.steps) == epoch_steps(chats, tokenizer)
    assert_assistant_only_loss(full.model.steps, chats, tokenizer)
    crashed = ChatModule(chats, tokenizer, crash_at=CRASH_AT)
    with contextlib.suppress(Crash):
        trainer(tmp_path / "ckpt").fit(crashed)
    resumed = ChatModule(chats, tokenizer)
    trainer(tmp_path / "ckpt").fit(resumed, ckpt_path="last")
    assert_resumed_exactly(full.model.steps, crashed.model.steps, resumed.model.steps)


def test_a_transformers_causal_lm_takes_the_packed_batch_as_it_is(
    chats: Path, tokenizer: Any
) -> None:
    """``model(**batch)`` on a transformers causal LM (a 1-layer Llama, SDPA): it masks
    attention within each conversation from the ``position_ids`` (each part's logits are the
    conversation's alone; without them, they are not) and its loss is ``by_hand``'s."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    batches = list(loader_of(chats, tokenizer, 0))
    assert any(b["num_tokens"] < b["input_ids"].numel() for b in batches)  # padding too
    for batch in batches[:3] + batches[-1:]:
        with torch.no_grad():
            out = model(**batch, use_cache=False)
            mixed = model(input_ids=batch["input_ids"], use_cache=False).logits.flatten(0, 1)
        step = {"logits": out.logits, "labels": batch["labels"]}
        torch.testing.assert_close(out.loss, by_hand(step).float())
        logits, ids = out.logits.flatten(0, 1), batch["input_ids"].flatten()
        differs = 0
        for start, end in itertools.pairwise(batch["cu_seqlens"].tolist()):
            with torch.no_grad():
                alone = model(input_ids=ids[None, start:end], use_cache=False).logits[0]
            torch.testing.assert_close(logits[start:end], alone, atol=1e-5, rtol=1e-5)
            differs += not torch.allclose(mixed[start:end], alone, atol=1e-5)
        assert differs > 0  # attention across conversations, without position_ids
