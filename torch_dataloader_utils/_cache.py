"""The index cache: parsed footers on local disk, so building a dataset again skips footer reads.

Location: ``$TDU_CACHE_DIR`` if set, else ``~/.cache/torch_dataloader_utils``; one SQLite file,
``index-v1.sqlite``, shared by all datasets, processes and ranks on the machine (WAL mode, so
concurrent builders do not block each other for long). ``TDU_INDEX_CACHE=0`` (or ``off``,
``false``, ``no``) disables it.

One row per (storage namespace, path, format). The row is used only when the file's size and
stamp still equal the stored ones: the version tag (ETag / generation / mtime) and, for local
files, also the change time and inode, which ``utime`` cannot restore. A changed object misses
and its row is replaced; other rows stay valid. Files without a version tag are never cached.

A row holds what planning needs, compactly: unit rows and bytes, a digest naming the file's
Arrow schema (stored once per distinct schema) and the serialized footer. Footers are parsed
lazily (``CachedMetadata.footer``): the main process never parses them, a worker parses only the
footers of files it reads, and nobody reads them from storage again.

The cache is an optimisation: any failure to open, read or write it warns once and indexing
proceeds from storage.
"""

from __future__ import annotations

import os
import pickle
import sqlite3
import threading
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import xxhash

from ._formats import FileMetadata

__all__ = ["CachedMetadata", "IndexCache", "cache_dir", "open_cache"]

_FILENAME = "index-v1.sqlite"
_OFF = frozenset({"0", "off", "false", "no", "disable", "disabled"})
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    namespace TEXT NOT NULL, path TEXT NOT NULL, format TEXT NOT NULL,
    size INTEGER NOT NULL, version TEXT NOT NULL, entry BLOB NOT NULL,
    PRIMARY KEY (namespace, path, format)
);
CREATE TABLE IF NOT EXISTS schemas (digest TEXT PRIMARY KEY, schema BLOB NOT NULL);
"""
_warned = threading.Event()


def cache_dir() -> Path | None:
    """Where the cache lives, or ``None`` when ``TDU_INDEX_CACHE`` disables it."""
    if os.environ.get("TDU_INDEX_CACHE", "1").strip().lower() in _OFF:
        return None
    configured = os.environ.get("TDU_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "torch_dataloader_utils"


class CachedMetadata(FileMetadata):
    """``FileMetadata`` whose ``footer`` is parsed from its serialized bytes on first use.

    Pickles with the bytes only, so handing an index to workers stays cheap.
    """

    def __init__(
        self, schema: pa.Schema, unit_rows: Sequence[int], unit_bytes: Sequence[int], footer: bytes
    ) -> None:
        object.__setattr__(self, "schema", schema)
        object.__setattr__(self, "unit_rows", tuple(unit_rows))
        object.__setattr__(self, "unit_bytes", tuple(unit_bytes))
        object.__setattr__(self, "_footer_bytes", footer)

    @property
    def footer(self) -> Any:
        parsed = self.__dict__.get("_footer")
        serialized = self.__dict__.get("_footer_bytes", b"")
        if parsed is None and serialized:
            parsed = pickle.loads(serialized)
            object.__setattr__(self, "_footer", parsed)
        return parsed

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_footer"}


class IndexCache:
    """Footers by (namespace, path, format), valid while size and version tag are unchanged."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(str(path), timeout=30, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._schemas: dict[str, pa.Schema] = {}

    def close(self) -> None:
        self._db.close()

    def get(self, namespace: str, fmt: str, entries: Sequence[Any]) -> list[FileMetadata | None]:
        """Cached metadata of each entry (``FileEntry``), ``None`` where missing or stale."""
        wanted = {e.path: (e.size, e.stamp) for e in entries if e.stamp}
        rows: dict[str, tuple[Any, ...]] = {}
        if not wanted:
            return [None] * len(entries)
        # One range scan of the primary key over the listed paths (they share a prefix).
        query = (
            "SELECT path, size, version, entry FROM files "
            "WHERE namespace = ? AND path >= ? AND path <= ? AND format = ?"
        )
        bounds = [namespace, min(wanted), max(wanted), fmt]
        for path, size, version, blob in self._db.execute(query, bounds):
            if wanted.get(path) == (size, version):
                rows[path] = pickle.loads(blob)
        self._load_schemas({row[0] for row in rows.values()})
        return [self._metadata(rows[e.path]) if e.path in rows else None for e in entries]

    def put(self, namespace: str, fmt: str, items: Iterable[tuple[Any, FileMetadata]]) -> None:
        """Store ``(FileEntry, FileMetadata)`` pairs, replacing older versions of the paths."""
        rows, schemas = [], {}
        for entry, meta in items:
            if not entry.stamp:
                continue
            schema_bytes = meta.schema.serialize().to_pybytes()
            digest = xxhash.xxh64_hexdigest(schema_bytes)
            schemas[digest] = schema_bytes
            footer = b"" if meta.footer is None else pickle.dumps(meta.footer, protocol=5)
            blob = pickle.dumps((digest, meta.unit_rows, meta.unit_bytes, footer), protocol=5)
            rows.append((namespace, entry.path, fmt, entry.size, entry.stamp, blob))
        if not rows:
            return
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT OR IGNORE INTO schemas VALUES (?, ?)", list(schemas.items())
            )
            self._db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)", rows)

    def _load_schemas(self, digests: set[str]) -> None:
        missing = [d for d in digests if d not in self._schemas]
        for digest in missing:
            row = self._db.execute(
                "SELECT schema FROM schemas WHERE digest = ?", [digest]
            ).fetchone()
            if row is not None:
                self._schemas[digest] = pa.ipc.read_schema(pa.py_buffer(row[0]))

    def _metadata(self, row: tuple[Any, ...]) -> FileMetadata | None:
        digest, unit_rows, unit_bytes, footer = row
        schema = self._schemas.get(digest)
        return None if schema is None else CachedMetadata(schema, unit_rows, unit_bytes, footer)


def open_cache() -> IndexCache | None:
    """The machine's index cache, or ``None`` if disabled or unusable (warned once)."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        return IndexCache(directory / _FILENAME)
    except (OSError, sqlite3.Error) as exc:
        warn_once(f"index cache at {directory} is unusable ({exc}); indexing without it")
        return None


def warn_once(message: str) -> None:
    """One warning per process about the cache, which never stops a dataset from building."""
    if not _warned.is_set():
        _warned.set()
        warnings.warn(
            f"{message}. Set TDU_CACHE_DIR to a writable local directory, or TDU_INDEX_CACHE=0 "
            f"to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
