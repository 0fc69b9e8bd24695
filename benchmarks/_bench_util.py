"""Shared helpers for the local benchmarks: synthetic Parquet data, timing, summaries, plots.

Imported by the ``bench_*.py`` scripts (run as scripts, so this folder is on
``sys.path``). Nothing here touches the library under test.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "cached_files",
    "ensure_dataset",
    "forked_children",
    "machine_note",
    "paired",
    "parquet_files",
    "per_call",
    "plot_bars",
    "rss_bytes",
    "status_kib",
    "summary",
    "timed",
]

# Generation parameters are stored beside the files; names starting with "_" are ignored by the
# library's listing (like pyarrow.dataset), so the manifest is never read as data.
_MANIFEST = "_bench_dataset.json"


def quiet_setup(data: str) -> None:
    """The package's index cache (parsed footers) beside the data, not in ~/.cache; no warnings
    about read-only numpy views or torchdata's use of torch's deprecated ``set_vital``."""
    os.environ.setdefault(
        "TDU_CACHE_DIR", os.path.join(os.path.dirname(os.path.abspath(data)), "index_cache")
    )
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def ensure_dataset(
    directory: str | os.PathLike[str],
    *,
    rows: int,
    files: int,
    row_group_rows: int,
    seed: int = 0,
    compression: str = "snappy",
    quiet: bool = False,
) -> list[str]:
    """Parquet files ``part-00000.parquet``… under ``directory`` with columns ``id`` (int64,
    0..rows-1 in file order), ``x`` (float64) and ``y`` (float32), written with ``compression``;
    reused when the manifest matches, regenerated otherwise. Returns the sorted file paths."""
    wanted: dict[str, Any] = {"rows": rows, "files": files, "row_group_rows": row_group_rows}
    wanted |= {"seed": seed, "compression": compression}
    return cached_files(directory, wanted, files, lambda root: _write_files(root, wanted, quiet))


def cached_files(
    directory: str | os.PathLike[str],
    wanted: dict[str, Any],
    files: int,
    write: Callable[[Path], None],
) -> list[str]:
    """The ``files`` files ``part-*.parquet`` under ``directory`` if its manifest equals
    ``wanted``; otherwise removes them, calls ``write(root)`` and records ``wanted``."""
    root = Path(directory)
    manifest = root / _MANIFEST
    if manifest.exists() and json.loads(manifest.read_text()) == wanted:
        found = parquet_files(root)
        if len(found) == files:
            return found
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob("part-*.parquet"):
        old.unlink()
    manifest.unlink(missing_ok=True)
    write(root)
    manifest.write_text(json.dumps(wanted))
    return parquet_files(root)


def _write_files(root: Path, wanted: dict[str, Any], quiet: bool) -> None:
    rows, files = wanted["rows"], wanted["files"]
    bounds = np.linspace(0, rows, files + 1).astype(np.int64)
    progress = _progress(files, f"writing {rows:,} rows to {root}", quiet)
    for number in range(files):
        start, stop = int(bounds[number]), int(bounds[number + 1])
        rng = np.random.default_rng([wanted["seed"], number])
        table = pa.table(
            {
                "id": np.arange(start, stop, dtype=np.int64),
                "x": rng.standard_normal(stop - start),
                "y": rng.standard_normal(stop - start, dtype=np.float32),
            }
        )
        path = root / f"part-{number:05d}.parquet"
        tmp = path.with_name("." + path.name + ".tmp")  # hidden until complete
        pq.write_table(
            table, tmp, row_group_size=wanted["row_group_rows"], compression=wanted["compression"]
        )
        os.replace(tmp, path)
        progress.update(1)
    progress.close()


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, quiet: bool) -> Any:
    if quiet:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit="file", file=sys.stderr)


def parquet_files(directory: str | os.PathLike[str]) -> list[str]:
    return sorted(str(p) for p in Path(directory).glob("part-*.parquet"))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, result)`` of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def per_call(fn: Callable[[], Any], calls: int) -> float:
    """Median seconds of ``calls`` calls of ``fn`` (for sub-millisecond calls such as
    ``state_dict()``), after one untimed call that fills any cache."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rss_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; 0 where it is unavailable)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def forked_children() -> set[int]:
    """Pids of this process's forked children (DataLoader workers; of all its threads), from
    ``/proc``: children running another program (``torch_shm_manager``) are left out."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:  # the thread ended meanwhile
            continue
    mine = Path("/proc/self/cmdline").read_bytes()
    return {pid for pid in pids if _cmdline(pid) == mine}


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its live forked children so far: what
    an epoch costs whatever the threads and workers it spreads over."""
    tick = os.sysconf("SC_CLK_TCK")
    own = os.times()
    total = own.user + own.system
    for pid in forked_children():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the worker ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def status_kib(pid: int, key: str) -> int:
    """``VmHWM`` / ``VmRSS`` … of ``pid`` from ``/proc/<pid>/status``, in KiB (0 if gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "best": max(values),
        "worst": min(values),
        "n": float(len(values)),
    }


def paired(runs: dict[str, list[float]], top: str, bottom: str) -> dict[str, float]:
    """``top / bottom``: median of the per-round ratios (runs adjacent in time, the primary
    figure on a noisy machine), ratio of the medians, and best / best."""
    per_round = [a / b for a, b in zip(runs[top], runs[bottom], strict=True)]
    return {
        "paired_median": statistics.median(per_round),
        "of_medians": statistics.median(runs[top]) / statistics.median(runs[bottom]),
        "best_over_best": max(runs[top]) / max(runs[bottom]),
    }


def machine_note() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"(shared machine: figures are noisy; compare the ratios, measured in the same run)"
    )


def _human(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def plot_bars(
    path: str,
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    ylabel: str,
    notes: Sequence[str] = (),
) -> bool:
    """A PNG bar chart at ``path``; ``False`` (and a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; no plot written")
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(labels)), 4.5))
    bars = ax.bar(range(len(labels)), values, color="#4C72B0")
    if min(values) > 0 and max(values) / min(values) > 50:
        ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(
            _human(value),
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom")
        fig.subplots_adjust(bottom=0.18 + 0.04 * len(notes))
    fig.tight_layout(rect=(0, 0.04 * len(notes), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
    return True
