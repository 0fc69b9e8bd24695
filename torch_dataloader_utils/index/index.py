"""The dataset index: listed files, their footers and fingerprints, and the splits cut from them.

This is the only planning step that does I/O. Footers are read once, in parallel, and travel
with the index to workers, which never read them again. Footers already in the local index
cache (``index.cache``) are not read at all; only new or changed files are. Under a
``torch.distributed`` process group whose ranks are the dataset's, rank 0 alone reads them and
hands the index to the others: the dataset passes the group's collectives in (a ``Job``, which
``checkpoint.distributed`` is), and this module calls no collective of its own.

Files are named in states relative to the dataset's *root*, the deepest directory holding them
all, so a copy of the files elsewhere (another node, a local copy of an S3 prefix) has the same
names; with content fingerprints (``index.footers``) a checkpoint resumes on it.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import os
import sqlite3
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import xxhash
from tqdm.auto import tqdm

from ..base.errors import DataSourceError, SchemaMismatchError
from ..base.log import log, some_names
from ..base.row_bytes import converted_row_bytes
from ..formats import FileFormat, FileMetadata
from ..storage.filesystem import FileEntry, Storage
from .cache import IndexCache, open_cache, warn_once
from .footers import TailFile, content_fingerprint
from .splits import Split, cut_splits

__all__ = ["DatasetIndex", "IndexedFile", "Job", "build_index", "column_differences"]

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
# The unit starts of a split of one unit (read-only: shared).
_ONE_UNIT = np.zeros(1, dtype=np.int64)
_ONE_UNIT.flags.writeable = False
# A state names at most this many groups of files, so its size does not grow with the file count.
MAX_FILE_GROUPS = 256
# Distinct schemas looked for when sharing one object among equal ones (usually there is one).
_SHARED_SCHEMAS = 8


@dataclass(frozen=True)
class IndexedFile:
    """A file: its filesystem path, display path (messages), name below the dataset root
    (states) and content fingerprint."""

    path: str
    display: str
    name: str
    fingerprint: str
    metadata: FileMetadata


@dataclass(frozen=True)
class DatasetIndex:
    files: tuple[IndexedFile, ...]
    splits: tuple[Split, ...]
    schema: pa.Schema
    root: str = ""  # display path of the directory the names are relative to (messages only)

    def row_bytes(self) -> int:
        """Estimated decoded bytes per row of the projected columns (for memory budgets)."""
        return self._row_bytes

    @cached_property
    def file_row_bytes(self) -> int:
        """Estimated decoded bytes per row of the files, all columns (sizes shuffle windows:
        the same whatever the projection, so a checkpoint's plan does not hang on it)."""
        full = converted_row_bytes(self.files[0].metadata.schema) if self.files else 0
        return max(full, self._stored_row_bytes, 1)

    @cached_property
    def _stored_row_bytes(self) -> int:
        rows = sum(f.metadata.num_rows for f in self.files)
        stored = sum(sum(f.metadata.unit_bytes) for f in self.files)
        return -(-stored // max(1, rows))

    @cached_property
    def _row_bytes(self) -> int:
        """``row_bytes``, summed over the files once."""
        return max(converted_row_bytes(self.schema), self._stored_row_bytes, 1)

    def unit_starts(self, split: int) -> npt.NDArray[np.int64]:
        """The first row of each unit of ``split``, relative to the split's first row."""
        units = self.splits[split].units
        if len(units) == 1:
            return _ONE_UNIT
        rows = self.files[self.splits[split].file].metadata.unit_rows[units.start : units.stop]
        return np.cumsum((0, *rows[:-1]), dtype=np.int64)

    @cached_property
    def split_rows(self) -> npt.NDArray[np.int64]:
        return np.array([s.row_length for s in self.splits], dtype=np.int64)

    def units(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Every unit that has rows, in split order: its split and its first row relative to
        the split. Splits cover the files' rows front to back on unit boundaries, so a unit's
        split is found by its row among the splits' (numpy over the units, nothing kept)."""
        rows = np.fromiter(
            itertools.chain.from_iterable(f.metadata.unit_rows for f in self.files), np.int64
        )
        starts = np.cumsum(rows)
        starts -= rows
        starts = starts[rows > 0]
        del rows
        split_starts = np.cumsum(self.split_rows) - self.split_rows
        split = np.searchsorted(split_starts, starts, side="right") - 1
        return split, starts - split_starts[split]

    @cached_property
    def digest(self) -> str:
        """Content address of the whole file list (names and fingerprints, in order)."""
        return _digest(f"{f.name}\0{f.fingerprint}" for f in self.files)

    def file_groups(self, groups: int = MAX_FILE_GROUPS, *, size: int = 0) -> list[list[object]]:
        """``[first name, last name, count, digest]`` for up to ``groups`` file runs (or runs of
        ``size`` files: how a stored state grouped them)."""
        size = size or self.group_size(groups)
        if size not in self._file_groups:
            runs = [self.files[i : i + size] for i in range(0, len(self.files), size)]
            self._file_groups[size] = tuple(
                (run[0].name, run[-1].name, len(run), _digest(f.fingerprint for f in run))
                for run in runs
            )
        return [list(group) for group in self._file_groups[size]]

    def group_size(self, groups: int) -> int:
        """Files of a run when the files make at most ``groups`` runs."""
        return max(1, math.ceil(len(self.files) / max(1, groups)))

    @cached_property
    def _file_groups(self) -> dict[int, tuple[tuple[object, ...], ...]]:
        """The groups of runs of each size asked for (a state is written at every step)."""
        return {}

    @cached_property
    def _file_by_name(self) -> dict[str, int]:
        return {f.name: i for i, f in enumerate(self.files)}

    @cached_property
    def _split_files(self) -> npt.NDArray[np.int64]:
        """Every split's file, in split order (which sorts them)."""
        return np.fromiter((s.file for s in self.splits), np.int64, len(self.splits))

    def split_at(self, path: str, row_offset: int, row_length: int) -> int | None:
        """The split a state names by ``(path, row_offset, row_length)``, if there is one.

        Splits are cut file by file, front to back, so a binary search finds it: a resume
        costs a lookup per named split, not a dictionary of every split.
        """
        file = self._file_by_name.get(path)
        if file is None:
            return None
        lo, hi = (int(i) for i in np.searchsorted(self._split_files, [file, file + 1]))
        offsets = [s.row_offset for s in self.splits[lo:hi]]  # one file's splits
        at = lo + bisect.bisect_left(offsets, row_offset)
        split = self.splits[at] if at < hi else None
        if split is None or (split.row_offset, split.row_length) != (row_offset, row_length):
            return None
        return at

    def describe(self, split: int) -> str:
        """``path rows [a, b)`` of split ``split``, as messages and states name it."""
        s = self.splits[split]
        return f"{self.files[s.file].display} rows [{s.row_offset}, {s.row_offset + s.row_length})"


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
    return _digest(head + [f"{e.path}\0{e.size}\0{e.version}" for e in entries])


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
    schema = _common_schema(files, columns)
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
        read = _read_all(storage, fmt, [entries[i] for i in missing])
        if cache is not None and missing:
            _store(
                cache, storage, fmt, [(entries[i], *m) for i, m in zip(missing, read, strict=True)]
            )
    finally:
        if cache is not None:
            cache.close()
    for i, meta in zip(missing, _shared_schemas(read), strict=True):
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


def _digest(parts: object) -> str:
    h = xxhash.xxh64()
    for part in parts:  # type: ignore[attr-defined]
        h.update(str(part).encode())
        h.update(b"\x1f")
    return h.hexdigest()


def _common_schema(files: Sequence[IndexedFile], columns: Sequence[str] | None) -> pa.Schema:
    """The projected schema shared by all files; names both files and fields when they differ."""
    first = files[0]
    reference = _project(first, columns)
    for other in files[1:]:
        schema = _project(other, columns)
        if not schema.equals(reference):
            raise SchemaMismatchError(
                f"schema of {other.display} differs from {first.display}: "
                f"{_schema_diff(reference, schema)}"
            )
    return reference


def _project(file: IndexedFile, columns: Sequence[str] | None) -> pa.Schema:
    schema = file.metadata.schema.remove_metadata()
    if columns is None:
        return schema
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise SchemaMismatchError(
            f"{file.display} has no column(s) {missing}; its columns are {schema.names}"
        )
    twice = [c for c in columns if schema.names.count(c) > 1]
    if twice:
        raise SchemaMismatchError(
            f"{file.display} has more than one column named {twice[0]!r}, so columns= cannot "
            f"select it; rename the columns in the data, or read all with columns=None and "
            f"output='arrow'"
        )
    return pa.schema([schema.field(c) for c in columns])


def _schema_diff(expected: pa.Schema, found: pa.Schema) -> str:
    diffs = [f"field {name!r}: {a} vs {b}" for name, a, b in column_differences(expected, found)]
    return "; ".join(diffs) or "field order differs"


def column_differences(expected: pa.Schema, found: pa.Schema) -> list[tuple[str, str, str]]:
    """The columns, by name, in which two schemas differ: a type, a nullability, or a column
    one of them lacks (or holds twice); each as ``(name, in expected, in found)``. Empty when
    they hold the same columns, whatever their order."""
    diffs = []
    for name in dict.fromkeys(expected.names + found.names):
        a, b = (_named(schema, name) for schema in (expected, found))
        if len(a) != len(b) or not all(x.equals(y) for x, y in zip(a, b, strict=True)):
            diffs.append((name, _kind(a), _kind(b)))
    return diffs


def _named(schema: pa.Schema, name: str) -> list[pa.Field]:
    return [schema.field(i) for i in schema.get_all_field_indices(name)]


def _kind(fields: list[pa.Field]) -> str:
    """A column as a schema difference names it: its type, and ``not null``."""
    if len(fields) != 1:
        return "missing" if not fields else f"{len(fields)} columns of that name"
    field = fields[0]
    return f"{field.type}" if field.nullable else f"{field.type} not null"
