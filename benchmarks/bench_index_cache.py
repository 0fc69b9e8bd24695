"""Building a dataset over many files: cold (footers read from storage) vs warm (index cache).

Writes ``--files`` small local Parquet files (default 10,000), then times ``StructuredDataset``
construction in fresh processes: once with an empty cache directory (cold, every footer read
and the cache filled) and ``--repeat`` times with the filled cache (warm). Prints both, the
ratio, and the spec target (warm <= 0.5 s for 10,000 files). ``--plot out.png`` draws them.

    python benchmarks/bench_index_cache.py [--files 10000] [--repeat 3] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = """
import json, sys, time
from torch_dataloader_utils import StructuredDataset
start, cpu = time.perf_counter(), time.process_time()
dataset = StructuredDataset(sys.argv[1], batch_size=1024)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu": cpu, "files": len(dataset._index.files),
                  "splits": len(dataset._index.splits)}))
"""


def write_files(root: Path, files: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    marker = root / f"_complete_{files}"
    if marker.exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        ids = np.arange(i * 100, (i + 1) * 100, dtype=np.int64)
        table = pa.table({"id": ids, "x": ids * 0.5, "name": [f"r{j}" for j in ids.tolist()]})
        pq.write_table(table, root / f"d{i // 1000:02d}" / f"part-{i:05d}.parquet")
    marker.write_text("")


def build(root: Path, cache: Path) -> dict[str, float]:
    env = {**os.environ, "TDU_CACHE_DIR": str(cache), "TDU_INDEX_CACHE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root)], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", help="where to keep the files (reused between runs)")
    parser.add_argument("--plot", help="write a PNG bar chart here")
    args = parser.parse_args()

    root = Path(args.dir or Path(tempfile.gettempdir()) / f"tdu-bench-index-{args.files}")
    data = root / "data"
    start = time.perf_counter()
    for sub in range(args.files // 1000 + 1):
        (data / f"d{sub:02d}").mkdir(parents=True, exist_ok=True)
    write_files(data, args.files)
    print(f"{args.files} files under {data} (ready in {time.perf_counter() - start:.1f} s)")
    with tempfile.TemporaryDirectory(prefix="tdu-index-cache-") as cache:
        cold = build(data, Path(cache))
        warm = [build(data, Path(cache)) for _ in range(args.repeat)]
    best = min(w["seconds"] for w in warm)
    best_cpu = min(w["cpu"] for w in warm)
    print(f"cold build (footers read, cache filled): {cold['seconds']:.3f} s wall, "
          f"{cold['cpu']:.3f} s CPU ({cold['files']} files, {cold['splits']} splits)")  # fmt: skip
    print(f"warm build (index cache), best of {args.repeat}: {best:.3f} s wall, "
          f"{best_cpu:.3f} s CPU "
          f"(wall: {', '.join(format(w['seconds'], '.3f') for w in warm)})")  # fmt: skip
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          f"(wall time on a busy machine exceeds CPU time)")  # fmt: skip
    print(f"speed-up cold/warm: {cold['seconds'] / best:.1f}x; target warm <= 0.5 s: "
          f"{'met' if best <= 0.5 else 'NOT met'}")  # fmt: skip
    if args.plot:
        plot(args.plot, cold["seconds"], best, args.files)


def plot(path: str, cold: float, warm: float, files: int) -> None:
    from _bench_util import plot_bars

    plot_bars(
        path,
        f"building a dataset over {files:,} files",
        ["cold (footers read)", "warm (index cache)"],
        [cold, warm],
        "seconds",
        notes=["target: warm <= 0.5 s"],
    )


if __name__ == "__main__":
    main()
