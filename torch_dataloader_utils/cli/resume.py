"""The checks of a resume, without iterating: the states of a checkpoint file against the files.

``load_states`` reads the file and checks each state's schema; ``epochs_for`` builds the dataset
with the checkpoint's settings (or overrides); ``resume`` runs what ``load_state_dict`` and the
first iteration check (files, settings, the position of every worker stream) for one rank.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..api.dataset import StructuredDataset
from ..base.errors import DataLoaderUtilsError, InvalidStateError
from ..checkpoint.schema import check_shape
from ..mixing.state import check_shape as check_mixture_shape
from ..mixing.state import stored_timeline
from ..planning.epochs import Epochs, Progress
from ..planning.tokens import TokenPacking
from .files import BadInput, Found, find_states, read_checkpoint

__all__ = [
    "SETTINGS",
    "epochs_for",
    "epochs_of",
    "is_mixture",
    "load_states",
    "packing_of",
    "paths",
    "resume",
]

# The settings a state records: its key, and the command-line option that overrides it.
SETTINGS = {
    "_format": "format",
    "_split_bytes": "split_bytes",
    "_shuffle": "shuffle",
    "_shuffle_seed": "seed",
    "_shuffle_memory_bytes": "shuffle_memory_bytes",
    "_even_batches": "even_batches",
    "_world_size": "world_size",
    "_num_workers": "num_workers",
}


def load_states(args: argparse.Namespace) -> Found:
    """The states in ``args.checkpoint`` (at ``args.key``), each checked for this schema: all
    one dataset's, or (the first is a mixture's) all a mixture's."""
    found = find_states(read_checkpoint(args.checkpoint, args.storage_options), args.key)
    first = found.states[0]
    mixture = is_mixture(first)
    check = _check_mixture if mixture else check_shape
    for number, state in enumerate(found.states):
        try:
            check(state)
        except DataLoaderUtilsError as exc:
            where = f"state {number} of {len(found.states)}" if len(found.states) > 1 else "state"
            under = f" under key {found.key!r}" if found.key else ""
            raise BadInput(f"{args.checkpoint}: {where}{under}: {exc}") from None
    if mixture and any(list(s["sources"]) != list(first["sources"]) for s in found.states):
        raise BadInput(
            f"{args.checkpoint}: the states are of different mixtures (sources "
            f"{sorted({tuple(s['sources']) for s in found.states})}): give one job's states"
        )
    return found


def is_mixture(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` was saved by a mixture of sources."""
    return "_mixture" in state


def _check_mixture(state: Mapping[str, Any]) -> None:
    """A mixture's state: its own keys, its mixture, and each source's state."""
    check_mixture_shape(state)
    stored_timeline(state)
    for name, sub in state["sources"].items():
        try:
            check_shape(sub)
            epochs = sub.get("epochs")
            if not (
                isinstance(epochs, list)
                and len(epochs) == len(sub["streams"])
                and all(type(e) is int and e >= 0 for e in epochs)
            ):
                raise InvalidStateError(
                    f"state key 'epochs' must be a source epoch >= 0 per worker stream, got "
                    f"{epochs!r:.80}"
                )
        except DataLoaderUtilsError as exc:
            raise InvalidStateError(f"state of source {name!r}: {exc}") from None


def setting(args: argparse.Namespace, state: Mapping[str, Any], key: str) -> Any:
    """The override of state key ``key`` given on the command line, else the state's value."""
    value = getattr(args, SETTINGS[key], None)
    return state[key] if value is None else value


def epochs_for(state: Mapping[str, Any], args: argparse.Namespace, path: Sequence[str]) -> Epochs:
    """The dataset over ``path`` with the checkpoint's settings (and any overrides), as rank 0."""
    dataset = StructuredDataset(
        paths(path),
        setting(args, state, "_format"),
        split_bytes=setting(args, state, "_split_bytes"),
        shuffle=setting(args, state, "_shuffle"),
        shuffle_seed=setting(args, state, "_shuffle_seed"),
        shuffle_memory_bytes=setting(args, state, "_shuffle_memory_bytes"),
        rank=0,
        world_size=setting(args, state, "_world_size"),
        even_batches=setting(args, state, "_even_batches"),
        storage_options=args.storage_options,
        packing=packing_of(state),
    )
    return epochs_of(dataset)


def packing_of(state: Mapping[str, Any]) -> TokenPacking | None:
    """The token packing ``state`` records (``_packing``: its column and separator; with
    ``_whole_documents``, the choices that decide a window's sequences; its ``_companions``).

    Those decide which tokens a row makes (and what a batch carries beside them), so they are
    all a check of positions needs; ``pad_id`` (and ``seq_len`` when documents are cut) only
    shape batches, so any value serves.
    """
    recorded = state["_packing"]
    if recorded is None:
        return None
    whole = state.get("_whole_documents")
    try:
        column, separator = recorded
        companions = state.get("_companions") or {}
        if whole is not None:
            return TokenPacking(
                column, separator=separator, companions=companions, whole_documents=True, **whole
            )
        return TokenPacking(column, seq_len=1, separator=separator, companions=companions)
    except (TypeError, ValueError) as exc:
        raise BadInput(
            f"state key '_packing' is {recorded!r}, not [column, separator]: {exc}"
        ) from None


def epochs_of(dataset: StructuredDataset) -> Epochs:
    """The dataset's pure epoch logic (plans, positions, states): the one private used here."""
    epochs = dataset._epochs
    if not isinstance(epochs, Epochs):
        raise BadInput("the CLI does not read mixtures yet: give one dataset's files")
    return epochs


def paths(given: Sequence[str]) -> str | list[str]:
    return given[0] if len(given) == 1 else list(given)


def resume(epochs: Epochs, state: Mapping[str, Any], workers: int | None) -> Progress:
    """Progress of ``state`` on its rank: the checks of ``load_state_dict`` and of iteration."""
    mine = replace(epochs, rank=state["_rank"])
    start = mine.load(state, workers)
    return mine.begin(start, state["_num_workers"] if workers is None else workers)
