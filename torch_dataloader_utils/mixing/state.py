"""A mixture's checkpoint state: how it is written, and how each part of it is validated.

A mixture's state is plain JSON-safe builtins::

    version, epoch                      int      the mixture epoch
    _num_workers, _rank, _world_size    int
    _even_batches                       bool
    _mixture     {"weights": {name: int}, "epoch_size": int,
                  "policies": {name: [max_epochs, "stop" | "renormalize"]} (limited sources),
                  "schedule_block": int (0: the period in order), "schedule_seed": int,
                  "shuffle_memory_bytes": int (the stream's budget its sources share; a
                  state without it: each source had the whole budget),
                  "segment": [epoch, [position per worker], {name: [rows read per worker]},
                              [positions of that epoch per worker]: an elastic resume's
                              rest, or the epoch in progress when the mixture changed
                              ([]: an epoch's, or the position if later)]}
    streams      positions handed out in the epoch, one per worker stream of this rank
    cursor                              int      the worker whose batch comes next
    sources      {name: the state of that source as a dataset of its own (files, settings,
                  and per worker stream its place in its share of the source's epoch, by
                  content), whose "epoch" is the source epoch of the first stream, and
                  "epochs": the source epoch of each worker stream, "rests" and "fresh":
                  the source's epochs an elastic resume left (``SourceRest``: increasing,
                  "fresh" the one after the last, 0 without any); the source's
                  files make at most max(1, 256 // number of sources) groups. Written
                  without what the rest of the state says (``mixing.compact``): no
                  "_shuffle_seed" when the mixture's seed gives it, "files.root" below
                  source_settings' "root"; a source of one file's "files" as
                  {"file": [name, fingerprint], "root"} and its places as [position,
                  tokens, rows, row_offset, row_length, row]; no "num_splits" when one per
                  file; no "epochs" when all are "epoch", no "rests" and "fresh" when [] and 0}
    source_settings  {key: value} of ``SHARED_KEYS`` that every source's state holds alike,
                  written here once and left out of each, and "root": the start of every
                  source's "files.root" (optional: a state without source_settings holds
                  every source's state whole)

Unpacked, each stream's place in a source follows from its position (``mixing.epochs``);
packed, it is the stored place (how far a source got depends on its tokens). The places by
content make a changed file of any source fail to match, and the error names the source. A
state read and validated against the job: ``mixing.read``; its places checked: ``mixing.locate``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ..base.errors import CheckpointMismatchError, InvalidStateError
from ..checkpoint.schema import (
    STATE_VERSION,
    check_cursor,
    check_version,
    decode_generation,
    encode_generation,
)
from .compact import ROOT, SHARED_KEYS, source_seed, whole_source, written_streams
from .epochs import MixedEpochs, MixedProgress
from .places import SourceRest
from .schedule import Schedule
from .source import MAX_EPOCH_SIZE
from .timeline import Segment, Timeline

# Positions of a stream over all its epochs: room left within int64.
MAX_POSITION = 2**62

__all__ = [
    "MAX_POSITION",
    "check_shape",
    "encode_mixture",
    "expanded",
    "in_source",
    "stored_rests",
    "stored_timeline",
]


def encode_mixture(mix: MixedEpochs, progress: MixedProgress) -> dict[str, Any]:
    """The state dict of ``progress``."""
    streams = max(1, progress.num_workers)
    entries = [progress.entries(w) if w in progress.positions else None for w in range(streams)]
    known = next((e for e in entries if e is not None), None)
    shared, own = mix.source_states(progress.num_workers)
    sources = {}
    for s, name in enumerate(mix.names):  # what ``whole_source`` puts back left out
        sub = dict(own[s])
        epoch = 0 if known is None else known[s][0]
        epochs = [0 if e is None else e[s][0] for e in entries]
        sub["epoch"] = epoch
        if epochs.count(epoch) != streams:
            sub["epochs"] = epochs
        sub["streams"] = written_streams(own[s], [None if e is None else e[s][1] for e in entries])
        rest = mix.rest(s)
        if rest.epochs or rest.fresh:  # both, or neither: one left out alone is refused
            sub["rests"] = [[e, [encode_generation(g) for g in deals]] for e, deals in rest.epochs]
            sub["fresh"] = rest.fresh
        sources[name] = sub
    segment = mix.timeline.segment
    return {
        "version": STATE_VERSION,
        "epoch": progress.epoch,
        "_mixture": {
            "weights": mix.weights,
            "epoch_size": mix.timeline.epoch_size,
            "policies": mix.timeline.policies,
            "schedule_block": mix.timeline.schedule.block,
            "schedule_seed": mix.timeline.schedule.seed,
            "shuffle_memory_bytes": mix.config.shuffle_memory_bytes,
            "segment": [
                segment.epoch,
                list(segment.positions),
                {name: list(counts) for name, counts in segment.counts.items()},
                list(segment.lengths),
            ],
        },
        "_num_workers": progress.num_workers,
        "_rank": mix.rank,
        "_world_size": mix.world_size,
        "_even_batches": mix.even_batches,
        "streams": [
            None if p is None else int(p) for p in map(progress.positions.get, range(streams))
        ],
        "cursor": progress.cursor,
        "sources": sources,
        "source_settings": shared,
    }


def expanded(state: object) -> Any:
    """``state`` with each source's state whole (``mixing.compact``): with ``source_settings``
    (what every source's state holds alike, written once; then left out) and what the rest of
    the state says (a state written without it is whole already; anything but a dict is left
    for the checks of its shape)."""
    if not isinstance(state, Mapping):
        return state
    shared, subs = state.get("source_settings"), state.get("sources")
    if shared is None:
        if isinstance(subs, dict):
            for name, sub in subs.items():
                missing = [k for k in SHARED_KEYS if isinstance(sub, Mapping) and k not in sub]
                if missing:
                    raise InvalidStateError(
                        f"state key 'source_settings' is missing, and source {name!r} has no "
                        f"key {missing[0]!r}: was the state saved by this library?"
                    )
        return state
    if not (
        isinstance(shared, dict)
        and all(k in SHARED_KEYS or k == ROOT for k in shared)
        and isinstance(shared.get(ROOT, ""), str)
        and isinstance(subs, dict)
        and all(isinstance(sub, dict) for sub in subs.values())
    ):
        raise InvalidStateError(
            f"state key 'source_settings' must be a dict of some of the keys {SHARED_KEYS} "
            f"and {ROOT!r} (a text), and 'sources' a dict of dicts, got {shared!r:.120} and "
            f"{type(subs).__name__}"
        )
    mixture = state.get("_mixture")
    seed = mixture.get("schedule_seed", 0) if isinstance(mixture, Mapping) else None
    return {
        **{k: v for k, v in state.items() if k != "source_settings"},  # whole, as before it
        "sources": {
            name: whole_source(
                name, sub, shared, source_seed(seed, name) if type(seed) is int else None
            )
            for name, sub in subs.items()
        },
    }


def in_source(exc: CheckpointMismatchError | InvalidStateError, name: str) -> Exception:
    """``exc`` naming the mixture's source it is about."""
    if isinstance(exc, InvalidStateError):
        return InvalidStateError(f"state of source {name!r}: {exc}")
    return CheckpointMismatchError(
        f"source {name!r}: {exc}", split=exc.split, field=exc.field, expected=exc.expected,
        found=exc.found,
    )  # fmt: skip


def stored_timeline(state: Mapping[str, Any]) -> Timeline:
    mixture = state["_mixture"]
    weights, rows, segment = (mixture.get(k) for k in ("weights", "epoch_size", "segment"))
    if not (
        isinstance(weights, dict)
        and weights
        and all(isinstance(n, str) and type(w) is int and w >= 1 for n, w in weights.items())
        and list(weights) == list(state["sources"])
    ):
        raise InvalidStateError(
            f"state key '_mixture.weights' must map each source of 'sources' to an int >= 1, "
            f"got {weights!r:.200}"
        )
    if type(rows) is not int or not 1 <= rows <= MAX_EPOCH_SIZE:
        raise InvalidStateError(
            f"state key '_mixture.epoch_size' must be an int from 1 to {MAX_EPOCH_SIZE}, got "
            f"{rows!r:.80}"
        )
    streams = len(state["streams"])  # a segment's lists hold one entry per worker stream, or none
    if not (
        isinstance(segment, list)
        and len(segment) == 4
        and isinstance(segment[3], list)
        and all(type(n) is int and n >= 0 for n in segment[3])
        and len(segment[3]) in (0, streams)
        and type(segment[0]) is int
        and 0 <= segment[0] <= state["epoch"]
        and isinstance(segment[1], list)
        and len(segment[1]) in (0, streams)
        and all(type(p) is int and p >= 0 for p in segment[1])
        and isinstance(segment[2], dict)
        and all(
            isinstance(c, list)
            and len(c) == len(segment[1])
            and all(type(v) is int and v >= 0 for v in c)
            for c in segment[2].values()
        )
    ):
        raise InvalidStateError(
            f"state key '_mixture.segment' must be [epoch (at most the state's epoch "
            f"{state['epoch']}), [position per worker], {{source: [rows per worker]}}, "
            f"[positions of that epoch per worker]], each list empty or of one entry per "
            f"worker stream ({streams}), got {segment!r:.200}"
        )
    _check_dealt(segment[1], segment[3])
    if (state["epoch"] + 1) * rows > MAX_POSITION:
        raise InvalidStateError(
            f"state key 'epoch' is {state['epoch']}: epochs of {rows} positions put it past "
            f"position 2**62 of the mixture, beyond any job: the state is corrupted"
        )
    block, seed = mixture.get("schedule_block", 0), mixture.get("schedule_seed", 0)
    if type(block) is not int or block < 0 or type(seed) is not int:
        raise InvalidStateError(
            f"state keys '_mixture.schedule_block' and '.schedule_seed' must be ints (the "
            f"block >= 0), got {block!r:.40} and {seed!r:.40}"
        )
    try:
        schedule = Schedule(tuple(weights.values()), block=block, seed=seed)
    except ValueError as exc:
        raise InvalidStateError(f"state key '_mixture.weights': {exc}") from exc
    policies = mixture.get("policies", {})
    if not (
        isinstance(policies, dict)
        and all(
            n in weights
            and isinstance(p, list)
            and len(p) == 2
            and type(p[0]) is int
            and p[0] >= 1
            and p[1] in ("stop", "renormalize")
            for n, p in policies.items()
        )
    ):
        raise InvalidStateError(
            f"state key '_mixture.policies' must map sources to [max_epochs >= 1, 'stop' | "
            f"'renormalize'], got {policies!r:.200}"
        )
    return Timeline(
        tuple(weights),
        schedule,
        rows,
        Segment(
            segment[0],
            tuple(segment[1]),
            {n: tuple(c) for n, c in segment[2].items()},
            tuple(segment[3]),
        ),
        max_epochs=tuple(policies[n][0] if n in policies else None for n in weights),
        stops=tuple(n in policies and policies[n][1] == "stop" for n in weights),
    )


def _check_dealt(begun: list[int], lengths: list[int]) -> None:
    """An elastic resume's positions of the segment's epoch per stream (no ``begun``: a
    reweight's go from where each stream stood, ``mixing.read``) are one deal of the positions
    left, maybe cut to whole batches: the larger first, differing by at most one, or by one
    batch and every one a multiple of it. (How many were left, the old job's, is not kept.)"""
    spread = max(lengths, default=0) - min(lengths, default=0)
    uneven = spread > 1 and any(n % spread for n in lengths)
    if not begun and (lengths != sorted(lengths, reverse=True) or uneven):
        raise InvalidStateError(
            f"state key '_mixture.segment' gives the streams {lengths!r:.120} positions of the "
            f"epoch an elastic resume dealt, but a deal gives the larger shares first, differing "
            f"by at most one, or by one batch with every share a multiple of it: the state is "
            f"corrupted"
        )


def stored_rests(state: Mapping[str, Any], names: Sequence[str]) -> tuple[SourceRest, ...]:
    """Each source's (of ``names``) epochs left by elastic resumes, as the state records them."""
    return tuple(_source_rest(state["sources"].get(name), name) for name in names)


def _source_rest(sub: object, name: str) -> SourceRest:
    if not isinstance(sub, Mapping):
        return SourceRest()  # an added source
    rests, fresh = sub.get("rests"), sub.get("fresh")
    if not (
        isinstance(rests, list)
        and type(fresh) is int
        and fresh >= 0
        and all(
            isinstance(r, list) and len(r) == 2 and type(r[0]) is int and isinstance(r[1], list)
            for r in rests
        )
    ):
        raise InvalidStateError(
            f"state keys 'sources.{name}.rests' and '.fresh' must be [[epoch, [generation, "
            f"...]], ...] and an int >= 0, got {rests!r:.120} and {fresh!r:.40}"
        )
    epochs = [r[0] for r in rests]
    if not (
        all(e >= 0 and deals for e, deals in rests)
        and all(a < b for a, b in itertools.pairwise(epochs))
        and fresh == (epochs[-1] + 1 if epochs else 0)
    ):
        raise InvalidStateError(
            f"state keys 'sources.{name}.rests' and '.fresh' must be the source's unfinished "
            f"epochs in increasing order, each with its deals, and the epoch after the last (0 "
            f"without any), got epochs {epochs!r:.80} and fresh {fresh}: the state is corrupted"
        )
    return SourceRest(
        tuple(
            (e, tuple(decode_generation(g, i) for i, g in enumerate(deals))) for e, deals in rests
        ),
        fresh,
    )


_KEYS: dict[str, type] = {
    "version": int, "epoch": int, "_mixture": dict, "_num_workers": int, "_rank": int,
    "_world_size": int, "_even_batches": bool, "streams": list, "cursor": int, "sources": dict,
}  # fmt: skip


def check_shape(state: object) -> None:
    if not isinstance(state, Mapping):
        raise InvalidStateError(f"a state must be a dict, got {type(state).__name__}")
    if "_mixture" not in state:
        raise InvalidStateError(
            "this dataset is a mixture, but the state has no key '_mixture': it was saved by "
            "a dataset of one source"
        )
    for key, kind in _KEYS.items():
        if key not in state:
            raise InvalidStateError(f"state has no key {key!r}; was it saved by this library?")
        value = state[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidStateError(
                f"state key {key!r} must be {kind.__name__}, got {type(value).__name__}"
            )
        if isinstance(value, int) and value < 0:
            raise InvalidStateError(f"state key {key!r} must be >= 0, got {value}")
    check_version(state["version"], unshuffled=False)
    for number, position in enumerate(state["streams"]):
        if position is not None and (type(position) is not int or position < 0):
            raise InvalidStateError(
                f"state key 'streams[{number}]' must be a position >= 0 or null, got "
                f"{position!r:.80}"
            )
    check_cursor(state)
