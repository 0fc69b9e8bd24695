"""Continuing a mixture from its states: as saved, under new weights or sources
(``reweight``), or on another world (``elastic``). The state itself: ``mixing.state``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from ..base.arrays import IntArray
from ..base.errors import CheckpointMismatchError, InvalidStateError
from ..base.log import log
from ..checkpoint.checks import check_setting
from ..checkpoint.merge import one_job
from ..checkpoint.schema import Generation
from ..planning.epochs import Start
from ..planning.plan import Deal, Pieces
from .epochs import MixedEpochs, MixedProgress, MixPosition, Segment, SourceRest, Timeline
from .state import (
    check_positions,
    check_shape,
    checked_rows,
    expanded,
    stored_rests,
    stored_timeline,
)

__all__ = ["load_mixture", "load_mixture_elastic"]


def load_mixture(
    mix: MixedEpochs, state: Mapping[str, Any], num_workers: int | None, *, reweight: bool
) -> tuple[Start, MixedEpochs]:
    """Where ``state`` continues, and the mixture to continue it with: ``mix`` under the
    state's segment, or (``reweight``, weights or sources changed) a segment starting there."""
    with _inconsistent():
        return _load(mix, state, num_workers, reweight=reweight)


def load_mixture_elastic(
    mix: MixedEpochs, states: Sequence[Mapping[str, Any]], num_workers: int
) -> tuple[Start, MixedEpochs]:
    """Every old rank's state dealt anew to this job: per source, the rows of the epochs the
    old streams had begun and not finished (each epoch's rest dealt as one dataset's elastic
    resume deals it, packed: a document cut where its tokens stopped), then its next epochs
    afresh; the rest of the mixture epoch's positions dealt to the new streams, whose schedule
    starts there."""
    with _inconsistent():
        return _load_elastic(mix, states, num_workers)


@contextmanager
def _inconsistent() -> Iterator[None]:
    """A state whose parts are well-formed but do not fit together (a position past its
    epoch, a segment after it, numbers out of range) is corrupted: say so, never raise raw."""
    try:
        yield
    except (InvalidStateError, CheckpointMismatchError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as exc:
        raise InvalidStateError(
            f"the mixture state is corrupted: its parts do not fit together "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _load(
    mix: MixedEpochs, state: Mapping[str, Any], num_workers: int | None, *, reweight: bool
) -> tuple[Start, MixedEpochs]:
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
    rests = stored_rests(state, mix)
    then = MixedProgress(mix.following(stored, rests), state["epoch"], workers)
    then.positions = {w: p for w, p in enumerate(state["streams"]) if p is not None}
    if len(state["streams"]) != max(1, workers):
        raise InvalidStateError(
            f"state key 'streams' holds {len(state['streams'])} positions for "
            f"{max(1, workers)} worker stream(s): the state is corrupted"
        )
    check_positions(then)
    rows = {
        name: checked_rows(mix, then, mix.names.index(name), sub, workers)
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


def _load_elastic(
    mix: MixedEpochs, states: Sequence[Mapping[str, Any]], num_workers: int
) -> tuple[Start, MixedEpochs]:
    ordered = one_job(
        [expanded(s) for s in states],
        check_shape,
        ("_num_workers", "_even_batches", "_mixture"),
        _job_part,
    )
    first = ordered[0]
    where = f"mixture {list(first['sources'])}"
    stored = stored_timeline(first)
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
    rests = stored_rests(first, mix)
    sources = tuple(replace(epochs, world_size=old_world) for epochs in mix.sources)
    old = replace(
        mix, world_size=old_world, even_batches=first["_even_batches"], sources=sources,
        rests=rests, _orders={}, _shares={}, _settings_states={},
    )  # fmt: skip
    ordinals = np.zeros((len(mix.names), old_world * streams), dtype=np.int64)
    tokens = np.zeros_like(ordinals)  # packed: of each old stream's next row, delivered
    remaining = 0
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
        check_positions(then)
        for name, sub in state["sources"].items():
            source = mix.names.index(name)
            rows = checked_rows(ranked, then, source, sub, old_workers)
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
    lengths = mix.whole_batches(deal.shares_of(mix.rank * workers, workers))
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


def _job_part(state: Mapping[str, Any], key: str) -> Any:
    """What the states of one job share: ``key``, of the mixture all but each rank's segment."""
    if key != "_mixture":
        return state[key]
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


def _lengths_on(then: MixedProgress, current: Timeline, workers: int) -> tuple[int, ...]:
    """Positions of the epoch in progress under ``current`` per stream (``()``: the new
    epoch's, or the position if later): a stream that had ended its epoch ends it there; the
    rest an elastic resume dealt goes on at most to the new epoch's end."""
    before = then.mix.timeline.segment
    dealt = before.lengths if then.epoch == before.epoch else ()
    streams = range(max(1, workers))
    ended = [then.positions[w] >= then.total(w) for w in streams]
    if not dealt and not any(ended):
        return ()
    lengths = then.mix.following(current).epoch_lengths(workers)
    out = []
    for w in streams:
        end = int(lengths[then.stream(w)])
        end = min(end, dealt[w]) if dealt else end
        out.append(int(then.positions[w] if ended[w] else max(end, then.positions[w])))
    return tuple(out)


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
    segment = Segment(
        epoch=then.epoch,
        positions=tuple(then.positions[w] for w in range(streams)),
        counts={n: tuple(c[old.index(n)] for c in counts) for n in current.names if n in old},
        lengths=_lengths_on(then, current, workers),
    )
    removed = [n for n in old if n not in current.names]
    added = [n for n in current.names if n not in old]
    log.warning(
        "mixture changed at epoch %d positions %s: weights %s -> %s (added %s: first epoch; "
        "removed %s: their rows not read yet are not read)",
        then.epoch, list(segment.positions), then.mix.weights, current.weights, added, removed,
    )  # fmt: skip
    return replace(current, segment=segment)
