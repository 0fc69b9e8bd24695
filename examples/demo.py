"""``make demo``: train, get killed mid-epoch, resume from the last checkpoint, prove exactness.

What it does, on this machine, in about a minute:

1. Writes a sample Parquet dataset under ``demo_output/data`` (``--rows`` rows of 8 float32
   features ``f0..f7``, a target ``y = X @ w + noise`` and a unique ``id``; ~100 MB), with a
   progress bar. It is reused on later runs.
2. Starts the training as a subprocess (``python examples/demo.py --train``): a small
   regression model over ``StructuredDataset.create_dataloader(..., num_workers=2,
   shuffle=True)``. Every ``--checkpoint-every`` steps it atomically saves the model, the
   optimizer and ``loader.state_dict()`` together (``torch.save`` to a temporary file, then
   ``os.replace``) and appends the ids of every delivered row to ``ids.bin``.
3. Kills it with SIGKILL mid-epoch, between two checkpoints.
4. Restarts it with ``--resume``: it loads the last checkpoint, truncates the id log to what
   that checkpoint had delivered, and finishes the epoch.
5. Prints a report (rows/s, checkpoint size, time to first batch after resume) and checks
   that every row of the dataset was delivered exactly once, counting the rows delivered up to
   the last checkpoint plus those delivered after the resume. Rows delivered after the last
   checkpoint but before the kill are discarded from that count, as the model updates they
   fed were lost with the process; the demo also checks that the resumed run re-delivered
   exactly those rows, in the same order. Exits 1 if any check fails.

    python examples/demo.py [--out demo_output] [--rows 2400000]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

FEATURES = [f"f{i}" for i in range(8)]
BATCH = 4096
CHECKPOINT = "checkpoint.pt"
IDS = "ids.bin"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="demo_output", help="directory for data and the run")
    p.add_argument("--rows", type=int, default=2_400_000, help="rows in the sample dataset")
    p.add_argument("--files", type=int, default=12, help="Parquet files in the sample dataset")
    p.add_argument("--checkpoint-every", type=int, default=25, help="steps between checkpoints")
    p.add_argument("--kill-at", type=float, default=0.5, help="kill after this epoch fraction")
    p.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP (0: linear)")
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def write_dataset(directory: Path, rows: int, files: int) -> list[Path]:
    """The sample dataset (reused when its manifest matches)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    manifest = directory / "_demo_dataset.json"  # "_" names are not read as data
    wanted = {"rows": rows, "files": files, "seed": 0}
    existing = sorted(directory.glob("part-*.parquet"))
    if manifest.exists() and json.loads(manifest.read_text()) == wanted and existing:
        return existing
    directory.mkdir(parents=True, exist_ok=True)
    for old in existing:
        old.unlink()
    weights = np.linspace(-1.0, 1.0, len(FEATURES), dtype=np.float32)
    bounds = np.linspace(0, rows, files + 1).astype(np.int64)
    for number in tqdm(range(files), desc=f"writing {rows:,} rows to {directory}", unit="file"):
        start, stop = int(bounds[number]), int(bounds[number + 1])
        rng = np.random.default_rng([0, number])
        x = rng.standard_normal((stop - start, len(FEATURES)), dtype=np.float32)
        y = x @ weights + 0.5 + 0.1 * rng.standard_normal(stop - start, dtype=np.float32)
        columns = {name: x[:, i] for i, name in enumerate(FEATURES)}
        table = pa.table({"id": np.arange(start, stop, dtype=np.int64), **columns, "y": y})
        path = directory / f"part-{number:05d}.parquet"
        tmp = directory / f".{path.name}.tmp"
        pq.write_table(table, tmp, row_group_size=50_000)
        os.replace(tmp, path)
    manifest.write_text(json.dumps(wanted))
    return sorted(directory.glob("part-*.parquet"))


# ----------------------------------------------------------------------------- training (child)


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout for the driver."""
    print(json.dumps({"event": event, **fields}), flush=True)


def save_atomically(obj: dict[str, Any], path: Path) -> int:
    """``torch.save`` to a temporary file, fsync, then rename over ``path``; returns bytes."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


class Job:
    """The training job: loader, model, optimizer, and what it has delivered so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from torch_dataloader_utils import StructuredDataset

        torch.manual_seed(0)
        # The two DataLoader workers use the other core(s); one intra-op thread avoids
        # oversubscribing a small machine (two spinning threads made steps ~20x slower here).
        torch.set_num_threads(1)
        self.run = Path(args.out) / "run"
        self.loader, _ = StructuredDataset.create_dataloader(
            str(Path(args.out) / "data"),
            batch_size=BATCH,
            num_workers=2,
            shuffle=True,
            shuffle_seed=0,
            columns=["id", *FEATURES, "y"],
        )
        self.model = make_model(args.hidden)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.step, self.logged = 0, 0  # steps taken, row ids logged

    def restore(self) -> None:
        """Model, optimizer and data position from the last checkpoint."""
        import torch

        checkpoint = torch.load(self.run / CHECKPOINT, weights_only=True)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.loader.load_state_dict(checkpoint["data"])
        self.step, self.logged = checkpoint["step"], checkpoint["ids_logged"]

    def train_step(self, batch: dict[str, Any]) -> float:
        import torch

        x = torch.stack([batch[name] for name in FEATURES], dim=1)
        loss = torch.nn.functional.mse_loss(self.model(x).squeeze(1), batch["y"])
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return float(loss.item())

    def checkpoint(self) -> None:
        """Model, optimizer, data state and the id-log length, in one atomic write."""
        state = {
            "step": self.step,
            "ids_logged": self.logged,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "data": self.loader.state_dict(),
        }
        size = save_atomically(state, self.run / CHECKPOINT)
        emit(
            "checkpoint",
            step=self.step,
            bytes=size,
            ids_logged=self.logged,
            data_state_json_bytes=len(json.dumps(state["data"])),
        )


def train(args: argparse.Namespace) -> int:
    """The child process: one epoch (or its rest, with ``--resume``), logging delivered ids."""
    began = time.perf_counter()
    job = Job(args)
    built = resumed_at = time.perf_counter()
    if args.resume:
        job.restore()  # times from here: load_state_dict, then the first batch
    ids_log = open(job.run / IDS, "r+b" if args.resume else "wb")  # noqa: SIM115
    ids_log.truncate(job.logged * 8)  # rows delivered after the checkpoint are discarded
    ids_log.seek(job.logged * 8)
    total_steps = len(job.loader) + job.step
    emit(
        "start",
        resumed=args.resume,
        step=job.step,
        ids_logged=job.logged,
        total_steps=total_steps,
        setup_s=built - began,
    )
    rows, loss, start = 0, float("nan"), time.perf_counter()
    for batch in job.loader:
        if not rows:
            now = time.perf_counter()
            emit("first_batch", since_load_s=now - resumed_at, since_process_s=now - began)
        loss = job.train_step(batch)
        ids_log.write(batch["id"].numpy().tobytes())
        ids_log.flush()  # so that the driver sees what was delivered before a kill
        rows, job.logged = rows + len(batch["id"]), job.logged + len(batch["id"])
        emit("step", step=job.step, rows=rows, seconds=time.perf_counter() - start)
        if job.step % args.checkpoint_every == 0 or job.step == total_steps:
            job.checkpoint()
    ids_log.close()
    emit("done", step=job.step, rows=rows, seconds=time.perf_counter() - start, loss=loss)
    return 0


def make_model(hidden: int) -> Any:
    import torch

    if hidden <= 0:
        return torch.nn.Linear(len(FEATURES), 1)
    return torch.nn.Sequential(
        torch.nn.Linear(len(FEATURES), hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    )


# ----------------------------------------------------------------------------- driver


class Child:
    """The training subprocess and the events it printed."""

    def __init__(self, args: argparse.Namespace, *, resume: bool) -> None:
        cmd = [
            sys.executable,
            __file__,
            "--train",
            "--out",
            args.out,
            "--hidden",
            str(args.hidden),
            "--checkpoint-every",
            str(args.checkpoint_every),
        ]
        self.proc = subprocess.Popen(
            [*cmd, "--resume"] if resume else cmd, stdout=subprocess.PIPE, text=True
        )
        self.events: dict[str, dict[str, Any]] = {}
        self.checkpoints: list[dict[str, Any]] = []

    def lines(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("{"):
                print(line, end="")
                continue
            event = json.loads(line)
            self.events[event["event"]] = event
            if event["event"] == "checkpoint":
                self.checkpoints.append(event)
            yield event


def run_until_killed(args: argparse.Namespace) -> Child:
    """First run: SIGKILL once past ``--kill-at`` of the epoch, half-way between checkpoints."""
    child = Child(args, resume=False)
    kill_after: int | None = None
    for event in child.lines():
        if event["event"] == "start":
            total = event["total_steps"]
            target = max(args.checkpoint_every, int(total * args.kill_at))
            last_checkpoint = target - target % args.checkpoint_every
            kill_after = last_checkpoint + max(1, args.checkpoint_every // 2)
        elif event["event"] == "step" and kill_after is not None and event["step"] >= kill_after:
            child.proc.send_signal(signal.SIGKILL)
            child.proc.wait()
            child.events["killed"] = {"after_step": event["step"]}
            break
    child.proc.wait()
    if "killed" not in child.events:
        raise SystemExit(f"the training ended (exit {child.proc.returncode}) before the kill")
    return child


def read_ids(run: Path) -> np.ndarray:
    raw = (run / IDS).read_bytes()
    return np.frombuffer(raw[: len(raw) // 8 * 8], dtype=np.int64)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.train:
        return train(args)
    out = Path(args.out)
    files = write_dataset(out / "data", args.rows, args.files)
    size = sum(f.stat().st_size for f in files)
    print(
        f"dataset: {out / 'data'}: {len(files)} Parquet files, {args.rows:,} rows, "
        f"{size / 2**20:.0f} MiB"
    )
    # The package's index cache (parsed footers) lives beside the data, not in ~/.cache.
    os.environ.setdefault("TDU_CACHE_DIR", str(out / "index_cache"))
    run = out / "run"
    run.mkdir(parents=True, exist_ok=True)
    for stale in (CHECKPOINT, IDS):
        (run / stale).unlink(missing_ok=True)

    print("training (num_workers=2, shuffle=True) ...", flush=True)
    first = run_until_killed(args)
    import torch

    checkpoint = torch.load(run / CHECKPOINT, weights_only=True)
    killed_ids = read_ids(run)
    kept = checkpoint["ids_logged"]
    discarded = killed_ids[kept:]
    print(
        f"killed with SIGKILL after step {first.events['killed']['after_step']} of "
        f"{first.events['start']['total_steps']}; last checkpoint at step {checkpoint['step']}"
    )

    print("resuming from the last checkpoint ...", flush=True)
    second = Child(args, resume=True)
    for _ in second.lines():
        pass
    if second.proc.wait() != 0:
        print(f"the resumed training failed (exit {second.proc.returncode})")
        return 1
    return report(args, first, second, checkpoint, discarded, read_ids(run))


def report(
    args: argparse.Namespace,
    first: Child,
    second: Child,
    checkpoint: dict[str, Any],
    discarded: np.ndarray,
    final_ids: np.ndarray,
) -> int:
    kept = checkpoint["ids_logged"]
    after = final_ids[kept:]
    in_range = final_ids.size == 0 or (final_ids.min() >= 0 and final_ids.max() < args.rows)
    counts = np.bincount(final_ids, minlength=args.rows) if in_range else np.zeros(0)
    checks = {
        "every row delivered exactly once": bool(
            in_range and counts.size == args.rows and (counts == 1).all()
        ),
        "rows discarded at the kill were re-delivered first, in the same order": bool(
            np.array_equal(after[: discarded.size], discarded)
        ),
    }
    killed_step = first.events["step"]
    done = second.events["done"]
    first_batch = second.events["first_batch"]
    last = first.checkpoints[-1]
    setup = second.events["start"]["setup_s"]
    print("\n============================ report ============================")
    print("throughput, training loop with the model step (num_workers=2, from iter() on):")
    print(
        f"  first run   {killed_step['rows'] / killed_step['seconds']:12,.0f} rows/s"
        f"  ({killed_step['rows']:,} rows until the kill)"
    )
    print(
        f"  resumed run {done['rows'] / done['seconds']:12,.0f} rows/s"
        f"  ({done['rows']:,} rows to the end of the epoch; final loss {done['loss']:.4f})"
    )
    print(f"checkpoint size: {last['bytes']:,} bytes on disk (model + optimizer + data state)")
    print(f"  of which the data state: {last['data_state_json_bytes']:,} bytes as JSON")
    print(f"time to first batch after resume: {first_batch['since_load_s'] * 1e3:.0f} ms")
    print("  (reading the checkpoint, load_state_dict, starting 2 workers, first batch);")
    print(
        f"  {first_batch['since_process_s']:.2f} s from process start, of which "
        f"{setup:.2f} s imports + dataset construction"
    )
    print(f"rows in the dataset:                      {args.rows:12,}")
    print(f"  delivered up to the last checkpoint:    {kept:12,}  (step {checkpoint['step']})")
    print(f"  delivered after the resume:             {after.size:12,}")
    print(
        f"  discarded: delivered after that checkpoint, before the kill: {discarded.size:,}\n"
        f"  (not counted: their training steps died with the process, and the resume\n"
        f"  delivers them again)"
    )
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    verified = all(checks.values())
    print("VERIFIED: every row seen exactly once" if verified else "VERIFICATION FAILED")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
