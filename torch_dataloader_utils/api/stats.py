"""``loader.stats()``: is the training loop waiting on data?

The loader times each ``next()`` the training loop makes: how long the loop was blocked in it
(the data wait) and how long it spent between two calls (the trainer's time), and counts the
batches, rows and tokens it handed out. A ``Recorder`` keeps exact totals since the iteration
began and, for percentiles and the recent window, a fixed-size ring of the last ``RING``
batches (bounded memory: no list grows with the epoch). ``Recorder.stats()`` turns them into a
``LoaderStats`` value with a ``bottleneck`` verdict and one line of ``advice``.

The first batch's wait is start-up (workers starting, the first read): it is reported apart,
as ``LoaderStats.startup_seconds``, and left out of the wait figures, so that it does not mask
a steady state in which data is ready before the loop asks.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..base.log import log
from ..base.stages import STAGES
from ..mixing.epochs import AnyProgress
from .mixture_stats import MixtureFigures, SourceStats
from .stage_stats import KEEP_EVERY, Bottleneck, ProcessStats, StageRecorder, batch_rows, verdict

__all__ = ["RING", "LoaderStats", "LoopStats", "Recorder", "summary"]

# Batches whose per-batch figures are kept (for percentiles and the recent window).
RING = 2048
# The verdict judges the recent window if it spans this long (or all it was asked to), else
# the iteration since its start: a few ms of tiny batches say little.
_JUDGED_SECONDS = 1.0


@dataclass(frozen=True)
class LoopStats:
    """The training loop's side of the loader over one span of time.

    ``wait_seconds`` is the time the loop was blocked in ``next()`` (the first batch's start-up
    excepted), ``trainer_seconds`` the time between a batch handed out and the next
    ``next()``; ``wait_fraction`` is ``wait / (wait + trainer)`` (0 before a second batch).
    ``rows`` are the rows the batches hold (a packed batch's sequences), ``tokens`` the real
    tokens of packed batches (their ``num_tokens``; 0 for other batches).
    ``wait_p50``/``wait_p95``/``wait_p99`` are per-batch waits in seconds (nearest rank), over
    the span's batches among the last ``RING`` (2,048) handed out, refreshed once 1/64 of
    those batches changed.
    """

    seconds: float
    batches: int
    rows: int
    tokens: int
    wait_seconds: float
    trainer_seconds: float
    wait_fraction: float
    wait_p50: float
    wait_p95: float
    wait_p99: float


@dataclass(frozen=True)
class LoaderStats:
    """What ``StructuredDataLoader.stats()`` returns: figures of the current iteration.

    ``since_start`` covers the iteration from the loop's first ``next()``; ``recent`` the last
    ``recent_seconds`` (or the last 2,048 batches, if those span less: its ``seconds`` says
    which). ``startup_seconds`` is the wait for the first batch. ``processes`` are where the
    reading time went: the training process (``"main"``) first, then each worker.
    ``queued_batches`` are batches arrived from workers and not yet handed out.
    ``mixture`` has a mixture's sources, what each delivered against its share (empty for
    one dataset).
    ``bottleneck`` names what limits throughput, ``"trainer"`` when data is ready before the
    loop asks for it, and ``advice`` the setting to change (docs/observability.md has the
    rule). ``as_dict()`` is the value as plain JSON-able types, ``metrics()`` its key figures
    as ``data/...`` numbers for a trainer's logger.
    """

    since_start: LoopStats
    recent: LoopStats
    recent_seconds: float
    startup_seconds: float
    num_workers: int
    processes: tuple[ProcessStats, ...]
    queued_batches: int
    mixture: tuple[SourceStats, ...]
    bottleneck: Bottleneck
    advice: str

    def as_dict(self) -> dict[str, Any]:
        """The figures as a dict of ``str``, ``int``, ``float``, nested dicts and lists."""
        figures = asdict(self)
        figures["processes"] = list(figures["processes"])
        figures["mixture"] = list(figures["mixture"])
        return figures

    def metrics(self) -> dict[str, float]:
        """The key figures of the recent window as ``data/<name>`` numbers for a trainer's
        logger: the loop's wait (share; p50/p95/p99 in seconds), rows and tokens per second,
        queued batches, each stage's seconds over all processes (``data/decode_seconds``,
        ...) and a mixture's ``data/<source>/delivered_share`` and ``data/<source>/epoch``."""
        recent = self.recent
        seconds = recent.seconds or 1.0
        metrics = {
            "data/wait_fraction": recent.wait_fraction,
            "data/wait_p50": recent.wait_p50,
            "data/wait_p95": recent.wait_p95,
            "data/wait_p99": recent.wait_p99,
            "data/rows_per_second": recent.rows / seconds,
            "data/tokens_per_second": recent.tokens / seconds,
            "data/queued_batches": float(self.queued_batches),
        }
        for stage in STAGES:
            total = sum(getattr(p.recent, stage) for p in self.processes)
            metrics[f"data/{stage}_seconds"] = total
        for source in self.mixture:
            metrics[f"data/{source.name}/delivered_share"] = source.delivered_share
            metrics[f"data/{source.name}/epoch"] = float(source.epoch)
        return metrics


class Recorder:
    """One iteration's timings and counts, as the loader hands out batches (not thread-safe
    for writing: only the iterating thread calls ``record``; ``stats`` may read any time)."""

    def __init__(self, num_workers: int, size: int = RING, log_every: float | None = None) -> None:
        self._num_workers = num_workers
        self._log_every = log_every  # seconds between INFO lines of summary(); None: none
        self._next_log = math.inf
        self._keep_own = 0.0  # when the training process's figures are kept next
        # the processes' figures and the verdict, refreshed at most every KEEP_EVERY seconds:
        # when, for which recent window, and them
        self._judged: tuple[float, float, tuple[ProcessStats, ...], Bottleneck, str] = (
            -math.inf,
            0.0,
            (),
            "trainer",
            "",
        )
        self.stages = StageRecorder(num_workers)  # each process's reading
        self._mixture = MixtureFigures()
        self._size = size
        self._asked = [0.0] * size  # when the loop called next() for batch j (at j % size)
        self._before: list[tuple[float, float, int, int]] = [(0.0, 0.0, 0, 0)] * size
        self._wait = np.zeros(size)  # blocked in that next() (0 for the first batch)
        self._trainer = [0.0] * size  # the loop's time before that next()
        self._count = 0
        self._start = 0.0  # the first next()
        self._last = 0.0  # when the last batch was handed out
        self._startup = 0.0
        self._totals = (0.0, 0.0, 0, 0)  # wait, trainer, rows, tokens
        self._window = 0  # the recent window's first batch at the last stats()
        # Per span (since the start, recent): the batches and percentiles last computed.
        self._cached = [(1, 1, (0.0, 0.0, 0.0))] * 2

    def record(self, asked: float, got: float, batch: Any) -> None:
        """The loop called ``next()`` at ``asked`` and got ``batch`` at ``got``."""
        i = self._count % self._size
        if self._count:
            wait, trainer = got - asked, asked - self._last
        else:
            self._start, self._startup, wait, trainer = asked, got - asked, 0.0, 0.0
            if self._log_every:
                self._next_log = got + self._log_every
        rows, tokens = batch_rows(batch)
        before = self._totals
        self._asked[i], self._before[i], self._wait[i] = asked, before, wait
        self._trainer[i] = trainer
        self._totals = (
            before[0] + wait,
            before[1] + trainer,
            before[2] + rows,
            before[3] + tokens,
        )
        self._last = got
        self._count += 1
        if got >= self._keep_own:
            self._keep_own = got + KEEP_EVERY
            self.stages.keep_own(got, self._totals[2], self._count)
        if got >= self._next_log:
            self._next_log = got + (self._log_every or math.inf)
            log.info("%s", summary(self.stats(self._log_every or 1.0)))

    def stats(self, recent_seconds: float, progress: AnyProgress | None = None) -> LoaderStats:
        """The figures now; ``recent`` over the last ``recent_seconds``; a mixture's per source
        from ``progress``, the iteration's delivery.

        O(log RING) but for the percentiles (a partial sort of at most ``RING`` waits): the
        ring keeps the totals before each batch, so a window's sums are two subtractions.
        """
        now = time.perf_counter()
        count, size = self._count, self._size
        oldest = max(count - size, 0)  # the oldest batch in the ring
        since = _loop(
            seconds=now - self._start if count else 0.0,
            count=count,
            sums=self._totals,
            percentiles=self._quantiles(oldest, 0),
        )
        recent = self._recent(now - recent_seconds, now, oldest)
        at, window, processes, bottleneck, advice = self._judged
        if now - at >= KEEP_EVERY or window != recent_seconds or count < 2:
            processes = self.stages.processes(now - recent.seconds, since.rows, since.batches)
            bottleneck, advice = self._verdict(since, recent, recent_seconds, processes)
            self._judged = (now, recent_seconds, processes, bottleneck, advice)
        return LoaderStats(
            since_start=since,
            recent=recent,
            recent_seconds=recent_seconds,
            startup_seconds=self._startup,
            num_workers=self._num_workers,
            processes=processes,
            queued_batches=self.stages.received() - count if self._num_workers else 0,
            mixture=self._mixture.of(progress),
            bottleneck=bottleneck,
            advice=advice,
        )

    def _verdict(
        self,
        since: LoopStats,
        recent: LoopStats,
        recent_seconds: float,
        processes: tuple[ProcessStats, ...],
    ) -> tuple[Bottleneck, str]:
        """The verdict on the recent window, unless its ring of batches spans too short a
        time to judge by (then on the iteration since its start)."""
        short = recent.seconds < min(recent_seconds, _JUDGED_SECONDS)
        judged = since if recent.batches < 2 or short else recent
        return verdict(
            wait_fraction=judged.wait_fraction,
            wait_seconds=judged.wait_seconds,
            seconds=judged.seconds,
            batches=judged.batches,
            rows=judged.rows,
            processes=tuple(p.recent if judged is recent else p.since_start for p in processes),
            num_workers=self._num_workers,
        )

    def _recent(self, cutoff: float, now: float, oldest: int) -> LoopStats:
        """The figures of the batches asked for from ``cutoff`` on (those still in the ring:
        if the window reaches back past the ring, it starts at the ring's oldest batch)."""
        count, size = self._count, self._size
        cutoff = max(cutoff, self._start)
        first = self._window_start(cutoff, oldest)
        if first == oldest and oldest:
            cutoff = self._asked[oldest % size]
        totals = before = self._totals
        earlier = 0.0
        if first < count:  # the loop's time before the window's first batch is not in it
            before = self._before[first % size]
            earlier = max(self._trainer[first % size] - (self._asked[first % size] - cutoff), 0)
        return _loop(
            seconds=now - cutoff if count else 0.0,
            count=count - first,
            sums=(
                totals[0] - before[0],
                totals[1] - before[1] - earlier,
                totals[2] - before[2],
                totals[3] - before[3],
            ),
            percentiles=self._quantiles(first, 1),
        )

    def _window_start(self, cutoff: float, oldest: int) -> int:
        """The first batch in the ring asked for at or after ``cutoff``. Called every step,
        the window has moved by a batch or two since the last call: step forward from there
        (binary search over the ring when it moved far or back)."""
        count, size, asked = self._count, self._size, self._asked
        first = max(self._window, oldest)
        back = first > oldest and asked[(first - 1) % size] >= cutoff
        if back or (first + 8 < count and asked[(first + 8) % size] < cutoff):
            first = oldest + bisect.bisect_left(
                range(oldest, count), cutoff, key=lambda j: asked[j % size]
            )
        while first < count and asked[first % size] < cutoff:
            first += 1
        self._window = first
        return first

    def _quantiles(self, first: int, span: int) -> tuple[float, float, float]:
        """p50/p95/p99 of the waits of batches ``first ..`` (``span`` 0: since the start, 1:
        recent), recomputed once the batches that entered or left the span since the last
        computation reach 1/64 of it: each figure is then a wait whose rank is off by at most
        that share, and ``stats()`` every step stays cheap."""
        first = max(first, 1)  # the first batch's wait is start-up
        was_first, was_count, values = self._cached[span]
        moved = abs(first - was_first) + (self._count - was_count)
        if moved and moved >= (self._count - first) >> 6:
            values = _percentiles(self._waits(first))
            self._cached[span] = (first, self._count, values)
        return values

    def _waits(self, first: int) -> Any:
        """The waits of batches ``first ..`` (all in the ring), in no particular order."""
        lo, hi = first % self._size, self._count % self._size
        if first >= self._count:
            return self._wait[:0]
        if lo < hi:
            return self._wait[lo:hi]
        return np.concatenate((self._wait[lo:], self._wait[:hi]))


def _loop(
    *,
    seconds: float,
    count: int,
    sums: tuple[float, float, int, int],
    percentiles: tuple[float, float, float],
) -> LoopStats:
    wait, trainer, rows, tokens = sums
    p50, p95, p99 = percentiles
    return LoopStats(
        seconds=seconds,
        batches=count,
        rows=int(rows),
        tokens=int(tokens),
        wait_seconds=wait,
        trainer_seconds=trainer,
        wait_fraction=wait / (wait + trainer) if wait + trainer > 0 else 0.0,
        wait_p50=p50,
        wait_p95=p95,
        wait_p99=p99,
    )


def _percentiles(waits: Any) -> tuple[float, float, float]:
    """p50, p95, p99 of ``waits`` by nearest rank (each is one of the waits); 0 for none."""
    n = len(waits)
    if not n:
        return 0.0, 0.0, 0.0
    ranks = [max(math.ceil(q * n) - 1, 0) for q in (0.50, 0.95, 0.99)]
    ordered = np.partition(waits, ranks)
    p50, p95, p99 = (float(ordered[k]) for k in ranks)
    return p50, p95, p99


def summary(stats: LoaderStats) -> str:
    """One line: the recent wait, its p99, rows (and tokens) per second, the verdict."""
    recent = stats.recent
    seconds = recent.seconds or 1.0
    tokens = f", {recent.tokens / seconds:,.0f} tokens/s" if recent.tokens else ""
    return (
        f"data: the loop waited {recent.wait_fraction:.0%} of the last {recent.seconds:.0f} s "
        f"(p99 {recent.wait_p99 * 1e3:.1f} ms per batch), {recent.rows / seconds:,.0f} rows/s"
        f"{tokens}, {recent.batches} batches; bottleneck {stats.bottleneck}: {stats.advice}"
    )
