"""Ranged reads of remote objects for pyarrow, and the read-ahead of one stream's pieces.

- ``RemoteObject``: one object's size and name, and ``get(start, stop)``: one ranged GET,
  retried on transient errors (``storage.retry``); a persistent failure raises ``DataSourceError``
  naming the object and the byte range.
- ``Group``: bytes fetched together: the byte spans of one or more whole consecutive units (row
  groups, record batches) of one piece, at most ``WINDOW`` bytes unless one unit is larger,
  merged across small holes (at most ``HOLE`` bytes and 1/16 of the merged span).
- ``ReadAhead``: one lane of a stream: the groups its pieces read, in reading order, fetched in
  the background at most ``AHEAD_BYTES`` past the group being read (at least one group), so
  I/O overlaps decoding and nothing is fetched that the lane does not read.
- ``RemoteFile``: the seekable file pyarrow reads one piece through. A read inside the piece's
  groups is served from its lane (a zero-copy ``memoryview``); any other read is one GET of
  exactly the bytes asked (the last one, if small, kept for reads inside it); ``known`` bytes
  (a footer the index kept) are never fetched.
"""

from __future__ import annotations

import bisect
import io
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..base.errors import DataSourceError
from ..base.stages import BYTES_FETCHED, REQUESTS, STORAGE, Stage, count
from .backends import cause
from .retry import DEFAULT_RETRY, RetryPolicy, retry_call, tries
from .secrets import exception_texts

__all__ = [
    "AHEAD_BYTES",
    "HOLE",
    "WINDOW",
    "Group",
    "PieceReads",
    "ReadAhead",
    "RemoteFile",
    "RemoteObject",
    "plan_groups",
    "storage_error",
]

WINDOW = 32 * 2**20
AHEAD_BYTES = 2 * WINDOW
HOLE = 64 * 2**10
_FETCH_THREADS = 4
_KEEP_LAST = 2**20  # a direct read up to this size is kept: a re-read inside it is free

Span = tuple[int, int]  # [start, stop) byte offsets
Fetch = Callable[[int, int], bytes]


class RemoteObject:
    """``size`` bytes of the object ``name`` (its display name), read by ``fetch(start, stop)``."""

    def __init__(
        self,
        fetch: Fetch,
        size: int,
        name: str,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        redact: Callable[[str], str] = str,
    ) -> None:
        self._fetch, self.size, self.name = fetch, size, name
        self._retry, self._redact = retry, redact

    def get(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)``: one GET, retried; ``DataSourceError`` naming the range."""

        def attempt() -> bytes:
            data = self._fetch(start, stop)
            count(REQUESTS)
            count(BYTES_FETCHED, len(data))
            if len(data) != stop - start:
                raise ConnectionError(
                    f"short read: {len(data)} of {stop - start} bytes (connection closed early)"
                )
            return data

        began = time.monotonic()
        what = f"reading {self.name} bytes [{start}, {stop})"
        try:
            return retry_call(attempt, self._retry, what=what, redact=self._redact)
        except Exception as exc:
            how = tries(exc, self._retry, time.monotonic() - began)
            text = f"cannot read {self.name} bytes [{start}, {stop}) {how}: {cause(exc)}"
            error = storage_error(text, exc, self._redact)
        raise error  # outside the handler: no __context__ (see storage_error)


def storage_error(
    text: str,
    exc: BaseException,
    redact: Callable[[str], str],
    kind: type[OSError] = DataSourceError,
) -> OSError:
    """``kind(text)``, credentials scrubbed, with ``exc`` as its cause unless a credential is
    in a text of ``exc`` or of any exception reachable from it (``exception_texts``).

    Raise it outside the ``except`` block that caught ``exc``: raised inside, Python sets its
    ``__context__`` to ``exc``, credentials included, whatever its cause says.
    """
    error = kind(redact(text))
    held = any(redact(t) != t for t in exception_texts(exc))
    error.__cause__ = None if held else exc
    return error


@dataclass(frozen=True)
class Group:
    """Sorted, disjoint byte spans of whole units, fetched together."""

    spans: tuple[Span, ...]

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.spans)


def plan_groups(
    unit_spans: Iterable[Sequence[Span]], window: int | None = None, hole: int = HOLE
) -> list[Group]:
    """Consecutive units' spans in groups of at most ``window`` bytes (a larger unit alone)."""
    window = WINDOW if window is None else window
    groups: list[Group] = []
    current: list[Span] = []
    size = 0
    for spans in unit_spans:
        unit_size = sum(b - a for a, b in spans)
        if current and size + unit_size > window:
            groups.append(Group(tuple(_merge(sorted(current), hole))))
            current, size = [], 0
        current.extend(spans)
        size += unit_size
    if current:
        groups.append(Group(tuple(_merge(sorted(current), hole))))
    return groups


def _merge(spans: Sequence[Span], hole: int) -> list[Span]:
    """``spans`` (sorted) merged where they touch or a hole is small: at most ``hole`` bytes and
    1/16 of the merged span, so merging reads at most ~6 % more than asked."""
    merged: list[Span] = []
    for a, b in spans:
        if merged:
            first, last = merged[-1]
            gap = a - last
            if gap <= 0 or (gap <= hole and gap * 16 <= b - first):
                merged[-1] = (first, max(last, b))
                continue
        merged.append((a, b))
    return merged


_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _reset_after_fork() -> None:
    global _pool_lock, _pool
    _pool_lock, _pool = threading.Lock(), None


os.register_at_fork(after_in_child=_reset_after_fork)


def _fetch_pool() -> ThreadPoolExecutor:
    """One small fetch pool per process, created after fork (pools do not survive a fork)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(_FETCH_THREADS, "tdu-fetch"))
        return _pool[1]


class _Fetching:
    """One group's bytes, fetched in the background: one GET per span, cut at ``WINDOW``."""

    def __init__(self, obj: RemoteObject, group: Group) -> None:
        pool = _fetch_pool()
        self.name = obj.name
        self._parts = [
            (a, min(a + WINDOW, stop), pool.submit(obj.get, a, min(a + WINDOW, stop)))
            for start, stop in group.spans
            for a in range(start, stop, WINDOW)
        ]
        self._starts = [a for a, _, _ in self._parts]

    def read(self, start: int, stop: int) -> bytes | memoryview | None:
        """Bytes ``[start, stop)`` when the group holds all of them, else ``None``."""
        i = bisect.bisect_right(self._starts, start) - 1
        out: list[memoryview] = []
        pos = start
        while pos < stop:
            if i < 0 or i >= len(self._parts) or not self._parts[i][0] <= pos < self._parts[i][1]:
                return None
            a, b, future = self._parts[i]
            take = min(stop, b)
            out.append(memoryview(future.result())[pos - a : take - a])
            pos, i = take, i + 1
        return out[0] if len(out) == 1 else b"".join(out)

    def cancel(self) -> None:
        for _, _, future in self._parts:
            future.cancel()


Key = tuple[int, int]  # (piece number in the lane, group number in the piece)


@dataclass
class _Planned:
    key: Key
    obj: RemoteObject
    group: Group
    fetching: _Fetching | None = None

    def start(self) -> _Fetching:
        if self.fetching is None:
            self.fetching = _Fetching(self.obj, self.group)
        return self.fetching


class ReadAhead:
    """The groups one lane reads, in order; those after the one being read fetched ahead.

    ``planned`` yields ``(key, object, group)`` in reading order, keys increasing; it is pulled
    lazily, only as far as the read-ahead reaches. Used by one thread (the stream's).
    """

    def __init__(
        self, planned: Iterable[tuple[Key, RemoteObject, Group]], ahead: int | None = None
    ) -> None:
        self._planned: Iterator[tuple[Key, RemoteObject, Group]] = iter(planned)
        self._ahead = AHEAD_BYTES if ahead is None else ahead
        self._queue: deque[_Planned] = deque()

    def take(self, key: Key) -> _Fetching | None:
        """The group planned under ``key`` (fetching); planned groups before it are dropped
        unread. ``None`` when ``key`` is not planned."""
        while True:
            if not self._queue and not self._pull():
                return None
            if self._queue[0].key > key:
                return None
            head = self._queue.popleft()
            if head.key == key:
                break
            if head.fetching is not None:
                head.fetching.cancel()
        fetching = head.start()
        self._fill()
        return fetching

    def close(self) -> None:
        """Cancel every fetch not yet taken."""
        for planned in self._queue:
            if planned.fetching is not None:
                planned.fetching.cancel()
        self._queue.clear()
        self._planned = iter(())

    def _pull(self) -> bool:
        item = next(self._planned, None)
        if item is None:
            return False
        self._queue.append(_Planned(*item))
        return True

    def _fill(self) -> None:
        """Start the queued groups up to ``ahead`` bytes (at least the next one)."""
        budget, i = self._ahead, 0
        while i < len(self._queue) or self._pull():
            planned = self._queue[i]
            if i and planned.group.nbytes > budget:
                return
            budget -= planned.group.nbytes
            planned.start()
            i += 1


@dataclass(frozen=True)
class PieceReads:
    """What one piece reads: its ``groups``, fetched by ``lane`` under ``(piece, i)``;
    ``owned``: the lane serves this piece alone and closes with its file."""

    lane: ReadAhead
    piece: int
    groups: tuple[Group, ...]
    owned: bool = False


class RemoteFile(io.RawIOBase):
    """A read-only, seekable view of a ``RemoteObject`` for pyarrow.

    With ``reads``, bytes inside the piece's groups come from its lane; ``known`` is
    ``(offset, bytes)`` of the object already held (a footer), never fetched again.
    """

    def __init__(
        self,
        obj: RemoteObject,
        *,
        reads: PieceReads | None = None,
        known: tuple[int, bytes] | None = None,
    ) -> None:
        super().__init__()
        self._obj, self.name = obj, obj.name
        self._reads, self._known = reads, known
        self._pos = 0
        spans = [
            (a, b, g)
            for g, group in enumerate(reads.groups if reads is not None else ())
            for a, b in group.spans
        ]
        spans.sort()
        self._spans = spans
        self._span_starts = [a for a, _, _ in spans]
        self._group = -1  # the group being read
        self._held: _Fetching | None = None
        self._last: tuple[int, bytes] = (0, b"")  # the last small direct read

    # ------------------------------------------------------------------ file protocol

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._obj.size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._obj.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position in {self.name}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> Any:
        """Up to ``size`` bytes from the position, as a zero-copy ``memoryview`` when they lie
        in one fetched part (pyarrow wraps it without copying), else ``bytes``."""
        if self.closed:
            raise ValueError(f"read of closed file {self.name}")
        end = self._obj.size
        stop = end if size is None or size < 0 else min(end, self._pos + size)
        if stop <= self._pos:
            return b""
        data = self._read_range(self._pos, stop)
        self._pos = stop
        return data

    def readall(self) -> bytes:
        return bytes(self.read(-1))

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer)[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._held = None
        if self._reads is not None and self._reads.owned:
            self._reads.lane.close()
        super().close()

    # ------------------------------------------------------------------ reading

    def _read_range(self, start: int, stop: int) -> bytes | memoryview:
        with Stage(STORAGE):  # waiting for bytes fetched ahead, or fetching them now
            return self._bytes(start, stop)

    def _bytes(self, start: int, stop: int) -> bytes | memoryview:
        if self._known is not None:
            at, known = self._known
            if at <= start and stop <= at + len(known):
                return memoryview(known)[start - at : stop - at]
        group = self._group_of(start)
        if group is not None and group >= self._group and self._reads is not None:
            if group > self._group:
                key = (self._reads.piece, group)
                fetching = self._reads.lane.take(key)
                self._group = group
                self._held = fetching or _Fetching(self._obj, self._reads.groups[group])
            assert self._held is not None
            data = self._held.read(start, stop)
            if data is not None:
                return data
        at, last = self._last
        if at <= start and stop <= at + len(last):  # pyarrow's footer, then its last 8 bytes
            return memoryview(last)[start - at : stop - at]
        data = self._obj.get(start, stop)
        if len(data) <= _KEEP_LAST:
            self._last = (start, data)
        return data

    def _group_of(self, offset: int) -> int | None:
        i = bisect.bisect_right(self._span_starts, offset) - 1
        if i < 0 or offset >= self._spans[i][1]:
            return None
        return self._spans[i][2]
