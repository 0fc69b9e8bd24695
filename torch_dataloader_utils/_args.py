"""Arguments at the public boundary: builtins in, or an error that names the argument.

Values reach us from config files (strings), numpy (``np.int64``, ``np.bool_``) and arithmetic
(floats). A state must hold builtins only (JSON, ``torch.load(weights_only=True)``), so numpy
integers and booleans are taken and turned into ``int``/``bool`` here; anything else that is
not the type asked for is refused, saying what was received and what is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["flag", "loader_options", "optional_flag", "optional_whole", "seconds", "whole"]


def whole(name: str, value: object, *, at_least: int | None = None) -> int:
    """``value`` as a builtin int (numpy integers too), at least ``at_least``."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {_received(value)}{_parse_hint(value, 'int')}")
    number = int(value)
    if at_least is not None and number < at_least:
        raise ValueError(f"{name} must be {_int_range(at_least)}, got {number}")
    return number


def optional_whole(name: str, value: object, *, at_least: int | None = None) -> int | None:
    """``whole``, or ``None`` for ``None``."""
    return None if value is None else whole(name, value, at_least=at_least)


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


def _int_range(at_least: int) -> str:
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
