"""Launching multi-process jobs from tests: torchrun on 127.0.0.1, a log, no orphan on timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# What every launched job gets: gloo over loopback, one thread per process, quiet warnings, and
# Python's fault handler (a job that hangs is sent SIGABRT: each process prints its stacks).
JOB_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
    "PYTHONFAULTHANDLER": "1",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, script: Path | str) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` on ``nproc`` local ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--monitor_interval=0.2",
        str(script),
    ]  # fmt: skip


def run_logged(
    cmd: Sequence[str],
    *,
    log_file: Path,
    cwd: Path,
    pythonpath: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """Run ``cmd`` with its output in ``log_file``; ``(return code, log)``. On timeout it is
    stopped (ranks included) and the log's tail raised."""
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*pythonpath, *sys.path]),
        **JOB_ENV,
        **(env or {}),
    }
    with log_file.open("w") as log:
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _dump_stacks(proc.pid)
            _stop(proc)
            log_text = log_file.read_text()
            raise AssertionError(
                f"{cmd} timed out; where its processes waited:\n{_stacks(log_text)}\n"
                f"the log's end:\n{log_text[-3000:]}"
            ) from None
    return code, log_file.read_text()


def _dump_stacks(root: int) -> None:
    """SIGABRT to every process below ``root`` (ranks run in sessions of their own, so not a
    process group): with ``PYTHONFAULTHANDLER`` each prints every thread's stack into the log,
    which says where a hung job waited. Linux only (``/proc``); a no-op elsewhere."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    below = {root}
    while grown := {pid for pid, parent in parents.items() if parent in below} - below:
        below |= grown
    for pid in sorted(below - {root}, reverse=True):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
    time.sleep(2)  # the dumps reach the log


def _stacks(log: str) -> str:
    """The fault handler's stack dumps in ``log`` (the first 30 lines of each)."""
    dumps = log.split("Fatal Python error: Aborted")[1:]
    return "\n".join("\n".join(d.strip().splitlines()[:30]) for d in dumps) or "(none)"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """torchrun starts each rank in a session of its own: SIGTERM lets it stop them first;
    then the whole group is killed."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


TESTS = Path(__file__).parent


def launch_job(
    cmd: Sequence[str],
    job: Mapping[str, object],
    workdir: Path,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """Run ``cmd`` + a job file (``job`` as JSON, its ``dir`` the ``workdir``) with the tests'
    helpers importable (``tests/``, ``tests/trainers/``); ``(return code, log)``."""
    job_file = workdir / f"{job['phase']}-job.json"
    job_file.write_text(json.dumps({**job, "dir": str(workdir)}))
    return run_logged(
        [*cmd, str(job_file)],
        log_file=workdir / f"{job['phase']}.log",
        cwd=workdir,
        pythonpath=[str(TESTS), str(TESTS / "trainers")],
        timeout=timeout,
        env=env,
    )
