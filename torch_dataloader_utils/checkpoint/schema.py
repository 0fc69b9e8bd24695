"""The checkpoint state's schema (version 6): its keys, the values they hold, and its shape.

A state is plain JSON-safe builtins::

    version, epoch                      int
    _num_workers, _rank, _world_size    int      the DataLoader's and DDP's, at save time
    _shuffle, _shuffle_seed             bool, int
    _split_bytes, _format               int, str
    _even_batches                       bool
    _shuffle_memory_bytes               int      the shuffle's memory budget per stream
    _shuffle_window_rows                int      rows of a shuffle window (0 unshuffled)
    _packing                            list | null   TokenPacking.setting
    _tokenize        (only when given)  list          Tokenize.setting: [text column, the
                                                      tokenizer's fingerprint]
    _whole_documents (only when given)  dict          TokenPacking.whole_setting: {"seq_len",
                                                      "window", "overlong"}; then a stream's
                                                      ``tokens`` count the sequences of the
                                                      window at ``position`` delivered
    _companions      (only when given)  dict          TokenPacking.companion_setting: each
                                                      companion column's name: its pad
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
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base.arrays import IntArray
from ..base.errors import InvalidStateError
from ..base.world import World

__all__ = [
    "STATE_VERSION",
    "Decoded",
    "Generation",
    "Settings",
    "StreamEntry",
    "bad_stream",
    "check_cursor",
    "check_shape",
    "check_version",
    "decode_generation",
    "encode_generation",
    "is_stream",
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
    tokenize: list[str] | None = None  # Tokenize.setting
    whole_documents: dict[str, Any] | None = None  # TokenPacking.whole_setting
    companions: dict[str, int] | None = None  # TokenPacking.companion_setting

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


def bad_stream(entry: object, number: int) -> InvalidStateError:
    return InvalidStateError(
        f"state key 'streams[{number}]' must be [position, tokens, rows, path, row_offset, "
        f"row_length, fingerprint, row] with position < rows < 2**62, or [rows, 0, rows] at "
        f"the stream's end, got {entry!r:.200}"
    )


def is_stream(entry: object) -> bool:
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
        if entry is not None and not is_stream(entry):
            raise bad_stream(entry, number)
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
    for key, (fits, expected) in _OPTIONAL_SHAPES.items():
        if key in state and not fits(state[key]):
            raise InvalidStateError(
                f"state key {key!r} must be {expected}, got {state[key]!r:.200}"
            )


def _whole_documents_fit(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and sorted(value) == ["overlong", "seq_len", "window"]
        and type(value["seq_len"]) is int
        and type(value["window"]) is int
        and isinstance(value["overlong"], str)
    )


def _tokenize_fits(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(t, str) for t in value)


def _companions_fit(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and type(v) is int for k, v in value.items()
    )


# The keys a state holds only when a setting is given: what their values must be.
_OPTIONAL_SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "_whole_documents": (_whole_documents_fit, "{'seq_len': int, 'window': int, 'overlong': str}"),
    "_tokenize": (_tokenize_fits, "[text column, tokenizer fingerprint]"),
    "_companions": (_companions_fit, "a dict of column names to pads (ints)"),
}


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
