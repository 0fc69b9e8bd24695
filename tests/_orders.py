"""A stream's whole delivery order as ``(split, row)`` pairs, from the library's pure order.

For tests that check what a position stands for (the fuzzer's oracle, the order's properties):
materialises every row, so for small data only.
"""

from __future__ import annotations

from torch_dataloader_utils.planning.bijection import permutation
from torch_dataloader_utils.planning.order import StreamOrder


def stream_rows(order: StreamOrder) -> list[tuple[int, int]]:
    """``(split, row of split)`` of every row ``order`` delivers, in delivery order."""
    pieces = order.pieces
    triples = zip(pieces.splits.tolist(), pieces.lo.tolist(), pieces.hi.tolist(), strict=True)
    if order.plan.previous is not None:
        return [row for g, lo, hi in triples for row in stream_rows(order.older(g))[lo:hi]]
    if order.shuffled is None:
        return [(s, r) for s, lo, hi in triples for r in range(lo, hi)]
    out: list[tuple[int, int]] = []
    for number in range(len(order.shuffled.ends)):
        blocks, _, key = order.shuffled.window(number)
        rows = [(s, r) for s, lo, hi in zip(blocks.splits.tolist(), blocks.lo.tolist(),
                                            blocks.hi.tolist(), strict=True)
                for r in range(lo, hi)]  # fmt: skip
        out += [rows[i] for i in permutation(len(rows), key).tolist()]
    return out
