"""The library's logger, and how its messages name many things in one line.

The logger has a ``NullHandler``: its records reach only the handlers an application configures
(Python's last-resort handler would print WARNINGs to stderr in a script that configured none).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["log", "some_names"]

log = logging.getLogger("torch_dataloader_utils")
log.addHandler(logging.NullHandler())


def some_names(names: Sequence[str], limit: int = 3) -> str:
    """``a, b, c and 4 more``: the first ``limit`` of ``names`` and how many others there are."""
    shown = ", ".join(names[:limit])
    rest = len(names) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown
