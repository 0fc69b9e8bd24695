"""The shuffled order as a pure function: a bijection, windows of blocks, content at a position."""

from __future__ import annotations

import numpy as np
import pytest
from _orders import stream_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_dataloader_utils.checkpoint.schema import Generation
from torch_dataloader_utils.formats import FileMetadata
from torch_dataloader_utils.index.index import DatasetIndex, IndexedFile
from torch_dataloader_utils.index.splits import cut_splits
from torch_dataloader_utils.planning.bijection import permutation, permuted
from torch_dataloader_utils.planning.order import (
    _FEW_BLOCKS,
    BLOCKS_PER_WINDOW,
    Shuffle,
    ShuffledShare,
    StreamOrder,
    _stratified,
    cut_blocks,
    shuffled_sequence,
)
from torch_dataloader_utils.planning.plan import EpochPlan, Pieces


@given(st.integers(0, 5000), st.integers(0, 2**64 - 1))
def test_permutation_is_a_bijection_with_random_access(rows: int, key: int) -> None:
    order = permutation(rows, key)
    assert sorted(order.tolist()) == list(range(rows))
    for t in {0, rows // 3, rows - 1} - {-1}:
        if 0 <= t < rows:
            assert permuted(t, rows, key) == order[t]


def test_permutation_is_pinned() -> None:
    """Our own integer arithmetic: the same on every platform and numpy version."""
    assert permutation(10, 0).tolist() == [7, 8, 5, 3, 9, 6, 2, 0, 1, 4]
    assert permutation(10, 12345).tolist() == [3, 6, 9, 2, 4, 8, 0, 5, 7, 1]
    assert permutation(1000, 7)[:8].tolist() == [560, 257, 324, 887, 31, 182, 482, 785]


@given(st.integers(2, 40), st.integers(0, 2**64 - 1))
def test_a_few_blocks_are_dealt_to_windows_as_many_are(windows: int, key: int) -> None:
    """A share of a few blocks deals them in Python ints, of more in numpy: the same deal."""
    many = _stratified(_FEW_BLOCKS + windows, windows, key).tolist()
    assert _stratified(_FEW_BLOCKS, windows, key).tolist() == many[:_FEW_BLOCKS]


def test_the_deal_to_windows_is_pinned() -> None:
    assert _stratified(12, 3, 12345).tolist() == [2, 1, 0, 2, 0, 1, 0, 2, 1, 1, 2, 0]
    assert _stratified(5, 2, 2**64 - 1).tolist() == [0, 1, 0, 1, 1]
    assert _stratified(3, 1, 7).tolist() == [0, 0, 0]


def test_permutation_looks_uniform() -> None:
    """Neighbours in storage rarely meet in a batch; no drift from front to back."""
    rows, batch = 200_000, 1024
    order = permutation(rows, 99)
    where = np.empty(rows, dtype=np.int64)
    where[order] = np.arange(rows)
    together = np.mean(where[1:] // batch == where[:-1] // batch)
    assert together < 2 * batch / rows
    assert abs(np.corrcoef(order, np.arange(rows))[0, 1]) < 0.01
    assert abs(np.std(order[:batch] / rows) - 0.2887) < 0.02


@given(
    st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=1, max_size=5),
    st.integers(1, 60),
)
def test_blocks_cover_each_piece_once_within_the_bound(units, block_rows) -> None:
    """Blocks tile every piece, cut on unit boundaries unless a unit is sliced, each shorter
    than twice the bound."""
    starts = [np.cumsum([0, *u[:-1]]) for u in units]
    totals = [sum(u) for u in units]
    pieces = Pieces.of([(s, 0, totals[s]) for s in range(len(units))])
    blocks, _ = cut_blocks(
        pieces, lambda s: np.asarray(starts[s], dtype=np.int64), block_rows, block_rows
    )
    rows = [(int(s), r) for s, lo, hi in zip(blocks.splits, blocks.lo, blocks.hi, strict=True)
            for r in range(lo, hi)]  # fmt: skip
    assert rows == [(s, r) for s in range(len(units)) for r in range(totals[s])]
    assert (blocks.rows < 2 * max(block_rows, 256)).all()
    assert (blocks.rows > 0).all()


def _index(file_rows: list[list[int]], split_bytes: int = 60) -> DatasetIndex:
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64())])
    files = tuple(
        IndexedFile(path=f"/d/{i}", display=f"/d/{i}", name=str(i), fingerprint=f"fp{i}",
                    metadata=FileMetadata(schema, tuple(rows), tuple(10 * r for r in rows)))
        for i, rows in enumerate(file_rows)
    )  # fmt: skip
    splits = cut_splits([f.metadata.unit_bytes for f in files],
                        [f.metadata.unit_rows for f in files], split_bytes)  # fmt: skip
    return DatasetIndex(files, tuple(splits), schema)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=6), min_size=1, max_size=6),
       st.sampled_from([60, 10**6]), st.integers(1, 2_000), st.integers(0, 3))  # fmt: skip
def test_the_shuffled_sequence_is_every_row_once_in_blocks_of_whole_units(
    file_rows, split_bytes, window, epoch
) -> None:
    index = _index(file_rows, split_bytes)
    sequence = shuffled_sequence(index, window, 5, epoch)
    assert sorted(_rows(sequence)) == sorted(
        (s, r) for s in range(len(index.splits)) for r in range(index.split_rows[s])
    )
    for split, lo, hi in zip(sequence.splits, sequence.lo, sequence.hi, strict=True):
        starts = [*index.unit_starts(split).tolist(), int(index.split_rows[split])]
        assert lo in starts and hi in starts and hi > lo
    again = shuffled_sequence(index, window, 5, epoch)
    assert _rows(again) == _rows(sequence)


def _rows(pieces: Pieces) -> list[tuple[int, int]]:
    triples = zip(pieces.splits.tolist(), pieces.lo.tolist(), pieces.hi.tolist(), strict=True)
    return [(s, r) for s, lo, hi in triples for r in range(lo, hi)]


def test_every_stream_draws_from_all_over_the_data_whatever_the_streams() -> None:
    """8 files of one split each (10 row groups of 100 rows), 4 ranks x 2 workers: a stream's
    share is row groups of many files, not one whole file (each stream its file before state
    version 6), and small units are dealt in blocks (one read), not one by one."""
    index = _index([[100] * 10] * 8, split_bytes=10**9)
    assert len(index.splits) == 8
    sequence = shuffled_sequence(index, 10**7, 0, 0)
    assert len(sequence) == 80 and (sequence.rows == 100).all()  # a block: at most 1/4,096
    plan = EpochPlan.first(epoch=0, sequence=sequence, world_size=4, num_workers=2, even=False)
    files = [len(set(plan.stream_share(g).splits.tolist())) for g in range(8)]
    assert min(files) >= 4 and np.mean(files) > 5
    assert not np.array_equal(shuffled_sequence(index, 10**7, 0, 1).splits, sequence.splits)
    small = _index([[10] * 10_000] * 8, split_bytes=10**9)  # 800,000 rows in units of 10
    blocks = shuffled_sequence(small, 64 * 40, 0, 0)  # blocks of 40 rows: 4 units each
    assert len(blocks) == 20_000 and (blocks.rows == 40).all()


layouts = st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=5), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(layouts, st.integers(1, 3), st.integers(0, 3), st.integers(1, 80), st.data())
def test_every_row_once_and_row_at_names_it(file_rows, world, workers, window, data) -> None:
    """Every stream of every deal (an elastic one too): all rows once; ``row_at(p)`` is the
    row the stream delivers at ``p``; windows hold at most ``window`` rows plus a block."""
    index = _index(file_rows)
    shuffle = Shuffle(seed=3, window_rows=window)
    plan = EpochPlan.first(epoch=1, sequence=shuffled_sequence(index, window, 3, 1),
                           world_size=world, num_workers=workers, even=False)  # fmt: skip
    everything = sorted((s, r) for s in range(len(index.splits))
                        for r in range(index.split_rows[s]))  # fmt: skip
    delivered: list[tuple[int, int]] = []
    left: list[tuple[int, int]] = []
    positions = []
    for g in range(plan.deal.streams):
        stream = StreamOrder(index=index, plan=plan, stream=g, shuffle=shuffle)
        rows = stream_rows(stream)
        assert [stream.row_at(p) for p in range(len(rows))] == rows
        assert stream.row_at(len(rows)) is None
        shuffled = stream.shuffled
        if shuffled is not None and len(shuffled.ends) > 1:
            sizes = np.diff(np.concatenate(([0], shuffled.ends)))
            assert sizes.max() <= window + shuffled.blocks.rows.max()
        cut = data.draw(st.integers(0, len(rows)))
        positions.append(cut)
        delivered += rows[:cut]
        left += rows[cut:]
    assert sorted(delivered + left) == everything
    zeros = np.zeros(len(positions), dtype=np.int64)
    later = plan.then(Generation(world, workers, False, np.array(positions), zeros),
                      world_size=2, num_workers=1, even=False)  # fmt: skip
    rest = [row for g in range(later.deal.streams)
            for row in stream_rows(StreamOrder(index=index, plan=later, stream=g,
                                               shuffle=shuffle))]  # fmt: skip
    assert sorted(delivered + rest) == everything


def test_a_window_draws_blocks_from_all_over_the_share() -> None:
    """64 splits of 10 row groups: every window of about 1/8 of the share holds blocks of
    most splits, at places all over them (not each split's same stretch)."""
    starts = np.arange(10, dtype=np.int64) * 100
    share = Pieces.of([(s, 0, 1000) for s in range(64)])
    shuffled = ShuffledShare.build(share, unit_starts=lambda s: starts, window_rows=8000, key=5)
    assert len(shuffled.ends) in (8, 9)  # near-equal windows within window_rows + a block
    for number in range(len(shuffled.ends)):
        blocks, _, _ = shuffled.window(number)
        assert len(blocks) >= BLOCKS_PER_WINDOW * 3 // 4  # blocks of about window / 64 rows
        assert len(set(blocks.splits.tolist())) > 32
        assert np.std(blocks.lo / 1000) > 0.25


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_tiny_windows(rows: int) -> None:
    assert sorted(permutation(rows, 1).tolist()) == list(range(rows))
