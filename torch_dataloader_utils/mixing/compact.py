"""A source's part of a mixture's state, written without what the rest of the state says, and
made whole again (a state of 1,000 sources of one file stays within 256 KiB).

Each source's state is its state as a dataset of its own (``checkpoint.state``), less:

- the keys of ``SHARED_KEYS`` every source's state holds alike: written once, in the mixture
  state's ``source_settings``, with (``"root"``) the start all the sources' ``files.root`` share
  (each source's holds the rest);
- ``_shuffle_seed``, when it is the one the mixture's seed gives the source
  (``source_seed`` of ``_mixture.schedule_seed`` and the source's name);
- of a source of one file, ``files`` but for ``{"file": [name, fingerprint], "root"}`` (its
  count, digest and group follow from them), and of each stream's place the file's name and
  fingerprint: ``[position, tokens, rows, row_offset, row_length, row]``;
- ``num_splits`` when the source has a split per file; ``epochs`` when each stream's is
  ``epoch``; ``rests`` and ``fresh`` when ``[]`` and 0 (both: one left out alone is refused).

What is left out is what ``whole`` puts back (checked when written), so a source's state made
whole is validated as ever: a changed file, seed or setting fails to match, naming the source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from ..base.errors import InvalidStateError
from ..index.index import MAX_FILE_GROUPS, DatasetIndex, digest
from ..planning.epochs import Epochs, Progress, Start

__all__ = [
    "ROOT",
    "SHARED_KEYS",
    "SettingsStates",
    "settings_states",
    "source_seed",
    "whole_source",
    "written_once",
    "written_streams",
]

# Keys of a source's state that a mixture's state writes once when every source's are alike.
SHARED_KEYS = (
    "version", "_num_workers", "_shuffle", "_split_bytes", "_rank", "_world_size", "_format",
    "_even_batches", "_shuffle_memory_bytes", "_shuffle_window_rows", "_packing", "generations",
    "cursor",
)  # fmt: skip
# The key of ``source_settings`` holding the start every source's ``files.root`` shares.
ROOT = "root"
# What every source's state holds alike, and each source's own settings and files.
SettingsStates = tuple[dict[str, Any], tuple[dict[str, Any], ...]]
# A source's keys a mixture's state writes per call (its progress), not with its settings.
_PROGRESS_KEYS = ("epoch", "streams")


def source_seed(seed: int, name: str) -> int:
    """The shuffle seed of source ``name``: its order is its own, not its neighbours'."""
    return xxhash.xxh64_intdigest(f"{seed}:{name}".encode()) >> 1


def settings_states(
    sources: Sequence[Epochs], names: Sequence[str], seed: int, num_workers: int
) -> SettingsStates:
    """Each source's state as a dataset of its own, but for its epoch and streams: its files
    and settings, split into what every source's holds alike and each one's own, as a state
    writes them (``written_once``; ``seed``: the mixture's). The mixture's files make at most
    ``MAX_FILE_GROUPS`` groups, as one dataset's do: each source's get their share."""
    states = []
    for epochs in sources:
        plan = epochs.plan(Start.fresh(0), num_workers)
        state = epochs.encode(Progress(plan, epochs.settings(num_workers), {}, ()))
        state["files"]["groups"] = epochs.index.file_groups(max(1, MAX_FILE_GROUPS // len(sources)))
        states.append(state)
    seeds = [source_seed(seed, name) for name in names]
    return written_once(states, [epochs.index for epochs in sources], seeds)


def written_once(
    states: Sequence[dict[str, Any]], indexes: Sequence[DatasetIndex], seeds: Sequence[int]
) -> SettingsStates:
    """The sources' ``states`` (their settings and files, of ``indexes``), split into what every
    one holds alike and each one's own, without what the state says elsewhere (``seeds``: the
    shuffle seed the mixture's seed gives each)."""
    first = states[0]
    shared = {k: first[k] for k in SHARED_KEYS if all(s[k] == first[k] for s in states)}
    prefix = _shared_root([s["files"]["root"] for s in states])
    if prefix:
        shared[ROOT] = prefix
    own = []
    for state, index, seed in zip(states, indexes, seeds, strict=True):
        sub = {k: v for k, v in state.items() if k not in shared and k not in _PROGRESS_KEYS}
        files = {**sub["files"], "root": sub["files"]["root"][len(prefix) :]}
        one = [index.files[0].name, index.files[0].fingerprint] if len(index.files) == 1 else None
        if one is not None and _one_file(*one) == {k: v for k, v in files.items() if k != "root"}:
            files = {"file": one, "root": files["root"]}
        sub["files"] = files
        if sub["_shuffle_seed"] == seed:
            del sub["_shuffle_seed"]
        if sub["num_splits"] == len(index.files):
            del sub["num_splits"]
        own.append(sub)
    return shared, tuple(own)


def written_streams(own: Mapping[str, Any], streams: list[list[Any] | None]) -> list[Any]:
    """A source's stream places as its state writes them (copies: the places are kept for
    the next state): of a source of one file (``own``, its part of ``written_once``), without
    the file's name and fingerprint."""
    name, fingerprint = own["files"].get("file") or (None, None)
    return [
        None
        if e is None
        else [e[0], e[1], e[2], e[4], e[5], e[7]]
        if len(e) == 8 and e[3] == name and e[6] == fingerprint
        else e[:]
        for e in streams
    ]


def whole_source(
    name: str, sub: Mapping[str, Any], shared: Mapping[str, Any], seed: int | None
) -> dict[str, Any]:
    """Source ``name``'s state ``sub`` made whole: with the ``shared`` settings, its root below
    theirs, ``seed`` (the one the mixture's seed gives it; ``None``: unknown), its files, places
    and the keys left out at their defaults (anything of the wrong type is left for the
    checks of a source's state, which name its key)."""
    whole = {k: v for k, v in shared.items() if k != ROOT} | dict(sub)
    if "_shuffle_seed" not in whole and seed is not None:
        whole["_shuffle_seed"] = seed
    files = whole.get("files")
    if isinstance(files, dict):
        file = files.get("file")
        files = whole["files"] = _whole_files(name, files, shared.get(ROOT, ""))
        if file is not None and isinstance(whole.get("streams"), list):
            whole["streams"] = [_whole_place(e, file) for e in whole["streams"]]
        if "num_splits" not in whole and "count" in files:
            whole["num_splits"] = files["count"]
    if "epochs" not in whole and "epoch" in whole and isinstance(whole.get("streams"), list):
        whole["epochs"] = [whole["epoch"]] * len(whole["streams"])
    if "rests" not in whole and "fresh" not in whole:
        whole["rests"], whole["fresh"] = [], 0
    return whole


def _shared_root(roots: list[str]) -> str:
    """The start of ``roots`` up to a ``/`` they all share, as text (an URL's ``//`` kept)."""
    low, high = min(roots), max(roots)  # what these two share, all the others between do
    pairs = enumerate(zip(low, high, strict=False))
    common = next((i for i, (a, b) in pairs if a != b), len(low))
    return low[: low.rfind("/", 0, common) + 1]


def _one_file(name: str, fingerprint: str) -> dict[str, Any]:
    """``files`` of a state of one file (``checkpoint.state.encode``), but its root."""
    groups = [[name, name, 1, digest([fingerprint])]]
    return {"count": 1, "digest": digest([f"{name}\0{fingerprint}"]), "groups": groups}


def _whole_files(name: str, files: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A source's ``files``: its root below ``prefix``; of one file, its count, digest and
    group from its name and fingerprint."""
    whole = dict(files)
    if isinstance(whole.get("root"), str):
        whole["root"] = prefix + whole["root"]
    file = whole.pop("file", None)
    if file is None:
        return whole
    if not (
        isinstance(file, list)
        and len(file) == 2
        and all(isinstance(v, str) for v in file)
        and not whole.keys() & {"count", "digest", "groups"}
    ):
        raise InvalidStateError(
            f"state key 'sources.{name}.files.file' must be [name, fingerprint] of the "
            f"source's one file (which gives its 'count', 'digest' and 'groups'), got "
            f"{file!r:.120} beside {sorted(whole)}"
        )
    return {**_one_file(*file), **whole}


def _whole_place(entry: object, file: object) -> object:
    """A stream's place of a source of one file (``file``: its name and fingerprint) whole:
    ``[position, tokens, rows, path, row_offset, row_length, fingerprint, row]``."""
    if not (isinstance(entry, list) and len(entry) == 6 and isinstance(file, list)):
        return entry
    return [*entry[:3], file[0], entry[3], entry[4], file[1], entry[5]]
