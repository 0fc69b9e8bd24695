from __future__ import annotations

import base64
import binascii
import functools
import itertools
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from ._errors import CheckpointMismatchError, InvalidStateError
from ._index import DatasetIndex
from ._plan import Consumed, Intervals, merge_intervals
from ._world import World

__all__ = [
    "STATE_VERSION",
    "Cuts",
    "Settings",
    "check_coverage",
    "check_same_epoch",
    "check_setting",
    "decode",
    "decode_cuts",
    "encode",
    "merge_states",
    "misplaced",
    "stored_split",
]

STATE_VERSION = 3
# Rows a packed stream cut mid-document: (split id, row of the split) -> tokens delivered.
Cuts = Mapping[tuple[int, int], int]

_KEY_TYPES: dict[str, type | tuple[type, ...]] = {
    "version": int, "epoch": int, "_num_workers": int, "_shuffle_seed": int, "_shuffle": bool,
    "_split_bytes": int, "_rank": int, "_world_size": int, "_format": str,
    "_even_batches": bool, "_shuffle_window": int, "files": dict,
    "num_splits": int, "done": str, "partial": list, "base": (dict, type(None)), "cursor": int,
    "_packing": (list, type(None)), "tokens": list,
}  # fmt: skip
_SIGNED_KEYS = ("_shuffle_seed",)
# Versions this library refuses, with why their progress cannot be carried over.
_OLD_VERSIONS = {
    1: "saved before rows were dealt to streams row by row",
    2: "which names files by absolute path with fingerprints of their mtime or ETag, where "
    "version 3 names them below the dataset root with fingerprints of their content (and "
    "records token packing)",
}
_ELASTIC_FIELDS = ("world_size", "rank", "num_workers", "even_batches")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The settings a checkpoint must agree with (``num_workers`` as the DataLoader counts)."""

    format: str
    split_bytes: int
    shuffle: bool
    shuffle_seed: int
    window: int  # splits mixed together per stream: 1 without shuffle
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


def encode(
    *,
    epoch: int,
    delivered: Consumed,
    base: Consumed,
    cursor: int,
    index: DatasetIndex,
    settings: Settings,
    cuts: Cuts = MappingProxyType({}),
) -> dict[str, Any]:
    """The state dict of an epoch in which ``delivered`` (dealt after ``base``) is done, and
    ``cuts`` tokens of rows not yet wholly delivered."""
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
        "_shuffle_window": settings.window,
        "_packing": settings.packing,
        "files": {
            "count": len(index.files),
            "digest": index.digest,
            "groups": index.file_groups(),
            "root": index.root,  # where the names were relative to, for messages only
        },
        "num_splits": len(index.splits),
        "done": _pack_bits(delivered.done),
        "partial": _partial_rows(delivered.partial, index),
        "base": None
        if base.is_empty()
        else {"done": _pack_bits(base.done), "partial": _partial_rows(base.partial, index)},
        "cursor": cursor,
        "tokens": [
            [*_split_key(split, index), row, count] for (split, row), count in sorted(cuts.items())
        ],
    }


def decode(
    state: Mapping[str, Any], *, index: DatasetIndex, settings: Settings, elastic: bool = False
) -> tuple[Consumed, Consumed]:
    """Validate ``state`` against the dataset; return ``(delivered, base)`` by split id."""
    _check_shape(state)
    _check_settings(state, settings, elastic)
    _check_files(state, index)
    done = _consumed(state["done"], state["partial"], index, "done")
    if state["base"] is None:
        return done, Consumed.nothing(len(index.splits))
    if not isinstance(state["base"], dict) or set(state["base"]) != {"done", "partial"}:
        raise InvalidStateError("state key 'base' must be null or {'done': str, 'partial': list}")
    return done, _consumed(state["base"]["done"], state["base"]["partial"], index, "base.done")


def decode_cuts(state: Mapping[str, Any], index: DatasetIndex, delivered: Consumed) -> Cuts:
    """The rows ``state`` cut mid-document, validated against the files and ``delivered``."""
    cuts: dict[tuple[int, int], int] = {}
    for entry in state.get("tokens", ()):
        if not (
            isinstance(entry, list)
            and len(entry) == 6
            and isinstance(entry[0], str)
            and isinstance(entry[3], str)
            and all(type(v) is int for v in (entry[1], entry[2], entry[4], entry[5]))
        ):
            raise InvalidStateError(
                f"state key 'tokens': entry {entry!r}: expected [path, row_offset, row_length, "
                f"fingerprint, row, tokens delivered]"
            )
        split = _split_of(entry[:4], index)
        row, count = entry[4], entry[5]
        taken = delivered.done[split] or any(
            lo <= row < hi for lo, hi in delivered.partial.get(split, ())
        )
        if not 0 <= row < entry[2] or count < 1 or taken or (split, row) in cuts:
            raise InvalidStateError(
                f"state key 'tokens': entry {entry!r}: row {row} is not a row of the split "
                f"partly delivered"
            )
        cuts[split, row] = count
    return cuts


def _check_shape(state: object) -> None:
    if not isinstance(state, Mapping):
        raise InvalidStateError(f"a state must be a dict, got {type(state).__name__}")
    version = state.get("version")
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


def _check_nested(state: Mapping[str, Any]) -> None:
    """The parts of ``base`` (an elastic resume's), ``files`` and ``_packing`` that code reads
    without further checks: of the right type, or an error naming the key."""
    base = state["base"]
    if base is not None:
        if set(base) != {"done", "partial"}:
            raise InvalidStateError(
                f"state key 'base' must be null or {{'done': str, 'partial': list}}, got the "
                f"keys {list(base)}"
            )
        _check_nested_key("base.done", base["done"], str)
        _check_nested_key("base.partial", base["partial"], list)
    for key, kind in (("count", int), ("digest", str), ("root", str), ("groups", list)):
        if key in state["files"]:
            _check_nested_key(f"files.{key}", state["files"][key], kind)
    packing = state["_packing"]
    if packing is not None and not (
        len(packing) == 2
        and isinstance(packing[0], str)
        and (packing[1] is None or type(packing[1]) is int)
    ):
        raise InvalidStateError(
            f"state key '_packing' must be null or [column, separator], got {packing!r}"
        )


def _check_nested_key(key: str, value: object, kind: type) -> None:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidStateError(
            f"state key {key!r} must be {_type_name(kind)}, got {type(value).__name__}"
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
        "shuffle_window": (state["_shuffle_window"], settings.window),
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
        root = state["files"].get("root")
        if partial and isinstance(partial[0], list) and len(partial[0]) == 5:
            path, offset, length = partial[0][:3]
            return f"{_located(root, path)} rows [{offset}, {offset + length})"
        return f"{_located(root, state['files']['groups'][0][0])} (full file)"
    except (KeyError, TypeError, IndexError, AttributeError):
        return "(no split named in the state)"


def _check_files(state: Mapping[str, Any], index: DatasetIndex) -> None:
    files = state["files"]
    if files.get("digest") == index.digest and state["num_splits"] == len(index.splits):
        return
    stored = files.get("groups")
    current = index.file_groups()
    if not isinstance(stored, list) or not all(_is_group(g) for g in stored):
        raise InvalidStateError(
            "state key 'files.groups' must be a list of [first path, last path, count, digest]"
        )
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


def _consumed(bits: str, partial: Sequence[Any], index: DatasetIndex, key: str) -> Consumed:
    done = _unpack_bits(bits, len(index.splits), key)
    partial_key = key.removesuffix("done") + "partial"  # 'partial' or 'base.partial'
    rows: dict[int, Intervals] = {}
    for entry in partial:
        if not (
            isinstance(entry, list)
            and len(entry) == 5
            and isinstance(entry[0], str)
            and isinstance(entry[3], str)
            and all(type(v) is int for v in (entry[1], entry[2]))
            and isinstance(entry[4], list)
            and all(type(v) is int for v in entry[4])
        ):
            raise InvalidStateError(
                f"state key {partial_key!r}: entry {entry!r}: expected [path, row_offset, "
                f"row_length, fingerprint, [lo, hi, ...] rows delivered]"
            )
        split = _split_of(entry[:4], index)
        rows[split] = _intervals(entry[4], entry[2], entry, done[split], key=partial_key)
    return Consumed(done, rows)


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


def _intervals(
    bounds: list[int], length: int, entry: object, done: bool, key: str = "partial"
) -> Intervals:
    """Stored ``[lo, hi, lo, hi, ...]`` as intervals: sorted, disjoint, within, not all rows."""
    pairs = tuple(zip(bounds[::2], bounds[1::2], strict=False))
    if (
        done
        or len(bounds) % 2
        or not pairs
        or merge_intervals(pairs) != pairs
        or pairs[0][0] < 0
        or pairs[-1][1] > length
        or pairs == ((0, length),)
    ):
        raise InvalidStateError(f"state key {key!r}: entry {entry!r}: delivered rows out of range")
    return pairs


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


def _partial_rows(partial: Mapping[int, Intervals], index: DatasetIndex) -> list[list[Any]]:
    """``[*split key, [lo, hi, lo, hi, ...]]`` per split in progress (hundreds per call with
    many workers and wide shuffle windows: kept to one list per entry)."""
    return [
        [*_split_key(split, index), list(itertools.chain.from_iterable(ranges))]
        for split, ranges in sorted(partial.items())
    ]


def _pack_bits(done: np.ndarray) -> str:
    return _compressed(np.packbits(done).tobytes())


@functools.lru_cache(maxsize=8)
def _compressed(bits: bytes) -> str:
    """zlib + base64 of a bitmap; cached, since it changes only when a split completes and
    compressing 100,000 shuffled bits costs a millisecond (StatefulDataLoader asks every step)."""
    return base64.b64encode(zlib.compress(bits, 6)).decode("ascii")


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


def merge_states(
    states: Sequence[Mapping[str, Any]], *, index: DatasetIndex, settings: Settings
) -> tuple[int, Consumed, Cuts]:
    """Epoch, union of what every old rank delivered, and the rows they cut mid-document;
    one state per old rank, same epoch."""
    if not states:
        raise InvalidStateError("no states given: pass one state per rank of the old job")
    for state in states:
        _check_shape(state)
    check_coverage(states)
    check_same_epoch(states)
    merged = Consumed.nothing(len(index.splits))
    cuts: dict[tuple[int, int], int] = {}
    for state in states:
        delivered, base = decode(state, index=index, settings=settings, elastic=True)
        _check_base_delivered(delivered, base, index)
        merged = merged.union(delivered, index.split_rows)
        for key, count in decode_cuts(state, index, delivered).items():
            cuts[key] = max(count, cuts.get(key, 0))
    for split, row in list(cuts):
        if merged.done[split] or any(lo <= row < hi for lo, hi in merged.partial.get(split, ())):
            raise InvalidStateError(
                f"split {index.describe(split)}: one rank's state cut row {row} mid-document, "
                f"another delivered it whole: the states are not of one step"
            )
    return states[0]["epoch"], merged, cuts


def _check_base_delivered(delivered: Consumed, base: Consumed, index: DatasetIndex) -> None:
    """What a state's ``base`` (an earlier job's, before an elastic resume) records is part of
    what it delivered: a state where it is not would have those rows delivered again."""
    if base.is_empty():
        return
    union = delivered.union(base, index.split_rows)
    if np.array_equal(union.done, delivered.done) and dict(union.partial) == dict(
        delivered.partial
    ):
        return
    raise InvalidStateError(
        "state key 'base' holds rows that 'done'/'partial' do not: the state is corrupted "
        "(what an elastic resume's base delivered is part of what the state delivered)"
    )
