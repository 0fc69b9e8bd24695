"""The index cache: parsed footers on local disk, so building a dataset again skips footer reads.

Location: ``$TDU_CACHE_DIR`` if set, else ``~/.cache/torch_dataloader_utils``; one SQLite file,
``index-v4.sqlite``, shared by all datasets, processes and ranks on the machine.
``TDU_INDEX_CACHE=0`` (or ``off``, ``false``, ``no``) disables it.

One row per (storage namespace, path, format). The row is used only when the file's size and
stamp still equal the stored ones: the version tag (ETag / generation / mtime) and, for local
files, also the change time and inode, which ``utime`` cannot restore. A changed object misses
and its row is replaced; other rows stay valid. Files without a version tag are never cached.

A row is data, never code: JSON of what planning needs (unit rows and bytes, the file's content
fingerprint, the digest naming the file's Arrow schema, stored once per distinct schema as IPC
bytes) plus the footer in the format's own bytes (Parquet: its Thrift bytes). Nothing is
unpickled, so a cache directory shared with others cannot run their code.

Every row proves itself: it carries a checksum (xxh3) of the cache's format version and of
everything else it holds, key and stamp included, and a schema is named by the xxhash of its
bytes. A row that fails its checksum or does not decode, or whose schema fails its digest, is
logged (one WARNING naming the files and the cache), its file's footer is read again from
storage and the row rewritten; a failed row of a file not listed is deleted. The other rows are
used as they are. A database SQLite finds damaged (not a database, malformed) is deleted and
created anew. Footers are parsed when read from
(``index.parsed``): the main process never parses them, a worker only those of files it reads.

The database uses SQLite's default rollback journal (``DELETE``), not WAL: WAL needs shared
memory between the processes, which network filesystems (an NFS home directory) do not
provide, and a WAL database there can be corrupted. Concurrent builders wait up to 30 s for a
write.

The cache is an optimisation: any other failure to open, read or write it (read-only, locked)
warns once and indexing proceeds from storage.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import xxhash

from ..base.log import log, some_names
from ..formats import FileFormat, FileMetadata
from .parsed import SerializedMetadata, serialized

__all__ = ["IndexCache", "cache_dir", "open_cache"]

# v1 rows were pickles, v2 rows have no content fingerprint, v3 rows no checksum of the whole
# row: none is ever read. The version is also part of every row's checksum.
_VERSION = 4
_FILENAME = f"index-v{_VERSION}.sqlite"
_OFF = frozenset({"0", "off", "false", "no", "disable", "disabled"})
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    namespace TEXT NOT NULL, path TEXT NOT NULL, format TEXT NOT NULL,
    size INTEGER NOT NULL, version TEXT NOT NULL, entry TEXT NOT NULL, footer BLOB NOT NULL,
    checksum TEXT NOT NULL,
    PRIMARY KEY (namespace, path, format)
);
CREATE TABLE IF NOT EXISTS schemas (digest TEXT PRIMARY KEY, schema BLOB NOT NULL);
"""
# How long a builder waits for another's write before indexing without the cache.
_BUSY_SECONDS = 30.0
# SQLite's primary result codes for a damaged file: SQLITE_CORRUPT, SQLITE_NOTADB.
_DAMAGED = (11, 26)
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


@dataclass(frozen=True)
class _Row:
    """A decoded ``files`` row: schema digest, unit rows and bytes, fingerprint, footer."""

    schema: str
    unit_rows: tuple[int, ...]
    unit_bytes: tuple[int, ...]
    fingerprint: str
    footer: bytes


class IndexCache:
    """Footers by (namespace, path, format), valid while size and version tag are unchanged."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._schemas: dict[str, pa.Schema] = {}
        try:
            self._db = _connect(path)
        except sqlite3.DatabaseError as exc:
            if not _damaged(exc):
                raise
            self._db = self._anew(exc)

    def close(self) -> None:
        self._db.close()

    def get(
        self, namespace: str, fmt: FileFormat, entries: Sequence[Any]
    ) -> list[tuple[FileMetadata, str] | None]:
        """Cached metadata and content fingerprint of each entry (``FileEntry``), ``None`` where
        missing, stale or corrupt (corrupt rows are logged; reading the file again replaces
        them). A damaged database is rebuilt empty."""
        try:
            return self._get(namespace, fmt, entries)
        except sqlite3.DatabaseError as exc:
            if not _damaged(exc):
                raise
            self._db.close()
            self._db = self._anew(exc)
            return [None] * len(entries)

    def put(
        self, namespace: str, fmt: FileFormat, items: Iterable[tuple[Any, FileMetadata, str]]
    ) -> None:
        """Store ``(FileEntry, FileMetadata, fingerprint)``, replacing older versions."""
        rows, schemas = [], {}
        for entry, meta, fingerprint in items:
            if not entry.stamp:
                continue
            schema_bytes = meta.schema.serialize().to_pybytes()
            digest = xxhash.xxh64_hexdigest(schema_bytes)
            schemas[digest] = schema_bytes
            held = serialized(meta, fmt)
            footer = held.footer_bytes if isinstance(held, SerializedMetadata) else b""
            fields = {
                "schema": digest,
                "unit_rows": list(meta.unit_rows),
                "unit_bytes": list(meta.unit_bytes),
                "fingerprint": fingerprint,
            }
            # As SQLite hands them back, so that the checksum is that of what is read.
            key = (namespace, entry.path, fmt.name, int(entry.size), str(entry.stamp))
            row = (*key, json.dumps(fields, separators=(",", ":")))
            rows.append((*row, footer, _checksum(row, footer)))
        if not rows:
            return
        try:
            self._write(rows, schemas)
        except sqlite3.DatabaseError as exc:
            if not _damaged(exc):
                raise
            self._db.close()
            self._db = self._anew(exc)
            self._write(rows, schemas)

    def _get(
        self, namespace: str, fmt: FileFormat, entries: Sequence[Any]
    ) -> list[tuple[FileMetadata, str] | None]:
        wanted = {e.path: (e.size, e.stamp) for e in entries if e.stamp}
        if not wanted:
            return [None] * len(entries)
        # One range scan of the primary key over the listed paths (they share a prefix).
        query = (
            "SELECT rowid, path, size, version, entry, footer, checksum FROM files "
            "WHERE namespace = ? AND path >= ? AND path <= ? AND format = ?"
        )
        bounds = [namespace, min(wanted), max(wanted), fmt.name]
        rows: dict[str, _Row | None] = {}
        failed: dict[int, str] = {}  # rowid: path, of rows that fail their checksum
        for rowid, path, size, version, entry, footer, checksum in self._db.execute(query, bounds):
            if checksum != _checksum((namespace, path, fmt.name, size, version, entry), footer):
                failed[rowid] = path
            elif wanted.get(path) == (size, version):
                rows[path] = _decode(entry, footer)
        self._load_schemas({row.schema for row in rows.values() if row is not None})
        found = [self._metadata(rows[e.path], fmt) if e.path in rows else None for e in entries]
        bad = [e.path for e, m in zip(entries, found, strict=True) if e.path in rows and not m]
        bad += failed.values()
        if bad:
            log.warning(
                "index cache %s: %d corrupt entries ignored (%s); reading their footers again "
                "from storage and rewriting them",
                self.path,
                len(bad),
                some_names(bad),
            )
        if failed:
            self._forget(list(failed))
        return found

    def _write(self, rows: list[tuple[Any, ...]], schemas: dict[str, bytes]) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            # REPLACE, not IGNORE: a schema row that went bad is rewritten with good bytes.
            self._db.executemany("INSERT OR REPLACE INTO schemas VALUES (?, ?)", schemas.items())
            self._db.executemany(
                "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows
            )

    def _forget(self, rowids: list[int]) -> None:
        """Delete rows that failed their checksum (a listed file's row is rewritten anyway; this
        removes one whose key went bad). Left for the next build if the cache is busy or
        read-only (which the write of the listed files reports)."""
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("DELETE FROM files WHERE rowid = ?", [(r,) for r in rowids])
        except sqlite3.OperationalError:
            pass

    def _anew(self, exc: sqlite3.DatabaseError) -> sqlite3.Connection:
        """An empty database in place of one SQLite finds damaged (its journal, which belongs
        to the damaged file, deleted too)."""
        log.warning(
            "index cache %s is damaged (%s); deleting it and building it anew: every footer "
            "is read again from storage",
            self.path,
            exc,
        )
        for stale in (self.path, self.path.with_name(f"{self.path.name}-journal")):
            stale.unlink(missing_ok=True)
        self._schemas.clear()
        return _connect(self.path)

    def _load_schemas(self, digests: set[str]) -> None:
        """Parse the schemas named by ``digests``; a row whose bytes do not match its digest
        is left out (the files naming it miss, are logged and read again)."""
        for digest in digests - self._schemas.keys():
            row = self._db.execute(
                "SELECT schema FROM schemas WHERE digest = ?", [digest]
            ).fetchone()
            if row is None or not isinstance(row[0], bytes):
                continue
            if xxhash.xxh64_hexdigest(row[0]) == digest:
                self._schemas[digest] = pa.ipc.read_schema(pa.py_buffer(row[0]))

    def _metadata(self, row: _Row | None, fmt: FileFormat) -> tuple[FileMetadata, str] | None:
        schema = None if row is None else self._schemas.get(row.schema)
        if row is None or schema is None:
            return None
        meta = SerializedMetadata(schema, row.unit_rows, row.unit_bytes, row.footer, fmt)
        return meta, row.fingerprint


def _connect(path: Path) -> sqlite3.Connection:
    """The database at ``path``, its tables created if new."""
    db = sqlite3.connect(str(path), timeout=_BUSY_SECONDS, isolation_level=None)
    try:
        # Text that is not UTF-8 (a corrupt row) decodes to a value that fails its checksum.
        db.text_factory = lambda raw: raw.decode(errors="surrogateescape")
        db.execute("PRAGMA journal_mode=DELETE")  # not WAL: see the module docstring
        db.executescript(_SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite found the file damaged, not busy, locked or read-only."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in _DAMAGED
    return "malformed" in str(exc) or "not a database" in str(exc)


def _checksum(fields: tuple[object, ...], footer: object) -> str | None:
    """xxh3 of the cache's format version, a row's fields (key, stamp, entry) and its footer;
    ``None`` (which no stored checksum equals) when the footer is not bytes. Fields are joined
    by NUL, which none holds (JSON escapes it)."""
    if not isinstance(footer, bytes):
        return None
    text = "\0".join(map(str, (_VERSION, *fields, "")))
    return xxhash.xxh3_64_hexdigest(text.encode(errors="surrogateescape") + footer)


def _decode(entry: object, footer: bytes) -> _Row | None:
    """The row's fields if they are well formed (a row with a valid checksum is, unless a
    writer other than this module made it)."""
    try:
        fields = json.loads(entry)  # type: ignore[arg-type]
        row = _Row(
            fields["schema"],
            tuple(fields["unit_rows"]),
            tuple(fields["unit_bytes"]),
            fields["fingerprint"],
            footer,
        )
    except (ValueError, TypeError, KeyError):
        return None
    ints = row.unit_rows + row.unit_bytes
    valid = (
        isinstance(row.schema, str)
        and isinstance(row.fingerprint, str)
        and len(row.fingerprint) == 16
        and len(row.unit_rows) == len(row.unit_bytes)
        and all(type(n) is int and n >= 0 for n in ints)
    )
    return row if valid else None


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
