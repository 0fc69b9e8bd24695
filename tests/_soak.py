"""Crash soak: SIGKILL a training process again and again, resume, prove every row once per epoch.

``make soak`` runs ``python tests/_soak.py --cycles 100``; ``tests/test_soak.py`` runs a short
version. A *run* is a training job over ``--epochs`` epochs of a small Parquet dataset
(``create_dataloader(..., num_workers=2, shuffle=True)``, batches of 16); it is started as a
subprocess (this file with ``child``), killed, restarted from its last checkpoint, killed again,
… until it finishes, then checked; then the next run starts with another seed. A *cycle* is one
child process and the kill that ends it, of one of these kinds (in a seeded random order):

* ``batch`` — the whole process group (trainer and workers) at a random step;
* ``timed`` — the whole group at a random moment after the start (start-up, resume, training);
* ``ckpt-write`` — while a checkpoint file is half written (the child stops there and says so);
* ``ckpt-replace`` — after the checkpoint's temporary file is written and fsynced, just before
  ``os.replace``;
* ``worker`` — one DataLoader worker alone: the trainer must then fail loudly (non-zero exit and
  an error on stderr) within ``HANG_S`` seconds, not hang and not carry on;
* ``main`` — the trainer alone (as the OOM killer does): every worker must exit within 5 s.

The child logs ``(epoch, id)`` of every delivered row to ``ids.bin`` and checkpoints every
``CHECKPOINT_EVERY`` steps and at the end of each epoch: ``torch.save`` of the loader state, the
epoch and the log length to a temporary file, fsync, ``os.replace`` (and fsync of the directory).
A restarted child truncates the log to the length its checkpoint recorded: rows delivered after
the last checkpoint are discarded (their updates died with the process) and must be delivered
again. When a run finishes, each epoch's logged ids must be every row exactly once, and in the
order of an uninterrupted run with the same seed.

    python tests/_soak.py [--cycles 100] [--seed 0] [--workdir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
KINDS = ("batch", "timed", "ckpt-write", "ckpt-replace", "worker", "main")
ROWS_PER_FILE = (700, 500, 900, 900)  # 3,000 rows
ROW_GROUP = 24
BATCH = 16
CHECKPOINT_EVERY = 5
STEP_PAUSE_S = 0.004  # a little "training" per step, so kills land mid-epoch
HANG_S = 30.0  # a child that says nothing for this long is hung
ORPHAN_S = 5.0  # target: workers of a trainer killed alone are gone by then (SPEC)
ORPHAN_HARD_S = 15.0  # ... and if they are not gone by this, they are orphaned for good


# ----------------------------------------------------------------------------- shared


def make_loader(data: str, seed: int) -> tuple[Any, Any]:
    from torch_dataloader_utils import StructuredDataset

    return StructuredDataset.create_dataloader(
        data, batch_size=BATCH, split_bytes=1, num_workers=2, shuffle=True, shuffle_seed=seed
    )


def children(pid: int) -> list[int]:
    """Live forked children of ``pid`` with its command line: the DataLoader workers."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and running(int(entry)):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                same = Path(f"/proc/{entry}/cmdline").read_bytes() == cmdline
            except OSError:
                continue
            if same and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ----------------------------------------------------------------------------- child


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class Trainer:
    """The child: trains ``epochs`` epochs from its last checkpoint, logging delivered ids."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        torch.set_num_threads(1)
        self.args, self.run = args, Path(args.run)
        self.ckpt = self.run / "ckpt.pt"
        self.loader, self.dataset = make_loader(args.data, args.seed)
        self.start_epoch, self.logged, self.resumed = 0, 0, False
        if self.ckpt.exists():
            saved = torch.load(self.ckpt, weights_only=True)
            self.loader.load_state_dict(saved["data"])
            self.start_epoch, self.logged, self.resumed = saved["epoch"], saved["logged"], True
        self.checkpoints = 0

    def train(self) -> None:
        log = open(self.run / "ids.bin", "r+b" if self.logged else "wb")  # noqa: SIM115
        log.truncate(self.logged * 16)  # rows delivered after the checkpoint are discarded
        log.seek(self.logged * 16)
        emit("start", epoch=self.start_epoch, logged=self.logged)
        step = 0
        for epoch in range(self.start_epoch, self.args.epochs):
            if not self.resumed:
                self.dataset.set_epoch(epoch)
            self.resumed = False
            for batch in self.loader:
                ids = batch["id"].numpy()
                log.write(np.stack([np.full_like(ids, epoch), ids], axis=1).tobytes())
                log.flush()
                self.logged += len(ids)
                step += 1
                emit("step", step=step, epoch=epoch)
                time.sleep(STEP_PAUSE_S)
                if step % CHECKPOINT_EVERY == 0:
                    self.checkpoint(epoch)
            self.checkpoint(epoch)  # after the last batch: resumes to an empty remainder
        log.close()
        emit("done", logged=self.logged)

    def checkpoint(self, epoch: int) -> None:
        """``torch.save`` to a temporary file, fsync, ``os.replace``; may stop where told."""
        import torch

        self.checkpoints += 1
        stall = self.args.stall_phase if self.checkpoints == self.args.stall_at else None
        blob = io.BytesIO()
        torch.save({"epoch": epoch, "logged": self.logged, "data": self.loader.state_dict()}, blob)
        data = blob.getvalue()
        tmp = self.ckpt.with_name("ckpt.pt.tmp")
        with open(tmp, "wb") as f:
            if stall == "write":
                f.write(data[: len(data) // 2])
                f.flush()
                self.stall()
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if stall == "replace":
            self.stall()
        os.replace(tmp, self.ckpt)
        directory = os.open(self.run, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def stall(self) -> None:
        emit("stall")
        time.sleep(HANG_S * 2)  # the driver kills us here
        raise SystemExit("soak: the driver did not kill a stalled checkpoint")


def child_main(args: argparse.Namespace) -> int:
    Trainer(args).train()
    return 0


# ----------------------------------------------------------------------------- driver


class Child:
    """A training subprocess in its own session; its stdout events and stderr, read by threads."""

    def __init__(self, data: Path, run: Path, seed: int, epochs: int, stall: tuple[int, str]):
        cmd = [sys.executable, __file__, "child", "--data", str(data), "--run", str(run)]
        cmd += ["--seed", str(seed), "--epochs", str(epochs)]
        cmd += ["--stall-at", str(stall[0]), "--stall-phase", stall[1]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        self.proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read_events, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr.extend(self.proc.stderr)

    def next_event(self, deadline: float) -> dict[str, Any] | None:
        """The next event; ``None`` at the end of stdout; ``TimeoutError`` at ``deadline``."""
        try:
            return self.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=HANG_S)

    def stderr_text(self, wait: float = 2.0) -> str:
        end = time.monotonic() + wait
        while self.proc.stdout and not self.proc.stdout.closed and time.monotonic() < end:
            if self.events.qsize() == 0 and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        return "".join(self.stderr)


class SoakFailure(AssertionError):
    pass


@dataclass
class Soak:
    root: Path
    rng: np.random.Generator
    epochs: int
    data: Path = field(init=False)
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    notes: collections.Counter[str] = field(default_factory=collections.Counter)
    runs_verified: int = 0
    orphan_exit_s: list[float] = field(default_factory=list)
    run_number: int = -1
    run_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        from _data import write_dataset

        self.data = self.root / "data"
        write_dataset(self.data, ROWS_PER_FILE, row_group_size=ROW_GROUP)
        self.next_run()

    @property
    def seed(self) -> int:
        return 1000 + self.run_number

    def next_run(self) -> None:
        self.run_number += 1
        self.run_dir = self.root / f"run-{self.run_number:03d}"
        self.run_dir.mkdir(parents=True)

    def start(self, stall: tuple[int, str] = (0, "none")) -> Child:
        return Child(self.data, self.run_dir, self.seed, self.epochs, stall)

    def cycle(self, kind: str) -> bool:
        """One child and a kill of ``kind``; ``False`` when the run finished before the kill."""
        stall = (int(self.rng.integers(1, 4)), kind.split("-")[1]) if "ckpt" in kind else (0, "-")
        child = self.start(stall)
        try:
            killed = getattr(self, "_kill_" + kind.replace("-", "_"))(child)
        finally:
            child.kill_group()
        if not killed:
            self.finish_run(child)
        return killed

    def _await(self, child: Child, want: str, steps: int = 0) -> bool:
        """Read events until ``want`` (the ``steps``-th step for ``"step"``); ``False`` at done."""
        seen = 0
        while True:
            event = child.next_event(time.monotonic() + HANG_S)
            if event is None or event["event"] == "done":
                self._wait_success(child)
                return False
            if event["event"] == want and (want != "step" or (seen := seen + 1) >= steps):
                return True

    def _wait_success(self, child: Child) -> None:
        rc = child.proc.wait(timeout=HANG_S)
        if rc != 0:
            raise SoakFailure(f"child failed (exit {rc}):\n{child.stderr_text()}")

    def _kill_batch(self, child: Child) -> bool:
        if not self._await(child, "step", int(self.rng.integers(1, 50))):
            return False
        child.kill_group()
        return True

    def _kill_timed(self, child: Child) -> bool:
        deadline = time.monotonic() + float(self.rng.uniform(0.0, 4.0))
        while True:
            try:
                event = child.next_event(deadline)
            except TimeoutError:
                child.kill_group()
                return True
            if event is None or event["event"] == "done":
                self._wait_success(child)
                return False

    def _kill_ckpt_write(self, child: Child) -> bool:
        if not self._await(child, "stall"):
            return False
        child.kill_group()
        return True

    _kill_ckpt_replace = _kill_ckpt_write

    def _kill_worker(self, child: Child) -> bool:
        if not self._await(child, "step", int(self.rng.integers(1, 40))):
            return False
        workers = children(child.proc.pid)
        if len(workers) != 2:
            raise SoakFailure(f"expected 2 DataLoader workers, found {workers}")
        os.kill(workers[int(self.rng.integers(0, 2))], signal.SIGKILL)
        try:
            rc = child.proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            raise SoakFailure(f"trainer hung {HANG_S:.0f} s after a worker was killed") from None
        err = child.stderr_text()
        if rc == 0:  # the worker had delivered its share: nothing was lost, the run completed
            self.notes["worker kill after its share (run completed)"] += 1
            return False
        if not err.strip():
            raise SoakFailure(f"trainer exited {rc} after a worker kill without an error message")
        message = re.sub(r"\d+", "N", _last_line(err))[:90]  # pids differ
        self.notes[f"worker kill -> {message}"] += 1
        return True

    def _kill_main(self, child: Child) -> bool:
        if not self._await(child, "step", int(self.rng.integers(1, 40))):
            return False
        workers = children(child.proc.pid)
        os.kill(child.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        child.proc.wait(timeout=HANG_S)
        while any(running(p) for p in workers) and time.monotonic() - killed < ORPHAN_HARD_S:
            time.sleep(0.02)
        alive = [p for p in workers if running(p)]
        if alive:
            raise SoakFailure(
                f"workers {alive} still running {ORPHAN_HARD_S:.0f} s after the trainer"
            )
        self.orphan_exit_s.append(time.monotonic() - killed)
        return True

    def finish_run(self, child: Child | None = None) -> None:
        """Run the current run to its end (unless ``child`` did), check it, start the next."""
        if child is None:
            child = self.start()
            try:
                while child.next_event(time.monotonic() + HANG_S) is not None:
                    pass
                self._wait_success(child)
            finally:
                child.kill_group()
        verify_run(self.data, self.run_dir, self.seed, self.epochs)
        self.runs_verified += 1
        self.next_run()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reference_order(data: Path, seed: int, epochs: int) -> list[list[int]]:
    """Ids per epoch of an uninterrupted run (same loader arguments, in this process)."""
    loader, dataset = make_loader(str(data), seed)
    order = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        order.append([int(i) for batch in loader for i in batch["id"].tolist()])
    return order


def verify_run(data: Path, run: Path, seed: int, epochs: int) -> None:
    """Each epoch's logged ids: every row once, in the order of an uninterrupted run."""
    import torch

    saved = torch.load(run / "ckpt.pt", weights_only=True)
    raw = (run / "ids.bin").read_bytes()
    log = np.frombuffer(raw[: saved["logged"] * 16], dtype=np.int64).reshape(-1, 2)
    total = sum(ROWS_PER_FILE)
    expected = reference_order(data, seed, epochs)
    for epoch in range(epochs):
        got = log[log[:, 0] == epoch, 1]
        counts = np.bincount(got, minlength=total) if got.size else np.zeros(total, np.int64)
        if counts.size != total or not (counts == 1).all():
            lost, twice = int((counts == 0).sum()), int((counts > 1).sum())
            raise SoakFailure(f"{run.name} epoch {epoch}: {lost} rows lost, {twice} repeated")
        if got.tolist() != expected[epoch]:
            raise SoakFailure(f"{run.name} epoch {epoch}: every row once, but not in run order")


def soak(
    cycles: int, seed: int, root: Path, epochs: int = 2, kinds: tuple[str, ...] = KINDS
) -> dict[str, Any]:
    """``cycles`` kills (``kinds`` in a seeded random order), every finished run checked."""
    rng = np.random.default_rng(seed)
    state = Soak(root=root, rng=rng, epochs=epochs)
    schedule = [kinds[i % len(kinds)] for i in range(cycles)]
    rng.shuffle(schedule)
    began = time.monotonic()
    for number, kind in enumerate(schedule, 1):
        for _ in range(5):  # a run may end before the kill: the next run gets it
            if state.cycle(kind):
                state.kills[kind] += 1
                break
            state.notes[f"{kind}: run finished before the kill"] += 1
        print(
            f"cycle {number}/{cycles}: {kind:<12} survived  (runs verified so far: "
            f"{state.runs_verified}, {time.monotonic() - began:.0f} s)",
            flush=True,
        )
    state.finish_run()
    return {
        "cycles": sum(state.kills.values()),
        "by_kind": dict(sorted(state.kills.items())),
        "runs_verified": state.runs_verified,
        "notes": dict(state.notes),
        "orphan_exit_s": [round(s, 3) for s in state.orphan_exit_s],
        "seconds": time.monotonic() - began,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command")
    child = sub.add_parser("child")
    child.add_argument("--data", required=True)
    child.add_argument("--run", required=True)
    child.add_argument("--seed", type=int, required=True)
    child.add_argument("--epochs", type=int, default=2)
    child.add_argument("--stall-at", type=int, default=0)
    child.add_argument("--stall-phase", default="-")
    p.add_argument("--cycles", type=int, default=100, help="kills, of all kinds together")
    p.add_argument("--seed", type=int, default=0, help="seeds the kinds' order and moments")
    p.add_argument("--epochs", type=int, default=2, help="epochs per training run")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    p.add_argument("--kinds", default=",".join(KINDS), help="kinds of kill, comma-separated")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "child":
        return child_main(args)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="tdu-soak-"))
    os.environ.setdefault("TDU_CACHE_DIR", str(root / "index_cache"))
    if args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    try:
        kinds = tuple(args.kinds.split(","))
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise SystemExit(f"unknown --kinds {unknown}; choose from {list(KINDS)}")
        report = soak(args.cycles, args.seed, root, args.epochs, kinds)
    except SoakFailure as exc:
        print(f"\nSOAK FAILED (seed {args.seed}; runs kept in {root}):\n{exc}", flush=True)
        return 1
    print(f"\nsoak passed: {report['cycles']} kills survived, by kind: {report['by_kind']}")
    print(f"training runs checked (every row exactly once per epoch, in run order): "
          f"{report['runs_verified']}")  # fmt: skip
    exits = report["orphan_exit_s"]
    late = [s for s in exits if s > ORPHAN_S]
    if exits:
        print(
            f"workers of a trainer killed alone were gone {min(exits):.2f}-{max(exits):.2f} s "
            f"after the SIGKILL (median {float(np.median(exits)):.2f} s): "
            + (f"TARGET MISSED: {len(late)} of {len(exits)} over {ORPHAN_S:.0f} s" if late
               else f"all within {ORPHAN_S:.0f} s")
        )  # fmt: skip
    for note, count in sorted(report["notes"].items()):
        print(f"  {count:3d} x {note}")
    print(f"{report['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
