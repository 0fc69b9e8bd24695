"""Dataset states inside checkpoint files, for the command line.

A checkpoint file is JSON or a ``torch.save`` file (read with ``weights_only=True``). It holds one
dataset state, a list of every rank's states, or a dict with either somewhere under its keys
(``{"model": ..., "data": states}``). A state is a dict with the keys ``"version"`` and
``"_num_workers"``; ``find_states`` returns the states and the dotted key they were found under.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from ..mixing.state import expanded

__all__ = ["BadInput", "Found", "find_states", "read_checkpoint", "stream_entry"]


class BadInput(ValueError):
    """Input the command line cannot use (exit status 2): the message says what and why."""


@dataclass(frozen=True)
class Found:
    """The states of a checkpoint file and the dotted key they were under (``None``: the top)."""

    states: list[Mapping[str, Any]]
    key: str | None


def read_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> object:
    """The object in ``path``: parsed JSON, or what ``torch.load(weights_only=True)`` returns."""
    try:
        with fsspec.open(path, "rb", **dict(storage_options or {})) as file:
            data: bytes = file.read()
    except FileNotFoundError:
        raise BadInput(f"checkpoint {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"checkpoint {path} cannot be read: {exc}") from None
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            return json.loads(data)
        except ValueError as exc:
            raise BadInput(f"checkpoint {path} is not valid JSON: {exc}") from None
    return _torch_load(path, data)


def _torch_load(path: str, data: bytes) -> object:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise BadInput(
            f"checkpoint {path} is neither JSON nor a file torch.load(weights_only=True) "
            f"reads: {_reason(exc)}"
        ) from None


def _reason(exc: Exception) -> str:
    """The line of a ``torch.load`` error that says what failed (not its advice)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    lines = text.split(marker, 1)[1] if marker in text else text
    found = [line.strip() for line in lines.splitlines() if line.strip()]
    return found[0].split(". ")[0] if found else type(exc).__name__


def find_states(checkpoint: object, key: str | None = None) -> Found:
    """The dataset state(s) in ``checkpoint``: at ``key`` (``a.b``), or the one place found."""
    if key is not None:
        value = _at_key(checkpoint, key)
        if not _holds_states(value):
            raise BadInput(
                f"key {key!r} holds {_kind(value)}, not a dataset state (a dict with keys "
                f"'version' and '_num_workers') or a list of them"
            )
        return Found(_as_list(value), key)
    if _holds_states(checkpoint):
        return Found(_as_list(checkpoint), None)
    places = dict(_candidates(checkpoint, ()))
    if len(places) == 1:
        (where, value), *_ = places.items()
        return Found(_as_list(value), where)
    if places:
        raise BadInput(
            f"dataset states found under several keys {sorted(places)}: choose one with --key"
        )
    raise BadInput(
        f"no dataset state found in {_kind(checkpoint)}: expected a dict with keys 'version' "
        f"and '_num_workers' (or a list of them), at the top or under a key of a dict; "
        f"pass --key if it is elsewhere"
    )


def stream_entry(worker: int, entry: Any) -> dict[str, Any]:
    """A worker stream's rows handed out of its share, and the split it is in."""
    if not (isinstance(entry, list) and len(entry) in (3, 8)):
        raise BadInput(
            f"state key 'streams': entry {str(entry)[:80]} is not [position, tokens, rows, "
            f"path, row_offset, row_length, fingerprint, row]"
        )
    split = None
    if len(entry) == 8:
        path, offset, length = entry[3:6]
        split = f"{path} rows [{offset}, {offset + length}) row {entry[7]}"
    return {"worker": worker, "rows": entry[0], "tokens": entry[1], "share": entry[2],
            "split": split}  # fmt: skip


def _is_state(value: object) -> bool:
    return isinstance(value, Mapping) and "version" in value and "_num_workers" in value


def _holds_states(value: object) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_is_state(v) for v in value)
    return _is_state(value)


def _as_list(value: Any) -> list[Mapping[str, Any]]:
    """The states, a mixture's with each source's state whole."""
    return [expanded(v) for v in (value if isinstance(value, list) else [value])]


def _candidates(value: object, where: tuple[str, ...]) -> Iterator[tuple[str, object]]:
    """``(dotted key, states)`` of every place under the dicts of ``value`` that holds states."""
    if not isinstance(value, Mapping):
        return
    for name, item in value.items():
        path = (*where, str(name))
        if _holds_states(item):
            yield ".".join(path), item
        else:
            yield from _candidates(item, path)


def _at_key(value: object, key: str) -> object:
    """``value[a][b]`` for ``key="a.b"``; a part may be a list index or an int dict key."""
    for depth, part in enumerate(key.split(".")):
        where = ".".join(key.split(".")[:depth]) or "the top level"
        if isinstance(value, Mapping):
            names = {str(k): k for k in value}
            if part not in names:
                raise BadInput(f"key {key!r}: {where} has no key {part!r}; it has {sorted(names)}")
            value = value[names[part]]
        elif isinstance(value, Sequence) and not isinstance(value, str):
            if not part.isdigit() or int(part) >= len(value):
                raise BadInput(f"key {key!r}: {where} is a list of {len(value)}, not {part!r}")
            value = value[int(part)]
        else:
            raise BadInput(f"key {key!r}: {where} is {_kind(value)}, which has no keys")
    return value


def _kind(value: object) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(str(k) for k in value)[:10]}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"a {type(value).__name__}"
