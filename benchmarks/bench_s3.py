"""S3 throughput on a moto server on loopback: our loader vs raw s3fs sequential reads.

The server runs in its own process (so it does not share the benchmark's GIL), on 127.0.0.1 at
a free port, with fake credentials. Both sides read the same objects:

- raw: ``fs.cat_file(path)`` of every object, one after the other (the bytes only, no decoding);
  with ``--columns``, ranged ``cat_file`` of each row group's projected column chunks instead
  (the same bytes ours needs, one GET per contiguous range);
- ours: one epoch of ``StructuredDataset.create_dataloader`` over ``s3://`` (ranged, coalesced
  reads with read-ahead, Parquet decoding and conversion to torch tensors included).

Prints rows/s and MB/s of both and the ratio ours/raw (spec target: >= 0.8), and the GET
requests and bytes one epoch of ours fetched (counted in s3fs, workers included), against the
stored bytes of the columns read (target: fetched/stored <= 1.10). For context it also times the
loader over the same files in ``memory://`` (no network: the cost of decoding and converting
alone) and reports the CPU time each side used. ``--plot out.png`` writes a chart.

    python benchmarks/bench_s3.py [--files 8] [--mb 16] [--num-workers 0] [--repeat 3]
                                  [--columns id,f0]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

KEY, SECRET = "AKIAFAKEBENCHKEY0000", "fake-bench-secret-0000000000000000000000"
BUCKET = "tdu-bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    code = (
        "import logging, sys; logging.getLogger('werkzeug').setLevel(logging.ERROR);"
        "from moto.server import ThreadedMotoServer;"
        f"s = ThreadedMotoServer('127.0.0.1', {port}, verbose=False); s.start();"
        "sys.stdin.read()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    endpoint = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for _ in range(200):
        try:
            opener.open(f"{endpoint}/moto-api/data.json", timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto server did not start")


def make_table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols: dict[str, Any] = {"id": np.arange(rows, dtype=np.int64) + seed * rows}
    for i in range(7):
        cols[f"f{i}"] = rng.random(rows)
    return pa.table(cols)


def upload(fs: Any, files: int, mb: float, row_group_rows: int) -> list[str]:
    rows = int(mb * 2**20 / 64)  # 8 columns of 8 bytes, random floats barely compress
    paths = []
    for i in range(files):
        buffer = io.BytesIO()
        pq.write_table(make_table(rows, i), buffer, row_group_size=row_group_rows)
        path = f"{BUCKET}/data/part-{i:04d}.parquet"
        fs.pipe_file(path, buffer.getvalue())
        paths.append(path)
    return paths


class Requests:
    """GETs and bytes through s3fs in this process and its forked workers (shared counters)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("fork")
        self._gets, self._bytes = context.Value("q", 0), context.Value("q", 0)

    def install(self) -> None:
        """Count every ``_cat_file`` of s3fs (``cat_file`` and ranged reads go through it)."""
        import s3fs

        original = s3fs.S3FileSystem._cat_file
        gets, nbytes = self._gets, self._bytes

        async def counted(self: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
            data = await original(self, path, *args, **kwargs)
            with gets.get_lock():
                gets.value += 1
                nbytes.value += len(data)
            return bytes(data)

        s3fs.S3FileSystem._cat_file = counted

    def take(self) -> tuple[int, int]:
        """``(GETs, bytes)`` since the last call."""
        with self._gets.get_lock():
            out = (self._gets.value, self._bytes.value)
            self._gets.value = self._bytes.value = 0
        return out


Range = tuple[str, int | None, int | None]  # path, start, end (None: the whole object)


def column_ranges(fs: Any, paths: list[str], columns: list[str] | None) -> list[Range]:
    """Whole objects, or per row group the projected column chunks (touching ones joined)."""
    if columns is None:
        return [(path, None, None) for path in paths]
    ranges: list[Range] = []
    for path in paths:
        footer = pq.ParquetFile(fs.open(path)).metadata
        for r in range(footer.num_row_groups):
            group = footer.row_group(r)
            spans: list[list[int]] = []
            for c in range(group.num_columns):
                chunk = group.column(c)
                if chunk.path_in_schema not in columns:
                    continue
                start = chunk.data_page_offset
                if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
                    start = chunk.dictionary_page_offset
                stop = start + chunk.total_compressed_size
                if spans and spans[-1][1] == start:
                    spans[-1][1] = stop
                else:
                    spans.append([start, stop])
            ranges += [(path, a, b) for a, b in spans]
    return ranges


def stored_bytes(fs: Any, paths: list[str], columns: list[str] | None) -> int:
    """Compressed bytes of the column chunks of ``columns`` (all when ``None``) in ``paths``."""
    total = 0
    for path in paths:
        footer = pq.ParquetFile(fs.open(path)).metadata
        for r in range(footer.num_row_groups):
            group = footer.row_group(r)
            for c in range(group.num_columns):
                if columns is None or group.column(c).path_in_schema in columns:
                    total += group.column(c).total_compressed_size
    return total


def raw_read(fs: Any, ranges: list[Range]) -> tuple[float, int]:
    start = time.perf_counter()
    total = sum(len(fs.cat_file(path, start=a, end=b)) for path, a, b in ranges)
    return time.perf_counter() - start, total


def make_loader(
    options: dict[str, Any], num_workers: int, batch_size: int, url: str, columns: list[str] | None
) -> Any:
    """One loader per source, kept for every pass: workers (persistent) start once, as in
    training, so a pass measures streaming rather than process start-up."""
    from torch_dataloader_utils import StructuredDataset

    loader, _ = StructuredDataset.create_dataloader(
        url,
        batch_size=batch_size,
        columns=columns,
        num_workers=num_workers,
        storage_options=options,
        persistent_workers=num_workers > 0,
    )
    return loader


def ours_read(loader: Any) -> tuple[float, int]:
    start = time.perf_counter()
    rows = sum(len(next(iter(batch.values()))) for batch in loader)
    return time.perf_counter() - start, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mb", type=float, default=16.0, help="size of each object in MiB")
    parser.add_argument("--row-group-rows", type=int, default=65_536)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--columns", help="comma-separated columns to read (default: all)")
    parser.add_argument("--plot", help="write a PNG bar chart here")
    args = parser.parse_args()
    columns = args.columns.split(",") if args.columns else None
    requests = Requests()
    requests.install()  # before any worker forks

    os.environ.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_EC2_METADATA_DISABLED="true", NO_PROXY="127.0.0.1")  # fmt: skip
    os.environ.setdefault("TDU_CACHE_DIR", tempfile.mkdtemp(prefix="tdu-bench-cache-"))
    proc, endpoint = start_server()
    try:
        import s3fs

        options = {"key": KEY, "secret": SECRET, "endpoint_url": endpoint}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir(BUCKET)
        paths = upload(fs, args.files, args.mb, args.row_group_rows)
        total_bytes = sum(fs.size(p) for p in paths)
        stored = stored_bytes(fs, paths, columns)
        ranges = column_ranges(fs, paths, columns)
        rows_total = sum(pq.ParquetFile(fs.open(p)).metadata.num_rows for p in paths)
        memory = fsspec.filesystem("memory")
        for p in paths:
            memory.pipe_file(f"/tdu-bench/{p}", fs.cat_file(p))
        memory_url = f"memory:///tdu-bench/{BUCKET}/data/"
        s3_url = f"s3://{BUCKET}/data/"
        s3_loader = make_loader(options, args.num_workers, args.batch_size, s3_url, columns)
        memory_loader = make_loader({}, args.num_workers, args.batch_size, memory_url, columns)
        ours_read(s3_loader)  # warm: workers, connections
        ours_read(memory_loader)
        raw_read(fs, ranges)
        raw_times, our_times, memory_times = [], [], []
        raw_cpu, our_cpu = [], []
        epochs: list[tuple[int, int]] = []
        for _ in range(args.repeat):
            cpu = time.process_time()
            raw_times.append(raw_read(fs, ranges)[0])
            raw_cpu.append(time.process_time() - cpu)
            cpu = time.process_time()
            requests.take()
            seconds, rows = ours_read(s3_loader)
            epochs.append(requests.take())
            our_cpu.append(time.process_time() - cpu)
            assert rows == rows_total, (rows, rows_total)
            our_times.append(seconds)
            memory_times.append(ours_read(memory_loader)[0])
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # open keep-alive connections hold its threads
            proc.kill()
            proc.wait()
    raw, ours, decode = min(raw_times), min(our_times), min(memory_times)
    mb, needed = total_bytes / 2**20, stored / 2**20
    gets, fetched = max(epochs, key=lambda e: e[1])
    print(f"objects: {args.files} x {args.mb:g} MiB parquet ({mb:.1f} MiB, {rows_total} rows), "
          f"columns={args.columns or 'all'}, num_workers={args.num_workers}, "
          f"best of {args.repeat}")  # fmt: skip
    print(f"raw s3fs cat_file : {needed / raw:8.1f} MiB/s  {rows_total / raw:12,.0f} rows/s  "
          f"({len(ranges)} GETs of the bytes ours needs)")  # fmt: skip
    print(f"torch_dataloader  : {needed / ours:8.1f} MiB/s  {rows_total / ours:12,.0f} rows/s")
    print(f"ratio ours/raw    : {raw / ours:.2f}  (target >= 0.8)")
    print(f"per epoch (ours)  : {gets} GETs, {fetched / 2**20:.1f} MiB fetched of "
          f"{stored / 2**20:.1f} MiB stored in the columns read: fetched/stored "
          f"{fetched / stored:.3f} (target <= 1.10)")  # fmt: skip
    print(f"context: loader over memory:// (decode + convert, no I/O): {needed / decode:.1f} "
          f"MiB/s; "
          f"CPU s per pass (this process, workers excluded): raw {min(raw_cpu):.2f}, "
          f"ours {min(our_cpu):.2f}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    if args.plot:
        plot(args.plot, needed / raw, needed / ours, needed / decode)


def plot(path: str, raw: float, ours: float, decode: float) -> None:
    from _bench_util import plot_bars

    plot_bars(
        path,
        f"S3 on moto (loopback): ours / raw s3fs = {ours / raw:.2f}",
        ["raw s3fs cat_file", "torch_dataloader_utils s3://", "same over memory://"],
        [raw, ours, decode],
        "MiB/s",
        notes=["memory://: decode + convert only, no I/O"],
    )


if __name__ == "__main__":
    main()
