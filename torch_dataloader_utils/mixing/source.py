"""``Source``: one named dataset of a mixture, and the checks of a mixture's arguments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from ..base.args import (
    PathArg,
    dataset_paths,
    optional_mapping,
    optional_name,
    optional_whole,
    whole,
)
from ..base.errors import SchemaMismatchError
from ..formats import get_format
from ..index.schema import column_differences
from ..planning.chat import check_roles
from ..planning.config import MIN_SHUFFLE_MEMORY_BYTES
from ..planning.tokens import PACKED_KEYS

__all__ = [
    "MAX_EPOCH_SIZE",
    "Source",
    "SourceSpec",
    "check_policies",
    "check_schemas",
    "mixture_sources",
    "source_budget",
    "source_column_name",
]

# Positions of a mixture epoch, at most (``epoch_size``, and a state's): far beyond any job,
# well within int64.
MAX_EPOCH_SIZE = 2**48


@dataclass(frozen=True, kw_only=True)
class Source:
    """A dataset of a mixture where it differs from the others: its files, and (``None``: the
    dataset's argument) its format, storage options, split size and shuffle memory budget.

    ``create_dataloader({"web": Source(path="s3://web/", storage_options=...), "code":
    "data/code/"}, weights={"web": 7, "code": 3})``; a plain path stands for ``Source(path=...)``.

    A source cycles through its epochs; with ``max_epochs`` each stream reads at most that many
    epochs of it, and then ``when_exhausted="renormalize"`` lets the other sources go on under
    their own weights, ``"stop"`` ends the stream.

    Each source shuffles in windows of its own: those without their own
    ``shuffle_memory_bytes`` share the mixture's equally (``source_budget``), so a stream holds
    up to the mixture's budget and the sources' own (``docs/mixing.md``).

    ``text_column`` names the source's text column when the mixture tokenizes
    (``tokenize=Tokenize(...)``) and the source's differs from ``Tokenize.column``. For chat
    (``Tokenize(..., chat_template=...)``), ``role_field``, ``content_field`` and ``roles`` are
    the source's own where they differ from ``Tokenize``'s: a ShareGPT source (``from`` /
    ``value``, ``human`` / ``gpt``) beside a Hugging Face one (``docs/chat.md``).
    """

    path: PathArg
    format: str | None = None
    storage_options: Mapping[str, Any] | None = None
    split_bytes: int | None = None
    shuffle_memory_bytes: int | None = None
    max_epochs: int | None = None
    when_exhausted: str = "renormalize"
    text_column: str | None = None
    role_field: str | None = None
    content_field: str | None = None
    roles: Mapping[str, str] | None = None


@dataclass(frozen=True)
class SourceSpec:
    """A source as the dataset builds it: its name, weight and resolved arguments."""

    name: str
    weight: int
    path: str | Sequence[str]
    format: str
    storage_options: Mapping[str, Any] | None
    split_bytes: int
    memory_bytes: int
    max_epochs: int | None
    stops: bool
    text_column: str | None = None
    shares_budget: bool = True  # a share of the mixture's ``shuffle_memory_bytes``, not its own
    chat_fields: Mapping[str, Any] = field(default_factory=dict)  # Tokenize's, where its own


def mixture_sources(
    paths: Mapping[str, PathArg | Source],
    weights: Mapping[str, int] | None,
    *,
    format: str,
    storage_options: Mapping[str, Any] | None,
    split_bytes: int,
    shuffle_memory_bytes: int,
) -> tuple[SourceSpec, ...]:
    """The sources of ``paths``, in its order, with ``weights``: one positive int per name."""
    if not paths:
        raise ValueError("a mixture needs at least one source; got an empty mapping")
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"a mixture of sources {list(paths)} needs weights=, one int per source, e.g. "
            f"weights={{{', '.join(f'{n!r}: 1' for n in paths)}}}; got {weights!r:.80}"
        )
    names = list(paths)
    if set(weights) != set(names):
        raise ValueError(
            f"weights name sources {list(weights)}, but the mixture has sources {names}: "
            f"give one weight per source (missing {[n for n in names if n not in weights]}, "
            f"unknown {[n for n in weights if n not in paths]})"
        )
    given = {n: p if isinstance(p, Source) else Source(path=p) for n, p in paths.items()}
    sharing = sum(source.shuffle_memory_bytes is None for source in given.values())
    share = source_budget(shuffle_memory_bytes, sharing)
    specs = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"source names must be non-empty strings, got {name!r}")
        source = given[name]
        specs.append(
            SourceSpec(
                name=name,
                weight=whole(f"weights[{name!r}]", weights[name], at_least=1),
                path=dataset_paths(f"the path of source {name!r}", source.path),
                format=format if source.format is None else _format(name, source.format),
                storage_options=storage_options
                if source.storage_options is None
                else optional_mapping(
                    f"storage_options of source {name!r}", source.storage_options
                ),
                split_bytes=split_bytes
                if source.split_bytes is None
                else whole(f"split_bytes of source {name!r}", source.split_bytes, at_least=1),
                memory_bytes=share
                if source.shuffle_memory_bytes is None
                else whole(
                    f"shuffle_memory_bytes of source {name!r}",
                    source.shuffle_memory_bytes,
                    at_least=1,
                ),
                max_epochs=optional_whole(
                    f"max_epochs of source {name!r}", source.max_epochs, at_least=1
                ),
                stops=_stops(name, source.when_exhausted),
                text_column=optional_name(f"text_column of source {name!r}", source.text_column),
                shares_budget=source.shuffle_memory_bytes is None,
                chat_fields=_chat_fields(name, source),
            )
        )
    return tuple(specs)


def _chat_fields(name: str, source: Source) -> dict[str, Any]:
    """The chat arguments ``source`` gives (``Tokenize``'s names), checked."""
    check_roles(f"roles of source {name!r}", source.roles)
    fields = {key: optional_name(f"{key} of source {name!r}", getattr(source, key))
              for key in ("role_field", "content_field")}  # fmt: skip
    given = {key: value for key, value in fields.items() if value is not None}
    return given if source.roles is None else {**given, "roles": dict(source.roles)}


def source_budget(budget: int, sharing: int) -> int:
    """The shuffle memory of each of ``sharing`` sources that share a stream's ``budget``: an
    equal part, at least the minimum (``MIN_SHUFFLE_MEMORY_BYTES``)."""
    return max(MIN_SHUFFLE_MEMORY_BYTES, budget // max(1, sharing))


def _format(name: str, format: object) -> str:
    """A source's ``format``: the name of a supported one."""
    if not isinstance(format, str):
        raise TypeError(f"format of source {name!r} must be a str, got {format!r:.80}")
    try:
        get_format(format)
    except ValueError as exc:
        raise ValueError(f"format of source {name!r}: {exc}") from None
    return format


def source_column_name(value: object, *, packed: bool) -> str | None:
    """``source_column`` checked: ``None``, or a name; not a key of a packed batch (nor, once
    the sources' columns are known, one of them)."""
    name = optional_name("source_column", value)
    if packed and name in PACKED_KEYS:
        raise ValueError(
            f"source_column={name!r} is a key of a packed batch ({', '.join(PACKED_KEYS)}): "
            f"pass source_column= another name"
        )
    return name


def _stops(name: str, policy: object) -> bool:
    if policy not in _POLICIES:
        raise ValueError(
            f"when_exhausted of source {name!r} must be one of {list(_POLICIES)}, got {policy!r}"
        )
    return policy == "stop"


_POLICIES = ("renormalize", "stop")


def check_policies(
    specs: Sequence[SourceSpec], *, schedule_block: int | None, packed: bool, lockstep: bool
) -> None:
    """Refuse exhaustion policies the mixture cannot honour: packed (a source runs out when
    its tokens do, known only by reading), or ending streams at different batches under DDP."""
    limited = [spec.name for spec in specs if spec.max_epochs is not None]
    if not limited:
        return
    if schedule_block:
        raise ValueError(
            "schedule_block with max_epochs is not supported: where a source runs out is "
            "closed-form arithmetic on the schedule in order"
        )
    if packed:
        raise ValueError(
            f"max_epochs with packing is not supported yet (sources {limited}): "
            f"a packed source runs out when its tokens do"
        )
    if lockstep and (any(spec.stops for spec in specs) or len(limited) == len(specs)):
        raise ValueError(
            "under DDP with even_batches, a mixture's streams must not end (each would end at "
            "its own batch, and DDP would hang): let at least one source cycle (no "
            "max_epochs) and use when_exhausted='renormalize'"
        )


def check_schemas(names: Sequence[str], schemas: Sequence[pa.Schema]) -> None:
    """Every source holds the first's columns with the same types and nullability: the rule of
    one dataset's files (``index.schema.column_differences``), but in any order, since a mixture
    joins its sources' columns by name. Otherwise an error naming both sources and the column."""
    first, reference = names[0], schemas[0]
    for name, schema in zip(names[1:], schemas[1:], strict=True):
        if schema.equals(reference):
            continue  # the same order too: columns of one name are joined by their place
        for column, ours, theirs in column_differences(reference, schema)[:1]:
            raise SchemaMismatchError(
                f"sources {first!r} and {name!r} differ in column {column!r}: {ours} in "
                f"{first!r}, {theirs} in {name!r}; pass columns= to read the columns they "
                f"agree on, or rewrite one source's files with the other's schema"
            )
        twice = next((c for c in reference.names if reference.names.count(c) > 1), None)
        if twice is not None:
            raise SchemaMismatchError(
                f"sources {first!r} and {name!r} hold their columns in different orders and "
                f"two columns named {twice!r}: a mixture joins its sources' columns by name; "
                f"rename the columns in the data, or pass columns= without {twice!r}"
            )
