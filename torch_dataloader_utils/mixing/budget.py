"""One shuffle budget for a stream of a mixture, whatever the number of sources.

A stream of a mixture reads a window of each of its sources at once. The sources without a
``Source(shuffle_memory_bytes=)`` of their own share the mixture's ``shuffle_memory_bytes``
equally (``mixing.source.source_budget``), so a stream holds up to that budget (and the
sources' own), as one dataset's does.

A source's share sizes its windows, and its windows make its order: a share that followed the
set of sources would reorder every source a ``reweight=True`` load adds or removes one, its
rows of the epoch in progress lost or read twice. So a source keeps the share it was given: a
load (as saved, reweighted or elastic) under the same stream budget gives each sharing source
the share its state records; a source the load adds takes its share of the mixture as built.
An epoch restarted afresh after such a load (``MixedEpochs.serving``) is the mixture as built,
its sources' shares too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..planning.config import MIN_SHUFFLE_MEMORY_BYTES
from .epochs import MixedEpochs
from .state import expanded

__all__ = ["kept_budgets"]


def kept_budgets(mix: MixedEpochs, state: object) -> MixedEpochs:
    """``mix`` with each source that shares the stream's budget given the budget ``state``
    records for it, if the state's stream budget is ``mix``'s (a state without one: each of
    its sources had the whole budget). Anything else is left for the state's checks."""
    state = expanded(state)
    if not isinstance(state, Mapping):
        return mix
    subs, mixture = state.get("sources"), state.get("_mixture")
    if not (isinstance(subs, Mapping) and isinstance(mixture, Mapping)):
        return mix
    budget = mix.config.shuffle_memory_bytes
    sources, changed = list(mix.sources), False
    for s, epochs in enumerate(mix.sources):
        sub = subs.get(mix.source_names[s])
        kept = sub.get("_shuffle_memory_bytes") if isinstance(sub, Mapping) else None
        if not (mix.sharing and mix.sharing[s]) or type(kept) is not int:
            continue
        if mixture.get("shuffle_memory_bytes", kept) != budget:
            continue  # another stream budget: the checks name the source's
        if kept != epochs.config.shuffle_memory_bytes and kept >= MIN_SHUFFLE_MEMORY_BYTES:
            sources[s] = replace(epochs, config=replace(epochs.config, shuffle_memory_bytes=kept))
            changed = True
    if not changed:
        return mix
    return replace(
        mix, sources=tuple(sources), built=mix.built or mix.sources, _orders={}, _shares={},
        _settings_states={},
    )  # fmt: skip
