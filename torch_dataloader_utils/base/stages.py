"""Where a process's reading time goes: seconds per stage and counts, for ``loader.stats()``.

Each process (a DataLoader worker, or the training process) keeps running totals: the
seconds its threads spent in each of ``STAGES`` and the counts of ``COUNTS``. A stage is
entered around a piece of work (``timed`` around an iterator's ``next()``, ``Stage`` around a
call); stages nest, and a stage's time excludes the stages entered inside it, so a chunk's
decoding is not counted again as the shuffle window that asked for it. Time outside every
stage is not counted. The cost is two clock reads per entry, once per chunk, window, packet
or batch, never per row.

Each thread has its own stack of stages and its own totals (no lock on the clock path);
``snapshot()`` sums the threads' (those of threads that ended are folded into one sum).
Counts (bytes fetched, requests, retries) are added by the fetching threads under a lock:
they are exact. The figures are cumulative for the process: whoever reads them subtracts a
snapshot taken when its span began.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from time import perf_counter
from typing import Any, Final, TypeVar

import numpy as np

__all__ = [
    "BLOCKED",
    "BYTES_FETCHED",
    "COUNTS",
    "DECODE",
    "FIGURES",
    "LISTING",
    "PACKING",
    "READ_AHEAD",
    "REQUESTS",
    "RETRIES",
    "SHUFFLE",
    "STAGES",
    "STORAGE",
    "TRANSFORM",
    "TRANSPORT",
    "Stage",
    "count",
    "snapshot",
    "timed",
]

# The stages, by index into a snapshot. docs/observability.md says what each one holds.
STAGES: Final = (
    "listing",  # listing files, reading footers, cutting splits (the dataset's index)
    "storage",  # waiting for bytes from an object store (fetched ahead in threads)
    "decode",  # decoding units into chunks, cutting them into batches, converting them
    "shuffle",  # filling a shuffle window with decoded rows and gathering its rows
    "transform",  # the user's transform, the tokenizer
    "packing",  # token packing
    "transport",  # packing batches into shared memory and pickling (worker); unpacking (main)
    "blocked",  # a worker waiting for a free slot: the main process has not taken its batches
    "read_ahead",  # the training process waiting for its workers or its read-ahead thread
)
LISTING, STORAGE, DECODE, SHUFFLE, TRANSFORM, PACKING, TRANSPORT, BLOCKED, READ_AHEAD = range(9)
COUNTS: Final = ("bytes_fetched", "requests", "retries")
BYTES_FETCHED, REQUESTS, RETRIES = range(3)
# A snapshot: the stages' seconds, then the counts.
FIGURES: Final = len(STAGES) + len(COUNTS)

T = TypeVar("T")


class _Thread(threading.local):
    """One thread's stack of stages and its totals (registered once, summed by snapshot)."""

    def __init__(self) -> None:
        self.totals = [0.0] * len(STAGES)
        self.stack: list[int] = []
        self.mark = 0.0
        with _lock:
            _threads.append(self.totals)
        # a thread that ended (a read-ahead thread per iteration) folds into _ended
        weakref.finalize(threading.current_thread(), _thread_ended, self.totals)


def _thread_ended(totals: list[float]) -> None:
    with _lock:
        _threads.remove(totals)
        for i, seconds in enumerate(totals):
            _ended[i] += seconds


_lock = threading.RLock()  # re-entered by _thread_ended when GC runs under it
_threads: list[list[float]] = []
_ended = [0.0] * len(STAGES)  # the seconds of threads that ended
_counts = [0] * len(COUNTS)
_local = _Thread()


def _reset_after_fork() -> None:
    """A worker forked while a fetching thread held the lock must not wait for it forever."""
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _enter(stage: int) -> None:
    state = _local
    now = perf_counter()
    if state.stack:
        state.totals[state.stack[-1]] += now - state.mark
    state.stack.append(stage)
    state.mark = now


def _leave() -> None:
    state = _local
    now = perf_counter()
    state.totals[state.stack.pop()] += now - state.mark
    state.mark = now


class Stage:
    """``with Stage(DECODE): ...``: the block's time (less nested stages') counts as ``stage``."""

    __slots__ = ("_stage",)

    def __init__(self, stage: int) -> None:
        self._stage = stage

    def __enter__(self) -> None:
        _enter(self._stage)

    def __exit__(self, *exc: object) -> None:
        _leave()


def timed(items: Iterable[T], stage: int) -> Iterator[T]:
    """``items``, the time spent getting each one counted as ``stage``; closing this closes
    ``items`` (a generator's clean-up runs at once)."""
    it = iter(items)
    try:
        while True:
            _enter(stage)
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                _leave()
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def count(figure: int, n: int = 1) -> None:
    """Add ``n`` to count ``figure`` (an index into ``COUNTS``); any thread."""
    with _lock:
        _counts[figure] += n


def snapshot() -> np.ndarray[Any, np.dtype[np.float64]]:
    """This process's figures now: seconds per stage of all its threads, then the counts."""
    with _lock:
        seconds = np.sum([_ended, *_threads], axis=0)
        return np.concatenate((seconds, np.asarray(_counts, dtype=np.float64)))
