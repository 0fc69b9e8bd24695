"""``loader.stats()``: exact counts of what the loop was handed, its wait and its own time."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from _data import write_dataset, write_token_documents

from torch_dataloader_utils import (
    LoaderStats,
    LoopStats,
    StructuredDataLoader,
    StructuredDataset,
    TokenPacking,
)
from torch_dataloader_utils.api.mixture_stats import SourceStats
from torch_dataloader_utils.api.stage_stats import ProcessStats, StageStats, batch_rows
from torch_dataloader_utils.api.stats import Recorder


def _loader(root: Path, workers: int, **kwargs: Any) -> Any:
    options = {"persistent_workers": False} if workers else {}
    return StructuredDataLoader(
        StructuredDataset(str(root), **kwargs), num_workers=workers, **options
    )


def _held(batches: list[dict[str, Any]]) -> tuple[int, int]:
    rows = sum(len(next(iter(b.values()))) for b in batches)
    tokens = sum(int(b.get("num_tokens", 0)) for b in batches)
    return rows, tokens


@pytest.mark.parametrize("workers", [0, 2])
def test_counts_equal_what_the_batches_hold(tmp_path: Path, workers: int) -> None:
    write_dataset(tmp_path, [37, 50, 13], row_group_size=8)
    loader = _loader(tmp_path, workers, batch_size=16)
    batches = list(loader)
    stats = loader.stats()
    assert stats.since_start.batches == len(batches) == len(loader)
    assert stats.since_start.rows == 100 == _held(batches)[0]
    assert stats.since_start.tokens == 0
    assert stats.recent.rows == 100  # all within the last 10 s
    assert stats.num_workers == workers


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_batches_count_sequences_and_real_tokens(tmp_path: Path, workers: int) -> None:
    write_token_documents(tmp_path)
    loader = _loader(
        tmp_path,
        workers,
        batch_size=4,
        columns=["tokens"],
        packing=TokenPacking("tokens", seq_len=16, separator=-1),
    )
    batches = list(loader)
    rows, tokens = _held(batches)
    stats = loader.stats().since_start
    assert (stats.batches, stats.rows, stats.tokens) == (len(batches), rows, tokens)
    # every document's tokens and its separator: 150 docs of d % 31 tokens
    assert tokens == sum(d % 31 for d in range(150)) + 150
    assert rows == sum(len(b["input_ids"]) for b in batches)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_slow_consumer_is_the_bottleneck(tmp_path: Path, workers: int) -> None:
    """A loop whose step (0.25 s) outlasts the reading of a batch by far: a worker stalled by
    a loaded machine for up to 125 ms over the 10 steps still leaves the verdict "trainer" (at
    0.1 s a step, a CI run beside other tests' processes once stalled past its 50 ms)."""
    write_dataset(tmp_path, [240], row_group_size=20)
    loader = _loader(tmp_path, workers, batch_size=20)
    it = iter(loader)
    for _ in range(10):
        next(it)
        time.sleep(0.25)
    next(it)  # asks once more: the tenth step's time is recorded
    stats = loader.stats()
    loop = stats.since_start
    assert loop.batches == 11 and loop.rows == 220
    assert 2.45 <= loop.trainer_seconds < 20
    assert loop.wait_p50 <= loop.wait_p95 <= loop.wait_p99 <= loop.wait_seconds
    assert loop.seconds >= loop.trainer_seconds + loop.wait_seconds
    assert stats.bottleneck == "trainer"
    assert "nothing to change" in stats.advice
    it.close()


def test_a_fast_consumer_waits_on_data_and_is_told_what_to_change() -> None:
    recorder = Recorder(num_workers=2)
    t = 100.0
    for _ in range(20):  # 9 ms blocked in next(), 1 ms of training per batch
        recorder.record(t, t + 0.009, {"x": [0] * 8})
        t += 0.010
    stats = recorder.stats(recent_seconds=1e9)
    loop = stats.since_start
    assert loop.batches == 20 and loop.rows == 160
    assert loop.wait_seconds == pytest.approx(19 * 0.009)
    assert loop.trainer_seconds == pytest.approx(19 * 0.001)
    assert loop.wait_fraction == pytest.approx(0.9)
    assert loop.wait_p50 == pytest.approx(0.009)
    assert stats.startup_seconds == pytest.approx(0.009)
    # no stage of any process took that time, nor was it spent waiting for the workers:
    # the training process's own handling of each batch
    assert stats.bottleneck == "transport"
    assert re.fullmatch(  # its share of the time: of a span that ends now, not at t=100.2
        r"the loop waits 90% of its time on data; moving batches of 8 rows to the loop took "
        r"the training process \d+% of the time: raise batch_size \(fewer, larger batches\), or "
        r"prefetch_factor",
        stats.advice,
    )
    # without workers, a wait spent in no stage of the reading is the batches' own handling
    alone = Recorder(num_workers=0)
    for n in range(20):
        alone.record(100.0 + n * 0.01, 100.009 + n * 0.01, {"x": [0] * 8})
    assert alone.stats(recent_seconds=1e9).bottleneck == "transport"


def test_the_first_batch_is_start_up_not_wait() -> None:
    recorder = Recorder(num_workers=2)
    recorder.record(0.0, 3.0, {"x": [1]})  # workers starting
    recorder.record(3.1, 3.1005, {"x": [1]})
    stats = recorder.stats(recent_seconds=1e9)
    assert stats.startup_seconds == 3.0
    assert stats.since_start.wait_seconds == pytest.approx(0.0005)
    assert stats.since_start.wait_p99 == pytest.approx(0.0005)
    assert stats.bottleneck == "trainer"


def test_the_ring_bounds_memory_and_the_recent_window() -> None:
    recorder = Recorder(num_workers=0, size=8)
    for n in range(100):
        waited = 0.5 if n < 90 else 0.001  # the last 10 batches wait little
        recorder.record(n * 1.0, n * 1.0 + waited, {"x": [1, 2]})
    stats = recorder.stats(recent_seconds=1e9)
    assert stats.since_start.batches == 100 and stats.since_start.rows == 200  # exact totals
    assert stats.since_start.wait_seconds == pytest.approx(89 * 0.5 + 10 * 0.001)
    assert stats.recent.batches == 8  # the window reaches back past the ring: its 8 batches
    assert stats.recent.wait_p99 == pytest.approx(0.001)
    assert stats.since_start.wait_p99 == pytest.approx(0.001)  # the ring: the last 8 batches
    assert len(recorder._wait) == 8


def test_recent_covers_only_the_last_seconds() -> None:
    recorder = Recorder(num_workers=1)
    now = time.perf_counter()
    for n in range(10):  # long ago: 1 s blocked in next() per batch
        recorder.record(now - 100 + 2 * n, now - 99 + 2 * n, {"x": [1, 2, 3]})
    for n in range(10):  # the last 3 s: 1 ms blocked, 0.2 s apart
        asked = now - 3 + 0.2 * n
        recorder.record(asked, asked + 0.001, {"x": [1, 2]})
    before = time.perf_counter()
    stats = recorder.stats(recent_seconds=5)
    after = time.perf_counter()
    recent = stats.recent
    assert (recent.batches, recent.rows) == (10, 20)
    assert 4.9 < recent.seconds < 6
    assert recent.wait_seconds == pytest.approx(0.010)
    # 9 gaps of 0.199 s, and of the pause before the window's first batch its 2 s inside the
    # window, less the time from ``now`` to the call (the window ends when it is made)
    lowest, highest = (9 * 0.199 + 2 - (at - now) for at in (after, before))
    assert lowest - 0.01 <= recent.trainer_seconds <= highest + 0.01
    assert recent.wait_p99 == pytest.approx(0.001)
    assert stats.since_start.wait_p99 == pytest.approx(1.0)
    assert (stats.since_start.batches, stats.since_start.rows) == (20, 50)
    assert stats.bottleneck == "trainer"
    # a longer window reaches back again; the shorter one after it is the same as before
    longer = recorder.stats(recent_seconds=1000).recent
    assert (longer.batches, longer.wait_p99) == (20, pytest.approx(1.0))
    again = recorder.stats(recent_seconds=5).recent
    assert (again.batches, again.wait_seconds) == (recent.batches, recent.wait_seconds)


def test_percentiles_are_refreshed_once_1_64th_of_their_batches_changed() -> None:
    recorder = Recorder(num_workers=1)
    t = 0.0
    for wait in [0.001] * 891 + [0.5] * 9:  # 9 of the 899 waits that count are long
        recorder.record(t, t + wait, {"x": [1]})
        t += 1.0
    assert recorder.stats(1e9).since_start.wait_p99 == pytest.approx(0.5)
    recorder.record(t, t + 0.001, {"x": [1]})
    stale = recorder.stats(1e9).since_start
    # 9 long of 900 would make p99 short; 1 new wait of 900 is under 1/64: not recomputed yet
    assert stale.batches == 901 and stale.wait_p99 == pytest.approx(0.5)
    for _ in range(300):
        t += 1.0
        recorder.record(t, t + 0.001, {"x": [1]})
    assert recorder.stats(1e9).since_start.wait_p99 == pytest.approx(0.001)  # 9 long of 1,200


def test_stats_start_fresh_for_each_iterator_and_after_resume(tmp_path: Path) -> None:
    write_dataset(tmp_path, [64], row_group_size=8)
    loader = _loader(tmp_path, 0, batch_size=8)
    assert loader.stats().since_start.batches == 0
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert loader.stats().since_start.rows == 24
    it.close()
    resumed = _loader(tmp_path, 0, batch_size=8)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert resumed.stats().since_start.batches == len(rest) == 5
    assert resumed.stats().since_start.rows == 40
    loader.load_state_dict(state)
    assert sum(1 for _ in loader) == 5
    assert loader.stats().since_start.rows == 40  # the new iterator's, not 24 + 40


def test_as_dict_round_trips_through_json(tmp_path: Path) -> None:
    write_dataset(tmp_path, [40], row_group_size=8)
    loader = _loader(tmp_path, 0, batch_size=8)
    list(loader)
    stats = loader.stats()
    restored = json.loads(json.dumps(stats.as_dict()))
    assert restored == stats.as_dict()
    assert (
        LoaderStats(
            **{
                **restored,
                "since_start": LoopStats(**restored["since_start"]),
                "recent": LoopStats(**restored["recent"]),
                "processes": tuple(
                    ProcessStats(
                        p["process"], StageStats(**p["since_start"]), StageStats(**p["recent"])
                    )
                    for p in restored["processes"]
                ),
                "mixture": tuple(SourceStats(**s) for s in restored["mixture"]),
            }
        )
        == stats
    )
    # list() does nothing between batches: it waits on data
    assert restored["since_start"]["rows"] == 40 and restored["bottleneck"] != "trainer"


def test_rows_of_each_output_type() -> None:
    import numpy as np
    import pyarrow as pa
    import torch

    assert batch_rows({"x": torch.zeros(5, 3), "n": torch.tensor(2)}) == (5, 0)
    assert batch_rows({"num_tokens": 7, "input_ids": np.zeros((2, 4))}) == (2, 7)
    assert batch_rows(pa.record_batch({"x": [1, 2, 3]})) == (3, 0)
    assert batch_rows((torch.zeros(4), torch.zeros(4))) == (4, 0)
    assert batch_rows(()) == (0, 0)
    assert batch_rows(3.5) == (0, 0)


def test_bad_window_is_refused(tmp_path: Path) -> None:
    write_dataset(tmp_path, [8], row_group_size=8)
    with pytest.raises(ValueError, match=r"recent_seconds=...\) must be > 0, got 0"):
        _loader(tmp_path, 0, batch_size=8).stats(recent_seconds=0)
