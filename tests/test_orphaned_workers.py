"""DataLoader workers never outlive the training process, even when it is SIGKILLed alone
(what the OOM killer does): they notice within seconds and exit, and never spin meanwhile.

The training process is this file run as a script: it reports its workers' pids after the
first batch, then takes batches slowly and keeps them, so the workers wait for free slots
when it dies (not in torch's own loop, whose watchdog would notice within 5 s by itself).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _soak import children, running

HERE = Path(__file__).resolve().parent


def _train(data: str) -> None:
    from torch_dataloader_utils import StructuredDataset

    loader, _ = StructuredDataset.create_dataloader(
        data, batch_size=4, split_bytes=1, num_workers=2, prefetch_factor=8
    )
    kept = []  # batches kept alive hold their slots: the workers must wait for one
    for number, batch in enumerate(loader):
        kept.append(batch)
        if number == 0:
            print("workers", *children(os.getpid()), flush=True)
        time.sleep(0.5)


@pytest.mark.slow
def test_workers_exit_within_5s_of_a_sigkilled_trainer(tmp_path: Path):
    from _data import write_dataset

    write_dataset(tmp_path, [400, 400], row_group_size=4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    trainer = subprocess.Popen(
        [sys.executable, __file__, str(tmp_path)],
        env=env, start_new_session=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = trainer.stdout.readline()  # type: ignore[union-attr]
        workers = [int(p) for p in line.split()[1:]]
        assert line.startswith("workers") and len(workers) >= 2, line
        time.sleep(1.0)  # the workers fill their slots and wait
        os.kill(trainer.pid, signal.SIGKILL)  # the trainer alone, not its process group
        trainer.wait(timeout=30)
        killed = time.monotonic()
        while any(running(p) for p in workers) and time.monotonic() - killed < 5.0:
            time.sleep(0.05)
        alive = [p for p in workers if running(p)]
        assert not alive, f"workers {alive} still running 5 s after the trainer was killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)  # whatever is left of the session


if __name__ == "__main__":
    _train(sys.argv[1])
