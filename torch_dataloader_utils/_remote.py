"""Ranged, coalesced, read-ahead reads of one remote object for pyarrow.

``RemoteFile`` is a read-only, seekable file object. It never asks the filesystem for more
than it was told is needed:

- Without a layout (footer reads while indexing, Arrow IPC files) every read is one ranged GET
  of exactly the bytes asked for (small reads are rounded up to ``MIN_READ`` within the object).
- With a ``Layout`` (the byte spans of each Parquet row group's projected column chunks and the
  row groups where splits begin), the first read of a row group plans the rest of its split:
  the spans of the split's remaining row groups, merged across holes up to ``HOLE`` bytes and
  cut into windows of at most ``WINDOW`` bytes. Windows are fetched in the background, at most
  ``AHEAD`` beyond the one being read, so a stream holds at most ``(AHEAD + 1) * WINDOW``
  bytes of read-ahead at a time; the windows behind the reader are dropped.

Every GET is retried on transient errors (``_retry``); a persistent failure raises
``DataSourceError`` naming the object and the byte range.
"""

from __future__ import annotations

import bisect
import io
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ._errors import DataSourceError
from ._retry import DEFAULT_RETRY, RetryPolicy, is_transient, retry_call

__all__ = ["AHEAD", "HOLE", "WINDOW", "Layout", "RemoteFile", "parquet_layout"]

WINDOW = 32 * 2**20
AHEAD = 1
HOLE = 1 * 2**20
MIN_READ = 64 * 2**10
_FETCH_THREADS = 4

Span = tuple[int, int]  # [start, stop) byte offsets


@dataclass(frozen=True)
class Layout:
    """Where a file's units (row groups) live: merged byte spans per unit, split start units."""

    unit_spans: tuple[tuple[Span, ...], ...]
    split_starts: tuple[int, ...]

    def unit_at(self, offset: int) -> int | None:
        """The unit one of whose spans holds byte ``offset``; ``None`` outside all of them."""
        for unit, spans in enumerate(self.unit_spans):
            if any(a <= offset < b for a, b in spans):
                return unit
        return None

    def split_end(self, unit: int) -> int:
        """The first unit after ``unit`` that starts another split."""
        i = bisect.bisect_right(self.split_starts, unit)
        return self.split_starts[i] if i < len(self.split_starts) else len(self.unit_spans)

    def windows(self, unit: int, window: int | None = None, hole: int | None = None) -> list[Span]:
        """Byte windows covering units ``[unit, split_end)``: merged, each at most ``window``."""
        window = WINDOW if window is None else window
        spans = sorted(s for u in range(unit, self.split_end(unit)) for s in self.unit_spans[u])
        merged = _merge(spans, HOLE if hole is None else hole)
        return [(start, min(start + window, b)) for a, b in merged for start in range(a, b, window)]


def parquet_layout(
    footer: Any, columns: Sequence[str] | None, split_starts: Sequence[int]
) -> Layout:
    """The ``Layout`` of a Parquet file from its parsed footer, for the projected columns."""
    wanted = None if columns is None else set(columns)
    spans = []
    for r in range(footer.num_row_groups):
        group = footer.row_group(r)
        chunks = []
        for c in range(group.num_columns):
            col = group.column(c)
            if wanted is not None and col.path_in_schema.split(".")[0] not in wanted:
                continue
            start = col.data_page_offset
            if col.has_dictionary_page and 0 < col.dictionary_page_offset < start:
                start = col.dictionary_page_offset
            chunks.append((start, start + col.total_compressed_size))
        spans.append(tuple(_merge(sorted(chunks), 0)))
    return Layout(tuple(spans), tuple(sorted(set(split_starts))))


def _merge(spans: Sequence[Span], hole: int) -> list[Span]:
    merged: list[Span] = []
    for a, b in spans:
        if merged and a - merged[-1][1] <= hole:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
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


Fetch = Callable[[int, int], bytes]


class RemoteFile(io.RawIOBase):
    """A read-only view of ``size`` bytes fetched through ``fetch(start, stop)``.

    ``name`` is the object's display name, used in errors; ``redact`` scrubs messages.
    """

    def __init__(
        self,
        fetch: Fetch,
        size: int,
        name: str,
        *,
        layout: Layout | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        redact: Callable[[str], str] = str,
        prefetched: dict[Span, Future[bytes]] | None = None,
    ) -> None:
        super().__init__()
        self._fetch, self._size, self.name = fetch, size, name
        self._layout, self._retry, self._redact = layout, retry, redact
        self._pos = 0
        self._windows: list[Span] = []
        self._starts: list[int] = []
        self._futures: dict[int, Future[bytes]] = {}
        self._prefetched = dict(prefetched or {})  # windows fetched before this file opened
        self._current = -1  # index of the window being read
        self._block: tuple[int, bytes] = (0, b"")  # the last small direct read, rounded up
        self.requests = 0
        self.bytes_fetched = 0

    # ------------------------------------------------------------------ file protocol

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position in {self.name}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> Any:
        """Up to ``size`` bytes from the position, as a zero-copy ``memoryview`` when they lie
        in one fetched window (pyarrow wraps it without copying), else ``bytes``."""
        if self.closed:
            raise ValueError(f"read of closed file {self.name}")
        stop = self._size if size is None or size < 0 else min(self._size, self._pos + size)
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
        for future in [*self._futures.values(), *self._prefetched.values()]:
            future.cancel()
        self._futures.clear()
        self._prefetched.clear()
        super().close()

    # ------------------------------------------------------------------ reading

    def _read_range(self, start: int, stop: int) -> bytes | memoryview:
        if self._layout is not None and not self._windows:
            self._plan_windows(start)
        window = self._window_of(start)
        if window is None:
            return self._direct(start, stop)
        parts: list[bytes | memoryview] = []
        pos = start
        while pos < stop:
            if window is None or window >= len(self._windows):
                parts.append(self._direct(pos, stop))
                break
            a, b = self._windows[window]
            if pos < a:  # a gap between windows: bytes nobody planned for
                parts.append(self._direct(pos, min(a, stop)))
                pos = min(a, stop)
                continue
            data = self._window_data(window)
            take = min(stop, b)
            parts.append(memoryview(data)[pos - a : take - a])
            pos, window = take, window + 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _plan_windows(self, offset: int) -> None:
        assert self._layout is not None
        unit = self._layout.unit_at(offset)
        if unit is None:
            return
        self._windows = self._layout.windows(unit)
        self._starts = [a for a, _ in self._windows]

    def _window_of(self, offset: int) -> int | None:
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset >= self._windows[i][1] or i < self._current:
            return None
        return i

    def _window_data(self, window: int) -> bytes:
        """Window ``window``'s bytes; keeps ``AHEAD`` windows after it in flight."""
        if window != self._current:
            for old in [w for w in self._futures if w < window]:
                self._futures.pop(old).cancel()
            self._current = window
        for ahead in range(window, min(window + AHEAD + 1, len(self._windows))):
            if ahead not in self._futures:
                a, b = self._windows[ahead]
                early = self._prefetched.pop((a, b), None)
                self._futures[ahead] = early or _fetch_pool().submit(self._get, a, b)
        return self._futures[window].result()

    def prefetch(self, unit: int) -> dict[Span, Future[bytes]]:
        """Start fetching the first windows of the split entered at ``unit``; for the next open."""
        if self._layout is None:
            return {}
        windows = self._layout.windows(unit)[: AHEAD + 1]
        return {(a, b): _fetch_pool().submit(self._get, a, b) for a, b in windows}

    def _direct(self, start: int, stop: int) -> bytes | memoryview:
        """Bytes ``[start, stop)``; a small read is rounded up to ``MIN_READ`` and kept."""
        at, block = self._block
        if at <= start and stop <= at + len(block):
            return memoryview(block)[start - at : stop - at]
        if stop - start >= MIN_READ:
            return self._get(start, stop)
        end = min(self._size, max(stop, start + MIN_READ))
        self._block = (start, self._get(start, end))
        return memoryview(self._block[1])[: stop - start]

    def _get(self, start: int, stop: int) -> bytes:
        def attempt() -> bytes:
            data = self._fetch(start, stop)
            if len(data) != stop - start:
                raise ConnectionError(
                    f"short read: {len(data)} of {stop - start} bytes (connection closed early)"
                )
            return data

        try:
            data = retry_call(
                attempt, self._retry, what=f"reading {self.name} bytes [{start}, {stop})"
            )
        except Exception as exc:
            error = self._failure(start, stop, exc)
            raise error from error.__cause__
        self.requests += 1
        self.bytes_fetched += len(data)
        return data

    def _failure(self, start: int, stop: int, exc: Exception) -> DataSourceError:
        """The error for a range that could not be read, credentials scrubbed, cause kept."""
        tries = (
            f"after {self._retry.attempts} attempts (set TDU_RETRY_ATTEMPTS to retry longer)"
            if is_transient(exc)
            else "(not retried: the error is not transient)"
        )
        text = f"cannot read {self.name} bytes [{start}, {stop}) {tries}: {exc}"
        error = DataSourceError(self._redact(text))
        error.__cause__ = exc if self._redact(text) == text else None
        return error
