"""Arguments at the public boundary: builtins in, or an error that names the argument.

Values reach us from config files (strings), numpy (``np.int64``, ``np.bool_``) and arithmetic
(floats). A state must hold builtins only (JSON, ``torch.load(weights_only=True)``), so numpy
integers and booleans are taken and turned into ``int``/``bool`` here; anything else that is
not the type asked for is refused, saying what was received and what is accepted.
"""

from __future__ import annotations

import numpy as np

__all__ = ["flag", "optional_flag", "optional_whole", "whole"]


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
