"""Building the dataset index: list the files, read their footers, cut the splits.

This is the only planning step that does I/O. Footers are read once, in parallel, and travel
with the index to workers, which never read them again. Footers already in the local index
cache (``index.cache``) are not read at all; only new or changed files are. Under a
``torch.distributed`` process group whose ranks are the dataset's, rank 0 alone reads them and
hands the index to the others: the dataset passes the group's collectives in (a ``Job``, which
``checkpoint.distributed`` is), and this module calls no collective of its own.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import pyarrow as pa
from tqdm.auto import tqdm

from ..base.errors import DataSourceError
from ..base.log import log, some_names
from ..formats import FileFormat, FileMetadata
from ..storage.filesystem import FileEntry, Storage
from .cache import IndexCache, open_cache, warn_once
from .footers import TailFile, content_fingerprint
from .index import DatasetIndex, IndexedFile, digest
from .parsed import serialized
from .schema import common_schema
from .splits import Split, cut_splits

__all__ = ["Job", "build_index"]

T = TypeVar("T")


class Job(Protocol):
    """The collectives over a job's ranks that indexing once per job needs."""

    def on_every_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        ...

    def from_rank_zero(self, compute: Callable[[], T]) -> T:
        """``compute()`` run on rank 0 only, its value (or its error) on every rank."""
        ...


_PROGRESS_MIN_FILES = 64
_MAX_READ_THREADS = 32
# Rows one split may hold (a unit this long is more than any row group a writer makes).
MAX_SPLIT_ROWS = 1 << 30
# Distinct schemas looked for when sharing one object among equal ones (usually there is one).
_SHARED_SCHEMAS = 8


def build_index(
    storage: Storage,
    fmt: FileFormat,
    paths: str | Sequence[str],
    columns: Sequence[str] | None,
    split_bytes: int,
    *,
    job: Job | None = None,
) -> DatasetIndex:
    """List ``paths``, read the footers not cached (thread pool, progress bar), cut splits.

    With ``job`` (the dataset's ranks are a process group's, and ``share_index=True``) only
    rank 0 reads footers; the others take its index if they list the same objects (they always
    list, which is cheap, so that no rank reads files it did not see).
    """
    if job is not None:
        return _index_once_per_job(storage, fmt, paths, columns, split_bytes, job)
    entries = storage.list_files(paths, extensions=fmt.extensions)
    return _index_of(storage, fmt, entries, columns, split_bytes)


def _index_once_per_job(
    storage: Storage,
    fmt: FileFormat,
    paths: str | Sequence[str],
    columns: Sequence[str] | None,
    split_bytes: int,
    job: Job,
) -> DatasetIndex:
    """Rank 0's index on every rank that lists the same objects; the others build their own.

    When every rank finds every footer in its index cache, each builds from it: that is
    cheaper than pickling the index on rank 0 and unpickling it everywhere.
    """
    listed: list[FileEntry] | Exception
    cached = None
    try:
        listed = storage.list_files(paths, extensions=fmt.extensions)
        key = _listing_key(storage, fmt, listed, columns, split_bytes)
        cached = _all_cached(storage, fmt, listed)
    except Exception as exc:  # every rank must still join the collectives, or the others hang
        listed, key = exc, ""
    if job.on_every_rank(cached is not None) and cached and not isinstance(listed, Exception):
        return _assemble(storage, listed, cached, columns, split_bytes)

    def build() -> tuple[str, DatasetIndex]:
        if isinstance(listed, Exception):
            raise listed
        return key, _index_of(storage, fmt, listed, columns, split_bytes)

    theirs, index = job.from_rank_zero(build)
    if isinstance(listed, Exception):
        raise listed
    if theirs == key:
        return index
    names = some_names([storage.display(e.path) for e in listed])
    log.info(
        "this rank lists other objects (%s) than rank 0, or with other sizes, versions or "
        "settings; it reads their footers itself",
        names,
    )
    return _index_of(storage, fmt, listed, columns, split_bytes)


def _listing_key(
    storage: Storage,
    fmt: FileFormat,
    entries: list[FileEntry],
    columns: Sequence[str] | None,
    split_bytes: int,
) -> str:
    """Everything an index is a function of: the listed objects and the settings."""
    head = [storage.namespace, fmt.name, repr(None if columns is None else list(columns))]
    head.append(str(split_bytes))
    return digest(head + [f"{e.path}\0{e.size}\0{e.version}" for e in entries])


def _index_of(
    storage: Storage,
    fmt: FileFormat,
    entries: list[FileEntry],
    columns: Sequence[str] | None,
    split_bytes: int,
) -> DatasetIndex:
    """The index of listed ``entries``: footers (cache, else storage), names, schema, splits."""
    return _assemble(storage, entries, _metadata(storage, fmt, entries), columns, split_bytes)


def _assemble(
    storage: Storage,
    entries: list[FileEntry],
    found: list[Found],
    columns: Sequence[str] | None,
    split_bytes: int,
) -> DatasetIndex:
    """The index of ``entries`` whose metadata and fingerprints are ``found``."""
    root = _root([e.path for e in entries])
    files = tuple(
        IndexedFile(
            path=e.path,
            display=storage.display(e.path),
            name=_state_name(e.path[len(root) :].lstrip("/"), local=storage.is_local),
            fingerprint=fingerprint,
            metadata=meta,
        )
        for e, (meta, fingerprint) in zip(entries, found, strict=True)
    )
    schema = common_schema(files, columns)
    splits = cut_splits(
        [f.metadata.unit_bytes for f in files], [f.metadata.unit_rows for f in files], split_bytes
    )
    _check_rows(files, splits)
    return DatasetIndex(files, tuple(splits), schema, storage.display(root))


def _state_name(name: str, *, local: bool) -> str:
    """A file's name in states: without a URL's query, which holds a presigned URL's signature
    and credential or a SAS token (a state never holds a secret; the object signed anew is the
    same file)."""
    return name if local else name.split("?", 1)[0]


def _root(paths: Sequence[str]) -> str:
    """The deepest directory that holds every one of ``paths`` (``""``: none in common)."""
    parents = [p.split("/")[:-1] for p in paths]
    first, last = min(parents), max(parents)  # what all share, these two share
    pairs = enumerate(zip(first, last, strict=False))
    same = next((i for i, (a, b) in pairs if a != b), len(first))
    return "/".join(first[:same])


Found = tuple[FileMetadata, str]  # metadata and content fingerprint


def _metadata(storage: Storage, fmt: FileFormat, entries: list[FileEntry]) -> list[Found]:
    """Every entry's metadata and fingerprint: from the index cache where still valid, else
    from storage."""
    cache = open_cache()
    try:
        found = _cached(cache, storage, fmt, entries)
        missing = [i for i, m in enumerate(found) if m is None]
        read = [
            (serialized(meta, fmt), fingerprint)
            for meta, fingerprint in _shared_schemas(
                _read_all(storage, fmt, [entries[i] for i in missing])
            )
        ]
        if cache is not None and missing:
            _store(
                cache, storage, fmt, [(entries[i], *m) for i, m in zip(missing, read, strict=True)]
            )
    finally:
        if cache is not None:
            cache.close()
    for i, meta in zip(missing, read, strict=True):
        found[i] = meta
    if cache is not None:
        log.info(
            "index cache %s: %d of %d footer(s) cached, %d read from storage",
            cache.path, len(entries) - len(missing), len(entries), len(missing),
        )  # fmt: skip
    return found  # type: ignore[return-value]


def _all_cached(storage: Storage, fmt: FileFormat, entries: list[FileEntry]) -> list[Found] | None:
    """Every entry's metadata from the index cache, or ``None`` if any is not there."""
    cache = open_cache()
    if cache is None:
        return None
    try:
        found = _cached(cache, storage, fmt, entries)
    finally:
        cache.close()
    if any(f is None for f in found):
        return None
    log.info("index cache %s: all %d footer(s) cached", cache.path, len(entries))
    return found  # type: ignore[return-value]


def _shared_schemas(found: list[Found]) -> list[Found]:
    """Equal schemas as one object, so that an index pickles each once (to spawned workers and
    other ranks: unpickling a schema per file took ~1 s per 3,000 files)."""
    seen: list[pa.Schema] = []
    shared = []
    for meta, fingerprint in found:
        same = next((s for s in seen if s.equals(meta.schema, check_metadata=True)), None)
        if same is None and len(seen) < _SHARED_SCHEMAS:
            seen.append(meta.schema)
        elif same is not None and same is not meta.schema:
            meta = dataclasses.replace(meta, schema=same)
        shared.append((meta, fingerprint))
    return shared


def _cached(
    cache: IndexCache | None, storage: Storage, fmt: FileFormat, entries: list[FileEntry]
) -> list[Found | None]:
    if cache is None:
        return [None] * len(entries)
    try:
        return cache.get(storage.namespace, fmt, entries)
    except (sqlite3.Error, OSError, ValueError, pa.ArrowException) as exc:
        warn_once(f"index cache {cache.path} cannot be read ({exc}); indexing from storage")
        return [None] * len(entries)


def _store(
    cache: IndexCache,
    storage: Storage,
    fmt: FileFormat,
    items: list[tuple[FileEntry, FileMetadata, str]],
) -> None:
    try:
        cache.put(storage.namespace, fmt, items)
    except (sqlite3.Error, OSError, ValueError, pa.ArrowException) as exc:
        warn_once(f"index cache {cache.path} cannot be written ({exc})")


def _read_all(storage: Storage, fmt: FileFormat, entries: list[FileEntry]) -> list[Found]:
    """Footers of ``entries`` read in parallel, with a progress bar on long lists."""
    if not entries:
        return []
    with ThreadPoolExecutor(min(_MAX_READ_THREADS, len(entries))) as pool:
        return list(
            tqdm(
                pool.map(lambda e: _read_metadata(storage, fmt, e), entries),
                total=len(entries),
                desc="indexing files",
                unit="file",
                # only on a terminal (None), and only once per machine
                disable=len(entries) < _PROGRESS_MIN_FILES or _local_rank() != 0 or None,
                file=sys.stderr,
            )
        )


def _check_rows(files: Sequence[IndexedFile], splits: Sequence[Split]) -> None:
    """A split of more rows than positions can address is a corrupted (or absurd) footer."""
    for split in splits:
        if split.row_length > MAX_SPLIT_ROWS:
            file = files[split.file]
            raise DataSourceError(
                f"{file.display}: units {split.units.start}..{split.units.stop - 1} claim "
                f"{split.row_length} rows, more than the {MAX_SPLIT_ROWS} one split may hold; "
                f"the footer is likely corrupted (or write smaller row groups / record batches)"
            )


def _local_rank() -> int:
    """This process's rank on its machine (torchrun's ``LOCAL_RANK``), 0 without one."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def _read_metadata(storage: Storage, fmt: FileFormat, entry: FileEntry) -> Found:
    """The entry's metadata and content fingerprint; its footer region is fetched once."""
    display = storage.display(entry.path)
    try:
        with storage.open(entry.path) as source:
            tail = TailFile(source, entry.size, fmt)
            meta = fmt.read_metadata(tail)
            return meta, content_fingerprint(entry.size, tail.footer, meta)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DataSourceError(
            f"cannot read {display} as {fmt.name} (size {entry.size} bytes): {exc}"
        ) from exc
