"""Batches handed out but not yet read: what a trainer that reads ahead holds back.

A training loop that reads ahead (Lightning's fetcher when the loader has no ``len()``, a
loop that fetches the next batch before the step) takes a batch from the loader before the
step on the previous one has used it. A state taken then counts that batch as consumed, and
a resume from it would never train it. So the loader hands out each dict batch as an
``UnreadBatch``: a plain ``dict`` that tells the loader when it is first read (any key,
value or item looked at, or pickled). ``state_dict()`` then describes what the loop has read:
the position before the first batch handed out and not read since, not the loader's.

Reading a batch marks it, and every batch handed out before it, as consumed: a training step
reads its batch (to move it to a device, to index it, to unpack it into ``model(**batch)``).
Only batches held unread *after* one that was read count as read ahead; a loop that has read
nothing yet (``list(loader)``, ``next(it)`` without a look) has consumed what it took.
Batches that are not dicts (``output="arrow"``, a transform returning a tuple) cannot tell,
and count as consumed when handed out.

While the loop has read none, the dict batches it still holds can be refilled in place
(``start_over``): ``api.feed`` restarts the iteration in a later epoch under them when a trainer
moves the loader after it took them (Lightning resumed from an epoch-end checkpoint).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from ..mixing.epochs import AnyProgress
from ..planning.epochs import Start

__all__ = ["KEEP", "HandOuts", "Mark", "UnreadBatch"]

# Positions kept for batches held unread: a trainer reads ahead by a few batches, not more.
KEEP = 64


@dataclass(frozen=True)
class Mark:
    """Where delivery stood before a batch was handed out: the iteration's progress with its
    positions and cursor then, or (``progress`` None) the start of an iteration not begun."""

    progress: AnyProgress | None
    positions: dict[int, int]
    cursor: int
    start: Start


class HandOuts:
    """One iteration's batches handed out (numbered from 1) and how far the loop has read.

    Keeps the ``Mark`` before each batch handed out and not read; reading batch ``n`` drops
    the marks up to ``n``.
    """

    def __init__(self) -> None:
        self.progress: AnyProgress | None = None  # the iteration's, once it has begun
        self._handed = 0
        self._read = 0
        self._marks: dict[int, Mark] = {}
        self._held: list[weakref.ref[UnreadBatch]] = []  # while none is read (``start_over``)
        self.opaque = False  # a batch that is not a dict was handed out

    def hand_out(
        self,
        batch: Any,
        mark: Mark,
        progress: AnyProgress | None,
        into: UnreadBatch | None = None,
    ) -> Any:
        """``batch``, numbered and marked; an ``UnreadBatch`` if it is a dict (``into``,
        refilled, when given: a batch the loop holds from before ``start_over``)."""
        self.progress = progress
        self._handed += 1
        if type(batch) is not dict:  # cannot tell when it is read: consumed now
            self.opaque = True
            self.read(self._handed)
            return batch
        self._marks[self._handed] = mark
        self._marks.pop(self._handed - KEEP, None)  # held that far ahead: not a read-ahead
        unread = UnreadBatch() if into is None else into
        unread.hold(batch, self, self._handed)
        if not self._read and self._handed <= KEEP:
            self._held.append(weakref.ref(unread))
        return unread

    def read(self, number: int) -> None:
        """Batch ``number`` has been read: it and every batch before it are consumed."""
        for n in range(self._read + 1, number + 1):
            self._marks.pop(n, None)
        self._read = max(self._read, number)
        self._held.clear()

    def start_over(self) -> list[UnreadBatch] | None:
        """The iteration restarts, none of its batches read: the batches the loop still
        holds (in order, to hand out again refilled); the numbering begins again. ``None``
        if more than ``KEEP`` were handed out unread (not a trainer reading ahead)."""
        if not self.none_read() or self._handed > KEEP:
            return None
        held = [batch for ref in self._held if (batch := ref()) is not None]
        self.progress, self._handed, self._marks, self._held = None, 0, {}, []
        return held

    def none_read(self) -> bool:
        """Whether batches were handed out and the loop has read none of them yet."""
        return self._handed > 0 and not self._read

    def unread(self) -> tuple[int, Mark | None] | None:
        """How many batches the loop holds unread ahead of one it has read, and the mark
        before the first of them (``None``: more than ``KEEP`` ahead, no longer kept);
        ``None`` if it holds none, or has read none (a loop that collects batches unread,
        ``list(loader)``, has consumed what it collected)."""
        if not self._read or self._handed == self._read:
            return None
        return self._handed - self._read, self._marks.get(self._read + 1)


class UnreadBatch(dict[str, Any]):
    """A dict batch that tells its ``HandOuts`` when it is first read.

    Any read (item, key, value, iteration, membership, pickling, copying) counts; after the
    first, it behaves and costs as a plain ``dict``. Copies and pickles are plain dicts.
    """

    __slots__ = ("__weakref__", "_handouts", "_number")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handouts: HandOuts | None = None  # a trainer's rebuilt copy tells nobody
        self._number = 0

    def hold(self, batch: dict[str, Any], handouts: HandOuts, number: int) -> None:
        """Hold ``batch`` (only it), as batch ``number`` handed out by ``handouts``."""
        super().clear()
        super().update(batch)
        self._handouts = handouts
        self._number = number

    def _reading(self) -> None:
        if self._handouts is not None:
            self._handouts.read(self._number)
            self._handouts = None

    def __getitem__(self, key: str) -> Any:
        self._reading()
        return super().__getitem__(key)

    def __iter__(self) -> Any:  # also makes dict(b), {**b} and f(**b) go through keys()
        self._reading()
        return super().__iter__()

    def __contains__(self, key: object) -> bool:
        self._reading()
        return super().__contains__(key)

    def __eq__(self, other: object) -> bool:
        self._reading()
        return super().__eq__(other)

    __hash__ = None

    def get(self, key: str, default: Any = None) -> Any:
        self._reading()
        return super().get(key, default)

    def keys(self) -> Any:
        self._reading()
        return super().keys()

    def values(self) -> Any:
        self._reading()
        return super().values()

    def items(self) -> Any:
        self._reading()
        return super().items()

    def pop(self, key: str, *default: Any) -> Any:
        self._reading()
        return super().pop(key, *default)

    def copy(self) -> dict[str, Any]:
        self._reading()
        return dict(super().items())

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._reading()
        return dict, (dict(super().items()),)
