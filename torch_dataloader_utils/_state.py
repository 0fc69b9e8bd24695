"""Checkpoint states: what one rank has delivered, by content, as plain builtin types.

Schema, version 1 (every value JSON-safe)::

    {
      "version": 1,
      "epoch": int,
      "_num_workers": int, "_shuffle_seed": int, "_shuffle": bool, "_split_bytes": int,
      "_rank": int, "_world_size": int, "_format": str, "_even_batches": bool,
      "files": {"count": int, "digest": str,            # xxh64 of every (path, fingerprint)
                "groups": [[first path, last path, count, digest], ...]},   # <= 256 groups
      "num_splits": int,
      "done": str,        # splits fully delivered: bitmap over split ids, zlib + base64
      "partial": [[path, row_offset, row_length, fingerprint, rows_delivered], ...],
      "base": null | {"done": str, "partial": [...]},   # set when the epoch was dealt elastically
      "cursor": int,      # the worker whose batch comes next (order only, not progress)
    }

Split ids are positions in the plan, which is a pure function of the files (their fingerprints
include the footer layout) and ``split_bytes``; both are checked before any id is trusted.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import CheckpointMismatchError, InvalidStateError
from ._index import DatasetIndex
from ._plan import Consumed, EpochPlan
from ._world import World

__all__ = [
    "STATE_VERSION",
    "Progress",
    "Settings",
    "check_coverage",
    "check_same_epoch",
    "check_setting",
    "decode_consumed",
    "encode",
    "merge_states",
    "positions_of",
    "stored_split",
]

STATE_VERSION = 1

_KEY_TYPES: dict[str, type | tuple[type, ...]] = {
    "version": int, "epoch": int, "_num_workers": int, "_shuffle_seed": int, "_shuffle": bool,
    "_split_bytes": int, "_rank": int, "_world_size": int, "_format": str,
    "_even_batches": bool, "files": dict,
    "num_splits": int, "done": str, "partial": list, "base": (dict, type(None)), "cursor": int,
}  # fmt: skip
_ELASTIC_FIELDS = ("world_size", "rank", "num_workers", "even_batches")


@dataclass(frozen=True)
class Settings:
    """The settings a checkpoint must agree with (``num_workers`` as the DataLoader counts)."""

    format: str
    split_bytes: int
    shuffle: bool
    shuffle_seed: int
    rank: int
    world_size: int
    num_workers: int
    even_batches: bool = False

    def world(self, worker: int = 0) -> World:
        return World(self.rank, self.world_size, worker, max(1, self.num_workers))


@dataclass
class Progress:
    """Delivery in one epoch: per worker, ``(pieces done, rows into the next piece)``."""

    plan: EpochPlan
    settings: Settings
    positions: dict[int, tuple[int, int]] = field(default_factory=dict)
    cursor: int = 0

    def delivered(self) -> Consumed:
        done = self.plan.base.done.copy()
        partial = dict(self.plan.base.partial)
        for worker, (count, rows) in self.positions.items():
            pieces = self.plan.stream(self.settings.world(worker))
            done[pieces.splits[:count]] = True
            if rows and count < len(pieces):
                partial[int(pieces.splits[count])] = int(pieces.starts[count]) + rows
        return Consumed(done, {s: r for s, r in partial.items() if not done[s]})


def encode(
    epoch: int,
    delivered: Consumed,
    base: Consumed,
    cursor: int,
    index: DatasetIndex,
    settings: Settings,
) -> dict[str, Any]:
    """The state dict of an epoch in which ``delivered`` (dealt after ``base``) is done."""
    has_base = bool(base.done.any() or base.partial)
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
        "files": {"count": len(index.files), "digest": index.digest, "groups": index.file_groups()},
        "num_splits": len(index.splits),
        "done": _pack_bits(delivered.done),
        "partial": _partial_rows(delivered.partial, index),
        "base": {"done": _pack_bits(base.done), "partial": _partial_rows(base.partial, index)}
        if has_base
        else None,
        "cursor": cursor,
    }


def decode_consumed(
    state: Mapping[str, Any], index: DatasetIndex, settings: Settings, *, elastic: bool = False
) -> tuple[Consumed, Consumed]:
    """Validate ``state`` against the dataset; return ``(delivered, base)`` by split id."""
    _check_shape(state)
    _check_settings(state, index, settings, elastic)
    _check_files(state, index)
    done = _consumed(state["done"], state["partial"], index, "done")
    if state["base"] is None:
        return done, Consumed.nothing(len(index.splits))
    if not isinstance(state["base"], dict) or set(state["base"]) != {"done", "partial"}:
        raise InvalidStateError("state key 'base' must be null or {'done': str, 'partial': list}")
    return done, _consumed(state["base"]["done"], state["base"]["partial"], index, "base.done")


def positions_of(
    plan: EpochPlan,
    delivered: Consumed,
    settings: Settings,
    workers: Iterable[int],
    index: DatasetIndex,
) -> dict[int, tuple[int, int]]:
    """Each worker's position in its own stream; mismatch if ``delivered`` is no prefix of it."""
    positions: dict[int, tuple[int, int]] = {}
    placed: set[int] = set()
    for worker in workers:
        pieces = plan.stream(settings.world(worker))
        done = delivered.done[pieces.splits]
        count = len(done) if done.all() else int(np.argmin(done))
        if done[count:].any():
            late = int(pieces.splits[count + int(np.argmax(done[count:]))])
            raise _misplaced(index.describe(late) + " (full)", settings, worker)
        rows = 0
        if count < len(pieces) and int(pieces.splits[count]) in delivered.partial:
            split = int(pieces.splits[count])
            rows = delivered.partial[split] - int(pieces.starts[count])
            placed.add(split)
        positions[worker] = (count, rows)
    stray = sorted(set(delivered.partial) - placed - set(plan.base.partial))
    if stray:
        rows = delivered.partial[stray[0]]
        raise _misplaced(f"{index.describe(stray[0])} ({rows} rows delivered)", settings, None)
    return positions


def _check_shape(state: object) -> None:
    if not isinstance(state, Mapping):
        raise InvalidStateError(f"a state must be a dict, got {type(state).__name__}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise InvalidStateError(
            f"unknown state version {version!r}: this library reads version {STATE_VERSION}"
        )
    for key, kind in _KEY_TYPES.items():
        if key not in state:
            raise InvalidStateError(f"state has no key {key!r}; was it saved by this library?")
        value = state[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidStateError(
                f"state key {key!r} must be {_type_name(kind)}, got {type(value).__name__}"
            )
        if isinstance(value, int) and value < 0:
            raise InvalidStateError(f"state key {key!r} must be >= 0, got {value}")


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _check_settings(
    state: Mapping[str, Any], index: DatasetIndex, settings: Settings, elastic: bool
) -> None:
    pairs = {
        "format": (state["_format"], settings.format),
        "split_bytes": (state["_split_bytes"], settings.split_bytes),
        "shuffle": (state["_shuffle"], settings.shuffle),
        "shuffle_seed": (state["_shuffle_seed"], settings.shuffle_seed),
        # which rows an evened epoch leaves out, and so where it ends, depends on it
        "even_batches": (state["_even_batches"], settings.even_batches),
        "world_size": (state["_world_size"], settings.world_size),
        "rank": (state["_rank"], settings.rank),
        # 0 and 1 workers both make one stream per rank, so they resume into each other.
        "num_workers": (state["_num_workers"], settings.num_workers),
    }
    for name, (expected, found) in pairs.items():
        if elastic and name in _ELASTIC_FIELDS:
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
    if name in _ELASTIC_FIELDS:
        hint = " (pass elastic=True with every rank's state to re-deal the rest of the epoch)"
    what = f"the state of rank {expected}" if name == "rank" else "this checkpoint"
    raise CheckpointMismatchError(
        f"{what} does not match the current dataset: stored split {split} was planned with "
        f"{name}={expected!r}, compared against the current plan with {name}={found!r}{hint}."
        f"\nLikely cause: {name} changed: checkpoint={expected!r}, current={found!r}",
        split=split, field=name, expected=expected, found=found,
    )  # fmt: skip


def stored_split(state: Mapping[str, Any]) -> str:
    """A split the state names, for messages: its first partial split, else its first file."""
    try:
        partial = state["partial"]
        if partial and isinstance(partial[0], list) and len(partial[0]) == 5:
            path, offset, length = partial[0][:3]
            return f"{path} rows [{offset}, {offset + length})"
        return f"{state['files']['groups'][0][0]} (full file)"
    except (KeyError, TypeError, IndexError):
        return "(no split named in the state)"


def _check_files(state: Mapping[str, Any], index: DatasetIndex) -> None:
    files = state["files"]
    if files.get("digest") == index.digest and state["num_splits"] == len(index.splits):
        return
    stored = files.get("groups")
    current = index.file_groups()
    if not isinstance(stored, list):
        raise InvalidStateError("state key 'files' has no list 'groups'")
    for old, new in zip(stored, current, strict=False):
        if old != new:
            raise _file_drift(old, new)
    if len(stored) == len(current):  # same files, yet another plan: the state was altered
        raise InvalidStateError(
            f"state key 'num_splits' is {state['num_splits']!r} (files digest "
            f"{files.get('digest')!r}), but these files make {len(index.splits)} splits with "
            f"digest {index.digest!r}: the state is corrupted"
        )
    old = stored[len(current)] if len(stored) > len(current) else ["(none)"] * 4
    new = current[len(stored)] if len(current) > len(stored) else ["(none)"] * 4
    raise _file_drift(old, new)


def _file_drift(old: Sequence[Any], new: Sequence[Any]) -> CheckpointMismatchError:
    def name(group: Sequence[Any]) -> str:
        if group[2] == 1 or group[2] == "(none)":
            return str(group[0])
        return f"{group[2]} files {group[0]} .. {group[1]}"

    changed = "content changed (size, ETag/mtime or footer)" if old[0] == new[0] else "renamed"
    return CheckpointMismatchError(
        f"checkpoint does not match the current files: stored {name(old)} (full file, "
        f"fingerprint {old[3]}) compared against current {name(new)} (fingerprint {new[3]})."
        f"\nLikely cause: files changed ({changed}): checkpoint={name(old)}@{old[3]}, "
        f"current={name(new)}@{new[3]}",
        split=f"{old[0]} (full file)", field="files", expected=old[3], found=new[3],
    )  # fmt: skip


def _consumed(bits: str, partial: Sequence[Any], index: DatasetIndex, key: str) -> Consumed:
    done = _unpack_bits(bits, len(index.splits), key)
    by_range = {
        (index.files[s.file].display, s.row_offset, s.row_length): i
        for i, s in enumerate(index.splits)
    }
    rows: dict[int, int] = {}
    for entry in partial:
        if not (
            isinstance(entry, list)
            and len(entry) == 5
            and isinstance(entry[0], str)
            and isinstance(entry[3], str)
            and all(type(v) is int for v in (entry[1], entry[2], entry[4]))
        ):
            raise InvalidStateError(
                f"partial entry {entry!r}: expected [path, row_offset, row_length, "
                f"fingerprint, rows_delivered]"
            )
        path, offset, length, fingerprint, delivered = entry
        split = by_range.get((path, offset, length))
        current = index.files[index.splits[split].file].fingerprint if split is not None else None
        if split is None or current != fingerprint:
            raise CheckpointMismatchError(
                f"checkpoint split {path} rows [{offset}, {offset + length}) "
                f"(fingerprint {fingerprint}) is not in the current plan "
                f"(current fingerprint: {current or 'no such split'})."
                f"\nLikely cause: files changed: checkpoint={path}@{fingerprint}, "
                f"current={path}@{current}",
                split=f"{path} rows [{offset}, {offset + length})",
                field="files", expected=fingerprint, found=current,
            )  # fmt: skip
        if not 0 < delivered < length or done[split]:
            raise InvalidStateError(f"partial entry {entry!r}: rows_delivered out of range")
        rows[split] = delivered
    return Consumed(done, rows)


def _misplaced(split: str, settings: Settings, worker: int | None) -> CheckpointMismatchError:
    where = "any worker" if worker is None else f"worker {worker}"
    return CheckpointMismatchError(
        f"checkpoint split {split} is out of order for {where} of rank {settings.rank}: "
        f"compared against the current plan (world_size={settings.world_size}, "
        f"num_workers={settings.num_workers}), delivered splits are not a prefix of that "
        f"worker's splits.\nLikely cause: the state was edited, or saved by another worker "
        f"or loader: checkpoint=out-of-order progress, current={where} of rank {settings.rank}",
        split=split, field="plan", expected="a prefix of each worker's splits", found=where,
    )  # fmt: skip


def _partial_rows(partial: Mapping[int, int], index: DatasetIndex) -> list[list[Any]]:
    rows = []
    for split, delivered in sorted(partial.items()):
        s = index.splits[split]
        f = index.files[s.file]
        rows.append([f.display, s.row_offset, s.row_length, f.fingerprint, delivered])
    return rows


def _pack_bits(done: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.packbits(done).tobytes(), 6)).decode("ascii")


def _unpack_bits(text: str, count: int, key: str) -> np.ndarray:
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (binascii.Error, zlib.error, UnicodeEncodeError) as exc:
        raise InvalidStateError(f"state key {key!r} is corrupted: {exc}") from exc
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))
    if len(raw) != (count + 7) // 8 or bits[count:].any():
        raise InvalidStateError(f"state key {key!r} is corrupted: expected {count} split bits")
    return bits[:count].astype(bool)


def check_coverage(states: Sequence[Mapping[str, Any]]) -> None:
    """One state per rank of the old job, each exactly once, all of one world size."""
    ranks = sorted(s["_rank"] for s in states)
    world_size = states[0]["_world_size"]
    if ranks == list(range(world_size)) and {s["_world_size"] for s in states} == {world_size}:
        return
    missing = sorted(set(range(world_size)) - set(ranks))
    duplicated = sorted({r for r in ranks if ranks.count(r) > 1})
    raise CheckpointMismatchError(
        f"the states do not cover the old job's ranks exactly once: ranks {ranks} for "
        f"world_size={world_size} (missing {missing}, duplicated {duplicated})."
        f"\nLikely cause: states list incomplete: checkpoint=world_size {world_size}, "
        f"current={len(states)} states",
        split=stored_split(states[0]), field="rank", expected=list(range(world_size)),
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


def merge_states(
    states: Sequence[Mapping[str, Any]], index: DatasetIndex, settings: Settings
) -> tuple[int, Consumed]:
    """Epoch and union of what every old rank delivered; one state per old rank, same epoch."""
    if not states:
        raise InvalidStateError("no states given: pass one state per rank of the old job")
    for state in states:
        _check_shape(state)
    check_coverage(states)
    check_same_epoch(states)
    done = np.zeros(len(index.splits), dtype=bool)
    partial: dict[int, int] = {}
    for state in states:
        delivered, _ = decode_consumed(state, index, settings, elastic=True)
        done |= delivered.done
        for split, rows in delivered.partial.items():
            partial[split] = max(rows, partial.get(split, 0))
    return states[0]["epoch"], Consumed(done, {s: r for s, r in partial.items() if not done[s]})
