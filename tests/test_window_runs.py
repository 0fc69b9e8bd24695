"""How a shuffle window's runs are decoded: by two threads, in order, never far ahead of the
consumer, so decoded runs do not pile up behind a slow one past the window's memory."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.reading import shuffled as _shuffled

FILES, ROWS = 16, 40


def test_runs_decoded_ahead_of_the_consumer_stay_bounded_behind_a_slow_first_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    write_dataset(tmp_path, [ROWS] * FILES, row_group_size=10)
    lock = threading.Lock()
    decoded, consumed, ahead = [0], [], [0]
    slowed: list[int] = []
    real_chunks, real_sliced = _shuffled.piece_chunks, _shuffled._sliced

    def slow_first(source: Any, read: Any, *args: Any) -> Any:
        if read.number == 0 and not slowed:
            slowed.append(1)
            time.sleep(0.5)  # the other thread decodes the rest meanwhile, if it may
        chunks = list(real_chunks(source, read, *args))
        with lock:
            decoded[0] += 1
            ahead[0] = max(ahead[0], decoded[0] - len(consumed))
        return iter(chunks)

    def taken(chunks: list[Any], *args: Any, **kwargs: Any) -> Any:
        with lock:
            if not any(chunks is c for c in consumed):
                consumed.append(chunks)  # the first block of a run: the run is taken
        return real_sliced(chunks, *args, **kwargs)

    monkeypatch.setattr(_shuffled, "piece_chunks", slow_first)
    monkeypatch.setattr(_shuffled, "_sliced", taken)
    dataset = StructuredDataset(str(tmp_path), batch_size=8, shuffle=True, split_bytes=1)
    ids = sorted(i for batch in dataset for i in batch["id"].tolist())
    assert ids == list(range(FILES * ROWS))
    assert slowed and len(consumed) >= FILES  # a window of many runs, one delayed
    # The run being taken, and at most one run per decoding thread beyond it.
    assert ahead[0] <= _shuffled._DECODE_THREADS + 1, ahead[0]
