"""A short crash soak (``make soak`` runs the long one): 8 kills of every kind, each followed by
a resume from the last checkpoint; every finished run delivers every row exactly once per epoch,
in the order of an uninterrupted run. See ``tests/_soak.py``.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
from _soak import KINDS, ORPHAN_HARD_S, ORPHAN_S, Soak, children, running, soak


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_soak_every_kind_of_kill(tmp_path: Path):
    kinds = (*KINDS, "worker", "ckpt-replace")  # 8 cycles, every kind at least once
    report = soak(len(kinds), seed=7, root=tmp_path, kinds=kinds)
    assert report["cycles"] == len(kinds)
    assert set(report["by_kind"]) == set(KINDS), report
    assert report["runs_verified"] >= 1
    # Hard limit here; the 5 s target is pinned by the test below.
    assert all(s < ORPHAN_HARD_S for s in report["orphan_exit_s"]), report


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_of_a_stepping_trainer_exit_well_within_5s(tmp_path: Path):
    state = Soak(root=tmp_path, rng=np.random.default_rng(0), epochs=2)
    child = state.start()
    try:
        assert state._await(child, "step", 20)
        workers = children(child.proc.pid)
        assert len(workers) == 2
        child.proc.send_signal(signal.SIGKILL)  # the trainer alone
        killed = time.monotonic()
        while any(running(p) for p in workers) and time.monotonic() - killed < ORPHAN_HARD_S:
            time.sleep(0.02)
        took = time.monotonic() - killed
    finally:
        child.kill_group()
    assert took < ORPHAN_S - 1.0, f"workers gone {took:.2f} s after the trainer's SIGKILL"
