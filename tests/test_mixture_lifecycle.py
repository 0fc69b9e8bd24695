"""A mixture's whole life as a training script drives it, model-based (hypothesis).

Random sequences of: iterate ``k`` batches (a new iterator when none runs), break (drop the
iterators: the next iteration restarts the epoch), ``set_epoch`` (the same epoch, the next, a
replay of an earlier one), ``state_dict()`` through JSON, and fresh loaders loading a saved
state: exactly, with ``reweight=True`` (weights changed, a source added or removed,
``epoch_size`` changed) or with ``elastic=True`` onto another world (ranks simulated in this
process, as ``tests/test_elastic.py`` does) and number of workers. Packed and not, shuffled and
not, 0 and 2 DataLoader workers, 1 or 2 ranks, over 2-3 small sources whose rows (documents,
packed) are identified by their ids (tokens).

The model follows each stream (rank x worker: the loader hands batches out round-robin from
the state's cursor) in each source: the source epoch and row of its share it reads next (taken
from the state at each iteration's start and checked against it after every batch). Invariants
at every step (``docs/mixing.md``):

- each source epoch's rows are delivered at most once, and all of them once every stream of
  the world has read past that epoch (unless the script skipped part of it: ``set_epoch`` of a
  later epoch mid-epoch); the same stream, source, source epoch and row always deliver the
  same row (a replay, a resume and a reweight continue each source where it stood);
- per stream, each source's count since the last change (the start, a reweight, an elastic
  resume) within 1 of its share of the positions, since a jump (``set_epoch`` elsewhere, a
  restarted epoch) within 2;
- a resume continues with exactly the batches the run it was saved from went on with;
- every state the loader produces goes through JSON and loads into a fresh loader;
- every refusal is the library's error of an epoch it cannot start (``EpochStartError``: the
  documented ``ValueError``, a ``DataLoaderUtilsError`` too) naming the epoch, and only where
  the docs allow one; any other error fails the sequence.

A replay of an epoch delivers its rows again: at most once holds per pass of a source epoch.
Restarting an epoch the mixture changed in (or before) reads it as the mixture is built, dealt
afresh: the model relabels every stream's places from that deal, in a new world.

``make test`` runs a few sequences; ``make soak`` many (``TDU_MIXLIFE_EXAMPLES``/``_STEPS``).
"""

from __future__ import annotations

import copy
import gc
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from _data import write_parquet
from _harness import json_round_trip
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from torch_dataloader_utils import StructuredDataset, TokenPacking
from torch_dataloader_utils.api.states import start_state
from torch_dataloader_utils.base.errors import EpochStartError
from torch_dataloader_utils.mixing.state import expanded

EXAMPLES = int(os.environ.get("TDU_MIXLIFE_EXAMPLES", "12"))
STEPS = int(os.environ.get("TDU_MIXLIFE_STEPS", "15"))

SPAN = 1000  # row r of source number n has id (n + 1) * SPAN + r; token t of it id * 100 + t
ROWS = {"a": 47, "b": 31, "c": 23}
NAMES = tuple(ROWS)
BATCH = 5
PACKING = TokenPacking("tokens", seq_len=8)

_ROOT = Path(tempfile.mkdtemp(prefix="tdu-mixlife-"))


def _write_sources() -> None:
    """Each source in 2 Parquet files (row groups of 5): ``id`` and ``tokens`` (1-12 tokens)."""
    for number, (name, rows) in enumerate(ROWS.items()):
        (_ROOT / name).mkdir()
        ids = np.arange(rows, dtype=np.int64) + (number + 1) * SPAN
        tokens = [[i * 100 + t for t in range(1 + (i * 7) % 12)] for i in ids.tolist()]
        table = pa.table({"id": ids, "tokens": pa.array(tokens, pa.list_(pa.int64()))})
        half = rows // 2
        for part, (lo, hi) in enumerate([(0, half), (half, rows)]):
            write_parquet(_ROOT / name / f"part-{part}.parquet", table.slice(lo, hi - lo), 5)


_write_sources()


def teardown_module() -> None:
    shutil.rmtree(_ROOT, ignore_errors=True)


def source_of(row: int) -> str:
    return NAMES[row // SPAN - 1]


@dataclass(frozen=True)
class Shape:
    """What a job's loaders are built with: the mixture, packing, order and world."""

    sources: tuple[str, ...]
    weights: tuple[int, ...]
    epoch_size: int | None
    packed: bool
    shuffle: bool
    world: int = 1
    workers: int = 0

    @property
    def per_rank(self) -> int:
        return max(1, self.workers)

    @property
    def mixture(self) -> tuple[Any, ...]:
        return self.sources, self.weights, self.epoch_size

    def loader(self, rank: int) -> tuple[Any, StructuredDataset]:
        return StructuredDataset.create_dataloader(
            {n: str(_ROOT / n) for n in self.sources},
            weights=dict(zip(self.sources, self.weights, strict=True)),
            epoch_size=self.epoch_size, batch_size=BATCH, shuffle=self.shuffle, shuffle_seed=5,
            split_bytes=1, packing=PACKING if self.packed else None, rank=rank,
            world_size=self.world, num_workers=self.workers,
            columns=None if self.packed else ["id"],
        )  # fmt: skip


@dataclass
class Window:
    """A stream's positions and rows per source since the last change (``bound`` 1) or jump
    (``bound`` 2), and where it stands: (mixture epoch, position in it)."""

    bound: int
    at: tuple[int, int]
    positions: int = 0
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class Life:
    """What the model knows, saved with each checkpoint (``copy.deepcopy``)."""

    world: int  # changes with every elastic resume: streams and rest epochs are dealt anew
    epoch: int
    seg_epoch: int | None  # the epoch a reweight or elastic resume changed the mixture
    incarnation: dict[str, int]  # a source added again starts its first epoch again
    # (stream, source) -> [source epoch, rows of the share started, rows of the share]
    places: dict[tuple[int, str], list[int]]
    # (source, incarnation) -> source epoch -> row -> (world, stream, row of the share)
    ledger: dict[tuple[str, int], dict[int, dict[int, tuple[int, int, int]]]]
    holes: set[tuple[str, int, int]]  # (source, incarnation, epoch) partly skipped
    windows: dict[int, Window]


def _same_place(old: list[int], new: list[int]) -> bool:
    """``new`` is where ``old`` stands: the same row, or the next epoch's first after the
    last row of ``old``'s epoch."""
    return new[:2] == old[:2] or (old[1] == old[2] and new[:2] == [old[0] + 1, 0])


def _signature(batch: Any) -> list[Any]:
    return [v.tolist() if hasattr(v, "tolist") else v for v in batch.values()]


class MixtureLife(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.shape: Shape
        self.life: Life
        self.jobs: list[tuple[Any, StructuredDataset]] = []
        self.iters: list[Any] = []
        self.cursors: list[int] = []  # per rank: the worker of its next batch
        self.ended: list[bool] = []  # per rank: its last iteration ran to the epoch's end
        self.log: dict[tuple[Any, ...], int] = {}  # (world, stream, source, inc, epoch, row)
        self.worlds = 0  # worlds made so far
        # a checkpoint: every rank's state, its job, the model then, and per rank the batches
        # of the iteration it was saved in (growing while that iteration goes on), and how many
        self.checkpoints: list[tuple[list[dict[str, Any]], Shape, Life, list[Any]]] = []
        self.tapes: list[list[Any]] = []  # per rank: the batches of its current iteration
        self.loaded = False  # a state is loaded and its iteration has not begun
        self.blocked = False  # the next iteration's start was refused: set_epoch or load
        self.began = False  # an iteration of the current epoch began in this loader
        self.carry_from: int | None = None  # packed: the epoch whose end the loader holds
        self.replaying: list[tuple[list[Any], int] | None] = []  # per rank: expected batches
        self.unrestartable = False  # packed: an epoch >= 1 loaded mid-way (its start unknown)

    # ------------------------------------------------------------------ building

    @initialize(
        count=st.integers(2, 3), weights=st.lists(st.integers(1, 4), min_size=3, max_size=3),
        packed=st.booleans(), shuffle=st.booleans(), workers=st.sampled_from([0, 0, 0, 2]),
        size=st.sampled_from([None, 30, 45]),
    )  # fmt: skip
    def build(
        self, count: int, weights: list[int], packed: bool, shuffle: bool, workers: int,
        size: int | None,
    ) -> None:  # fmt: skip
        if packed:
            size = size or 15
        self.shape = Shape(NAMES[:count], tuple(weights[:count]), size, packed, shuffle, 1, workers)
        self.life = Life(0, 0, None, dict.fromkeys(NAMES, 0), {}, {}, set(), {})
        self._open(self.shape)
        for rank in range(self.shape.world):
            self._place_all(rank, self._start_state(rank), check=None)
        self._new_windows(bound=1)

    def _open(self, shape: Shape) -> None:
        self._drop_iterators()
        self.shape = shape
        self.jobs = [shape.loader(rank) for rank in range(shape.world)]
        self.iters = [None] * shape.world
        self.cursors = [0] * shape.world
        self.ended = [False] * shape.world
        self.replaying = [None] * shape.world
        self.tapes = [[] for _ in range(shape.world)]
        self.blocked = self.began = self.loaded = False

    def _start_state(self, rank: int) -> dict[str, Any]:
        """The state of where rank ``rank``'s next iteration starts."""
        dataset = self.jobs[rank][1]
        start = dataset._next_start
        return json_round_trip(start_state(dataset._epochs, start, dataset._known_workers()))

    def _new_windows(self, bound: int) -> None:
        for rank in range(self.shape.world):
            state = self._start_state(rank)
            for w in range(self.shape.per_rank):
                stream = rank * self.shape.per_rank + w
                self.life.windows[stream] = Window(bound, (state["epoch"], state["streams"][w]))

    # ------------------------------------------------------------------ places and ledger

    def _entry(self, state: dict[str, Any], name: str, worker: int) -> list[int]:
        """``[source epoch, rows of the share started, rows of the share, 1 if packed and
        the last row started is not all handed out]`` of ``worker``."""
        source = expanded(state)["sources"][name]
        offset, tokens, rows = source["streams"][worker][:3]
        return [source["epochs"][worker], offset + (tokens > 0), rows, int(tokens > 0)]

    def _place_all(self, rank: int, state: dict[str, Any], check: str | None) -> None:
        """Take rank ``rank``'s places from ``state`` at a load: ``check`` "same" (a resume:
        each source where it stood), "kept" (a reweight: the sources kept where they stood,
        an added one at its start), None (a new world: streams dealt anew)."""
        life = self.life
        for w in range(self.shape.per_rank):
            stream = rank * self.shape.per_rank + w
            for name in self.shape.sources:
                new = self._entry(state, name, w)
                old = life.places.get((stream, name))
                if check == "same" or (check == "kept" and old is not None):
                    assert old is not None and _same_place(old, new), (
                        f"stream {stream} resumes source {name!r} at {new}, it stood at {old}"
                    )
                elif check == "kept":
                    assert new[:2] == [0, 0], f"added source {name!r} starts at {new}"
                life.places[(stream, name)] = new

    def _restart(self, rank: int, state: dict[str, Any]) -> None:
        """Rank ``rank``'s next iteration starts at ``state``: a stream elsewhere than it
        stood jumped (a replay rewinds the ledger, a skip leaves source epochs incomplete)."""
        life = self.life
        for w in range(self.shape.per_rank):
            stream = rank * self.shape.per_rank + w
            window = life.windows[stream]
            at = (state["epoch"], state["streams"][w])
            if at != window.at and not (self.ended[rank] and at == (window.at[0] + 1, 0)):
                life.windows[stream] = Window(2, at)  # not where it stood, nor the next epoch
            for name in self.shape.sources:
                new = self._entry(state, name, w)
                old = life.places[(stream, name)]
                inc = life.incarnation[name]
                if new[:2] < old[:2]:
                    for epoch, rows in life.ledger.get((name, inc), {}).items():
                        for row, (world, by, offset) in list(rows.items()):
                            if (world, by) == (life.world, stream) and [epoch, offset] >= new[:2]:
                                del rows[row]
                elif not _same_place(old, new):
                    life.holes.update((name, inc, e) for e in range(old[0], new[0] + 1))
                life.places[(stream, name)] = new

    def _relabel(self, states: list[dict[str, Any]]) -> None:
        """Every rank starts at ``states``: a restart of an epoch the mixture changed in (or
        before) reads it afresh as the mixture is built, dealt to this world from its start:
        a new world labels the streams' places (even where they stood: the deal may differ),
        each source's epochs from the earliest any stream starts in are a new pass (those some
        stream starts past part of: holes)."""
        life = self.life
        epoch = states[0]["epoch"]
        if life.seg_epoch is None or epoch > life.seg_epoch or self.loaded:
            return
        news = {
            (rank * self.shape.per_rank + w, name): self._entry(state, name, w)
            for rank, state in enumerate(states) for w in range(self.shape.per_rank)
            for name in self.shape.sources
        }  # fmt: skip
        life.world = self.worlds = self.worlds + 1
        for name in self.shape.sources:
            inc = life.incarnation[name]
            starts = [new for (_, n), new in news.items() if n == name]
            low = min(new[0] for new in starts)
            ledger = life.ledger.get((name, inc), {})
            for e in [e for e in ledger if e >= low]:
                del ledger[e]
            life.holes.update(
                (name, inc, e) for new in starts for e in range(low, new[0] + (new[1] > 0))
            )  # fmt: skip
        life.places.update(news)

    def _deliver(
        self, stream: int, name: str, rows: list[tuple[int, bool]], state: dict[str, Any], w: int
    ) -> None:
        """``rows`` of source ``name`` read by ``stream`` in a batch (packed: the documents
        its tokens are of, and whether their first token is among them), labelled with their
        source epoch by the places before and after it (the state's, after)."""
        life = self.life
        epoch, start, total, partial = life.places[(stream, name)]
        if rows and partial and not rows[0][1]:
            rows = rows[1:]  # the rest of the document the stream was in
        new = self._entry(state, name, w)
        labels: list[tuple[int, int] | None]
        if new[0] == epoch:
            assert new[1] == start + len(rows), (stream, name, epoch, start, rows, new)
            labels = [(epoch, start + i) for i in range(len(rows))]
        else:
            assert new[0] > epoch, f"stream {stream} went back in source {name!r}: {new}"
            first = total - start
            middle = len(rows) - first - new[1]
            assert first >= 0 and middle >= 0, (stream, name, epoch, start, total, rows, new)
            labels = [(epoch, start + i) for i in range(first)]
            if new[0] - epoch == 1:
                assert middle == 0, (stream, name, epoch, start, total, rows, new)
            elif new[0] - epoch == 2:  # all of the stream's share of the epoch between
                labels += [(epoch + 1, i) for i in range(middle)]
            else:  # several epochs (tiny elastic rests) in one batch: not labelled
                labels += [None] * middle
                inc = life.incarnation[name]
                life.holes.update((name, inc, e) for e in range(epoch + 1, new[0]))
            labels += [(new[0], i) for i in range(new[1])]
        inc = life.incarnation[name]
        ledger = life.ledger.setdefault((name, inc), {})
        for (row, first), label in zip(rows, labels, strict=True):
            if label is None:
                continue
            e, offset = label
            key = (life.world, stream, name, inc, e, offset)
            assert self.log.setdefault(key, row) == row, (
                f"stream {stream} source {name!r} epoch {e} row {offset}: {row}, before "
                f"{self.log[key]}"
            )
            if not first:  # begun by another stream (an elastic deal cut it): counted there
                continue
            seen = ledger.setdefault(e, {})
            then = seen.setdefault(row, (life.world, stream, offset))
            assert then == (life.world, stream, offset), (
                f"row {row} of source {name!r} delivered twice in its epoch {e}: by stream "
                f"{stream} (row {offset} of its share), before by {then}"
            )
        life.places[(stream, name)] = new

    # ------------------------------------------------------------------ rules

    def _may_start(self) -> bool:
        """Whether the next iteration's start may be refused (rather than must work): a
        loaded state must continue, any epoch restarts as the mixture is built; but a packed
        epoch >= 1 this loader cannot carry on from the epoch before, or loaded (where it
        began is not in the state), may not."""
        if self.loaded or not self.shape.packed or self.life.epoch == 0:
            return False
        return self.unrestartable or self.carry_from not in (self.life.epoch - 1, self.life.epoch)

    def _refused(self, exc: Exception) -> None:
        """A refusal: the library's error of an epoch the mixture cannot start (the
        documented ``ValueError``, a ``DataLoaderUtilsError`` too), naming the epoch."""
        assert isinstance(exc, EpochStartError), repr(exc)
        assert f"epoch {self.life.epoch}" in str(exc), str(exc)
        self.blocked = True

    @precondition(lambda self: not self.blocked)
    @rule(k=st.integers(1, 5))
    def iterate(self, k: int) -> None:
        """Every rank takes ``k`` batches (beginning an iteration where none runs)."""
        if all(it is None for it in self.iters):
            states = []
            for rank in range(len(self.jobs)):
                try:
                    states.append(self._start_state(rank))
                except Exception:  # refused: _begin checks it
                    break
            else:
                self._relabel(states)
        for rank, (loader, _) in enumerate(self.jobs):
            if self.iters[rank] is None and not self._begin(rank, loader):
                return
            for _ in range(k):
                batch = next(self.iters[rank], None)
                if batch is None:
                    self.iters[rank], self.ended[rank] = None, True
                    break
                self._take(rank, batch)

    def _begin(self, rank: int, loader: Any) -> bool:
        try:
            state = self._start_state(rank)
        except Exception as exc:
            assert self._may_start(), f"epoch {self.life.epoch} cannot start: {exc!r}"
            self._refused(exc)
            with pytest.raises(type(exc)):  # the loader itself refuses as its state did
                next(iter(loader))
            return False
        self._restart(rank, state)
        self.cursors[rank] = state["cursor"]
        self.iters[rank] = iter(loader)
        self.ended[rank] = False
        self.began = True
        self.carry_from = self.life.epoch
        if not self.loaded:  # a resume's expected batches are of its first iteration only
            self.replaying[rank] = None
        if self.tapes[rank]:  # else a checkpoint since the epoch's start may refer to it
            self.tapes[rank] = []
        if rank == len(self.jobs) - 1:
            self.loaded = False
        return True

    def _take(self, rank: int, batch: Any) -> None:
        shape, life = self.shape, self.life
        w = self.cursors[rank]
        self.cursors[rank] = (w + 1) % shape.per_rank
        stream = rank * shape.per_rank + w
        signature = _signature(batch)
        replay = self.replaying[rank]
        if replay is not None:  # a resume: what the saved run went on with
            tape, at = replay
            if at < len(tape):
                assert signature == tape[at], f"rank {rank}: batch {at} after the resume differs"
                self.replaying[rank] = (tape, at + 1)
        self.tapes[rank].append(signature)
        sources = [shape.sources[s] for s in batch["source"].tolist()]
        rows: dict[str, list[tuple[int, bool]]] = {name: [] for name in shape.sources}
        if shape.packed:  # a document's tokens run on, in order (or it begins again: the
            # next source epoch may begin with the row the last one ended with)
            last: dict[str, int] = {}
            for name, sequence in zip(sources, batch["input_ids"].tolist(), strict=True):
                for token in (t for t in sequence if t):  # 0 pads
                    assert source_of(token // 100) == name, (name, sequence)
                    if name in last and token // 100 == last[name] // 100 and token % 100:
                        assert token == last[name] + 1, (name, last[name], token)
                    else:
                        rows[name].append((token // 100, token % 100 == 0))
                    last[name] = token
        else:
            ids = batch["id"].tolist()
            assert [source_of(i) for i in ids] == sources, (ids, sources)
            for name, i in zip(sources, ids, strict=True):
                rows[name].append((i, True))
        state = json_round_trip(self.jobs[rank][0].state_dict())
        assert state["epoch"] == life.epoch
        for name in shape.sources:
            self._deliver(stream, name, rows[name], state, w)
        window = life.windows[stream]
        window.positions += len(sources)
        window.at = (state["epoch"], state["streams"][w])
        total = sum(shape.weights)
        for name, weight in zip(shape.sources, shape.weights, strict=True):
            window.counts[name] = window.counts.get(name, 0) + sources.count(name)
            gap = abs(window.counts[name] * total - window.positions * weight)
            assert gap < window.bound * total, (
                f"stream {stream}: {window.counts[name]} of source {name!r} in "
                f"{window.positions} positions at weights {shape.weights} (bound {window.bound})"
            )

    @rule()
    def stop(self) -> None:
        """The loop breaks: the iterators go (the next iteration restarts the epoch)."""
        self._drop_iterators()

    @rule(which=st.sampled_from(["next", "next", "same", "earlier"]), back=st.integers(1, 2))
    def set_epoch(self, which: str, back: int) -> None:
        life = self.life
        epoch = {"same": life.epoch, "next": life.epoch + 1}.get(which, life.epoch - back)
        if epoch < 0:
            return
        self._drop_iterators()
        # packed: an epoch >= 1 carries on from where the loader holds the one before (or
        # replays the one it holds); else set_epoch refuses at once (the dataset unchanged),
        # as it may for an epoch >= 1 loaded mid-way (where it began is not in the state)
        legit = not self.shape.packed or epoch == 0 or self.carry_from in (epoch - 1, epoch)
        again = self.unrestartable and epoch == life.epoch
        may_refuse = self.shape.packed and epoch > 0 and (not legit or again)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # after a load: "discards the ..."
            for rank, (_, dataset) in enumerate(self.jobs):
                try:
                    dataset.set_epoch(epoch)
                except ValueError as exc:
                    assert isinstance(exc, EpochStartError), repr(exc)
                    assert may_refuse and rank == 0, f"set_epoch({epoch}): {exc!r}"
                    assert f"epoch {epoch}" in str(exc), str(exc)
                    assert all(d.epoch == life.epoch for _, d in self.jobs)  # unchanged
                    return
        if self.shape.packed:
            self.carry_from = epoch if epoch and legit else None
        if epoch != life.epoch:
            self.unrestartable = False
        life.epoch, self.blocked, self.began, self.loaded = epoch, False, False, False
        self.tapes = [[] for _ in self.jobs]  # a checkpoint now is of the epoch's start
        may_refuse = self._may_start()
        try:  # the state now describes the epoch's start
            states = [json_round_trip(loader.state_dict()) for loader, _ in self.jobs]
        except Exception as exc:
            assert may_refuse, f"set_epoch({epoch}): {exc!r}"
            self._refused(exc)
            return
        self._relabel(states)
        for rank, state in enumerate(states):
            self._restart(rank, state)

    @precondition(lambda self: not self.blocked)
    @rule()
    def checkpoint(self) -> None:
        states = [json_round_trip(loader.state_dict()) for loader, _ in self.jobs]
        assert all(s["epoch"] == self.life.epoch for s in states)
        tapes = [(tape, len(tape)) for tape in self.tapes]
        self.checkpoints.append((states, self.shape, copy.deepcopy(self.life), tapes))

    @precondition(lambda self: bool(self.checkpoints))
    @rule(
        pick=st.integers(0, 10**6), data=st.data(),
        how=st.sampled_from(["exact", "reweight", "reweight", "elastic"]),
    )  # fmt: skip
    def resume(self, pick: int, how: str, data: Any) -> None:
        """Fresh loaders (a new job) load a checkpoint: as saved, reweighted, or elastic."""
        states, saved, life, tapes = self.checkpoints[pick % len(self.checkpoints)]
        shape = saved
        if how == "reweight":
            shape = self._reweighted(saved, states, data)
            if shape is None:
                return
        elif how == "elastic":
            world = data.draw(st.sampled_from([1, 1, 2]))
            shape = Shape(*saved.mixture, saved.packed, saved.shuffle, world,
                          data.draw(st.sampled_from([0, 0, 0, 2])))  # fmt: skip
        self.life = copy.deepcopy(life)
        self._open(shape)
        self.life.epoch = states[0]["epoch"]
        for rank, (loader, _) in enumerate(self.jobs):
            if how == "elastic":
                loader.load_state_dict(states, elastic=True)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    loader.load_state_dict(states[rank], reweight=how == "reweight")
        changed = how == "elastic" or shape.mixture != saved.mixture
        self.carry_from = self.life.epoch if shape.packed else None
        # packed, an epoch >= 1 loaded mid-way or dealt by an elastic resume (now, or in the
        # state's segment: a restart reads the epoch as built) may not restart
        dealt = how == "elastic" or any(
            s["_mixture"]["segment"][0] == s["epoch"] and s["_mixture"]["segment"][3]
            for s in states
        )  # fmt: skip
        self.unrestartable = (
            shape.packed and self.life.epoch > 0
            and (dealt or any(p for s in states for p in s["streams"]))
        )  # fmt: skip
        if how == "elastic":  # a new world (never one before: their deals differ)
            self.life.world = self.worlds = self.worlds + 1
            self.life.places = {}
        for name in shape.sources:
            if name not in saved.sources:  # added: its first epoch (again)
                self.life.incarnation[name] += 1
                self.life.places = {k: v for k, v in self.life.places.items() if k[1] != name}
        for rank in range(shape.world):
            check = {"exact": "same", "reweight": "kept"}.get(how)
            self._place_all(rank, self._start_state(rank), check)
        if changed:
            self.life.seg_epoch = self.life.epoch
            self.life.windows = {}
            self._new_windows(bound=1)
        else:
            self.replaying = list(tapes)
        self.loaded = True

    def _reweighted(self, saved: Shape, states: list[dict[str, Any]], data: Any) -> Shape | None:
        """A mixture with weights changed, a source added or removed, or epoch_size changed."""
        names = list(saved.sources)
        change = data.draw(st.sampled_from(["weights", "add", "remove", "epoch_size"]))
        if change == "add" and len(names) < len(NAMES):
            names.append(data.draw(st.sampled_from([n for n in NAMES if n not in names])))
        elif change == "remove" and len(names) > 1:
            names.remove(data.draw(st.sampled_from(names)))
        weights = tuple(data.draw(st.integers(1, 4)) for _ in names)
        size = saved.epoch_size
        if change == "epoch_size":
            size = data.draw(st.sampled_from([10, 20, 30] if saved.packed else [None, 12, 30, 45]))
        shape = Shape(tuple(names), weights, size, saved.packed, saved.shuffle, saved.world,
                      saved.workers)  # fmt: skip
        return shape

    # ------------------------------------------------------------------ invariants

    @invariant()
    def every_source_epoch_complete_once_read_past(self) -> None:
        """Epochs every stream of the world has read past hold every row of their source."""
        if not getattr(self, "jobs", None):
            return
        life = self.life
        streams = self.shape.world * self.shape.per_rank
        for name in self.shape.sources:
            inc = life.incarnation[name]
            ledger = life.ledger.get((name, inc), {})
            done = min(
                e + (offset >= rows)
                for e, offset, rows, _ in (life.places[(g, name)] for g in range(streams))
            )  # fmt: skip
            for epoch in range(done):
                if (name, inc, epoch) in life.holes:
                    continue
                got = set(ledger.get(epoch, {}))
                first = (NAMES.index(name) + 1) * SPAN
                missing = set(range(first, first + ROWS[name])) - got
                assert not missing, f"source {name!r} epoch {epoch} ended without {sorted(missing)}"

    @precondition(lambda self: bool(getattr(self, "jobs", None)) and not self.blocked)
    @invariant()
    def probe_every_state_loads(self) -> None:
        """Rank 0's state goes through JSON and loads into a fresh loader of its job."""
        state = self.jobs[0][0].state_dict()
        assert json_round_trip(state) == state
        fresh, _ = self.shape.loader(0)
        fresh.load_state_dict(state)

    def _drop_iterators(self) -> None:
        """Dropped by reference count: a generator closes (its workers stop) at once."""
        self.iters = [None] * len(self.iters)

    def teardown(self) -> None:
        self._drop_iterators()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            self.jobs = []
            gc.collect()


MixtureLife.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_mixture_lifecycle = pytest.mark.timeout(600)(MixtureLife.TestCase)


class _Drawn:
    """``data`` of a rule with its draws given in order."""

    def __init__(self, *values: Any) -> None:
        self.values = list(values)

    def draw(self, _: Any) -> Any:
        return self.values.pop(0)


def _drive(build: dict[str, Any], steps: list[tuple[str, dict[str, Any]]]) -> MixtureLife:
    machine = MixtureLife()
    machine.build(**build)
    try:
        for name, kwargs in [*steps, ("iterate", {"k": 5})]:
            getattr(machine, name)(**kwargs)
            machine.every_source_epoch_complete_once_read_past()
            if not machine.blocked:
                machine.probe_every_state_loads()
    finally:
        machine.teardown()
    return machine


def test_pinned_sequences() -> None:
    """Sequences the machine once got wrong: a restart after an elastic load reads the epoch
    dealt afresh (a new pass of its rows); a fresh packed mixture's set_epoch(1) is refused
    at once, the dataset unchanged; a reweight into an epoch shorter than the positions read
    ends it where it stands, and set_epoch(1) continues each source; a packed epoch 1 an
    elastic resume dealt, at its start, may refuse to restart (as one loaded mid-way)."""
    plain = {"count": 2, "weights": [1, 1, 1], "shuffle": False, "workers": 0, "size": None}
    nxt, it = ("set_epoch", {"back": 1, "which": "next"}), ("iterate", {"k": 5})
    machine = _drive(
        {**plain, "packed": False},
        [nxt, ("checkpoint", {}), ("resume", {"how": "elastic", "pick": 0, "data": _Drawn(1, 0)}),
         ("iterate", {"k": 4}), it, ("iterate", {"k": 1}), ("checkpoint", {}), ("stop", {}), it],
    )  # fmt: skip
    assert machine.life.world == 2  # the restart relabelled the streams
    machine = _drive({**plain, "packed": True}, [nxt])
    assert (machine.life.epoch, machine.blocked) == (0, False)
    removed = ("resume", {"how": "reweight", "pick": 0, "data": _Drawn("remove", "a", 1)})
    machine = _drive({**plain, "packed": False}, [it, it, ("checkpoint", {}), removed, it, nxt])
    assert machine.life.places[(0, "b")][:2] == [1, 19]  # 25 rows: 6 ended its epoch 0
    # packed, a state at the start of epoch 1 dealt by an elastic resume (loaded elastically,
    # or saved after one): the rest reads, a restart may be refused (found at 200 x 30)
    same = ("set_epoch", {"back": 1, "which": "same"})
    for then in ([], [("checkpoint", {}), ("resume", {"how": "exact", "pick": 1, "data": None})]):
        elastic = ("resume", {"how": "elastic", "pick": 0, "data": _Drawn(1, 0)})
        steps = [("iterate", {"k": 3}), nxt, ("checkpoint", {}), elastic, *then, same]
        machine = _drive({**plain, "packed": True}, steps)
        assert (machine.life.epoch, machine.blocked) == (1, False)  # refused, the rest read
