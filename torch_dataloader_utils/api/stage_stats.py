"""Where the reading time goes, per process, and the bottleneck verdict drawn from it.

Each DataLoader worker ships its figures (``base.stages``: seconds per stage, bytes fetched,
requests, retries; cumulative since its stream began) with every packet; ``StageRecorder``
keeps the last ones of each worker, with when they arrived, and snapshots of the training
process's own figures taken every ``KEEP_EVERY`` seconds of the loop and at each ``stats()``
call. A span's figures are the difference of two of them: no per-batch cost beyond a
packet's arrival.

``verdict`` turns the loop's wait and these figures into a ``Bottleneck`` and one line of
advice (the table in docs/observability.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Final, Literal

import numpy as np

from ..base import stages
from ..transport.packet import Packet

__all__ = [
    "KEEP_EVERY",
    "WAIT_THRESHOLD",
    "Bottleneck",
    "ProcessStats",
    "StageRecorder",
    "StageStats",
    "verdict",
]

Bottleneck = Literal["storage", "decode", "transform", "transport", "trainer"]

# Above this data-wait fraction the loop is waiting on data (docs/observability.md).
WAIT_THRESHOLD = 0.05
# Figures kept per process for the recent window: a worker's with each packet (of up to 64
# batches), the training process's every KEEP_EVERY seconds of the loop (102 s of them) and
# at each stats() call.
_KEPT = 256
_KEPT_OWN = 2048
KEEP_EVERY = 0.05
# A figures vector: base.stages' figures, then batches and rows.
_BATCHES, _ROWS = stages.FIGURES, stages.FIGURES + 1
_SIZE: Final = stages.FIGURES + 2
# What counts as each data-side verdict's work (indexes into a figures vector).
_GROUPS: Final[dict[Bottleneck, tuple[int, ...]]] = {
    "storage": (stages.STORAGE,),
    "decode": (stages.DECODE, stages.SHUFFLE),
    "transform": (stages.TRANSFORM, stages.PACKING),
    "transport": (stages.TRANSPORT,),
}

Figures = np.ndarray[Any, np.dtype[np.float64]]


@dataclass(frozen=True)
class StageStats:
    """One process's reading over a span: seconds per stage (a stage's time excludes the
    stages inside it; the threads of a process add up, so they may exceed the span), bytes
    fetched from an object store, GET requests and retries, and the batches and rows it
    sent (a worker; for the training process without workers, those it read)."""

    listing: float
    storage: float
    decode: float
    shuffle: float
    transform: float
    packing: float
    transport: float
    blocked: float
    read_ahead: float
    bytes_fetched: int
    requests: int
    retries: int
    batches: int
    rows: int

    @classmethod
    def of(cls, figures: Figures) -> StageStats:
        values: dict[str, Any] = {name: float(figures[i]) for i, name in enumerate(stages.STAGES)}
        counts = (*stages.COUNTS, "batches", "rows")
        values.update((name, int(figures[len(stages.STAGES) + i])) for i, name in enumerate(counts))
        return cls(**values)


@dataclass(frozen=True)
class ProcessStats:
    """The figures of one process: ``"main"`` (the training process) or ``"worker N"``."""

    process: str
    since_start: StageStats
    recent: StageStats


class StageRecorder:
    """The figures of an iteration's processes: workers' from their packets, the training
    process's own from ``base.stages`` (the files' listing since the process began; the rest
    since the iteration began)."""

    def __init__(self, num_workers: int) -> None:
        self._began = _own()
        self._workers: list[deque[tuple[float, Figures]]] = [
            deque(maxlen=_KEPT) for _ in range(num_workers)
        ]
        self._own: deque[tuple[float, Figures]] = deque(maxlen=_KEPT_OWN)
        self._sent = np.zeros((num_workers, 2))  # batches, rows received from each worker

    def arrived(self, packet: Packet) -> None:
        """A worker's packet arrived: keep its figures and count its batches and rows."""
        if packet.stages is None:  # an error's packet
            return
        sent = self._sent[packet.worker]
        sent += (len(packet.positions), _packet_rows(packet))
        figures = np.concatenate((packet.stages, sent))
        self._workers[packet.worker].append((perf_counter(), figures))

    def received(self) -> int:
        """Batches received from the workers."""
        return int(self._sent[:, 0].sum())

    def keep_own(self, now: float, rows: int, batches: int) -> Figures:
        """Keep the training process's figures now (the loop calls this every ``KEEP_EVERY``
        seconds, so that a recent window finds figures near its start); ``rows`` and
        ``batches``: the loop's, its own without workers."""
        own = _own() - self._began
        own[stages.LISTING] = self._began[stages.LISTING] + own[stages.LISTING]
        if not self._workers:
            own[_BATCHES], own[_ROWS] = batches, rows
        self._own.append((now, own))
        return own

    def processes(self, cutoff: float, rows: int, batches: int) -> tuple[ProcessStats, ...]:
        """Every process's figures since the start and since ``cutoff``."""
        before = _before(self._own, cutoff)
        own = self.keep_own(perf_counter(), rows, batches)
        main = ProcessStats("main", StageStats.of(own), StageStats.of(own - before))
        workers = (
            _process(f"worker {w}", kept[-1][1] if kept else np.zeros(_SIZE), kept, cutoff)
            for w, kept in enumerate(self._workers)
        )
        return (main, *workers)


def _process(
    name: str, now: Figures, kept: deque[tuple[float, Figures]], cutoff: float
) -> ProcessStats:
    return ProcessStats(name, StageStats.of(now), StageStats.of(now - _before(kept, cutoff)))


def verdict(
    *,
    wait_fraction: float,
    wait_seconds: float,
    seconds: float,
    batches: int,
    rows: int,
    processes: tuple[StageStats, ...],
    num_workers: int,
) -> tuple[Bottleneck, str]:
    """What limits the loop over a span of ``seconds`` (the loop's figures, and each
    process's, the training process first), and the setting to change.

    Data-side, each verdict's stages are weighed by how busy they keep their processes: the
    workers' seconds over ``num_workers x seconds``, the training process's over
    ``seconds``; the busiest wins. The loop's wait spent neither in a stage nor waiting for
    the workers (or the read-ahead thread) is the batches' own handling in the training
    process (cutting, converting, unpacking, handing out): transport.
    """
    share = f"the loop waits {wait_fraction:.0%} of its time on data"
    if batches < 2 or wait_fraction < WAIT_THRESHOLD:
        return "trainer", f"{share}: data is ready before it is asked for; nothing to change"
    main, workers = processes[0], processes[1:]
    span = max(seconds, 1e-9)
    busy: dict[Bottleneck, tuple[float, bool]] = {}  # share of the time, in the workers?
    for name, figures in _GROUPS.items():
        fields = [stages.STAGES[i] for i in figures]
        own = sum(getattr(main, f) for f in fields) / span
        theirs = sum(getattr(w, f) for w in workers for f in fields) / (len(workers) * span or 1)
        busy[name] = max((own, False), (theirs, True))
    # the loop's wait neither in a stage nor waiting for workers (or read-ahead): handling
    staged = sum(getattr(main, stages.STAGES[i]) for i in _BUSY) + main.read_ahead
    busy["transport"] = max(busy["transport"], (max(wait_seconds - staged, 0.0) / span, False))
    bottleneck = max(busy, key=lambda b: busy[b])
    if busy[bottleneck][0] <= 0:  # the workers' figures have not arrived yet: their reading
        return "decode", (
            f"{share}: the {len(workers)} worker(s) do not keep up; raise num_workers (up to "
            f"the free cores) or prefetch_factor"
        )
    part, in_workers = busy[bottleneck]
    who = f"the {len(workers)} workers" if in_workers else "the training process"
    advice = _advice(bottleneck, f"{who} {part:.0%} of the time", processes, rows / batches)
    return bottleneck, f"{share}; {advice}"


def _advice(
    bottleneck: Bottleneck, spent: str, processes: tuple[StageStats, ...], rows: float
) -> str:
    """The line for ``bottleneck``, which took ``spent`` ("the 2 workers 80% of the time")."""
    workers = len(processes) - 1
    more = "raise num_workers (up to the free cores)" if workers else "set num_workers >= 1"
    if bottleneck == "storage":
        fetched = sum(p.bytes_fetched for p in processes)
        requests = sum(p.requests for p in processes)
        retries = sum(p.retries for p in processes)
        return (
            f"waiting on storage took {spent} ({fetched / 2**20:,.1f} MiB in {requests} "
            f"requests, {retries} retries): {more} or prefetch_factor for more reads in "
            f"flight, or raise split_bytes for fewer, larger reads"
        )
    if bottleneck == "decode":
        if sum(p.shuffle for p in processes) > sum(p.decode for p in processes):
            return (
                f"filling and gathering shuffle windows took {spent}: lower "
                f"shuffle_memory_bytes (smaller windows), or {more}"
            )
        return f"decoding took {spent}: {more}, or read fewer columns (columns=[...])"
    if bottleneck == "transform":
        where = "set num_workers >= 1 to run it in workers" if not workers else more
        return (
            f"the transform (tokenizer, packing) took {spent}: {where}, or move it out of the "
            f"data path (onto the GPU, or precompute it into the files)"
        )
    return (
        f"moving batches of {rows:,.0f} rows to the loop took {spent}: raise batch_size "
        f"(fewer, larger batches)" + (", or prefetch_factor" if workers else "")
    )


# The stages that are work (not waiting on another process or thread).
_BUSY: Final = tuple(i for g in _GROUPS.values() for i in g)


def _own() -> Figures:
    return np.concatenate((stages.snapshot(), np.zeros(2)))


def _before(kept: deque[tuple[float, Figures]], cutoff: float) -> Figures:
    """The last figures kept before ``cutoff``; if none, zeros (the span begins with the
    iteration), or the oldest kept when older ones were dropped."""
    for at, figures in reversed(kept):  # a recent window starts near the newest
        if at < cutoff:
            return figures
    return kept[0][1] if len(kept) == kept.maxlen else np.zeros(_SIZE)


def _packet_rows(packet: Packet) -> int:
    """Rows of a packet's batches: each batch's first column's length."""
    lengths = packet.lengths
    if lengths is None:  # batches as they are
        return sum(batch_rows(batch)[0] for batch in packet.payload)
    return sum(n if isinstance(n, int) else next((v for v in n.values() if v), 0) for n in lengths)


def batch_rows(batch: Any) -> tuple[int, int]:
    """Rows a batch holds (its first column's length; a packed batch's sequences) and its real
    tokens (a packed batch's ``num_tokens``, else 0)."""
    if isinstance(batch, dict):
        tokens = batch.get("num_tokens", 0)
        tokens = int(tokens) if isinstance(tokens, (int, np.integer)) else 0
        for value in batch.values():
            rows = _length(value)
            if rows is not None:
                return rows, tokens
        return 0, tokens
    if isinstance(batch, (tuple, list)):
        return (_length(batch[0]) or 0 if batch else 0), 0
    return _length(batch) or 0, 0


def _length(value: Any) -> int | None:
    """Rows of a column or batch; ``None`` for a value without rows (a scalar, a 0-d tensor)."""
    shape = getattr(value, "shape", None)  # tensors, arrays, Arrow record batches: cheap
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    return len(value) if hasattr(value, "__len__") else None
