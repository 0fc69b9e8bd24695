"""What a dataset iterates, built from its arguments: the epochs of one dataset (its index), or
of a mixture (each source's index and epochs, the schedule and timeline), and how to read each
one's files."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..base.args import PathArg, dataset_paths, optional_mapping, optional_whole
from ..base.stages import LISTING, Stage
from ..base.world import World
from ..checkpoint import distributed
from ..formats import get_format
from ..index.build import build_index
from ..index.index import DatasetIndex
from ..mixing.compact import source_seed
from ..mixing.epochs import MixedEpochs
from ..mixing.schedule import MAX_BLOCK, Schedule
from ..mixing.source import (
    MAX_EPOCH_SIZE,
    Source,
    SourceSpec,
    check_policies,
    check_schemas,
    mixture_sources,
    source_column_name,
)
from ..mixing.timeline import Timeline
from ..planning.config import DatasetConfig
from ..planning.epochs import Epochs
from ..planning.text import Tokenize
from ..reading.stream import SourceFiles
from ..storage.filesystem import Storage

__all__ = ["build_epochs"]


def build_epochs(
    path: PathArg | Mapping[str, PathArg | Source],
    config: DatasetConfig,
    *,
    world: World,
    even_batches: bool,
    storage_options: Mapping[str, Any] | None,
    share_index: bool,
    weights: Mapping[str, int] | None,
    epoch_size: int | None,
    source_column: str | None,
    schedule_block: int | None,
) -> tuple[Epochs | MixedEpochs, tuple[SourceFiles, ...]]:
    """The epochs of the dataset at ``path`` (a mapping of source names: a mixture) as
    ``world``'s rank sees them, and how to read each source's files."""
    if isinstance(path, Mapping):
        return _mixture(
            path, weights, config, world=world, even_batches=even_batches,
            storage_options=storage_options, share_index=share_index,
            epoch_size=optional_whole("epoch_size", epoch_size, at_least=1,
                                      at_most=MAX_EPOCH_SIZE),
            source_column=source_column_name(source_column, packed=config.packing is not None),
            schedule_block=optional_whole("schedule_block", schedule_block, at_least=1,
                                          at_most=MAX_BLOCK),
        )  # fmt: skip
    if weights is not None or epoch_size is not None or schedule_block is not None:
        raise TypeError(
            "weights=, epoch_size= and schedule_block= are for a mixture: pass path "
            "as a mapping of source names to paths (docs/mixing.md)"
        )
    index, files = _source(path, config, world, storage_options, share_index)
    epochs = Epochs(
        index=index,
        config=config,
        rank=world.rank,
        world_size=world.world_size,
        even_batches=even_batches,
    )
    return epochs, (files,)


def _source(
    path: object,
    config: DatasetConfig,
    world: World,
    storage_options: Mapping[str, Any] | None,
    share_index: bool,
    source: str | None = None,
) -> tuple[DatasetIndex, SourceFiles]:
    """The index of one dataset's files (a mixture's ``source``), and how to read them."""
    path = dataset_paths("path", path)
    first = path if isinstance(path, str) else next(iter(path), "")
    storage = Storage(first, optional_mapping("storage_options", storage_options))
    fmt = get_format(config.format)
    # a collective only when asked for: the library calls dist.* only where told to
    shared = share_index and distributed.spans_process_group(world.rank, world.world_size)
    job = distributed if shared else None
    with Stage(LISTING):
        index = build_index(storage, fmt, path, config.read_columns, config.split_bytes, job=job)
    if config.tokenize is not None:
        named = "" if source is None else f"source {source!r}: "
        config.tokenize.check(index.schema, f"{named}the files at {storage.display(first)}")
    files = SourceFiles(
        storage=storage,
        fmt=fmt,
        columns=config.read_columns,
        memory_bytes=config.shuffle_memory_bytes,
        tokenize=config.tokenize,
    )
    return index, files


def _mixture(
    paths: Mapping[str, PathArg | Source],
    weights: Mapping[str, int] | None,
    config: DatasetConfig,
    *,
    world: World,
    even_batches: bool,
    storage_options: Mapping[str, Any] | None,
    share_index: bool,
    epoch_size: int | None,
    source_column: str | None,
    schedule_block: int | None,
) -> tuple[MixedEpochs, tuple[SourceFiles, ...]]:
    """The epochs of a mixture of ``paths`` and how to read each source."""
    if config.packing is not None and epoch_size is None:
        raise ValueError(
            "a packed mixture needs epoch_size= (packed sequences per epoch, over all "
            "ranks): how many sequences its sources make depends on their tokens"
        )
    specs = mixture_sources(
        paths, weights, format=config.format, storage_options=storage_options,
        split_bytes=config.split_bytes, shuffle_memory_bytes=config.shuffle_memory_bytes,
    )  # fmt: skip
    sources, files = [], []
    for spec in specs:
        try:
            own = replace(
                config, format=spec.format, split_bytes=spec.split_bytes,
                shuffle_seed=source_seed(config.shuffle_seed, spec.name),
                shuffle_memory_bytes=spec.memory_bytes,
                tokenize=_source_tokenize(config, spec),
            )  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"source {spec.name!r}: {exc}") from exc
        index, opened = _source(spec.path, own, world, spec.storage_options, share_index, spec.name)
        sources.append(
            Epochs(index=index, config=own, rank=world.rank, world_size=world.world_size,
                   even_batches=False)
        )  # fmt: skip
        files.append(opened)
    names = tuple(spec.name for spec in specs)
    check_schemas(names, [epochs.schema for epochs in sources])  # as delivered: tokens
    if source_column is not None and source_column in sources[0].index.schema.names:
        raise ValueError(
            f"the sources have a column {source_column!r}, the name of the column that "
            f"tells each row's source: pass source_column= another name"
        )
    total = sum(int(epochs.index.split_rows.sum()) for epochs in sources)
    schedule = Schedule(
        tuple(spec.weight for spec in specs), block=schedule_block or 0,
        seed=config.shuffle_seed,
    )  # fmt: skip
    timeline = Timeline(
        names,
        schedule,
        total if epoch_size is None else epoch_size,
        max_epochs=tuple(spec.max_epochs for spec in specs),
        stops=tuple(spec.stops for spec in specs),
    )
    check_policies(
        specs,
        schedule_block=schedule_block,
        packed=config.packing is not None,
        lockstep=even_batches and world.world_size > 1,
    )
    mix = MixedEpochs(
        timeline=timeline,
        sources=tuple(sources),
        source_names=names,
        config=config,
        rank=world.rank,
        world_size=world.world_size,
        even_batches=even_batches,
        source_column=source_column,
        sharing=tuple(spec.shares_budget for spec in specs),
    )
    return mix, tuple(files)


def _source_tokenize(config: DatasetConfig, spec: SourceSpec) -> Tokenize | None:
    """How a source tokenizes: the mixture's ``Tokenize``, on the source's own text column and
    (a chat) with its own message fields and roles (its fingerprint covers them)."""
    tokenize = config.tokenize
    if spec.text_column is None and not spec.chat_fields:
        return tokenize
    if spec.chat_fields and (tokenize is None or tokenize.chat is None):
        raise ValueError(
            f"{' and '.join(spec.chat_fields)} describe the source's conversations, but the "
            f"mixture renders none: pass tokenize=Tokenize(..., chat_template=...)"
        )
    if tokenize is None:
        raise ValueError(
            f"text_column={spec.text_column!r} names a text column to tokenize, but the mixture "
            f"has no tokenize=Tokenize(...)"
        )
    column = tokenize.column if spec.text_column is None else spec.text_column
    return replace(tokenize, column=column, **spec.chat_fields)
