"""Arguments at the public boundary: builtins in, or an error that names the argument.

Values reach us from config files (strings), numpy (``np.int64``, ``np.bool_``) and arithmetic
(floats). A state must hold builtins only (JSON, ``torch.load(weights_only=True)``), so numpy
integers and booleans are taken and turned into ``int``/``bool`` here; anything else that is
not the type asked for is refused, saying what was received and what is accepted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "PathArg",
    "dataset_paths",
    "flag",
    "loader_options",
    "optional_flag",
    "optional_mapping",
    "optional_name",
    "optional_whole",
    "seconds",
    "whole",
]


def whole(
    name: str, value: object, *, at_least: int | None = None, at_most: int | None = None
) -> int:
    """``value`` as a builtin int (numpy integers too), from ``at_least`` to ``at_most``."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {_received(value)}{_parse_hint(value, 'int')}")
    number = int(value)
    if (at_least is not None and number < at_least) or (at_most is not None and number > at_most):
        raise ValueError(f"{name} must be {_int_range(at_least, at_most)}, got {number}")
    return number


def optional_whole(
    name: str, value: object, *, at_least: int | None = None, at_most: int | None = None
) -> int | None:
    """``whole``, or ``None`` for ``None``."""
    return None if value is None else whole(name, value, at_least=at_least, at_most=at_most)


def optional_name(name: str, value: object) -> str | None:
    """``value`` as a non-empty string (a column's name), or ``None`` for ``None``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a column name (a str) or None, got {_received(value)}")
    if not value:
        raise ValueError(f"{name} must be a non-empty column name, or None")
    return value


def optional_mapping(name: str, value: object) -> Mapping[str, Any] | None:
    """``value`` if a mapping (a dict), ``None`` for ``None``."""
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping (a dict) or None, got {_received(value):.200}")
    return value


PathArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
"""What a dataset's ``path`` (or a source's) may be given as."""


def dataset_paths(name: str, value: object) -> str | list[str]:
    """``value`` as a path or a list of paths: strings, or ``os.PathLike`` (``pathlib.Path``)
    objects given as their strings."""
    if isinstance(value, str | os.PathLike):
        return _path_string(name, value)
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        return [_path_string(name, p) for p in value]
    raise TypeError(
        f"{name} must be a path (a str or os.PathLike) or a list of paths, got "
        f"{_received(value):.200}"
    )


def _path_string(name: str, value: object) -> str:
    path = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(path, str):
        raise TypeError(
            f"{name} must be a path (a str or os.PathLike) or a list of paths, got "
            f"{_received(value):.200}"
        )
    return path


def flag(name: str, value: object) -> bool:
    """``value`` as a builtin bool: ``True``/``False`` (numpy's too), nothing else.

    Not ``bool(value)``: the string ``"false"`` of a config file is truthy.
    """
    if not isinstance(value, bool | np.bool_):
        hint = (
            ' (a non-empty string, even "false", would mean True)' if isinstance(value, str) else ""
        )
        raise TypeError(f"{name} must be True or False, got {_received(value)}{hint}")
    return bool(value)


def optional_flag(name: str, value: object) -> bool | None:
    """``flag``, or ``None`` for ``None`` (the default of the argument)."""
    return None if value is None else flag(name, value)


def _received(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _parse_hint(value: object, kind: str) -> str:
    return (
        f"; convert a config file's string first: {kind}({value!r})"
        if isinstance(value, str)
        else ""
    )


def _int_range(at_least: int | None, at_most: int | None) -> str:
    if at_most is not None:
        return (
            f"an int <= {at_most}" if at_least is None else f"an int from {at_least} to {at_most}"
        )
    if at_least == 1:
        return "a positive int"
    if at_least == 0:
        return "a non-negative int"
    return f"an int >= {at_least}"


def loader_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The DataLoader options torch compares or tests for truth, checked and made builtins
    (torch would take ``persistent_workers="false"`` for True, and fail on ``num_workers="2"``
    with ``'<' not supported between 'str' and 'int'``)."""
    checked = dict(options)
    if "num_workers" in checked:
        checked["num_workers"] = whole("num_workers", checked["num_workers"], at_least=0)
    for name in ("persistent_workers", "pin_memory"):
        if name in checked:
            checked[name] = flag(name, checked[name])
    if checked.get("prefetch_factor") is not None:
        checked["prefetch_factor"] = whole(
            "prefetch_factor", checked["prefetch_factor"], at_least=1
        )
    if "timeout" in checked:
        checked["timeout"] = seconds("timeout", checked["timeout"])
    return checked


def seconds(name: str, value: object) -> float:
    """A non-negative number of seconds (an int or a float, numpy's too)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise TypeError(
            f"{name} must be a number of seconds, got {_received(value)}"
            f"{_parse_hint(value, 'float')}"
        )
    if not value >= 0:  # NaN too
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    return float(value)
