"""How the commands answer: exit statuses, reports as text or JSON, small formatters."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "PROG",
    "Report",
    "emit",
    "percent",
    "share_progress",
    "size",
    "table",
]

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2
PROG = "torch_dataloader_utils"
Report = dict[str, Any]
# Rows of a text table before "... N more": --json lists everything.
_TEXT_ROWS = 64


def emit(report: Report, as_json: bool, render: Callable[[Report], list[str]]) -> None:
    """Print ``report`` as JSON, or as the lines ``render`` makes of it."""
    print(json.dumps(report, indent=2) if as_json else "\n".join(render(report)))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, name: bool) -> list[str]:
    """Aligned columns (a ``name`` first column left, others right); ``_TEXT_ROWS`` rows."""
    shown = [[str(c) for c in r] for r in rows[:_TEXT_ROWS]]
    widths = [max(len(c) for c in column) for column in zip(headers, *shown, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        head = first.ljust(widths[0]) if name else first.rjust(widths[0])
        return "  ".join(["", head, *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))])

    more = [f"  ... {len(rows) - _TEXT_ROWS} more (--json lists all)"] * (len(rows) > _TEXT_ROWS)
    return [line(headers), *map(line, shown), *more]


def size(count: float) -> str:
    """``count`` bytes for people: ``512 B``, ``8.6 KiB``, ``1.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def share_progress(stream: Report) -> str:
    """A worker stream's rows (and tokens) of its share handed out, and the split it reads."""
    rows, share = stream["rows"], stream["share"]
    tokens = f" and {stream['tokens']} tokens" if stream["tokens"] else ""
    at = f", at {stream['split']}" if stream["split"] else ""
    return f"{rows}{tokens} of {share} rows ({percent(rows, share)}){at}"
