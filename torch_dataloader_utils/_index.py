"""The dataset index: listed files, their footers and fingerprints, and the splits cut from them.

This is the only planning step that does I/O. Footers are read once, in parallel, and travel
with the index to workers, which never read them again. Footers already in the local index
cache (``_cache``) are not read at all; only new or changed files are.
"""

from __future__ import annotations

import math
import os
import sqlite3
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import xxhash
from tqdm.auto import tqdm

from ._cache import IndexCache, open_cache, warn_once
from ._convert import converted_row_bytes
from ._errors import DataSourceError, SchemaMismatchError
from ._formats import FileFormat, FileMetadata
from ._interleave import MAX_PIECE_ROWS
from ._log import log
from ._plan import Split, cut_splits
from ._storage import FileEntry, Storage

__all__ = ["DatasetIndex", "IndexedFile", "build_index"]

_PROGRESS_MIN_FILES = 64
_MAX_READ_THREADS = 32
# Rows one split may hold (a shuffle window's positions are exact integer arithmetic below it).
MAX_SPLIT_ROWS = MAX_PIECE_ROWS
# A state names at most this many groups of files, so its size does not grow with the file count.
MAX_FILE_GROUPS = 256


@dataclass(frozen=True)
class IndexedFile:
    path: str
    display: str
    fingerprint: str
    metadata: FileMetadata


@dataclass(frozen=True)
class DatasetIndex:
    files: tuple[IndexedFile, ...]
    splits: tuple[Split, ...]
    schema: pa.Schema

    def row_bytes(self) -> int:
        """Estimated decoded bytes per row of the projected columns (for memory budgets)."""
        rows = sum(f.metadata.num_rows for f in self.files)
        stored = sum(sum(f.metadata.unit_bytes) for f in self.files)
        return max(converted_row_bytes(self.schema), -(-stored // max(1, rows)), 1)

    @cached_property
    def split_rows(self) -> npt.NDArray[np.int64]:
        return np.array([s.row_length for s in self.splits], dtype=np.int64)

    @cached_property
    def digest(self) -> str:
        """Content address of the whole file list (paths and fingerprints, in order)."""
        return _digest(f"{f.display}\0{f.fingerprint}" for f in self.files)

    def file_groups(self) -> list[list[object]]:
        """``[first path, last path, count, digest]`` for up to ``MAX_FILE_GROUPS`` file runs."""
        return [list(group) for group in self._file_groups]

    @cached_property
    def _file_groups(self) -> tuple[tuple[object, ...], ...]:
        size = max(1, math.ceil(len(self.files) / MAX_FILE_GROUPS))
        runs = [self.files[i : i + size] for i in range(0, len(self.files), size)]
        return tuple(
            (run[0].display, run[-1].display, len(run), _digest(f.fingerprint for f in run))
            for run in runs
        )

    @cached_property
    def _splits_by_range(self) -> dict[tuple[str, int, int], int]:
        return {
            (self.files[s.file].display, s.row_offset, s.row_length): i
            for i, s in enumerate(self.splits)
        }

    def split_at(self, path: str, row_offset: int, row_length: int) -> int | None:
        """The split a state names by ``(path, row_offset, row_length)``, if there is one."""
        return self._splits_by_range.get((path, row_offset, row_length))

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
) -> DatasetIndex:
    """List ``paths``, read the footers not cached (thread pool, progress bar), cut splits."""
    entries = storage.list_files(paths, extensions=fmt.extensions)
    metas = _metadata(storage, fmt, entries)
    files = tuple(
        IndexedFile(e.path, storage.display(e.path), _fingerprint(e, m), m)
        for e, m in zip(entries, metas, strict=True)
    )
    schema = _common_schema(files, columns)
    splits = cut_splits(
        [f.metadata.unit_bytes for f in files], [f.metadata.unit_rows for f in files], split_bytes
    )
    _check_rows(files, splits)
    return DatasetIndex(files, tuple(splits), schema)


def _metadata(storage: Storage, fmt: FileFormat, entries: list[FileEntry]) -> list[FileMetadata]:
    """Every entry's metadata: from the index cache where still valid, else from storage."""
    cache = open_cache()
    try:
        found = _cached(cache, storage, fmt, entries)
        missing = [i for i, m in enumerate(found) if m is None]
        read = _read_all(storage, fmt, [entries[i] for i in missing])
        if cache is not None and missing:
            _store(
                cache, storage, fmt, [(entries[i], m) for i, m in zip(missing, read, strict=True)]
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


def _cached(
    cache: IndexCache | None, storage: Storage, fmt: FileFormat, entries: list[FileEntry]
) -> list[FileMetadata | None]:
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
    items: list[tuple[FileEntry, FileMetadata]],
) -> None:
    try:
        cache.put(storage.namespace, fmt, items)
    except (sqlite3.Error, OSError, ValueError, pa.ArrowException) as exc:
        warn_once(f"index cache {cache.path} cannot be written ({exc})")


def _read_all(storage: Storage, fmt: FileFormat, entries: list[FileEntry]) -> list[FileMetadata]:
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


def _read_metadata(storage: Storage, fmt: FileFormat, entry: FileEntry) -> FileMetadata:
    display = storage.display(entry.path)
    try:
        with storage.open(entry.path) as source:
            return fmt.read_metadata(source)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DataSourceError(
            f"cannot read {display} as {fmt.name} (size {entry.size} bytes): {exc}"
        ) from exc


def _fingerprint(entry: FileEntry, meta: FileMetadata) -> str:
    """xxhash of size, version tag (ETag/mtime) and the footer's unit layout."""
    return _digest(
        [
            str(entry.size),
            entry.version,
            ",".join(map(str, meta.unit_rows)),
            ",".join(map(str, meta.unit_bytes)),
        ]
    )


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
    names = dict.fromkeys(expected.names + found.names)
    diffs = []
    for name in names:
        a = expected.field(name).type if name in expected.names else "missing"
        b = found.field(name).type if name in found.names else "missing"
        if str(a) != str(b):
            diffs.append(f"field {name!r}: {a} vs {b}")
    return "; ".join(diffs) or "field order or nullability differs"
