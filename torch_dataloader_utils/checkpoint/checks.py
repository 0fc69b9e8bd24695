"""A state against the current settings and plan: the mismatch errors, each with its "Likely cause".

``check_setting`` names the setting that changed, with both values; ``misplaced`` a progress that is
no position of the plan. An elastic resume may change the job's shape (``ELASTIC_FIELDS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..base.errors import CheckpointMismatchError
from .files import stored_split
from .schema import Settings

__all__ = ["ELASTIC_FIELDS", "check_setting", "check_settings", "misplaced"]

ELASTIC_FIELDS = ("world_size", "rank", "num_workers", "even_batches")


def check_settings(state: Mapping[str, Any], settings: Settings, elastic: bool) -> None:
    pairs = {
        "format": (state["_format"], settings.format),
        "split_bytes": (state["_split_bytes"], settings.split_bytes),
        "shuffle": (state["_shuffle"], settings.shuffle),
        "shuffle_seed": (state["_shuffle_seed"], settings.shuffle_seed),
        "shuffle_memory_bytes": (state["_shuffle_memory_bytes"], settings.memory_bytes)
        if settings.shuffle
        else (0, 0),
        "world_size": (state["_world_size"], settings.world_size),
        "rank": (state["_rank"], settings.rank),
        # which rows an evened epoch leaves out, and so where it ends, depends on it (after
        # world_size: its default follows world_size, so a changed world_size is named first)
        "even_batches": (state["_even_batches"], settings.even_batches),
        # 0 and 1 workers both make one stream per rank, so they resume into each other.
        "num_workers": (state["_num_workers"], settings.num_workers),
        # which tokens a row makes (seq_len may change: positions count tokens)
        "packing": (state["_packing"], settings.packing),
        # which tokens a text makes: the text column and the tokenizer's whole definition
        "tokenizer": (state.get("_tokenize"), settings.tokenize),
        # what a batch carries beside the tokens: the companion columns and their pads
        "companions": (state.get("_companions"), settings.companions),
    }
    for name, (expected, found) in pairs.items():
        if elastic and name in ELASTIC_FIELDS:
            continue
        check_setting(name, expected, found, stored_split(state))
    _check_whole(state.get("_whole_documents"), settings.whole_documents, stored_split(state))


def _check_whole(expected: dict[str, Any] | None, found: dict[str, Any] | None, split: str) -> None:
    """Whole-document packing's choices (a position counts the sequences they make): whether it
    is on, then each choice by name (``whole_documents.window``)."""
    if expected is None or found is None:
        check_setting("whole_documents", expected is not None, found is not None, split)
        return
    for key in sorted(expected.keys() | found.keys()):
        check_setting(f"whole_documents.{key}", expected.get(key), found.get(key), split)


def check_setting(name: str, expected: object, found: object, split: str) -> None:
    """Raise the mismatch error for setting ``name`` unless the values agree."""
    if expected == found:
        return
    # 0 and 1 workers both make one stream per rank, so they resume into each other.
    if name == "num_workers" and max(1, expected) == max(1, found):  # type: ignore[call-overload]
        return
    hint = ""
    if name == "shuffle_window_rows":
        hint = " (the rows of a shuffle window follow the files' bytes per row)"
    if name == "tokenizer":
        hint = (
            " (the text column, the tokenizer's definition, bos_id/eos_id or the chat template, "
            "its roles and fields differ: the checkpoint's token positions would count other "
            "tokens)"
        )
    if name.startswith("whole_documents"):
        hint = (
            " (TokenPacking's whole_documents, seq_len, window and overlong decide which "
            "sequences a window makes: the checkpoint's positions count those sequences)"
        )
    if name == "companions":
        hint = (
            " (TokenPacking(companions=...) differs: the batches would carry other columns "
            "beside the tokens, or other pads, than the checkpointed run's)"
        )
    if name in ELASTIC_FIELDS:
        hint = " (pass elastic=True with every rank's state to re-deal the rest of the epoch)"
    what = f"the state of rank {expected}" if name == "rank" else "this checkpoint"
    raise CheckpointMismatchError(
        f"{what} does not match the current dataset: stored split {split} was planned with "
        f"{name}={expected!r}, compared against the current plan with {name}={found!r}{hint}."
        f"\nLikely cause: {name} changed: checkpoint={expected!r}, current={found!r}",
        split=split, field=name, expected=expected, found=found,
    )  # fmt: skip


def misplaced(split: str, settings: Settings, worker: int | None) -> CheckpointMismatchError:
    """The state's progress is not where the plan puts any stream of this rank."""
    where = "any worker" if worker is None else f"worker {worker}"
    return CheckpointMismatchError(
        f"checkpoint split {split} is out of order for {where} of rank {settings.rank}: "
        f"compared against the current plan (world_size={settings.world_size}, "
        f"num_workers={settings.num_workers}), the delivered rows are not a position of that "
        f"worker's share.\nLikely cause: the state was edited, or saved by another worker "
        f"or loader: checkpoint=out-of-order progress, current={where} of rank {settings.rank}",
        split=split, field="plan", expected="a position of each worker's share", found=where,
    )  # fmt: skip
