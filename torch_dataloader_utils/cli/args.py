"""Options shared by the commands: dataset settings, byte sizes, ``--storage-option KEY=VALUE``."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from typing import Any

from ..planning.config import DEFAULT_SHUFFLE_MEMORY_BYTES, DEFAULT_SPLIT_BYTES
from ..storage.secrets import secret_values
from .files import BadInput

__all__ = [
    "add_settings",
    "add_sources",
    "byte_size",
    "pairs",
    "planned_settings",
    "storage_options",
    "weight",
]


def add_settings(parser: argparse.ArgumentParser, *, plan: bool) -> None:
    """Dataset settings; for inspect/verify they override the checkpoint's (default: its own)."""
    of = "" if plan else " (default: the checkpoint's)"
    parser.add_argument("--format", choices=("parquet", "arrow"), help=f"file format{of}")
    parser.add_argument(
        "--split-bytes",
        type=byte_size,
        metavar="N",
        help=f"split bound in stored bytes, e.g. 4096 or 128MiB{of}",
    )
    parser.add_argument("--world-size", type=int, metavar="N", help=f"DDP ranks{of}")
    parser.add_argument("--num-workers", type=int, metavar="N", help=f"DataLoader workers{of}")
    parser.add_argument(
        "--shuffle", action=argparse.BooleanOptionalAction, help=f"shuffle splits and rows{of}"
    )
    parser.add_argument("--seed", type=int, metavar="N", help=f"shuffle_seed{of}")
    parser.add_argument(
        "--shuffle-memory-bytes",
        type=byte_size,
        metavar="N",
        help=f"decoded bytes a shuffled stream holds, e.g. 256MiB{of}",
    )
    parser.add_argument(
        "--even-batches",
        action=argparse.BooleanOptionalAction,
        help=f"even out ranks (default: on when world size > 1){of}",
    )


def add_sources(parser: argparse.ArgumentParser) -> Any:
    """``--source NAME=PATH`` and ``--weight NAME=N``, repeatable: a mixture instead of PATH
    (the group, for a command's own mixture options)."""
    mixture = parser.add_argument_group("a mixture (instead of PATH)")
    mixture.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                         help="a source of the mixture, repeatable")  # fmt: skip
    mixture.add_argument("--weight", action="append", default=[], metavar="NAME=N",
                         help="its integer weight, one per source")  # fmt: skip
    return mixture


def planned_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``StructuredDataset`` arguments of ``plan``'s options, as rank 0 of the job."""
    return {
        "format": args.format or "parquet",
        "batch_size": args.batch_size,
        "columns": args.columns.split(",") if args.columns else None,
        "shuffle": bool(args.shuffle),
        "shuffle_seed": args.seed or 0,
        "shuffle_memory_bytes": args.shuffle_memory_bytes or DEFAULT_SHUFFLE_MEMORY_BYTES,
        "split_bytes": args.split_bytes or DEFAULT_SPLIT_BYTES,
        "rank": 0,
        "world_size": args.world_size or 1,
        "storage_options": args.storage_options,
        "even_batches": args.even_batches,
    }


def byte_size(text: str) -> int:
    """``4096``, ``64KiB``, ``128M``, ``1gb`` as bytes (binary units)."""
    match = re.fullmatch(r"(\d+) *([kmg]?)(i?b)?", text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected bytes like 4096, 64KiB or 128MiB, got {text!r}")
    return int(match[1]) << (10 * " kmg".index(match[2] or " "))


def pairs(items: Sequence[str], option: str, what: str) -> list[tuple[str, str]]:
    """``NAME=VALUE`` items of ``option`` (``--source NAME=PATH``) as pairs, each name once."""
    found: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise BadInput(f"{option} takes NAME={what}, got {item!r}")
        if name in found:
            raise BadInput(f"{option} names {name!r} twice: give each name once")
        found[name] = value
    return list(found.items())


def weight(text: str) -> int:
    """A mixture source's ``--weight NAME=N`` value: a whole number."""
    if not text.isdigit():
        raise BadInput(f"--weight takes NAME=N with N a whole number, got {text!r}")
    return int(text)


def storage_options(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items as fsspec options; VALUE is JSON if it parses, credentials stay text."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:  # never echo a value: it may be a secret
            raise BadInput(f"--storage-option takes KEY=VALUE, got one without '=' ({key[:20]!r})")
        options[key] = value if _is_credential(key) else _json_or_text(value)
    return options


def _is_credential(key: str) -> bool:
    """Whether the storage layer treats ``key`` as a credential (and redacts its value)."""
    return bool(secret_values({key: "****"}))


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
