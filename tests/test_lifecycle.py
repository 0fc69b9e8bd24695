"""The loader's whole lifecycle as a training script drives it, model-based (hypothesis).

Random sequences of ``iter()``, ``next()`` x k, a new iterator while an old one is alive,
dropping (and garbage-collecting) an old iterator, ``state_dict()`` (JSON round trip), a
fresh process-equivalent loader with ``load_state_dict()`` (also elastic, onto another
``num_workers``), and ``set_epoch()``, over 0/2 workers, ``persistent_workers``, shuffle and
``drop_last``. The model knows which rows each epoch holds and, while the order is exact (no
elastic resume since the epoch began), the uninterrupted run's batches: every delivered batch
must be the one it expects next (after an elastic resume: rows not yet delivered, none twice),
and every state must resume to exactly what the model says is left. An exhausted epoch has
delivered every row (with ``drop_last``: all but fewer than a batch per stream).

``make test`` runs a few examples; ``make soak`` runs many (``TDU_LIFECYCLE_EXAMPLES``).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _data import ids_of, write_dataset
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from torch_dataloader_utils import StructuredDataset

ROWS = (41, 30, 25)
TOTAL = sum(ROWS)
BATCH = 6
EXAMPLES = int(os.environ.get("TDU_LIFECYCLE_EXAMPLES", "6"))
STEPS = int(os.environ.get("TDU_LIFECYCLE_STEPS", "14"))

_ROOT = Path(tempfile.mkdtemp(prefix="tdu-lifecycle-"))
write_dataset(_ROOT, ROWS, row_group_size=8)


def teardown_module() -> None:
    shutil.rmtree(_ROOT, ignore_errors=True)


@dataclass(frozen=True)
class Shape:
    """What a loader is built with (a checkpoint's loader and its resumed one share all but
    ``num_workers``/``persistent``, which an elastic resume may change)."""

    num_workers: int
    persistent: bool
    shuffle: bool
    drop_last: bool

    def loader(self) -> tuple[Any, StructuredDataset]:
        extra = {"persistent_workers": True} if self.persistent else {}
        return StructuredDataset.create_dataloader(
            str(_ROOT), batch_size=BATCH, split_bytes=1, shuffle=self.shuffle, shuffle_seed=3,
            drop_last=self.drop_last, num_workers=self.num_workers, **extra,
        )  # fmt: skip


_REFERENCE: dict[tuple[Shape, int], list[list[int]]] = {}


def reference(shape: Shape, epoch: int) -> list[list[int]]:
    """The uninterrupted epoch's batches (row ids), from a fresh loader."""
    key = (Shape(shape.num_workers, False, shape.shuffle, shape.drop_last), epoch)
    if key not in _REFERENCE:
        loader, dataset = key[0].loader()
        dataset.set_epoch(epoch)
        _REFERENCE[key] = [ids_of(b) for b in loader]
    return _REFERENCE[key]


@dataclass
class Expect:
    """What the running (or next) iteration must deliver: the reference batches from ``pos``
    (exact), or any of ``left`` once each (after an elastic resume)."""

    epoch: int
    exact: list[list[int]] | None
    pos: int = 0
    left: set[int] = field(default_factory=set)
    delivered: set[int] = field(default_factory=set)  # rows of the epoch, before and now

    def take(self, batch: list[int]) -> None:
        assert not set(batch) & self.delivered, f"rows delivered twice: {batch}"
        if self.exact is not None:
            assert self.pos < len(self.exact), f"a batch after the epoch's end: {batch}"
            assert batch == self.exact[self.pos], f"batch {self.pos}: {batch}"
            self.pos += 1
        else:
            assert set(batch) <= self.left, f"rows not left to deliver: {batch}"
            self.left -= set(batch)
        self.delivered |= set(batch)

    def check_end(self, shape: Shape) -> None:
        if self.exact is not None:
            assert self.pos == len(self.exact), f"ended after {self.pos} of {len(self.exact)}"
        missing = TOTAL - len(self.delivered)
        streams = max(1, shape.num_workers)
        assert missing == 0 if not shape.drop_last else 0 <= missing < BATCH * streams

    def copy(self) -> Expect:
        return Expect(self.epoch, self.exact, self.pos, set(self.left), set(self.delivered))


def fresh(shape: Shape, epoch: int) -> Expect:
    return Expect(epoch, reference(shape, epoch))


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.shape: Shape
        self.loader: Any = None
        self.iterators: list[Any] = []  # older ones first; the last is the running one
        self.running: Expect | None = None  # what the running iterator delivers
        self.next_start: Expect
        self.checkpoints: list[tuple[dict[str, Any], Expect, Shape]] = []
        self.loaded_epoch: int | None = None  # a state loaded, not yet iterated
        self.described: Expect | None  # what state_dict() describes
        # An iteration begins at its first next(), not at iter(): between the two,
        # set_epoch/load_state_dict/state_dict act on what comes before it (checkpoints.md);
        # the model stays out of that window.
        self.pending = False

    @initialize(
        workers=st.sampled_from([0, 2]), persistent=st.booleans(), shuffle=st.booleans(),
        drop_last=st.booleans(),
    )  # fmt: skip
    def build(self, workers: int, persistent: bool, shuffle: bool, drop_last: bool) -> None:
        self.shape = Shape(workers, persistent and workers > 0, shuffle, drop_last)
        self.loader, self.dataset = self.shape.loader()
        self.next_start = fresh(self.shape, 0)
        self.described = self.next_start

    @rule()
    def new_iterator(self) -> None:
        """``iter(loader)`` (an old iterator stays alive): the next iteration begins."""
        self.iterators.append(iter(self.loader))
        if not self.pending:  # else the one before never began: this one takes its start
            self.running = self.next_start
            # after this iteration, another begins its epoch afresh unless a state is loaded
            self.next_start = fresh(self.shape, self.running.epoch)
            self.loaded_epoch = None
        self.pending = True

    @precondition(lambda self: self.running is not None)
    @rule(k=st.integers(1, 6))
    def take(self, k: int) -> None:
        assert self.running is not None
        if self.pending:  # the iteration begins now (set_epoch later: the state is the new
            self.described, self.pending = self.running, False  # epoch's, as documented)
        for _ in range(k):
            batch = next(self.iterators[-1], None)
            if batch is None:
                self.running.check_end(self.shape)
                self.running = None
                return
            self.running.take(ids_of(batch))

    @precondition(lambda self: len(self.iterators) > 1)
    @rule(collect=st.booleans())
    def drop_an_old_iterator(self, collect: bool) -> None:
        """``del`` an older iterator (or leave it to the garbage collector, in a cycle)."""
        old = self.iterators.pop(0)
        if collect:
            cycle: list[Any] = [old]
            cycle.append(cycle)
            del cycle
        del old
        gc.collect()

    @precondition(lambda self: not self.pending)
    @rule()
    def checkpoint(self) -> None:
        assert self.described is not None
        state = json.loads(json.dumps(self.loader.state_dict()))
        assert state["epoch"] == self.described.epoch
        self.checkpoints.append((state, self.described.copy(), self.shape))

    @precondition(lambda self: bool(self.checkpoints) and not self.pending)
    @rule(pick=st.integers(0, 10**6), elastic=st.booleans(), workers=st.sampled_from([0, 2]))
    def resume(self, pick: int, elastic: bool, workers: int) -> None:
        """A fresh loader (as in a new process) loads a checkpoint; old iterators go."""
        state, expect, shape = self.checkpoints[pick % len(self.checkpoints)]
        if not elastic:
            workers = shape.num_workers
        self._drop_all()
        self.shape = Shape(workers, shape.persistent and workers > 0, shape.shuffle,
                           shape.drop_last)  # fmt: skip
        self.loader, self.dataset = self.shape.loader()
        if elastic:
            self.loader.load_state_dict([state], elastic=True)
            every = set(range(TOTAL))
            expect = Expect(expect.epoch, None, 0, every - expect.delivered, expect.delivered)
        else:
            self.loader.load_state_dict(state)
            expect = expect.copy()
        self.next_start, self.loaded_epoch, self.described = expect, expect.epoch, expect

    @precondition(lambda self: not self.pending)
    @rule(epoch=st.integers(0, 2))
    def set_epoch(self, epoch: int) -> None:
        if self.loaded_epoch == epoch:  # documented: discards the resume, with a warning
            with pytest.warns(UserWarning, match="discards the checkpoint's progress"):
                self.dataset.set_epoch(epoch)
        else:
            self.dataset.set_epoch(epoch)
        self.next_start, self.loaded_epoch = fresh(self.shape, epoch), None
        self.described = self.next_start

    @invariant()
    def the_state_is_json_safe(self) -> None:
        if self.loader is not None and not self.pending:
            state = self.loader.state_dict()
            assert json.loads(json.dumps(state)) == state

    def _drop_all(self) -> None:
        self.iterators.clear()
        self.running, self.pending = None, False
        gc.collect()

    def teardown(self) -> None:
        self._drop_all()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            self.loader = None
            gc.collect()


Lifecycle.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_lifecycle = pytest.mark.timeout(600)(Lifecycle.TestCase)
