"""Memory stays bounded over an epoch of many splits.

An epoch of 2,400 small splits (60 files x 40 row groups of 16 rows; ``split_bytes=1``), read in a
fresh process with ``num_workers`` 0 and 2, shuffled. After a warm-up (the first 10 % of the
batches) the process resets its peak RSS (``/proc/self/clear_refs``), reads the rest, and
reports the new peak (``VmHWM``), its RSS at 50 % and at the end, and each worker's peak.
Bounds: the main process's peak grows by less than ``PEAK_BOUND_MIB`` after the warm-up, its RSS
by less than ``LEAK_BOUND_MIB`` from 50 % to the end of the epoch (a leak per split would show
there: 1,200 splits), and no worker peaks more than ``PEAK_BOUND_MIB`` above the main process's
RSS when the workers were forked.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FILES, GROUPS, GROUP_ROWS = 60, 40, 16  # 2,400 splits, 38,400 rows
PEAK_BOUND_MIB = 150
LEAK_BOUND_MIB = 32


def _status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def _measure(data: str, num_workers: int) -> dict[str, object]:
    """Child: read one epoch and report memory figures (KiB)."""
    from _soak import children

    from torch_dataloader_utils import StructuredDataset

    loader, dataset = StructuredDataset.create_dataloader(
        data, batch_size=64, split_bytes=1, shuffle=True, num_workers=num_workers
    )
    splits, batches = len(dataset._index.splits), len(loader)
    fork_rss = _status()["VmRSS"]
    figures: dict[str, object] = {"splits": splits, "batches": batches, "fork_rss": fork_rss}
    rows, workers = 0, {}
    for number, batch in enumerate(loader, 1):
        rows += len(batch["id"])
        if number == batches // 10:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            figures["warm_rss"] = _status()["VmRSS"]
        elif number == batches // 2:
            figures["half_rss"] = _status()["VmRSS"]
        if number % max(1, batches // 20) == 0:  # workers may finish before the last batch
            for pid in children(os.getpid()):
                with contextlib.suppress(OSError, KeyError):
                    workers[pid] = max(workers.get(pid, 0), _status(pid)["VmHWM"])
    figures["workers_hwm"] = list(workers.values())
    figures |= {"rows": rows, "end_rss": _status()["VmRSS"], "peak": _status()["VmHWM"]}
    return figures


@pytest.fixture(scope="module")
def many_splits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import pyarrow.parquet as pq
    from _data import rows_table

    root = tmp_path_factory.mktemp("many-splits")
    rows = GROUPS * GROUP_ROWS
    for number in range(FILES):
        table = rows_table(number * rows, rows)
        pq.write_table(table, root / f"part-{number:05d}.parquet", row_group_size=GROUP_ROWS)
    return root


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_peak_memory_stays_bounded_over_an_epoch_of_many_splits(
    many_splits: Path, num_workers: int
):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    done = subprocess.run(
        [sys.executable, __file__, str(many_splits), str(num_workers)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    mib = {k: got[k] / 1024 for k in ("fork_rss", "warm_rss", "half_rss", "end_rss", "peak")}
    assert got["splits"] >= 2000 and got["rows"] == FILES * GROUPS * GROUP_ROWS, got
    assert mib["peak"] - mib["warm_rss"] < PEAK_BOUND_MIB, got
    assert mib["end_rss"] - mib["half_rss"] < LEAK_BOUND_MIB, got
    for worker_hwm in got["workers_hwm"]:
        assert worker_hwm / 1024 - mib["fork_rss"] < PEAK_BOUND_MIB, got
    assert len(got["workers_hwm"]) == num_workers
    workers = ", ".join(f"{w / 1024:.0f}" for w in got["workers_hwm"])
    figures = ", ".join(f"{k} {v:.0f}" for k, v in mib.items())
    print(f"\nw{num_workers}, {got['splits']} splits: {figures}, workers' peaks [{workers}] MiB")


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1], int(sys.argv[2]))))
