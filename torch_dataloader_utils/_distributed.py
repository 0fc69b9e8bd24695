"""The only module that calls ``torch.distributed``: the explicit global-state collectives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["gather_states", "scatter_states"]


def gather_states(state: dict[str, Any], dst_rank: int) -> list[dict[str, Any]] | None:
    """Every rank's ``state`` as a list on ``dst_rank``; ``None`` on the others."""
    raise NotImplementedError("issue 3")


def scatter_states(
    states: Sequence[Mapping[str, Any]] | None,
    src_rank: int | None,
    rank: int,
    world_size: int,
    *,
    elastic: bool,
) -> Mapping[str, Any] | Sequence[Mapping[str, Any]]:
    """What this rank loads: its own state, or (elastic) the whole list."""
    raise NotImplementedError("issue 3")
