"""The states of one job together: every rank's, each once, of one epoch and one deal, merged into
one (an elastic resume re-deals the rest of the epoch from them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..base.errors import CheckpointMismatchError, DataLoaderUtilsError, InvalidStateError
from ..index.index import DatasetIndex
from .files import stored_split
from .schema import Decoded, Settings, StreamEntry, check_shape
from .state import decode

__all__ = ["check_coverage", "check_each", "check_same_epoch", "merge_states", "one_job"]


def check_coverage(states: Sequence[Mapping[str, Any]]) -> None:
    """One state per rank of the old job, each exactly once, all of one world size."""
    ranks = sorted(s["_rank"] for s in states)
    world_size = states[0]["_world_size"]
    if ranks == list(range(len(states))) and {s["_world_size"] for s in states} == {len(states)}:
        return
    present = set(ranks)  # a corrupted world_size may be huge: name the first missing ranks
    missing = list(itertools.islice((r for r in range(world_size) if r not in present), 8))
    duplicated = sorted({r for r in ranks if ranks.count(r) > 1})
    raise CheckpointMismatchError(
        f"the states do not cover the old job's ranks exactly once: ranks {ranks} for "
        f"world_size={world_size} (missing {missing}, duplicated {duplicated})."
        f"\nLikely cause: states list incomplete: checkpoint=world_size {world_size}, "
        f"current={len(states)} states",
        split=stored_split(states[0]), field="rank", expected=range(world_size),
        found=ranks,
    )  # fmt: skip


def check_same_epoch(states: Sequence[Mapping[str, Any]]) -> None:
    """Every rank's state from the same epoch (saved at the same step)."""
    epochs = sorted({s["epoch"] for s in states})
    if len(epochs) > 1:
        raise CheckpointMismatchError(
            f"the states come from different epochs {epochs}; save every rank at the same step."
            f"\nLikely cause: epoch differs between ranks: checkpoint={epochs[0]}, "
            f"current={epochs[-1]}",
            split=stored_split(states[0]), field="epoch", expected=epochs[0], found=epochs[-1],
        )  # fmt: skip


def check_each(states: Sequence[object], check: Callable[[Mapping[str, Any]], None]) -> None:
    """Each state well-formed (``check``): any error of it is refused, naming the state."""
    for number, state in enumerate(states):
        try:
            check(state)  # type: ignore[arg-type]
        except Exception as exc:
            raise _named(exc, f"states[{number}]") from exc


def _named(error: Exception, where: str) -> Exception:
    """``error`` about ``where``: a library error of the same kind with ``where`` in front of
    its message; any other error, as a malformed state."""
    if isinstance(error, CheckpointMismatchError):
        return CheckpointMismatchError(
            f"{where}: {error}", split=error.split, field=error.field, expected=error.expected,
            found=error.found,
        )  # fmt: skip
    if isinstance(error, DataLoaderUtilsError):
        return type(error)(f"{where}: {error}")
    return InvalidStateError(f"{where} is malformed ({type(error).__name__}: {error})")


def one_job(
    states: Sequence[Mapping[str, Any]],
    check: Callable[[Mapping[str, Any]], None],
    shared: Sequence[str],
    part: Callable[[Mapping[str, Any], str], Any] = lambda state, key: state[key],
) -> list[Mapping[str, Any]]:
    """The states of an old job, by rank: each well-formed (``check``), one per rank, of one
    epoch, and equal in their ``shared`` keys (``part(state, key)`` of them)."""
    if not states:
        raise InvalidStateError("no states given: pass one state per rank of the old job")
    check_each(states, check)
    check_coverage(states)
    check_same_epoch(states)
    ordered = sorted(states, key=lambda state: state["_rank"])
    first = ordered[0]
    for state in ordered[1:]:
        for key in shared:
            mine, theirs = part(first, key), part(state, key)
            if mine != theirs:
                raise CheckpointMismatchError(
                    f"the states of ranks {first['_rank']} and {state['_rank']} differ in "
                    f"{key.lstrip('_')}: they are not of one job and step."
                    f"\nLikely cause: states from different jobs: checkpoint={mine!r:.80}, "
                    f"current={theirs!r:.80}",
                    split=stored_split(state), field=key.lstrip("_"), expected=mine,
                    found=theirs,
                )  # fmt: skip
    return ordered


def merge_states(
    states: Sequence[Mapping[str, Any]], *, index: DatasetIndex, settings: Settings
) -> tuple[Mapping[str, Any], Decoded]:
    """The old job's states as one: its first state (epoch and settings) and every stream of
    every rank, in stream order; one state per old rank, same epoch, same deals before."""
    ordered = one_job(states, check_shape, ("_num_workers", "_even_batches", "generations"))
    first = ordered[0]
    streams: list[StreamEntry | None] = []
    for state in ordered:
        decoded = decode(state, index=index, settings=settings, elastic=True)
        if len(decoded.streams) != max(1, state["_num_workers"]):
            raise InvalidStateError(
                f"state key 'streams' of rank {state['_rank']} holds {len(decoded.streams)} "
                f"entries for num_workers={state['_num_workers']}: the state is corrupted"
            )
        streams.extend(decoded.streams)
    generations = decode(first, index=index, settings=settings, elastic=True).generations
    return first, Decoded(generations, tuple(streams))
