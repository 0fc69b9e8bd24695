"""Continuing a mixture from its states: as saved, under new weights or sources
(``reweight``), or on another world (``elastic``), in one pass: the states read and validated
(``mixing.read``), where every stream of every source stands (``mixing.locate``), and what the
reader is handed: where the iteration starts, and the mixture it continues
(``mixing.continuation``). The state itself: ``mixing.state``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..base.errors import CheckpointMismatchError, InvalidStateError
from ..planning.epochs import Start
from .budget import kept_budgets
from .continuation import continued, dealt_anew
from .epochs import MixedEpochs
from .locate import located, located_job
from .read import read_job, read_state

__all__ = ["load_mixture", "load_mixture_elastic"]


def load_mixture(
    mix: MixedEpochs, state: Mapping[str, Any], num_workers: int | None, *, reweight: bool
) -> tuple[Start, MixedEpochs]:
    """Where ``state`` continues, and the mixture to continue it with: ``mix`` under the
    state's segment, or (``reweight``, weights or sources changed) a segment starting there."""
    with _inconsistent():
        mix = kept_budgets(mix, state)
        read = read_state(mix, state, num_workers)
        return continued(mix, read, located(read), reweight=reweight)


def load_mixture_elastic(
    mix: MixedEpochs, states: Sequence[Mapping[str, Any]], num_workers: int
) -> tuple[Start, MixedEpochs]:
    """Every old rank's state dealt anew to this job: per source, the rows of the epochs the
    old streams had begun and not finished (each epoch's rest dealt as one dataset's elastic
    resume deals it, packed: a document cut where its tokens stopped), then its next epochs
    afresh; the rest of the mixture epoch's positions dealt to the new streams, whose schedule
    starts there."""
    with _inconsistent():
        mix = kept_budgets(mix, states[0]) if states else mix
        old, read = read_job(mix, states)
        return dealt_anew(mix, old, read, located_job(read), num_workers)


@contextmanager
def _inconsistent() -> Iterator[None]:
    """A state whose parts are well-formed but do not fit together (a position past its
    epoch, a segment after it, numbers out of range) is corrupted: say so, never raise raw."""
    try:
        yield
    except (InvalidStateError, CheckpointMismatchError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as exc:
        raise InvalidStateError(
            f"the mixture state is corrupted: its parts do not fit together "
            f"({type(exc).__name__}: {exc})"
        ) from exc
