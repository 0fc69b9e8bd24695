"""SIGKILL a training process mid-epoch, restart it from its last saved checkpoint: every row of
the epoch is trained on exactly once (counting only what the last checkpoint covered); with
token packing, every token.

The training process is this file run as a script: it appends each batch's ids to a log and
every few batches saves ``loader.state_dict()`` atomically (temp file + ``os.replace``), with
the number of batches the checkpoint covers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _options(num_workers: int, packed: bool) -> dict[str, object]:
    from torch_dataloader_utils import TokenPacking

    packing = TokenPacking("tokens", seq_len=7, separator=-1) if packed else None
    return {"batch_size": 5, "split_bytes": 1, "shuffle": True, "shuffle_seed": 11,
            "num_workers": num_workers, "packing": packing}  # fmt: skip


def _delivered(batch: dict) -> list[int]:
    """Row ids, or with packing the real tokens of the batch."""
    if "id" in batch:
        return batch["id"].tolist()
    return batch["input_ids"].flatten()[: batch["num_tokens"]].tolist()


def _train(data: str, ckpt: str, log: str, num_workers: int, run: int, packed: bool) -> None:
    from torch_dataloader_utils import StructuredDataset

    loader, _ = StructuredDataset.create_dataloader(data, **_options(num_workers, packed))
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            loader.load_state_dict(json.load(f)["state"])
    with open(log, "a") as out:
        for number, batch in enumerate(loader, 1):
            out.write(json.dumps({"run": run, "batch": number, "ids": _delivered(batch)}))
            out.write("\n")
            out.flush()
            if number % 4 == 0:
                tmp = f"{ckpt}.tmp"
                with open(tmp, "w") as f:
                    json.dump({"run": run, "batch": number, "state": loader.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, ckpt)
            time.sleep(0.02)
        out.write(json.dumps({"run": run, "finished": True}) + "\n")


def _start(
    data: Path, ckpt: Path, log: Path, num_workers: int, run: int, packed: bool
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    args = [str(data), str(ckpt), str(log), str(num_workers), str(run), str(int(packed))]
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        env=env, start_new_session=True, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize(("num_workers", "packed"), [(0, False), (2, False), (2, True)])
def test_sigkill_mid_epoch_then_resume(tmp_path: Path, num_workers: int, packed: bool):
    import _harness
    from _data import write_dataset
    from test_packing import expected_tokens, write_documents

    data = tmp_path / "data"
    lengths = [[(7 * i) % 23 for i in range(n)] for n in (120, 90, 150)]
    if packed:
        write_documents(data, lengths, row_group=8)
    else:
        write_dataset(data, [200, 150, 250], row_group_size=8)
    ckpt, log = tmp_path / "ckpt.json", tmp_path / "log.jsonl"

    trainer = _start(data, ckpt, log, num_workers, run=1, packed=packed)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt.exists() and json.loads(ckpt.read_text())["batch"] >= 40):
            assert trainer.poll() is None, f"trainer ended early:\n{trainer.stderr.read()}"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.01)
        time.sleep(0.05)  # a few batches past the checkpoint: those must be re-delivered
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
    assert trainer.returncode == -signal.SIGKILL
    saved = json.loads(ckpt.read_text())
    first = [r for r in _records(log) if r["run"] == 1]
    assert not any(r.get("finished") for r in first), "killed after the epoch ended"
    assert saved["run"] == 1 and len(first) >= saved["batch"]

    resumed = _start(data, ckpt, log, num_workers, run=2, packed=packed)
    _, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err
    second = [r for r in _records(log) if r["run"] == 2]
    assert second[-1].get("finished")

    kept = [i for r in first[: saved["batch"]] for i in r["ids"]]
    rest = [i for r in second if "ids" in r for i in r["ids"]]
    if packed:  # every token exactly once
        assert Counter(kept + rest) == expected_tokens(lengths)
    else:  # every row exactly once
        assert sorted(kept + rest) == list(range(600))
    # ... and in the order of an uninterrupted run.
    loader, _ = _harness.make_loader({"path": str(data), **_options(num_workers, packed)})
    assert kept + rest == [i for batch in loader for i in _delivered(batch)]


if __name__ == "__main__":
    data, ckpt, log, workers, run, packed = sys.argv[1:]
    _train(data, ckpt, log, int(workers), int(run), packed == "1")
