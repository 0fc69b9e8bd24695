"""A mixture's checkpoint state: how it is written, validated, and continued under new weights.

A mixture's state is plain JSON-safe builtins::

    version, epoch                      int      the mixture epoch
    _num_workers, _rank, _world_size    int
    _even_batches                       bool
    _mixture     {"weights": {name: int}, "epoch_size": int,
                  "policies": {name: [max_epochs, "stop" | "renormalize"]} (limited sources),
                  "schedule_block": int (0: the period in order), "schedule_seed": int,
                  "segment": [epoch, [position per worker], {name: [rows read per worker]}]}
    streams      positions handed out in the epoch, one per worker stream of this rank
    cursor                              int      the worker whose batch comes next
    sources      {name: the state of that source as a dataset of its own (files, settings,
                  and per worker stream its place in its share of the source's epoch, by
                  content), whose "epoch" is the source epoch of the first stream, and
                  "epochs": the source epoch of each worker stream}

Unpacked, each stream's place in a source follows from its position (``_mix_epochs``);
packed, it is the stored place (how far a source got depends on its tokens). The places by
content make a changed file of any source fail to match, and the error names the source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ._epoch import Start
from ._errors import CheckpointMismatchError, InvalidStateError
from ._log import log
from ._mix_epochs import MixedEpochs, MixedProgress, MixPosition, Segment, SourceRest, Timeline
from ._plan import Deal, Generation, IntArray, Pieces
from ._schedule import Schedule
from ._state import (
    STATE_VERSION,
    StreamEntry,
    check_coverage,
    check_same_epoch,
    check_setting,
    decode,
    decode_generation,
    encode_generation,
    misplaced,
)

__all__ = ["encode_mixture", "load_mixture", "load_mixture_elastic"]


def encode_mixture(mix: MixedEpochs, progress: MixedProgress) -> dict[str, Any]:
    """The state dict of ``progress``."""
    streams = max(1, progress.num_workers)
    entries = [progress.entries(w) if w in progress.positions else None for w in range(streams)]
    sources = {}
    for s, name in enumerate(mix.names):
        known = next((e[s] for e in entries if e is not None), None)
        rest = mix.rest(s)
        sources[name] = {
            **mix.source_state(s, progress.num_workers),
            "epoch": 0 if known is None else known[0],
            "epochs": [0 if e is None else e[s][0] for e in entries],
            "streams": [None if e is None else e[s][1] for e in entries],
            "rests": [[e, [encode_generation(g) for g in deals]] for e, deals in rest.epochs],
            "fresh": rest.fresh,
        }
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
    }


def load_mixture(
    mix: MixedEpochs, state: Mapping[str, Any], num_workers: int | None, *, reweight: bool
) -> tuple[Start, MixedEpochs]:
    """Where ``state`` continues, and the mixture to continue it with: ``mix`` under the
    state's segment, or (``reweight``, weights or sources changed) a segment starting there."""
    _check_shape(state)
    workers = state["_num_workers"] if num_workers is None else num_workers
    where = f"mixture {list(state['sources'])}"
    for name, (expected, found) in {
        "world_size": (state["_world_size"], mix.world_size),
        "rank": (state["_rank"], mix.rank),
        "even_batches": (state["_even_batches"], mix.even_batches),
        "num_workers": (state["_num_workers"], workers),
    }.items():
        check_setting(name, expected, found, where)
    stored = _stored_timeline(state)
    rests = _stored_rests(state, mix)
    then = MixedProgress(mix.following(stored, rests), state["epoch"], workers)
    then.positions = {w: p for w, p in enumerate(state["streams"]) if p is not None}
    rows = {
        name: _checked_rows(mix, then, mix.names.index(name), sub, workers)
        for name, sub in state["sources"].items()
        if name in mix.names
    }
    positions: list[int | None] = list(state["streams"])
    if mix.config.packing is not None:  # each source where its tokens got to
        for worker, position in then.positions.items():
            places = tuple(rows[n][worker] if n in rows else (0, 0) for n in mix.names)
            positions[worker] = MixPosition(position, places)
    start = Start(
        epoch=state["epoch"],
        positions=tuple(positions),
        cursor=state["cursor"],
        checkpoint_workers=state["_num_workers"],
        checkpoint_split=where,
    )
    current = mix.timeline
    if _described(stored) == _described(current):
        return start, mix.following(stored, rests)
    if not reweight:
        raise CheckpointMismatchError(
            f"this checkpoint's mixture is {_described(stored)}, the current one "
            f"{_described(current)}: a position reads other sources under other weights. "
            f"Pass reweight=True to load_state_dict to continue from the checkpoint under the "
            f"current mixture (every source continues where it stood; an added source starts "
            f"its first epoch)."
            f"\nLikely cause: weights or sources changed: checkpoint={stored.weights}, "
            f"current={current.weights}",
            split=where, field="weights", expected=stored.weights, found=current.weights,
        )  # fmt: skip
    return start, mix.following(_reweighted(then, current, workers), rests)


def load_mixture_elastic(
    mix: MixedEpochs, states: Sequence[Mapping[str, Any]], num_workers: int
) -> tuple[Start, MixedEpochs]:
    """Every old rank's state dealt anew to this job: per source, the rows of the epochs the
    old streams had begun and not finished (each epoch's rest dealt as one dataset's elastic
    resume deals it, packed: a document cut where its tokens stopped), then its next epochs
    afresh; the rest of the mixture epoch's positions dealt to the new streams, whose schedule
    starts there."""
    if not states:
        raise InvalidStateError("no states given: pass one state per rank of the old job")
    for state in states:
        _check_shape(state)
    check_coverage(states)
    check_same_epoch(states)
    ordered = sorted(states, key=lambda state: state["_rank"])
    first = ordered[0]
    where = f"mixture {list(first['sources'])}"
    for state in ordered[1:]:
        for key in ("_num_workers", "_even_batches", "_mixture"):
            if (state[key] if key != "_mixture" else _job_part(state)) != (
                first[key] if key != "_mixture" else _job_part(first)
            ):
                raise CheckpointMismatchError(
                    f"the states of ranks {first['_rank']} and {state['_rank']} differ in "
                    f"{key.lstrip('_')}: they are not of one job and step."
                    f"\nLikely cause: states from different jobs: checkpoint={first[key]!r:.80}, "
                    f"current={state[key]!r:.80}",
                    split=where, field=key.lstrip("_"),
                )  # fmt: skip
    stored = _stored_timeline(first)
    if _described(stored) != _described(mix.timeline) or stored.policies:
        raise CheckpointMismatchError(
            f"an elastic resume continues the same mixture: the checkpoint's is "
            f"{_described(stored)}, the current one {_described(mix.timeline)} (max_epochs is "
            f"not supported elastically yet). Resume elastically under the checkpoint's "
            f"mixture, save the state, and load it with reweight=True."
            f"\nLikely cause: weights or sources changed: checkpoint={stored.weights}, "
            f"current={mix.weights}",
            split=where, field="weights", expected=stored.weights, found=mix.weights,
        )  # fmt: skip
    old_workers = first["_num_workers"]
    old_world, streams = first["_world_size"], max(1, old_workers)
    rests = _stored_rests(first, mix)
    sources = tuple(replace(epochs, world_size=old_world) for epochs in mix.sources)
    old = replace(
        mix, world_size=old_world, sources=sources, rests=rests, _orders={}, _shares={},
        _settings_states={},
    )  # fmt: skip
    ordinals = np.zeros((len(mix.names), old_world * streams), dtype=np.int64)
    tokens = np.zeros_like(ordinals)  # packed: of each old stream's next row, delivered
    remaining = 0
    for state in ordered:
        rank = state["_rank"]
        ranked = replace(
            old, rank=rank, sources=tuple(replace(e, rank=rank) for e in old.sources)
        ).following(_stored_timeline(state), rests)
        then = MixedProgress(ranked, state["epoch"], old_workers)
        if None in state["streams"] or len(state["streams"]) != streams:
            raise InvalidStateError(
                f"state key 'streams' of rank {state['_rank']} must hold every worker's "
                f"position ({streams}): an elastic resume needs them all"
            )
        then.positions = dict(enumerate(state["streams"]))
        for name, sub in state["sources"].items():
            source = mix.names.index(name)
            rows = _checked_rows(ranked, then, source, sub, old_workers)
            for worker, (ordinal, delivered) in rows.items():
                ordinals[source, then.stream(worker)] = ordinal
                tokens[source, then.stream(worker)] = delivered
        for worker, position in then.positions.items():
            remaining += then.total(worker) - position
    new_rests = tuple(
        _dealt_rest(old, s, ordinals[s], tokens[s], old_workers) for s in range(len(mix.names))
    )
    workers = max(1, num_workers)
    deal = Deal(Pieces.of([(0, 0, remaining)]), mix.world_size, workers, mix.even_batches)
    lengths = deal.shares_of(mix.rank * workers, workers)
    segment = Segment(first["epoch"], (), {}, tuple(int(n) for n in lengths))
    log.info(
        "mixture %s: elastic resume of epoch %d from %d x %d streams to %d x %d: %d positions "
        "left, each source's unfinished epochs dealt anew",
        mix.weights, first["epoch"], old_world, streams, mix.world_size, max(1, num_workers),
        remaining,
    )  # fmt: skip
    beginning = (0,) * workers  # not fresh: persistent workers start anew
    if mix.config.packing is not None:  # a cut document's tokens: the deal's skips
        beginning = (MixPosition(0, ((0, 0),) * len(mix.names)),) * workers
    start = Start(
        epoch=first["epoch"],
        positions=beginning,
        checkpoint_workers=num_workers,
        checkpoint_split=where,
    )
    return start, mix.following(replace(mix.timeline, segment=segment), new_rests)


def _job_part(state: Mapping[str, Any]) -> Any:
    """What the states of one job share in their mixture (not each rank's segment)."""
    return {k: v for k, v in state["_mixture"].items() if k != "segment"}


def _dealt_rest(
    old: MixedEpochs, source: int, ordinals: IntArray, tokens: IntArray, workers: int
) -> SourceRest:
    """Source ``source``'s epochs the old streams (at ``ordinals``, with ``tokens`` of the
    next row delivered) had begun and not all finished, each with a generation recording every
    old stream's rows of it, then its first epoch no old stream had begun."""
    rest = old.rest(source)
    streams = len(ordinals)
    places = [old.place(source, g, int(n), workers) for g, n in enumerate(ordinals)]
    reading = [e for e, _ in rest.epochs]
    fresh = max([rest.fresh, *(p.epoch + 1 for p in places if p.epoch >= rest.fresh)])
    reading += list(range(rest.fresh, fresh))
    rank_of = {e: i for i, e in enumerate(reading)}
    deals = dict(rest.epochs)
    epochs = []
    for epoch in reading:
        done = np.array([
            old.order(source, g, epoch, workers).total if rank_of[epoch] < rank_of[p.epoch]
            else p.offset if epoch == p.epoch else 0
            for g, p in enumerate(places)
        ], dtype=np.int64)  # fmt: skip
        totals = np.array([old.order(source, g, epoch, workers).total for g in range(streams)])
        if (done >= totals).all():
            continue  # every old stream has read its rows of this epoch
        current = np.array([p.epoch == epoch for p in places])
        cut = np.where(current, tokens, 0).astype(np.int64)  # a document cut mid-way
        generation = Generation(old.world_size, workers, False, done, cut)
        epochs.append((epoch, (*deals.get(epoch, ()), generation)))
    return SourceRest(tuple(epochs), fresh)


def _described(timeline: Timeline) -> str:
    """What of a mixture a state compares: its weights, epoch size and policies."""
    text = f"{timeline.weights} with epoch_size={timeline.epoch_size}"
    if timeline.schedule.block:
        text += f", schedule_block={timeline.schedule.block} (seed {timeline.schedule.seed})"
    return text + (f", policies {timeline.policies}" if timeline.policies else "")


def _reweighted(then: MixedProgress, current: Timeline, workers: int) -> Timeline:
    """``current`` counting on from where the streams of ``then`` stood."""
    streams = max(1, workers)
    gone = [n for n in then.mix.timeline.policies if n not in current.names]
    if gone:
        raise CheckpointMismatchError(
            f"sources {gone} had max_epochs in the checkpoint's mixture and are not in the "
            f"current one: where the other sources stood depends on when they ran out, which "
            f"needs their files; keep them (their rows are not read once they ran out)",
            split=f"mixture {list(then.mix.timeline.names)}", field="sources",
            expected=list(then.mix.timeline.names), found=list(current.names),
        )  # fmt: skip
    if len(then.positions) != streams:
        raise InvalidStateError(
            "a state without every worker's position (saved by a DataLoader worker's copy of "
            "the dataset) cannot change the mixture: save the state through the loader"
        )
    counts = [then.counts(w, then.positions[w]).tolist() for w in range(streams)]
    old = then.mix.names
    before = then.mix.timeline.segment
    segment = Segment(
        epoch=then.epoch,
        positions=tuple(then.positions[w] for w in range(streams)),
        counts={n: tuple(c[old.index(n)] for c in counts) for n in current.names if n in old},
        # the epoch an elastic resume dealt keeps its length
        lengths=before.lengths if then.epoch == before.epoch else (),
    )
    removed = [n for n in old if n not in current.names]
    added = [n for n in current.names if n not in old]
    log.warning(
        "mixture changed at epoch %d positions %s: weights %s -> %s (added %s: first epoch; "
        "removed %s: their rows not read yet are not read)",
        then.epoch, list(segment.positions), then.mix.weights, current.weights, added, removed,
    )  # fmt: skip
    return replace(current, segment=segment)


def _checked_rows(
    mix: MixedEpochs, then: MixedProgress, source: int, sub: Any, workers: int
) -> dict[int, tuple[int, int]]:
    """Per worker, the row (over all its epochs) of source ``source`` it hands out next and
    the tokens of it handed out, after checking the source's state against its files, its
    settings and the stored positions."""
    name = mix.names[source]
    epochs = mix.sources[source]
    streams = max(1, workers)
    try:
        decoded = decode(sub, index=epochs.index, settings=epochs.settings(workers))
    except (CheckpointMismatchError, InvalidStateError) as exc:
        raise _in_source(exc, name) from exc
    entries: Sequence[StreamEntry | None] = decoded.streams
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
    stored = then.mix.names.index(name)
    rows = {}
    for worker, entry in enumerate(entries):
        if entry is None or worker not in then.positions:
            continue
        stream = then.stream(worker)
        if mix.config.packing is None:
            ordinal = int(then.counts(worker, then.positions[worker])[stored])
        else:
            ordinal = then.mix.ordinal_of(
                source, stream, source_epochs[worker], entry.position, workers
            )
        place = then.mix.place(source, stream, ordinal, workers, entry.tokens)
        if (place.epoch, entry.position, entry.rows, entry.next_row) != (
            source_epochs[worker],
            place.offset,
            place.order.total,
            place.order.row_at(place.offset),
        ):
            where = "the end of a share"
            if entry.next_row is not None:
                where = f"{epochs.index.describe(entry.next_row[0])} row {entry.next_row[1]}"
            raise _in_source(misplaced(where, epochs.settings(workers), worker), name)
        rows[worker] = (ordinal, entry.tokens)
    return rows


def _in_source(exc: CheckpointMismatchError | InvalidStateError, name: str) -> Exception:
    """``exc`` naming the mixture's source it is about."""
    if isinstance(exc, InvalidStateError):
        return InvalidStateError(f"state of source {name!r}: {exc}")
    return CheckpointMismatchError(
        f"source {name!r}: {exc}", split=exc.split, field=exc.field, expected=exc.expected,
        found=exc.found,
    )  # fmt: skip


def _stored_timeline(state: Mapping[str, Any]) -> Timeline:
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
    if type(rows) is not int or rows < 1:
        raise InvalidStateError(
            f"state key '_mixture.epoch_size' must be an int >= 1, got {rows!r:.80}"
        )
    if not (
        isinstance(segment, list)
        and len(segment) == 4
        and isinstance(segment[3], list)
        and all(type(n) is int and n >= 0 for n in segment[3])
        and (not segment[1] or len(segment[3]) in (0, len(segment[1])))
        and type(segment[0]) is int
        and segment[0] >= 0
        and isinstance(segment[1], list)
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
            f"state key '_mixture.segment' must be [epoch, [position per worker], {{source: "
            f"[rows per worker]}}, [positions of that epoch per worker]], got {segment!r:.200}"
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


def _stored_rests(state: Mapping[str, Any], mix: MixedEpochs) -> tuple[SourceRest, ...]:
    """Each current source's epochs left by elastic resumes, as the state records them."""
    return tuple(_source_rest(state["sources"].get(name), name) for name in mix.names)


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


def _check_shape(state: object) -> None:
    if not isinstance(state, Mapping):
        raise InvalidStateError(f"a state must be a dict, got {type(state).__name__}")
    if "_mixture" not in state:
        raise InvalidStateError(
            "this dataset is a mixture, but the state has no key '_mixture': it was saved by "
            "a dataset of one source"
        )
    for key, kind in _KEYS.items():
        value = state.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidStateError(
                f"state key {key!r} must be {kind.__name__}, got {type(value).__name__}"
            )
        if isinstance(value, int) and value < 0:
            raise InvalidStateError(f"state key {key!r} must be >= 0, got {value}")
    if state["version"] != STATE_VERSION:
        raise InvalidStateError(
            f"unknown state version {state['version']!r}: this library reads version "
            f"{STATE_VERSION}"
        )
    for number, position in enumerate(state["streams"]):
        if position is not None and (type(position) is not int or position < 0):
            raise InvalidStateError(
                f"state key 'streams[{number}]' must be a position >= 0 or null, got "
                f"{position!r:.80}"
            )
