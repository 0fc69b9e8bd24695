"""The last step of a mixture's resume: what the reader is handed. Where the iteration
starts, and the mixture it continues: under the state's timeline, the current one from where
the streams stood (``reweight``: a new segment), or, elastic, each source's unfinished epochs
and the rest of the mixture epoch dealt anew to this job."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..base.arrays import IntArray
from ..base.errors import CheckpointMismatchError, InvalidStateError
from ..base.log import log
from ..checkpoint.schema import Generation
from ..planning.epochs import Start
from ..planning.plan import Deal, Pieces
from .epochs import MixedEpochs, MixedProgress
from .locate import Rows
from .places import MixPosition, SourceRest
from .read import ReadState
from .timeline import Segment, Timeline

__all__ = ["continued", "dealt_anew"]


def continued(
    mix: MixedEpochs, read: ReadState, rows: dict[str, Rows], *, reweight: bool
) -> tuple[Start, MixedEpochs]:
    """Where the read state's streams start (packed: each source where its tokens got to),
    and ``mix`` under the state's timeline, or (``reweight``) the current one from there."""
    state, then = read.state, read.then
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
        checkpoint_split=read.where,
    )
    stored, current = then.mix.timeline, mix.timeline
    if stored.described == current.described:
        return start, mix.following(stored, read.rests)
    if not reweight:
        raise CheckpointMismatchError(
            f"this checkpoint's mixture is {stored.described}, the current one "
            f"{current.described}: a position reads other sources under other weights. "
            f"Pass reweight=True to load_state_dict to continue from the checkpoint under the "
            f"current mixture (every source continues where it stood; an added source starts "
            f"its first epoch)."
            f"\nLikely cause: weights or sources changed: checkpoint={stored.weights}, "
            f"current={current.weights}",
            split=read.where, field="weights", expected=stored.weights, found=current.weights,
        )  # fmt: skip
    return start, mix.following(_reweighted(then, current, then.num_workers), read.rests)


def dealt_anew(
    mix: MixedEpochs,
    old: MixedEpochs,
    read: Sequence[ReadState],
    located: tuple[IntArray, IntArray],
    num_workers: int,
) -> tuple[Start, MixedEpochs]:
    """The old job's streams, standing in each source at ``located`` (per source and old
    stream: its next row and the tokens of it delivered), dealt anew to this job: each
    source's unfinished epochs, and the rest of the mixture epoch's positions."""
    first = read[0].state
    old_workers, old_world = first["_num_workers"], first["_world_size"]
    streams = max(1, old_workers)
    ordinals, tokens = located
    remaining = sum(
        rank.then.total(worker) - position
        for rank in read
        for worker, position in rank.then.positions.items()
    )
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
        checkpoint_split=read[0].where,
    )
    return start, mix.following(replace(mix.timeline, segment=segment), new_rests)


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
