"""A state's files and splits against the current index: the key a split is stored by, the split
a stored key names, and the error naming what changed when the files drifted.

A state names files below the dataset's root with content fingerprints, in groups (at most
``index.MAX_FILE_GROUPS``), and each stream's next split by ``[path, row_offset, row_length,
fingerprint]``: a renamed, added, removed or rewritten file fails to match, and the error names it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..base.errors import CheckpointMismatchError, InvalidStateError
from ..index.index import DatasetIndex

__all__ = ["check_files", "split_key", "split_of", "stored_split"]


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


def check_files(state: Mapping[str, Any], index: DatasetIndex) -> None:
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


def split_of(key: Sequence[Any], index: DatasetIndex) -> int:
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


def split_key(split: int, index: DatasetIndex) -> tuple[Any, ...]:
    s = index.splits[split]
    f = index.files[s.file]
    return f.name, s.row_offset, s.row_length, f.fingerprint
