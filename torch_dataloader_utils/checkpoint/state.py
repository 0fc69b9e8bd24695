"""A checkpoint state written and read: ``encode`` builds it from the streams' progress, ``decode``
validates it against the dataset and settings and gives that progress back.

The schema, and how a generation is packed, are ``checkpoint.schema``'s; a stream's next split is
stored by its key (``checkpoint.files``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..index.index import DatasetIndex
from .checks import check_setting, check_settings
from .files import check_files, split_key, split_of, stored_split
from .schema import (
    STATE_VERSION,
    Decoded,
    Generation,
    Settings,
    StreamEntry,
    bad_stream,
    check_shape,
    decode_generation,
    encode_generation,
    is_stream,
)

__all__ = [
    "decode",
    "encode",
    "encode_stream",
    "stream_list",
]


def encode(
    *,
    epoch: int,
    streams: Sequence[StreamEntry | None],
    generations: Sequence[Generation],
    cursor: int,
    index: DatasetIndex,
    settings: Settings,
) -> dict[str, Any]:
    """The state dict of an epoch whose streams of this rank stand at ``streams``."""
    return {
        "version": STATE_VERSION,
        "epoch": epoch,
        "_num_workers": settings.num_workers,
        "_shuffle_seed": settings.shuffle_seed,
        "_shuffle": settings.shuffle,
        "_split_bytes": settings.split_bytes,
        "_rank": settings.rank,
        "_world_size": settings.world_size,
        "_format": settings.format,
        "_even_batches": settings.even_batches,
        "_shuffle_memory_bytes": settings.memory_bytes,
        "_shuffle_window_rows": settings.window_rows,
        "_packing": settings.packing,
        "files": {
            "count": len(index.files),
            "digest": index.digest,
            "groups": index.file_groups(),
            "root": index.root,  # where the names were relative to, for messages only
        },
        "num_splits": len(index.splits),
        "streams": [encode_stream(e, index) for e in streams],
        "generations": [encode_generation(g) for g in generations],
        "cursor": cursor,
        # only when tokenizing: the states of datasets that do not stay as they were
        **({} if settings.tokenize is None else {"_tokenize": settings.tokenize}),
        **(
            {}
            if settings.whole_documents is None
            else {"_whole_documents": settings.whole_documents}
        ),
        **({} if settings.companions is None else {"_companions": settings.companions}),
    }


def encode_stream(entry: StreamEntry | None, index: DatasetIndex) -> list[Any] | None:
    if entry is None:
        return None
    return stream_list(entry.position, entry.tokens, entry.rows, entry.next_row, index)


def stream_list(
    position: int, tokens: int, rows: int, next_row: tuple[int, int] | None, index: DatasetIndex
) -> list[Any]:
    """A stream entry as a state writes it (a mixture's, one per source at every call)."""
    if next_row is None:
        return [position, tokens, rows]
    split, row = next_row
    return [position, tokens, rows, *split_key(split, index), row]


def decode(
    state: Mapping[str, Any], *, index: DatasetIndex, settings: Settings, elastic: bool = False
) -> Decoded:
    """Validate ``state`` against the dataset and settings; its generations and streams."""
    check_shape(state)
    check_settings(state, settings, elastic)
    check_files(state, index)
    # rows of a shuffle window, from the budget and the files' bytes per row: compared once
    # the files are known to agree
    check_setting(
        "shuffle_window_rows", state["_shuffle_window_rows"], settings.window_rows,
        stored_split(state),
    )  # fmt: skip
    generations = tuple(decode_generation(g, i) for i, g in enumerate(state["generations"]))
    streams = tuple(_decode_stream(e, i, index) for i, e in enumerate(state["streams"]))
    return Decoded(generations, streams)


def _decode_stream(entry: object, number: int, index: DatasetIndex) -> StreamEntry | None:
    if entry is None:
        return None
    if not (is_stream(entry) and isinstance(entry, list)):
        raise bad_stream(entry, number)
    next_row = None if len(entry) == 3 else (split_of(entry[3:7], index), entry[7])
    return StreamEntry(entry[0], entry[1], entry[2], next_row)
