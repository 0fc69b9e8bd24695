"""The only module that calls ``torch.distributed`` collectives: global state and the index.

``gather_states`` collects every rank's ``state_dict()`` on one rank (``dist.gather_object``).
``scatter_states`` hands the saved list back: without ``elastic`` each rank receives only its
own entry (``dist.scatter_object_list``); with ``elastic`` every rank needs every old state, so
the whole list is broadcast (``dist.broadcast_object_list``). With ``src_rank=None`` every rank
already holds the list and nothing is communicated.

The list is validated where it is known (on ``src_rank``), every state's shape included, before
anything is sent; a failure (any exception: one that is not the library's becomes an
``InvalidStateError``) is sent to every rank instead of the states, so all ranks raise the same
error together instead of some of them waiting forever in a collective the others have left.
``agree`` then runs each rank's load and, when it fails on any rank, raises the first failing
rank's error on every rank.

``from_rank_zero`` builds a value (the dataset index) on rank 0 only and broadcasts it, so a
job reads every footer once, not once per rank (``on_every_rank`` first asks whether every
rank's index cache already holds it all). It runs when the dataset is built, and only
when ``spans_process_group``: the dataset's ranks are exactly the default group's processes,
so each of them builds the dataset (a dataset given another ``rank``/``world_size``, e.g. an
evaluation set on one rank, never communicates). A failure on rank 0 is raised on every rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from ..base.errors import CheckpointMismatchError, DataLoaderUtilsError, InvalidStateError
from .checks import check_setting
from .files import stored_split
from .merge import check_coverage, check_each, check_same_epoch
from .schema import check_shape

__all__ = [
    "agree",
    "from_rank_zero",
    "gather_states",
    "gather_stats",
    "on_every_rank",
    "scatter_states",
    "spans_process_group",
]

T = TypeVar("T")


def gather_states(state: dict[str, Any], dst_rank: int) -> list[dict[str, Any]] | None:
    """Every rank's ``state`` as a list on ``dst_rank``; ``None`` on the others."""
    world_size = _require_process_group("save_state_global")
    _check_rank_arg("dst_rank", dst_rank, world_size)
    if state["_world_size"] != world_size:
        raise ValueError(
            f"save_state_global gathers over the default process group of {world_size} ranks, "
            f"but this dataset was built for world_size={state['_world_size']}. Gather over "
            f"your data-parallel group yourself (dist.all_gather_object(..., group=...)) and "
            f"save that list instead."
        )
    mine = dist.get_rank()
    gathered: list[Any] | None = [None] * world_size if mine == dst_rank else None
    dist.gather_object(state, gathered, dst=dst_rank)
    if gathered is None:
        return None
    ranks = [s["_rank"] for s in gathered]
    if ranks != list(range(world_size)):
        raise ValueError(
            f"save_state_global gathered the states of dataset ranks {ranks} from process ranks "
            f"0..{world_size - 1}: the dataset's rank must be the process's rank (leave rank "
            f"and world_size to detection), or gather the states yourself in dataset-rank order"
        )
    return [dict(s) for s in gathered]


def gather_stats(stats: dict[str, Any], dst_rank: int) -> list[dict[str, Any]] | None:
    """Every rank's ``loader.stats()`` (as a dict) on ``dst_rank``, by process rank; ``None``
    on the others. One ``gather_object``."""
    world_size = _require_process_group("gather_stats")
    _check_rank_arg("dst_rank", dst_rank, world_size)
    gathered: list[Any] | None = [None] * world_size if dist.get_rank() == dst_rank else None
    dist.gather_object(stats, gathered, dst=dst_rank)
    return gathered


def scatter_states(
    states: Sequence[Mapping[str, Any]] | None,
    src_rank: int | None,
    rank: int,
    world_size: int,
    *,
    elastic: bool,
    check: Callable[[Mapping[str, Any]], None] = check_shape,
) -> Mapping[str, Any] | Sequence[Mapping[str, Any]]:
    """What this rank loads: its own state, or (elastic) the whole list; ``check`` (a
    dataset's state shape, by default one source's) refuses a state before anything is sent."""
    if src_rank is None:  # every rank holds the list: nothing to communicate
        if elastic:
            return _well_formed(states, check)
        return _own_state(_well_formed(states, check), rank, world_size)
    group_size = _require_process_group("restore_state_global")
    _check_rank_arg("src_rank", src_rank, group_size)
    if elastic:
        return _broadcast_list(states, src_rank, check)
    return _scatter_own(states, src_rank, rank, world_size, group_size, check)


def agree(load: Callable[[], None]) -> None:
    """Collective: ``load()`` on every rank; if it raised on any rank, every rank raises the
    error of the first rank it raised on (a rank whose load succeeded too), with a note
    naming that rank."""
    mine: tuple[bytes, object] | None = None
    if isinstance(failure := _outcome(load), _Failure):
        mine = _pickled(failure)  # its bytes, and what they hold
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if mine is None else mine[0])
    for rank, pickled in enumerate(failures):
        if pickled is not None:
            if mine is not None and rank == dist.get_rank():
                held = mine[1]  # this rank's own error, with its traceback
            else:
                held = pickle.loads(pickled)
            assert isinstance(held, _Failure)
            error = held.error
            error.add_note(
                f"(rank {rank} could not load its state; restore_state_global raises this on "
                f"every rank)"
            )
            raise error


def spans_process_group(rank: int, world_size: int) -> bool:
    """Whether ``rank`` of ``world_size`` is this process in an initialised default group of
    more than one process."""
    return (
        world_size > 1
        and dist.is_available()
        and dist.is_initialized()
        and (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
    )


def on_every_rank(flag: bool) -> bool:
    """Collective: whether ``flag`` holds on every rank of the default group."""
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return all(flags)


def from_rank_zero(compute: Callable[[], T]) -> T:
    """Collective: ``compute()`` run on rank 0 only, its value (or its error) on every rank.

    Rank 0 pickles the outcome itself, so one that cannot be pickled fails on every rank (as a
    ``RuntimeError``) instead of leaving the others waiting.
    """
    payload: list[Any] = [None]
    outcome: Any = None
    if dist.get_rank() == 0:
        try:
            outcome = compute()
        except Exception as exc:  # raised again below, on every rank
            outcome = _Failure(exc)
        payload[0], outcome = _pickled(outcome)
    dist.broadcast_object_list(payload, src=0)
    if dist.get_rank() == 0:
        return _unwrap(outcome)  # type: ignore[no-any-return]
    return _unwrap(pickle.loads(payload[0]))  # type: ignore[no-any-return]


def _pickled(outcome: object) -> tuple[bytes, object]:
    """``outcome`` pickled, or a failure saying why it cannot be (and that failure)."""
    try:
        return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL), outcome
    except Exception as exc:
        what = type(getattr(outcome, "error", outcome)).__name__
        failure = _Failure(
            RuntimeError(f"rank {dist.get_rank()} cannot send its {what} to the other ranks: {exc}")
        )
        return pickle.dumps(failure), failure


# ----------------------------------------------------------------- collectives


def _broadcast_list(
    states: Sequence[Mapping[str, Any]] | None,
    src_rank: int,
    check: Callable[[Mapping[str, Any]], None],
) -> Sequence[Mapping[str, Any]]:
    """The whole list on every rank; an unusable list raises on every rank."""
    payload: list[Any] = [None]
    if dist.get_rank() == src_rank:
        payload[0] = _pickled(_outcome(lambda: _well_formed(states, check)))[0]
    dist.broadcast_object_list(payload, src=src_rank)
    return _unwrap(pickle.loads(payload[0]))  # type: ignore[no-any-return]


def _scatter_own(
    states: Sequence[Mapping[str, Any]] | None,
    src_rank: int,
    rank: int,
    world_size: int,
    group_size: int,
    check: Callable[[Mapping[str, Any]], None],
) -> Mapping[str, Any]:
    """Process ``i`` receives ``states[i]``; a bad list raises the same error on every rank
    (each entry is pickled here, so one that cannot be is a refusal too, not a collective that
    fails on this rank alone)."""
    inputs: list[Any] | None = None
    if dist.get_rank() == src_rank:
        checked = _outcome(
            lambda: [
                pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
                for state in _checked_list(_well_formed(states, check), world_size, group_size)
            ]
        )
        inputs = [_pickled(checked)[0]] * group_size if isinstance(checked, _Failure) else checked
    received: list[Any] = [None]
    dist.scatter_object_list(received, inputs, src=src_rank)
    own = _unwrap(pickle.loads(received[0]))
    _check_owner(own, rank)
    return own  # type: ignore[no-any-return]


class _Failure:
    """An error decided on one rank, shipped to every rank to raise there."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _outcome(compute: Callable[[], T]) -> T | _Failure:
    """``compute()``, or its error as a failure: the library's errors and the argument errors
    (``TypeError``, ``ValueError``) as they are, any other as an ``InvalidStateError``."""
    try:
        return compute()
    except (DataLoaderUtilsError, TypeError, ValueError) as exc:
        return _Failure(exc)
    except Exception as exc:
        error = InvalidStateError(f"a malformed state ({type(exc).__name__}: {exc})")
        error.__cause__ = exc
        return _Failure(error)


def _unwrap(value: Any) -> Any:
    if isinstance(value, _Failure):
        raise value.error
    return value


# ----------------------------------------------------------------- validation


def _require_process_group(caller: str) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller} is a collective over torch.distributed, which is not initialised in this "
            f"process: call torch.distributed.init_process_group(...) first (torchrun sets the "
            f"environment for it). In a single process use state_dict()/load_state_dict(), or "
            f"restore_state_global(states, src_rank=None) when you hold the whole list."
        )
    return dist.get_world_size()


def _check_rank_arg(name: str, value: object, world_size: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < world_size:
        raise ValueError(
            f"{name} must be a rank of the process group, in [0, {world_size}), got {value!r}"
        )


def _as_list(states: object) -> list[Mapping[str, Any]]:
    if states is None:
        raise ValueError(
            "restore_state_global got states=None on the rank that must hold them (src_rank); "
            "pass the list returned by save_state_global, loaded from the checkpoint"
        )
    if isinstance(states, Mapping) or not isinstance(states, Sequence):
        raise TypeError(
            f"restore_state_global takes the list of every rank's state (as save_state_global "
            f"returns it), got {type(states).__name__}; for one rank's own state use "
            f"load_state_dict(state)"
        )
    out = list(states)
    if not out:
        raise InvalidStateError("no states given: pass one state per rank of the old job")
    for number, state in enumerate(out):
        if not isinstance(state, Mapping):
            raise InvalidStateError(f"states[{number}] must be a dict, got {type(state).__name__}")
        for key in ("_rank", "_world_size"):
            value = state.get(key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidStateError(
                    f"states[{number}] has no int key {key!r}; was it saved by this library?"
                )
    return out


def _well_formed(
    states: object, check: Callable[[Mapping[str, Any]], None]
) -> list[Mapping[str, Any]]:
    """``states`` as a list, each of its states of the right shape (``check``)."""
    out = _as_list(states)
    check_each(out, check)
    return out


def _checked_list(
    states: list[Mapping[str, Any]], world_size: int, group_size: int
) -> list[Mapping[str, Any]]:
    """Non-elastic: one state per rank, in rank order, of a job with this ``world_size``."""
    check_coverage(states)
    check_same_epoch(states)
    _check_order(states)
    old_world = states[0]["_world_size"]
    check_setting("world_size", old_world, world_size, stored_split(states[0]))
    if group_size != world_size:
        raise ValueError(
            f"restore_state_global scatters over the default process group of {group_size} "
            f"ranks, but the dataset has world_size={world_size}; load states[rank] with "
            f"load_state_dict on each rank instead"
        )
    return states


def _own_state(states: list[Mapping[str, Any]], rank: int, world_size: int) -> Mapping[str, Any]:
    own = _checked_list(states, world_size, world_size)[rank]
    _check_owner(own, rank)
    return own


def _check_order(states: list[Mapping[str, Any]]) -> None:
    """``states[r]`` must be rank ``r``'s, as the gathers return them."""
    for index, state in enumerate(states):
        if state["_rank"] != index:
            split = stored_split(state)
            raise CheckpointMismatchError(
                f"the states are not in rank order: states[{index}] is the state of rank "
                f"{state['_rank']} (stored split {split}). Pass the list as save_state_global "
                f"or dist.all_gather_object returns it."
                f"\nLikely cause: states list reordered: checkpoint=rank {state['_rank']} at "
                f"index {index}, current=rank {index}",
                split=split, field="rank", expected=state["_rank"], found=index,
            )  # fmt: skip


def _check_owner(state: Mapping[str, Any], rank: int) -> None:
    """The entry this rank received must be its own: the list must be in rank order."""
    owner = state["_rank"]
    if owner == rank:
        return
    split = stored_split(state)
    raise CheckpointMismatchError(
        f"the state of rank {owner} was handed to rank {rank}: stored split {split} belongs to "
        f"rank {owner}'s stream. Pass the list in rank order, as save_state_global or "
        f"dist.all_gather_object returns it (states[rank] is rank's own state)."
        f"\nLikely cause: rank changed: checkpoint={owner}, current={rank}",
        split=split, field="rank", expected=owner, found=rank,
    )  # fmt: skip
