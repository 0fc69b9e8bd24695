"""Batches lent from shared-memory slots stay valid for as long as the training loop keeps them."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.transport.slots import SharedSlots, Slab


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    write_dataset(tmp_path, [3000, 2000, 2500], row_group_size=500)
    return tmp_path


def _expected_x(ids: torch.Tensor) -> torch.Tensor:
    return ids.to(torch.float64) * 0.5


@pytest.mark.parametrize("persistent", [False, True])
def test_kept_batches_survive_later_epochs(dataset_dir: Path, persistent: bool) -> None:
    loader, dataset = StructuredDataset.create_dataloader(
        str(dataset_dir), batch_size=64, num_workers=2, shuffle=True,
        persistent_workers=persistent,
    )  # fmt: skip
    kept = list(loader)  # every batch retained: slots cannot all be lent out
    snapshot = [(b["id"].clone(), b["x"].clone()) for b in kept]
    for epoch in (1, 2):
        dataset.set_epoch(epoch)
        for batch in loader:
            batch["x"].fill_(-1.0)  # writing a lent view must not reach other batches
    for batch, (ids, x) in zip(kept, snapshot, strict=True):
        assert torch.equal(batch["id"], ids) and torch.equal(batch["x"], x)
        assert torch.equal(batch["x"], _expected_x(batch["id"]))
    assert sorted(torch.cat([b["id"] for b in kept]).tolist()) == list(range(7500))


def test_slot_is_lent_until_its_views_are_gone() -> None:
    slots = SharedSlots(num_workers=1, slots=4, slot_bytes=1 << 12)
    slots.begin(fresh_epoch=0)
    first = slots.acquire(0, slots.generation())
    assert first is not None
    assert slots.lend_or_copy(0, first)
    view = slots.view(0, first, Slab(0, torch.int64, (8,), False))
    second = slots.acquire(0, slots.generation())
    assert second is not None and second != first
    assert slots.lend_or_copy(0, second)
    other = slots.view(0, second, Slab(0, torch.int64, (8,), False))
    third = slots.acquire(0, slots.generation())
    assert not slots.lend_or_copy(0, third), "at most slots - 2 are lent"
    slots.free(0, third)  # copied out
    del view
    again = slots.acquire(0, slots.generation())
    assert slots.lend_or_copy(0, again), "the first slot came back once its view was dropped"
    assert set(slots._lent) == {(0, second), (0, again)}
    assert np.count_nonzero(slots._flags[2:]) == 2
    del other


def test_waiting_worker_gives_up_when_the_iteration_ends() -> None:
    slots = SharedSlots(num_workers=1, slots=1, slot_bytes=1 << 12)
    generation = slots.begin(fresh_epoch=0)
    assert generation == slots.generation()
    assert slots.acquire(0, generation) == 0
    slots.end(generation)
    assert slots.acquire(0, generation) is None
    later = slots.begin(fresh_epoch=1)
    slots.end(generation)  # an older iteration ending late leaves the newer one running
    assert slots.generation() == later


def test_persistent_workers_follow_set_epoch_without_a_restart(dataset_dir: Path) -> None:
    loader, dataset = StructuredDataset.create_dataloader(
        str(dataset_dir),
        batch_size=64,
        num_workers=2,
        shuffle=True,
        split_bytes=4096,
        persistent_workers=True,
    )
    epochs = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        epochs.append(torch.cat([b["id"] for b in loader]).tolist())
        if epoch == 0:
            workers = loader._iterator
    assert loader._iterator is workers, "the same worker processes served every epoch"
    assert all(sorted(ids) == list(range(7500)) for ids in epochs)
    assert epochs[0] != epochs[1] != epochs[2], "each epoch has its own order"
    fresh, _ = StructuredDataset.create_dataloader(
        str(dataset_dir), batch_size=64, num_workers=2, shuffle=True, split_bytes=4096
    )
    fresh.dataset.set_epoch(2)
    assert torch.cat([b["id"] for b in fresh]).tolist() == epochs[2]


def _wait_for_a_slot(slots: SharedSlots, generation: int, ready: Any, woke: Any) -> None:
    ready.set()
    woke.put(slots.acquire(0, generation))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_waiting_worker_blocks_without_cpu_and_wakes_on_free(method: str) -> None:
    context = multiprocessing.get_context(method)
    slots = SharedSlots(num_workers=1, slots=2, slot_bytes=1 << 12)
    slots.begin(fresh_epoch=0)
    generation = slots.generation()
    held = [slots.acquire(0, generation), slots.acquire(0, generation)]
    ready, woke = context.Event(), context.Queue()
    worker = context.Process(
        target=_wait_for_a_slot, args=(slots, generation, ready, woke), daemon=True
    )
    worker.start()
    try:
        assert ready.wait(60)
        time.sleep(0.2)  # inside acquire
        cpu = _cpu_seconds(worker.pid)
        time.sleep(1.0)
        assert _cpu_seconds(worker.pid) - cpu <= 0.05  # ~0.1 CPU-s per second when it polled
        slots.free(0, held[1])
        assert woke.get(timeout=10) == held[1]
        worker.join(10)
        assert worker.exitcode == 0
    finally:
        worker.kill()


def _cpu_seconds(pid: int | None) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_end_wakes_a_waiting_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Woken by ``end``, not by the check interval (made 60 s here: no timing on a loaded
    machine can pass for a wake-up)."""
    from torch_dataloader_utils.transport import slots as _transport

    monkeypatch.setattr(_transport, "_PARENT_CHECK", 60.0)
    slots = SharedSlots(num_workers=1, slots=1, slot_bytes=1 << 12)
    slots.begin(fresh_epoch=0)
    generation = slots.generation()
    assert slots.acquire(0, generation) == 0
    threading.Timer(0.1, slots.end, args=(generation,)).start()
    started = time.monotonic()
    assert slots.acquire(0, generation) is None
    assert time.monotonic() - started < 30


def test_an_orphaned_worker_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_dataloader_utils.transport import slots as _transport

    slots = SharedSlots(num_workers=1, slots=1, slot_bytes=1 << 12)
    slots.begin(fresh_epoch=0)
    generation = slots.generation()
    assert slots.acquire(0, generation) == 0
    monkeypatch.setattr(_transport, "_PARENT_CHECK", 0.01)
    assert not slots._orphaned()  # the parent seen by acquire, the owner alive

    def exit_(status: int) -> None:
        raise SystemExit(status)

    monkeypatch.setattr(os, "_exit", exit_)
    real = os.getppid()
    monkeypatch.setattr(os, "getppid", lambda: real + 1)  # adopted by another process
    with pytest.raises(SystemExit) as exc:
        slots.acquire(0, generation)
    assert exc.value.code == _transport._ORPHANED_EXIT
    monkeypatch.setattr(os, "getppid", lambda: real)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    slots._owner = dead.pid  # a forkserver's worker: the main process is not its parent
    assert slots._orphaned()
