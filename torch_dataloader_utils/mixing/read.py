"""The first step of a mixture's resume: its states read and validated against this job.

A state read here is well-formed (``mixing.state``), written by a job of this job's settings
(or, elastic, one job's states, one per old rank, of this mixture), its positions within their
epochs, and each source's state agrees with the source's files and settings
(``checkpoint.state.decode``). Where each stream stands in each source: ``mixing.locate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..base.errors import CheckpointMismatchError, InvalidStateError
from ..checkpoint.checks import check_setting
from ..checkpoint.merge import one_job
from ..checkpoint.schema import StreamEntry
from ..checkpoint.state import decode
from .epochs import MixedEpochs, MixedProgress
from .places import SourceRest
from .state import check_shape, expanded, in_source, stored_rests, stored_timeline

__all__ = ["ReadState", "SourceStreams", "read_job", "read_state"]


@dataclass(frozen=True)
class SourceStreams:
    """One source's part of a read state: per worker stream with a position, its place by
    content; per worker stream, the source epoch it is in (``fresh``: the state's, for errors)."""

    entries: dict[int, StreamEntry]
    epochs: tuple[int, ...]
    fresh: object


@dataclass(frozen=True)
class ReadState:
    """One rank's mixture state, read and validated: ``then``, its epoch and the positions of
    its streams under its timeline and rests; ``sources``, the part of each source ``mix`` (the
    mixture its sources are read against) holds."""

    state: Mapping[str, Any]  # expanded: each source's state whole
    where: str  # "mixture [sources]", as errors name it
    mix: MixedEpochs
    then: MixedProgress
    rests: tuple[SourceRest, ...]  # per source of ``mix``, as the state records them
    sources: dict[str, SourceStreams]


def read_state(mix: MixedEpochs, state: Mapping[str, Any], num_workers: int | None) -> ReadState:
    """``state`` read and validated for ``mix`` on this rank (``num_workers``: the loader's,
    ``None``: the state's)."""
    state = expanded(state)
    check_shape(state)
    workers = state["_num_workers"] if num_workers is None else num_workers
    where = f"mixture {list(state['sources'])}"
    for name, (expected, found) in {
        "world_size": (state["_world_size"], mix.world_size),
        "rank": (state["_rank"], mix.rank),
        "even_batches": (state["_even_batches"], mix.even_batches),
        "num_workers": (state["_num_workers"], workers),
    }.items():
        check_setting(name, expected, found, where)
    stored = stored_timeline(state)
    rests = stored_rests(state, mix.names)
    then = MixedProgress(mix.following(stored, rests), state["epoch"], workers)
    then.positions = {w: p for w, p in enumerate(state["streams"]) if p is not None}
    if len(state["streams"]) != max(1, workers):
        raise InvalidStateError(
            f"state key 'streams' holds {len(state['streams'])} positions for "
            f"{max(1, workers)} worker stream(s): the state is corrupted"
        )
    return _read_sources(mix, state, where, then, rests)


def read_job(
    mix: MixedEpochs, states: Sequence[Mapping[str, Any]]
) -> tuple[MixedEpochs, list[ReadState]]:
    """The old job's states, one per old rank, read and validated for an elastic resume of
    ``mix``; and the mixture the old job read (its world, its streams, its rests)."""
    ordered = one_job(
        [expanded(s) for s in states],
        check_shape,
        ("_num_workers", "_even_batches", "_mixture"),
        _job_part,
    )
    first = ordered[0]
    where = f"mixture {list(first['sources'])}"
    stored = stored_timeline(first)
    if stored.described != mix.timeline.described or stored.policies:
        raise CheckpointMismatchError(
            f"an elastic resume continues the same mixture: the checkpoint's is "
            f"{stored.described}, the current one {mix.timeline.described} (max_epochs is "
            f"not supported elastically yet). Resume elastically under the checkpoint's "
            f"mixture, save the state, and load it with reweight=True."
            f"\nLikely cause: weights or sources changed: checkpoint={stored.weights}, "
            f"current={mix.weights}",
            split=where, field="weights", expected=stored.weights, found=mix.weights,
        )  # fmt: skip
    old_workers = first["_num_workers"]
    old_world, streams = first["_world_size"], max(1, old_workers)
    rests = stored_rests(first, mix.names)
    sources = tuple(replace(epochs, world_size=old_world) for epochs in mix.sources)
    old = replace(
        mix, world_size=old_world, even_batches=first["_even_batches"], sources=sources,
        rests=rests, _orders={}, _shares={}, _settings_states={},
    )  # fmt: skip
    read = []
    for state in ordered:
        rank = state["_rank"]
        ranked = replace(
            old, rank=rank, sources=tuple(replace(e, rank=rank) for e in old.sources)
        ).following(stored_timeline(state), rests)
        then = MixedProgress(ranked, state["epoch"], old_workers)
        if None in state["streams"] or len(state["streams"]) != streams:
            raise InvalidStateError(
                f"state key 'streams' of rank {state['_rank']} must hold every worker's "
                f"position ({streams}): an elastic resume needs them all"
            )
        then.positions = dict(enumerate(state["streams"]))
        read.append(_read_sources(ranked, state, where, then, rests))
    return old, read


def _job_part(state: Mapping[str, Any], key: str) -> Any:
    """What the states of one job share: ``key``, of the mixture all but each rank's segment."""
    if key != "_mixture":
        return state[key]
    return {k: v for k, v in state["_mixture"].items() if k != "segment"}


def _read_sources(
    mix: MixedEpochs,
    state: Mapping[str, Any],
    where: str,
    then: MixedProgress,
    rests: tuple[SourceRest, ...],
) -> ReadState:
    """The state with its positions checked against their epochs and the part of each
    source of ``mix`` against the source's files and settings."""
    _check_positions(then)
    sources = {
        name: _source_streams(mix, name, sub, then)
        for name, sub in state["sources"].items()
        if name in mix.names
    }
    return ReadState(state, where, mix, then, rests, sources)


def _source_streams(mix: MixedEpochs, name: str, sub: Any, then: MixedProgress) -> SourceStreams:
    """Source ``name``'s state checked against its files and settings, one entry per worker
    stream, each stream with a position holding a place."""
    epochs = mix.sources[mix.names.index(name)]
    workers = then.num_workers
    streams = max(1, workers)
    try:
        decoded = decode(sub, index=epochs.index, settings=epochs.settings(workers))
    except (CheckpointMismatchError, InvalidStateError) as exc:
        raise in_source(exc, name) from exc
    entries = decoded.streams
    source_epochs = sub.get("epochs")
    if len(entries) != streams or not (
        isinstance(source_epochs, list)
        and len(source_epochs) == streams
        and all(type(e) is int and e >= 0 for e in source_epochs)
    ):
        raise InvalidStateError(
            f"state keys 'sources.{name}.streams' and '.epochs' must hold one entry per worker "
            f"stream ({streams}): the state is corrupted"
        )
    placed = {}
    for worker in then.positions:
        entry = entries[worker]
        if entry is None:
            raise InvalidStateError(
                f"state key 'sources.{name}.streams[{worker}]' is null, but 'streams[{worker}]' "
                f"holds a position: the state is corrupted"
            )
        placed[worker] = entry
    return SourceStreams(placed, tuple(source_epochs), sub.get("fresh"))


def _check_positions(then: MixedProgress) -> None:
    """Each stream's stored position within its epoch, whose length (after an elastic resume,
    the segment's) is at most an epoch's share, or what was read when the mixture changed."""
    segment = then.mix.timeline.segment
    changed = segment.positions
    for worker, length in enumerate(segment.lengths):
        # a rest dealt anew is at most an epoch's share; a changed epoch, what was read then
        read = changed[worker] if changed else 0
        if length > max(then.length(worker), read) + 1:
            raise InvalidStateError(
                f"state key '_mixture.segment' gives worker {worker} {length} positions in "
                f"epoch {segment.epoch}, more than an epoch's {then.length(worker)} and the "
                f"{read} read when the mixture changed: the state is corrupted"
            )
    for worker, position in then.positions.items():
        if position > then.total(worker):
            raise InvalidStateError(
                f"state key 'streams[{worker}]' is {position}, past the {then.total(worker)} "
                f"positions of that stream's epoch: the state is corrupted"
            )
