"""The checkpoint state: its schema (version 6), how it is written, and how it is validated.

A state is plain JSON-safe builtins::

    version, epoch                      int
    _num_workers, _rank, _world_size    int      the DataLoader's and DDP's, at save time
    _shuffle, _shuffle_seed             bool, int
    _split_bytes, _format               int, str
    _even_batches                       bool
    _shuffle_memory_bytes               int      the shuffle's memory budget per stream
    _shuffle_window_rows                int      rows of a shuffle window (0 unshuffled)
    _packing                            list | null   TokenPacking.setting
    files        {"count", "digest", "groups": [[first, last, count, digest], ...], "root"}
    num_splits                          int
    streams      one entry per worker stream of this rank, in worker order:
                 [position, tokens, rows, path, row_offset, row_length, fingerprint, row]:
                 rows handed out, tokens of the next row handed out, the stream's rows, and
                 the split and row (within the split) it hands out next; [position, 0, rows]
                 once it has handed out all its rows; null for a stream whose progress the
                 saving process did not see (a DataLoader worker's copy of the dataset)
    generations  the deals this epoch had before elastic resumes, oldest first:
                 [world_size, num_workers, even_batches, positions, tokens] with every
                 stream's position and tokens as zlib + base64 int64 arrays
    cursor                              int      the worker whose batch comes next

The plan (which rows each stream reads, in which order) is a pure function of the files, the
settings above and the generations, so a position per stream is an exact place in the epoch;
the split key and row of each stream's next row, and the files digest, make it content-
addressed: a changed file, split or plan fails to match, and the error names the split.
"""

from __future__ import annotations

import base64
import binascii
import functools
import itertools
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base.arrays import IntArray
from ..base.errors import CheckpointMismatchError, DataLoaderUtilsError, InvalidStateError
from ..base.world import World
from ..index.index import DatasetIndex

__all__ = [
    "ELASTIC_FIELDS",
    "STATE_VERSION",
    "Decoded",
    "Generation",
    "Settings",
    "StreamEntry",
    "check_coverage",
    "check_cursor",
    "check_each",
    "check_same_epoch",
    "check_setting",
    "check_shape",
    "check_version",
    "decode",
    "decode_generation",
    "encode",
    "encode_generation",
    "encode_stream",
    "merge_states",
    "misplaced",
    "one_job",
    "stored_split",
    "stream_list",
]


@dataclass(frozen=True)
class Generation:
    """Where the streams of a deal stood when an elastic resume dealt the rest anew.

    ``positions[g]``: rows stream ``g`` had delivered; ``tokens[g]``: tokens of its next row
    already delivered (token packing; 0 otherwise).
    """

    world_size: int
    num_workers: int  # the DataLoader's, as the state records it
    even: bool
    positions: IntArray
    tokens: IntArray


STATE_VERSION = 6
# Versions 5 and 6 changed only the shuffled order: an unshuffled state of 4 or 5 means the same.
_SAME_UNSHUFFLED = (4, 5)

_KEY_TYPES: dict[str, type | tuple[type, ...]] = {
    "version": int, "epoch": int, "_num_workers": int, "_shuffle_seed": int, "_shuffle": bool,
    "_split_bytes": int, "_rank": int, "_world_size": int, "_format": str,
    "_even_batches": bool, "_shuffle_memory_bytes": int, "_shuffle_window_rows": int,
    "files": dict,
    "num_splits": int, "streams": list, "generations": list, "cursor": int,
    "_packing": (list, type(None)),
}  # fmt: skip
_SIGNED_KEYS = ("_shuffle_seed",)
# Versions this library refuses, with why their progress cannot be carried over.
_OLD_VERSIONS = {
    1: "saved before rows were dealt to streams row by row",
    2: "which names files by absolute path with fingerprints of their mtime or ETag, where "
    "version 4 names them below the dataset root with fingerprints of their content",
    3: "which mixed a shuffle window's splits in storage order, where version 4 delivers a "
    "window's rows in a random order (the same position means other rows)",
    4: "whose shuffle dealt the parts of a sliced row group to windows at random, where "
    "version 5 deals them to consecutive windows (the same position means other rows)",
    5: "whose shuffle dealt each stream a run of whole splits, where version 6 deals it blocks "
    "from all over the dataset (the same position means other rows)",
}
ELASTIC_FIELDS = ("world_size", "rank", "num_workers", "even_batches")
# Rows or tokens a stream entry may count: beyond any data set, within int64 when summed.
_MAX_COUNT = 2**62


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The settings a checkpoint must agree with (``num_workers`` as the DataLoader counts)."""

    format: str
    split_bytes: int
    shuffle: bool
    shuffle_seed: int
    memory_bytes: int  # shuffle_memory_bytes
    window_rows: int  # rows of a shuffle window: 0 without shuffle
    rank: int
    world_size: int
    num_workers: int
    even_batches: bool = False
    packing: list[Any] | None = None  # TokenPacking.setting

    @property
    def streams_per_rank(self) -> int:
        return max(1, self.num_workers)

    def world(self, worker: int = 0) -> World:
        return World(self.rank, self.world_size, worker, self.streams_per_rank)


@dataclass(frozen=True)
class StreamEntry:
    """One stream of a state: rows and tokens handed out, its rows, and the split and row it
    hands out next (``None`` at its end)."""

    position: int
    tokens: int
    rows: int
    next_row: tuple[int, int] | None


@dataclass(frozen=True)
class Decoded:
    """A validated state, by split id: its generations and this rank's streams."""

    generations: tuple[Generation, ...]
    streams: tuple[StreamEntry | None, ...]


def encode(
    *,
    epoch: int,
    streams: Sequence[StreamEntry | None],
    generations: Sequence[Generation],
    cursor: int,
    index: DatasetIndex,
    settings: Settings,
) -> dict[str, Any]:
    """The state dict of an epoch whose streams of this rank stand at ``streams``."""
    return {
        "version": STATE_VERSION,
        "epoch": epoch,
        "_num_workers": settings.num_workers,
        "_shuffle_seed": settings.shuffle_seed,
        "_shuffle": settings.shuffle,
        "_split_bytes": settings.split_bytes,
        "_rank": settings.rank,
        "_world_size": settings.world_size,
        "_format": settings.format,
        "_even_batches": settings.even_batches,
        "_shuffle_memory_bytes": settings.memory_bytes,
        "_shuffle_window_rows": settings.window_rows,
        "_packing": settings.packing,
        "files": {
            "count": len(index.files),
            "digest": index.digest,
            "groups": index.file_groups(),
            "root": index.root,  # where the names were relative to, for messages only
        },
        "num_splits": len(index.splits),
        "streams": [encode_stream(e, index) for e in streams],
        "generations": [encode_generation(g) for g in generations],
        "cursor": cursor,
    }


def encode_stream(entry: StreamEntry | None, index: DatasetIndex) -> list[Any] | None:
    if entry is None:
        return None
    return stream_list(entry.position, entry.tokens, entry.rows, entry.next_row, index)


def stream_list(
    position: int, tokens: int, rows: int, next_row: tuple[int, int] | None, index: DatasetIndex
) -> list[Any]:
    """A stream entry as a state writes it (a mixture's, one per source at every call)."""
    if next_row is None:
        return [position, tokens, rows]
    split, row = next_row
    return [position, tokens, rows, *_split_key(split, index), row]


def encode_generation(generation: Generation) -> list[Any]:
    return [
        generation.world_size,
        generation.num_workers,
        generation.even,
        _packed_ints(generation.positions.tobytes()),
        _packed_ints(generation.tokens.tobytes()),
    ]


@functools.lru_cache(maxsize=16)
def _packed_ints(raw: bytes) -> str:
    """zlib + base64 of little-endian int64s; cached (a generation is written with every state)."""
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def decode(
    state: Mapping[str, Any], *, index: DatasetIndex, settings: Settings, elastic: bool = False
) -> Decoded:
    """Validate ``state`` against the dataset and settings; its generations and streams."""
    check_shape(state)
    _check_settings(state, settings, elastic)
    _check_files(state, index)
    # rows of a shuffle window, from the budget and the files' bytes per row: compared once
    # the files are known to agree
    check_setting(
        "shuffle_window_rows", state["_shuffle_window_rows"], settings.window_rows,
        stored_split(state),
    )  # fmt: skip
    generations = tuple(decode_generation(g, i) for i, g in enumerate(state["generations"]))
    streams = tuple(_decode_stream(e, i, index) for i, e in enumerate(state["streams"]))
    return Decoded(generations, streams)


def decode_generation(entry: object, number: int) -> Generation:
    key = f"generations[{number}]"
    if not (
        isinstance(entry, list)
        and len(entry) == 5
        and type(entry[0]) is int
        and type(entry[1]) is int
        and isinstance(entry[2], bool)
        and isinstance(entry[3], str)
        and isinstance(entry[4], str)
        and entry[0] >= 1
        and entry[1] >= 0
    ):
        raise InvalidStateError(
            f"state key {key!r} must be [world_size >= 1, num_workers >= 0, even_batches, "
            f"positions, tokens], got {entry!r:.200}"
        )
    positions = _unpacked_ints(entry[3], f"{key}.positions")
    tokens = _unpacked_ints(entry[4], f"{key}.tokens")
    streams = entry[0] * max(1, entry[1])
    if (
        len(positions) != streams
        or len(tokens) != streams
        or (positions < 0).any()
        or (tokens < 0).any()
    ):
        raise InvalidStateError(
            f"state key {key!r} must hold {streams} non-negative positions and tokens (one per "
            f"stream of world_size={entry[0]} x num_workers={entry[1]}): the state is corrupted"
        )
    return Generation(entry[0], entry[1], entry[2], positions, tokens)


def _unpacked_ints(text: str, key: str) -> IntArray:
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (binascii.Error, zlib.error, UnicodeEncodeError) as exc:
        raise InvalidStateError(f"state key {key!r} is corrupted: {exc}") from exc
    if len(raw) % 8:
        raise InvalidStateError(f"state key {key!r} is corrupted: not a list of int64")
    values: IntArray = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    return values


def _decode_stream(entry: object, number: int, index: DatasetIndex) -> StreamEntry | None:
    if entry is None:
        return None
    if not (_is_stream(entry) and isinstance(entry, list)):
        raise _bad_stream(entry, number)
    next_row = None if len(entry) == 3 else (_split_of(entry[3:7], index), entry[7])
    return StreamEntry(entry[0], entry[1], entry[2], next_row)


def _bad_stream(entry: object, number: int) -> InvalidStateError:
    return InvalidStateError(
        f"state key 'streams[{number}]' must be [position, tokens, rows, path, row_offset, "
        f"row_length, fingerprint, row] with position < rows < 2**62, or [rows, 0, rows] at "
        f"the stream's end, got {entry!r:.200}"
    )


def _is_stream(entry: object) -> bool:
    if not (
        isinstance(entry, list)
        and len(entry) in (3, 8)
        and all(type(v) is int and 0 <= v < _MAX_COUNT for v in entry[:3])
    ):
        return False
    position, tokens, rows = entry[:3]
    if len(entry) == 3:
        return bool(position == rows and tokens == 0)
    return bool(
        position < rows
        and isinstance(entry[3], str)
        and isinstance(entry[6], str)
        and all(type(v) is int and v >= 0 for v in (entry[4], entry[5], entry[7]))
        and entry[7] < entry[5]
    )


def check_version(version: object, *, unshuffled: bool) -> None:
    """Refuse a state of another version, saying why an old one cannot continue its epoch
    (an ``unshuffled`` one of a version whose unshuffled order is today's is accepted)."""
    if unshuffled and version in _SAME_UNSHUFFLED:
        return
    if type(version) is int and version in _OLD_VERSIONS:
        raise InvalidStateError(
            f"this state is version {version}, {_OLD_VERSIONS[version]}; this library reads "
            f"version {STATE_VERSION} and cannot continue that epoch exactly. Restart the "
            f"checkpoint's epoch with dataset.set_epoch(state['epoch'])."
        )
    if version != STATE_VERSION:
        raise InvalidStateError(
            f"unknown state version {version!r}: this library reads version {STATE_VERSION}"
        )


def check_shape(state: object) -> None:
    if not isinstance(state, Mapping):
        raise InvalidStateError(f"a state must be a dict, got {type(state).__name__}")
    check_version(
        state.get("version"), unshuffled=state.get("_shuffle") is False and "_mixture" not in state
    )
    if "_mixture" in state:
        sources = list(state["sources"]) if isinstance(state.get("sources"), dict) else "?"
        raise InvalidStateError(
            f"this state was saved by a mixture of sources {sources}; load it into a dataset "
            f"built from them (path as a mapping of source names to paths, with weights=)"
        )
    for key, kind in _KEY_TYPES.items():
        if key not in state:
            raise InvalidStateError(f"state has no key {key!r}; was it saved by this library?")
        value = state[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidStateError(
                f"state key {key!r} must be {_type_name(kind)}, got {type(value).__name__}"
            )
        if isinstance(value, int) and value < 0 and key not in _SIGNED_KEYS:
            raise InvalidStateError(f"state key {key!r} must be >= 0, got {value}")
    _check_nested(state)
    for number, generation in enumerate(state["generations"]):
        decode_generation(generation, number)
    for number, entry in enumerate(state["streams"]):
        if entry is not None and not _is_stream(entry):
            raise _bad_stream(entry, number)
    check_cursor(state)


def check_cursor(state: Mapping[str, Any]) -> None:
    """``cursor`` (an int >= 0) names one of the state's worker streams."""
    streams = max(1, len(state["streams"]))
    if state["cursor"] >= streams:
        raise InvalidStateError(
            f"state key 'cursor' is {state['cursor']}, but 'streams' holds {streams} worker "
            f"stream(s): the state is corrupted"
        )


def _check_nested(state: Mapping[str, Any]) -> None:
    """The parts of ``files`` and ``_packing`` that code reads without further checks: of the
    right type, or an error naming the key."""
    for key, kind in (("count", int), ("digest", str), ("root", str), ("groups", list)):
        value = state["files"].get(key)
        if key in state["files"] and (not isinstance(value, kind) or isinstance(value, bool)):
            raise InvalidStateError(
                f"state key 'files.{key}' must be {_type_name(kind)}, got {type(value).__name__}"
            )
    packing = state["_packing"]
    if packing is not None and not (
        len(packing) == 2
        and isinstance(packing[0], str)
        and (packing[1] is None or type(packing[1]) is int)
    ):
        raise InvalidStateError(
            f"state key '_packing' must be null or [column, separator], got {packing!r:.200}"
        )


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _check_settings(state: Mapping[str, Any], settings: Settings, elastic: bool) -> None:
    pairs = {
        "format": (state["_format"], settings.format),
        "split_bytes": (state["_split_bytes"], settings.split_bytes),
        "shuffle": (state["_shuffle"], settings.shuffle),
        "shuffle_seed": (state["_shuffle_seed"], settings.shuffle_seed),
        "shuffle_memory_bytes": (state["_shuffle_memory_bytes"], settings.memory_bytes)
        if settings.shuffle
        else (0, 0),
        "world_size": (state["_world_size"], settings.world_size),
        "rank": (state["_rank"], settings.rank),
        # which rows an evened epoch leaves out, and so where it ends, depends on it (after
        # world_size: its default follows world_size, so a changed world_size is named first)
        "even_batches": (state["_even_batches"], settings.even_batches),
        # 0 and 1 workers both make one stream per rank, so they resume into each other.
        "num_workers": (state["_num_workers"], settings.num_workers),
        # which tokens a row makes (seq_len may change: positions count tokens)
        "packing": (state["_packing"], settings.packing),
    }
    for name, (expected, found) in pairs.items():
        if elastic and name in ELASTIC_FIELDS:
            continue
        check_setting(name, expected, found, stored_split(state))


def check_setting(name: str, expected: object, found: object, split: str) -> None:
    """Raise the mismatch error for setting ``name`` unless the values agree."""
    if expected == found:
        return
    # 0 and 1 workers both make one stream per rank, so they resume into each other.
    if name == "num_workers" and max(1, expected) == max(1, found):  # type: ignore[call-overload]
        return
    hint = ""
    if name == "shuffle_window_rows":
        hint = " (the rows of a shuffle window follow the files' bytes per row)"
    if name in ELASTIC_FIELDS:
        hint = " (pass elastic=True with every rank's state to re-deal the rest of the epoch)"
    what = f"the state of rank {expected}" if name == "rank" else "this checkpoint"
    raise CheckpointMismatchError(
        f"{what} does not match the current dataset: stored split {split} was planned with "
        f"{name}={expected!r}, compared against the current plan with {name}={found!r}{hint}."
        f"\nLikely cause: {name} changed: checkpoint={expected!r}, current={found!r}",
        split=split, field=name, expected=expected, found=found,
    )  # fmt: skip


def stored_split(state: Mapping[str, Any]) -> str:
    """A split the state names, for messages: its first stream's, else its first file."""
    try:
        root = state["files"].get("root")
        for entry in state["streams"]:
            if isinstance(entry, list) and len(entry) == 8:
                path, offset, length = entry[3:6]
                return f"{_located(root, path)} rows [{offset}, {offset + length})"
        return f"{_located(root, state['files']['groups'][0][0])} (full file)"
    except (KeyError, TypeError, IndexError, AttributeError):
        return "(no split named in the state)"


def _check_files(state: Mapping[str, Any], index: DatasetIndex) -> None:
    files = state["files"]
    if files.get("digest") == index.digest and state["num_splits"] == len(index.splits):
        return
    stored = files.get("groups")
    if not isinstance(stored, list) or not all(_is_group(g) for g in stored):
        raise InvalidStateError(
            "state key 'files.groups' must be a list of [first path, last path, count, digest]"
        )
    # runs of as many files as the state's first (a mixture's source groups its files coarser)
    current = index.file_groups(size=max(1, stored[0][2]) if stored else 0)
    roots = (files.get("root"), index.root)
    for old, new in zip(stored, current, strict=False):
        if old != new:
            raise _file_drift(old, new, roots)
    if len(stored) == len(current):  # same files, yet another plan: the state was altered
        raise InvalidStateError(
            f"state key 'num_splits' is {state['num_splits']!r} (files digest "
            f"{files.get('digest')!r}), but these files make {len(index.splits)} splits with "
            f"digest {index.digest!r}: the state is corrupted"
        )
    old = stored[len(current)] if len(stored) > len(current) else ["(none)"] * 4
    new = current[len(stored)] if len(current) > len(stored) else ["(none)"] * 4
    raise _file_drift(old, new, roots)


def _located(root: object, name: object) -> str:
    """A stored name as messages show it: below its dataset root, when the state has one."""
    return f"{root}/{name}" if isinstance(root, str) and root else str(name)


def _is_group(group: object) -> bool:
    return (
        isinstance(group, list)
        and len(group) == 4
        and isinstance(group[0], str)
        and isinstance(group[1], str)
        and type(group[2]) is int
        and isinstance(group[3], str)
    )


def _file_drift(
    old: Sequence[Any], new: Sequence[Any], roots: tuple[object, str]
) -> CheckpointMismatchError:
    """Groups ``old`` (stored) and ``new`` (current) differ; names are below their roots."""

    def name(group: Sequence[Any], root: object) -> str:
        if group[2] == "(none)":
            return "(none)"
        if group[2] == 1:
            return _located(root, group[0])
        return f"{group[2]} files {_located(root, group[0])} .. {_located(root, group[1])}"

    was, now = name(old, roots[0]), name(new, roots[1])
    if old[2] == "(none)" or new[2] == "(none)":
        changed = "added" if old[2] == "(none)" else "removed"
    else:
        changed = "content changed (size or footer)" if old[0] == new[0] else "renamed"
    return CheckpointMismatchError(
        f"checkpoint does not match the current files: stored {was} (full file, fingerprint "
        f"{old[3]}) compared against current {now} (fingerprint {new[3]})."
        f"\nLikely cause: files changed ({changed}): checkpoint={was}@{old[3]}, "
        f"current={now}@{new[3]}",
        split=f"{_located(roots[0], old[0])} (full file)", field="files", expected=old[3],
        found=new[3],
    )  # fmt: skip


def _split_of(key: Sequence[Any], index: DatasetIndex) -> int:
    """The split a stored ``[path, row_offset, row_length, fingerprint]`` names, if unchanged."""
    path, offset, length, fingerprint = key
    split = index.split_at(path, offset, length)
    current = index.files[index.splits[split].file].fingerprint if split is not None else None
    if split is None or current != fingerprint:
        where = _located(index.root, path)
        raise CheckpointMismatchError(
            f"checkpoint split {where} rows [{offset}, {offset + length}) "
            f"(fingerprint {fingerprint}) is not in the current plan "
            f"(current fingerprint: {current or 'no such split'})."
            f"\nLikely cause: files changed: checkpoint={where}@{fingerprint}, "
            f"current={where}@{current}",
            split=f"{where} rows [{offset}, {offset + length})",
            field="files", expected=fingerprint, found=current,
        )  # fmt: skip
    return split


def _split_key(split: int, index: DatasetIndex) -> tuple[Any, ...]:
    s = index.splits[split]
    f = index.files[s.file]
    return f.name, s.row_offset, s.row_length, f.fingerprint


def misplaced(split: str, settings: Settings, worker: int | None) -> CheckpointMismatchError:
    """The state's progress is not where the plan puts any stream of this rank."""
    where = "any worker" if worker is None else f"worker {worker}"
    return CheckpointMismatchError(
        f"checkpoint split {split} is out of order for {where} of rank {settings.rank}: "
        f"compared against the current plan (world_size={settings.world_size}, "
        f"num_workers={settings.num_workers}), the delivered rows are not a position of that "
        f"worker's share.\nLikely cause: the state was edited, or saved by another worker "
        f"or loader: checkpoint=out-of-order progress, current={where} of rank {settings.rank}",
        split=split, field="plan", expected="a position of each worker's share", found=where,
    )  # fmt: skip


def check_coverage(states: Sequence[Mapping[str, Any]]) -> None:
    """One state per rank of the old job, each exactly once, all of one world size."""
    ranks = sorted(s["_rank"] for s in states)
    world_size = states[0]["_world_size"]
    if ranks == list(range(len(states))) and {s["_world_size"] for s in states} == {len(states)}:
        return
    present = set(ranks)  # a corrupted world_size may be huge: name the first missing ranks
    missing = list(itertools.islice((r for r in range(world_size) if r not in present), 8))
    duplicated = sorted({r for r in ranks if ranks.count(r) > 1})
    raise CheckpointMismatchError(
        f"the states do not cover the old job's ranks exactly once: ranks {ranks} for "
        f"world_size={world_size} (missing {missing}, duplicated {duplicated})."
        f"\nLikely cause: states list incomplete: checkpoint=world_size {world_size}, "
        f"current={len(states)} states",
        split=stored_split(states[0]), field="rank", expected=range(world_size),
        found=ranks,
    )  # fmt: skip


def check_same_epoch(states: Sequence[Mapping[str, Any]]) -> None:
    """Every rank's state from the same epoch (saved at the same step)."""
    epochs = sorted({s["epoch"] for s in states})
    if len(epochs) > 1:
        raise CheckpointMismatchError(
            f"the states come from different epochs {epochs}; save every rank at the same step."
            f"\nLikely cause: epoch differs between ranks: checkpoint={epochs[0]}, "
            f"current={epochs[-1]}",
            split=stored_split(states[0]), field="epoch", expected=epochs[0], found=epochs[-1],
        )  # fmt: skip


def check_each(states: Sequence[object], check: Callable[[Mapping[str, Any]], None]) -> None:
    """Each state well-formed (``check``): any error of it is refused, naming the state."""
    for number, state in enumerate(states):
        try:
            check(state)  # type: ignore[arg-type]
        except Exception as exc:
            raise _named(exc, f"states[{number}]") from exc


def _named(error: Exception, where: str) -> Exception:
    """``error`` about ``where``: a library error of the same kind with ``where`` in front of
    its message; any other error, as a malformed state."""
    if isinstance(error, CheckpointMismatchError):
        return CheckpointMismatchError(
            f"{where}: {error}", split=error.split, field=error.field, expected=error.expected,
            found=error.found,
        )  # fmt: skip
    if isinstance(error, DataLoaderUtilsError):
        return type(error)(f"{where}: {error}")
    return InvalidStateError(f"{where} is malformed ({type(error).__name__}: {error})")


def one_job(
    states: Sequence[Mapping[str, Any]],
    check: Callable[[Mapping[str, Any]], None],
    shared: Sequence[str],
    part: Callable[[Mapping[str, Any], str], Any] = lambda state, key: state[key],
) -> list[Mapping[str, Any]]:
    """The states of an old job, by rank: each well-formed (``check``), one per rank, of one
    epoch, and equal in their ``shared`` keys (``part(state, key)`` of them)."""
    if not states:
        raise InvalidStateError("no states given: pass one state per rank of the old job")
    check_each(states, check)
    check_coverage(states)
    check_same_epoch(states)
    ordered = sorted(states, key=lambda state: state["_rank"])
    first = ordered[0]
    for state in ordered[1:]:
        for key in shared:
            mine, theirs = part(first, key), part(state, key)
            if mine != theirs:
                raise CheckpointMismatchError(
                    f"the states of ranks {first['_rank']} and {state['_rank']} differ in "
                    f"{key.lstrip('_')}: they are not of one job and step."
                    f"\nLikely cause: states from different jobs: checkpoint={mine!r:.80}, "
                    f"current={theirs!r:.80}",
                    split=stored_split(state), field=key.lstrip("_"), expected=mine,
                    found=theirs,
                )  # fmt: skip
    return ordered


def merge_states(
    states: Sequence[Mapping[str, Any]], *, index: DatasetIndex, settings: Settings
) -> tuple[Mapping[str, Any], Decoded]:
    """The old job's states as one: its first state (epoch and settings) and every stream of
    every rank, in stream order; one state per old rank, same epoch, same deals before."""
    ordered = one_job(states, check_shape, ("_num_workers", "_even_batches", "generations"))
    first = ordered[0]
    streams: list[StreamEntry | None] = []
    for state in ordered:
        decoded = decode(state, index=index, settings=settings, elastic=True)
        if len(decoded.streams) != max(1, state["_num_workers"]):
            raise InvalidStateError(
                f"state key 'streams' of rank {state['_rank']} holds {len(decoded.streams)} "
                f"entries for num_workers={state['_num_workers']}: the state is corrupted"
            )
        streams.extend(decoded.streams)
    generations = decode(first, index=index, settings=settings, elastic=True).generations
    return first, Decoded(generations, tuple(streams))
