"""Reading a shuffled share, window by window in the order of ``planning.order``.

A window's blocks are read in storage order into a ``Window``, then its rows handed out in the
window's keyed random permutation; the next window is read in a thread meanwhile. Blocks of a
unit (row group) that was sliced between consecutive windows are read once: the parts of the
later windows are carried until their window is read.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ..base.stages import SHUFFLE, Stage
from ..index.index import DatasetIndex
from ..planning.bijection import permutation
from ..planning.order import ShuffledShare
from ..planning.plan import Pieces, Position
from .pieces import Opener, PieceSource, piece_chunks, piece_read
from .prefetch import prefetch
from .window import Rows, Window, owned

__all__ = ["WindowSource", "shuffled_chunks"]

# Windows ahead whose parts of a unit a window's read carries (their rows: one window's).
_CARRY_WINDOWS = 8
# Threads that decode a window's runs in the main process (pyarrow decodes without the GIL)
# when the consumer waited for the window before (the first one, or a reader slower than the
# consumer): it waits half as long. Otherwise one: a thread more than the cores slows every
# thread (numeric columns, 0 workers, always two: 0.56 of unshuffled; one: 0.60).
_DECODE_THREADS = 2


class WindowSource(PieceSource, Protocol):
    """What a shuffled share is read from (``reading.stream.StreamSource``)."""

    def lane_bytes(self) -> int: ...

    def read_rows(self, batch_size: int) -> int: ...


def shuffled_chunks(
    source: WindowSource, order: ShuffledShare, start: Position, gather_rows: int, read_ahead: int
) -> Iterator[tuple[Rows, int]]:
    """A shuffled share from ``start``: each window read whole, then handed out in its keyed
    permutation, ``gather_rows`` at a time; with ``read_ahead`` the next window is read in a
    thread meanwhile."""
    # Where the stream reads ahead (the main process), a window the consumer waited for makes
    # two threads decode the next; a DataLoader worker is one of several processes sharing
    # the cores already.
    waited = threading.Event()
    waited.set()  # for the first window
    threads = _DECODE_THREADS if read_ahead else 1
    windows: Iterator[tuple[Window, npt.NDArray[np.uint32], int]] = _read_windows(
        source, order, order.window_at(start), threads, waited
    )
    if read_ahead:
        windows = prefetch(windows, 1, waited)
    try:
        for data, index, begin in windows:
            rows = data.num_rows
            for lo in range(max(0, start - begin), rows, gather_rows):
                hi = min(lo + gather_rows, rows)
                with Stage(SHUFFLE):
                    rows_taken = data.take(index[lo:hi].astype(np.int64))
                yield rows_taken, begin + hi
            del data, index  # handed out: let go of it before the next one is read
    finally:
        windows.close()  # type: ignore[attr-defined]


# Parts of a window's units kept for the windows after it, by (split, first row): the reader
# decodes a unit once for the consecutive windows its parts were dealt to (``planning.order``).
_Carried: TypeAlias = dict[tuple[int, int], list[pa.RecordBatch]]


def _read_windows(
    source: WindowSource, order: ShuffledShare, first: int, threads: int, waited: threading.Event
) -> Iterator[tuple[Window, npt.NDArray[np.uint32], int]]:
    """Windows ``first, first + 1, ...``: their rows in storage order, permutation and first
    stream row; ``threads`` decode a window's runs (independent reads) if the consumer
    ``waited`` for the window before (cleared here), else one."""
    carried: _Carried = {}
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        for number in range(first, len(order.ends)):
            blocks, begin, key = order.window(number)
            later = (order.window(n)[0] for n in range(number + 1, len(order.ends)))
            runs_map = (
                partial(_in_order, pool, threads) if pool is not None and waited.is_set() else map
            )
            waited.clear()
            with Stage(SHUFFLE):  # decoding its runs counts as decode
                window = _read_window(source, blocks, later, carried, runs_map)
            yield window, permutation(window.num_rows, key), begin
            del window  # the consumer is done with it: not held while the next one is read
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)  # after an error, the runs not begun are not read


def _in_order(
    pool: ThreadPoolExecutor,
    ahead: int,
    fn: Callable[[int], list[pa.RecordBatch]],
    runs: range,
) -> Iterator[list[pa.RecordBatch]]:
    """``fn(run)`` of each of ``runs`` in order, computed by ``pool``: at most ``ahead`` runs
    submitted beyond the one the consumer holds (``pool.map`` would submit them all, and runs
    decoded behind a slow one would pile up, the window's rows held twice)."""
    later = iter(runs)
    pending = deque(pool.submit(fn, run) for run in itertools.islice(later, ahead))
    try:
        while pending:
            done = pending.popleft().result()
            run = next(later, None)
            if run is not None:
                pending.append(pool.submit(fn, run))
            yield done
            del done  # taken: not held while the next run is awaited
    finally:
        for future in pending:
            future.cancel()


def _read_window(
    source: WindowSource,
    blocks: Pieces,
    later: Iterator[Pieces],
    carried: _Carried,
    runs_map: Callable[
        [Callable[[int], list[pa.RecordBatch]], range], Iterable[list[pa.RecordBatch]]
    ],
) -> Window:
    """The rows of a window's ``blocks`` in storage order; ``carried`` (updated): the parts
    of the windows after it read so far; ``runs_map``: ``map``, or ``_in_order`` on a pool.

    Its blocks not carried from the windows before are read, with the ``later`` windows'
    parts of the units they slice not carried yet (nearest window first, while all that is
    carried for later windows stays within the window's rows): blocks of one unit and
    adjacent blocks are read as one run, so a unit is decoded at most once for the
    consecutive windows its parts were dealt to; the rows between them are dropped. Each run
    is put into the window as it is decoded, and let go of.
    """
    unit_starts = source.index.unit_starts
    keys = list(zip(blocks.splits.tolist(), blocks.lo.tolist(), strict=True))
    rows = (blocks.hi - blocks.lo).tolist()
    first_row = dict(zip(keys, itertools.accumulate(rows, initial=0), strict=False))
    held = sum(p.num_rows for k, parts in carried.items() if k not in first_row for p in parts)
    wanted, later = _not_in(blocks, carried), (_not_in(w, carried) for w in later)
    reads = _with_later_parts(wanted, later, source.index, int(blocks.total) - held)
    runs, run_of = _runs_of(reads, unit_starts)
    splits = list(dict.fromkeys(blocks.splits.tolist()))
    where = ", ".join(source.index.describe(s) for s in splits[:3])
    window = Window(int(blocks.total), f"splits {where}{' ...' if len(splits) > 3 else ''}")

    def put(key: tuple[int, int], parts: list[pa.RecordBatch]) -> None:
        row = first_row[key]
        for part in parts:
            window.put(row, part)
            row += part.num_rows

    for key in [key for key in keys if key in carried]:
        put(key, carried.pop(key))
    opener = Opener(source, runs, 0, 0)
    lane_bytes, read_rows = source.lane_bytes(), source.read_rows(1)

    def decoded(run: int) -> list[pa.RecordBatch]:
        read = piece_read(source, runs, run, 0)
        handle = opener.open(read, lane_bytes)
        return [_conform(c) for c, _ in piece_chunks(source, read, handle, read_rows)]

    blocks_of: list[list[tuple[int, int, int]]] = [[] for _ in range(len(runs))]  # as ints
    for run, split, lo, hi in zip(run_of.tolist(), reads.splits.tolist(), reads.lo.tolist(),
                                  reads.hi.tolist(), strict=True):  # fmt: skip
        blocks_of[run].append((split, lo, hi))
    for run, chunks in enumerate(runs_map(decoded, range(len(runs)))):
        start = int(runs.lo[run])
        for split, lo, hi in blocks_of[run]:
            key = split, lo
            if key in first_row:
                put(key, _sliced(chunks, lo - start, hi - start))
            else:  # a later window's part
                carried[key] = _sliced(chunks, lo - start, hi - start, own=True)
        del chunks  # put or carried: the next run is decoded without them
    window.finish()
    return window


def _not_in(blocks: Pieces, carried: _Carried) -> Pieces:
    """``blocks`` but those ``carried`` holds."""
    if not carried:
        return blocks
    keys = zip(blocks.splits.tolist(), blocks.lo.tolist(), strict=True)
    return blocks.take(np.flatnonzero([key not in carried for key in keys]))


def _with_later_parts(
    blocks: Pieces, later: Iterator[Pieces], index: DatasetIndex, most: int
) -> Pieces:
    """``blocks`` and the blocks of the ``later`` windows (nearest first, at most
    ``_CARRY_WINDOWS``) that are parts of the units ``blocks`` slice, up to ``most`` rows of
    them; in storage order."""
    sliced = {unit for unit, whole in _units_of(blocks, index) if not whole}
    parts: list[tuple[int, int, int]] = []  # as ints: a window's few blocks, Python per block
    for window in itertools.islice(later, _CARRY_WINDOWS):
        if most <= 0 or not sliced:
            break
        triples = zip(window.splits.tolist(), window.lo.tolist(), window.hi.tolist(), strict=True)
        units = _units_of(window, index)
        mine = [block for block, (unit, _) in zip(triples, units, strict=True) if unit in sliced]
        if not mine:  # parts of a unit are in consecutive windows: none further on
            break
        taken = 0
        for split, lo, hi in mine:  # the first of them, up to ``most`` rows
            if taken + hi - lo > most:
                break
            parts.append((split, lo, hi))
            taken += hi - lo
        most -= taken
    if not parts:  # no later parts: ``blocks`` are in storage order already
        return blocks
    own = zip(blocks.splits.tolist(), blocks.lo.tolist(), blocks.hi.tolist(), strict=True)
    return Pieces.of(sorted([*own, *parts]))  # by split, then first row


def _units_of(blocks: Pieces, index: DatasetIndex) -> list[tuple[tuple[int, int], bool]]:
    """The ``(split, unit)`` of each block's first row, and whether the block starts at the
    unit's start and covers it (else it is a part of a sliced unit)."""
    out = []
    triples = zip(blocks.splits.tolist(), blocks.lo.tolist(), blocks.hi.tolist(), strict=True)
    for split, lo, hi in triples:
        starts = index.unit_starts(split)
        if len(starts) == 1:  # a split of one unit (numpy on one value costs more)
            out.append(((split, 0), lo == 0 and hi >= int(index.split_rows[split])))
            continue
        unit = int(np.searchsorted(starts, lo, side="right")) - 1
        end = int(starts[unit + 1]) if unit + 1 < len(starts) else int(index.split_rows[split])
        out.append(((split, unit), lo == int(starts[unit]) and hi >= end))
    return out


def _sliced(
    chunks: list[pa.RecordBatch], lo: int, hi: int, *, own: bool = False
) -> list[pa.RecordBatch]:
    """Rows ``[lo, hi)`` of ``chunks`` laid end to end, as slices of them (no copy); with
    ``own``, each column ``owned`` (a slice keeps its whole chunk in memory: a part carried
    for a later window keeps at most twice its bytes)."""
    out, first = [], 0
    for chunk in chunks:
        a, b = max(lo - first, 0), min(hi - first, chunk.num_rows)
        if a < b:
            part = chunk.slice(a, b - a)
            if own:
                columns = [owned(column) for column in part.columns]
                part = pa.RecordBatch.from_arrays(columns, schema=part.schema)
            out.append(part)
        first += chunk.num_rows
    return out


def _runs_of(
    blocks: Pieces, unit_starts: Callable[[int], npt.NDArray[np.int64]]
) -> tuple[Pieces, npt.NDArray[np.int64]]:
    """Reads that cover ``blocks`` (in storage order), and the read of each block: a block
    joins the read before it when it is of the same split and no unit starts between them
    (its rows would be decoded anyway to reach it)."""
    if not len(blocks):
        return blocks, np.zeros(0, dtype=np.int64)
    joins = np.zeros(len(blocks), dtype=bool)
    splits, los, his = blocks.splits.tolist(), blocks.lo.tolist(), blocks.hi.tolist()
    for i in range(1, len(blocks)):
        if splits[i] == splits[i - 1]:
            gap = unit_starts(splits[i])
            # a split of one unit has no start past its first row: nothing between
            joins[i] = len(gap) == 1 or not ((gap > his[i - 1]) & (gap <= los[i])).any()
    run_of = np.cumsum(~joins) - 1
    first = np.flatnonzero(~joins)
    last = np.append(first[1:], len(blocks)) - 1
    return Pieces(blocks.splits[first], blocks.lo[first], blocks.hi[last]), run_of


def _conform(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with the dataset's schema (files may differ in schema metadata only)."""
    return batch if batch.schema.metadata is None else batch.replace_schema_metadata(None)
