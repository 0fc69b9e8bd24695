"""``loader.stats()`` where trainers look: ``data/...`` metrics for their loggers."""

from __future__ import annotations

from ..base.stages import STAGES
from .stats import LoaderStats

__all__ = ["data_metrics"]


def data_metrics(stats: LoaderStats) -> dict[str, float]:
    """The key figures of the recent window as ``data/<name>`` numbers for a trainer's logger:
    the loop's wait (share, p50/p95/p99 in seconds), rows/tokens per second, queued batches,
    the seconds each stage took over all processes, and a mixture's delivered shares."""
    recent = stats.recent
    seconds = recent.seconds or 1.0
    metrics = {
        "data/wait_fraction": recent.wait_fraction,
        "data/wait_p50": recent.wait_p50,
        "data/wait_p95": recent.wait_p95,
        "data/wait_p99": recent.wait_p99,
        "data/rows_per_second": recent.rows / seconds,
        "data/tokens_per_second": recent.tokens / seconds,
        "data/queued_batches": float(stats.queued_batches),
    }
    for stage in STAGES:
        total = sum(getattr(p.recent, stage) for p in stats.processes)
        metrics[f"data/{stage}_seconds"] = total
    for source in stats.mixture:
        metrics[f"data/{source.name}/delivered_share"] = source.delivered_share
        metrics[f"data/{source.name}/epoch"] = float(source.epoch)
    return metrics
