"""Where files live: listing through fsspec, opening them for pyarrow, naming them in messages.

Local files open as plain files (not memory maps). Every other protocol (``s3://``,
``gs://``, ``memory://``, ...) opens as a ``RemoteFile``: ranged GETs of exactly the bytes
pyarrow asks for, each retried on transient errors (see ``storage.retry``), or served from the
read-ahead of the stream that opens it (see ``storage.remote``). The storage holds no reading state:
what to fetch ahead is the stream reader's business (``reading.pieces``).

``storage_options`` go to fsspec unchanged. Their secret values (keys, secrets, tokens,
passwords, connection strings, in every encoding: ``storage.secrets``) and the credentials in
URLs are scrubbed from every message and log line this module produces.

Errors: a store that answered "not there" to a listing or a lookup (nothing under a path, no
such bucket, container or object) raises ``FileNotFoundError`` naming the URL. Any other failure
of a listing or a read (401/403, a refused connection, a timeout, a host name that does not
resolve, whatever exception the SDK raises) is a ``DataSourceError`` naming the URL, the
endpoint and the cause, the SDK's exception chained as ``__cause__``; transient ones are
retried first, by ``storage.retry`` alone (the SDK's own retries are switched off).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from ..base.compat import no_sdk_retries, strip_protocol
from ..base.errors import DataSourceError
from ..base.log import log, some_names
from .backends import cause, credentials, endpoint, without_sdk_retries
from .remote import PieceReads, RemoteFile, RemoteObject, storage_error
from .retry import RetryPolicy, policy_from_env, retry_call, tries
from .secrets import Redactor, secret_values, url_secrets

__all__ = ["FileEntry", "Storage"]

T = TypeVar("T")

_GLOB_CHARS = frozenset("*?[")
# What identifies one version of an object, by filesystem: S3/GCS ETag, then mtime-like fields.
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "created")
# storage_options keys that say which service a path lives on (part of the index cache key).
_ENDPOINT_KEYS = ("endpoint_url", "endpoint", "account_name", "project", "host", "port")


@dataclass(frozen=True)
class FileEntry:
    """A listed file: its path in the filesystem, size and a version tag (ETag or mtime).

    ``stamp`` is what the index cache compares: the version tag, plus for local files the
    change time and inode, which no ``touch``/``utime`` can set back.
    """

    path: str
    size: int
    version: str
    stamp: str = ""


class Storage:
    """One fsspec filesystem, built from the first path's protocol and ``storage_options``.

    Pickles by rebuilding the filesystem from its options, so it is safe to hand to forked or
    spawned DataLoader workers. ``storage_options`` never appear in messages or states.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
    ) -> None:
        options = dict(storage_options or {})
        self.redact = Redactor(secret_values(options) + url_secrets(url))
        self.retry = policy_from_env() if retry is None else retry
        self._fs = self._build(url, options)
        self.redact = self.redact.plus(credentials(self._fs))
        self._pid = os.getpid()
        self.is_local = isinstance(self._fs, LocalFileSystem)
        self.endpoint = endpoint(self._fs)
        self.namespace = _namespace(self._fs, options, self.endpoint)
        self._sizes: dict[str, int] = {}

    def _build(self, url: str, options: dict[str, Any]) -> Any:
        """The filesystem for ``url``; any failure named with the URL, credentials scrubbed."""
        protocol = fsspec.utils.get_protocol(url)
        if protocol != "file":  # our own instance: its SDK retries are switched off below
            options = {"skip_instance_cache": True, **without_sdk_retries(protocol, options)}
        try:
            fs, _ = fsspec.core.url_to_fs(url, **options)
        except (ValueError, TypeError) as exc:
            error: OSError | ValueError = ValueError(
                self.redact(f"cannot set up storage for {url}: {exc}")
            )
        except Exception as exc:  # the SDK's own types: ImportError, auth and network errors
            text = f"cannot set up storage for {url}: {cause(exc)}"
            error = storage_error(text, exc, self.redact)
        else:
            no_sdk_retries(fs)
            return fs
        raise error  # outside the handler: no __context__ holding a credential

    @property
    def fs(self) -> Any:
        """The filesystem, rebuilt from its options in a forked child (fsspec's async
        filesystems refuse to run on a loop inherited through fork)."""
        if self._pid != os.getpid():
            self._after_fork()
        return self._fs

    def _after_fork(self) -> None:
        """In a new process, at first use: the filesystem rebuilt from its options."""
        rebuild, args = self._fs.__reduce__()[:2]
        self._fs, self._pid = rebuild(*args), os.getpid()
        no_sdk_retries(self._fs)

    def display(self, path: str) -> str:
        """The path as users wrote it: plain for local files, ``protocol://`` otherwise."""
        return path if self.is_local else str(self.fs.unstrip_protocol(path))

    def list_files(
        self, paths: str | Sequence[str], *, extensions: Sequence[str] = ()
    ) -> list[FileEntry]:
        """Files named by ``paths``: each a file, directory (recursive), prefix or glob.

        Within each item files are sorted; items keep their order. Names starting with ``.`` or
        ``_`` below a directory or in a glob are skipped. Below a directory that holds files
        ending in one of ``extensions`` (the format's), only those are taken and the others
        are logged as skipped (another tool's ``index.json``, a ``README.md``); a directory
        without any keeps every file. A file named twice is an error.
        """
        suffixes = tuple(e.lower() for e in extensions)
        items = [paths] if isinstance(paths, str) else list(paths)
        if not items:
            raise ValueError("path is empty: pass a file, directory, glob or a list of them")
        self.redact = self.redact.plus(s for item in items for s in url_secrets(item))
        if not self.is_local:
            self.fs.invalidate_cache()  # a listing must see objects changed since the last one
        entries: dict[str, FileEntry] = {}
        for item in items:
            listed = self._call(partial(self._list_item, item, suffixes), f"list {item}")
            for entry in listed:
                if entry.path in entries:
                    raise ValueError(f"{self.display(entry.path)} is named twice in path")
                entries[entry.path] = entry
        self._sizes.update((e.path, e.size) for e in entries.values())
        return list(entries.values())

    def open(
        self,
        path: str,
        *,
        reads: PieceReads | None = None,
        known: tuple[int, bytes] | None = None,
    ) -> Any:
        """A pyarrow-readable handle: a plain file locally, ``RemoteFile`` otherwise.

        A remote file serves the bytes of ``reads`` from their read-ahead and ``known``
        (``(offset, bytes)`` the caller holds) from memory. Not a memory map locally: a file
        truncated or rewritten under a mapping kills the process with SIGBUS, where a read
        raises an error that names the file.
        """
        if self.is_local:
            try:
                return pa.OSFile(path)
            except (OSError, ValueError) as exc:
                raise DataSourceError(f"cannot open {path}: {exc}") from exc
        return RemoteFile(self.remote(path), reads=reads, known=known)

    def remote(self, path: str) -> RemoteObject:
        """The object at ``path`` for ranged reads (its size from the listing, else asked)."""
        fs = self.fs  # rebuilt at first use in a DataLoader worker
        name = self.display(path)
        size = self._sizes.get(path)
        if size is None:
            size = int(self._call(lambda: fs.size(path), f"open {name}"))
        return RemoteObject(
            lambda start, stop: fs.cat_file(path, start=start, end=stop),
            size,
            name,
            retry=self.retry,
            redact=self.redact,
        )

    def _call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` with retries. A ``FileNotFoundError`` of our own (a listing that found
        nothing) passes; the SDK's (a missing bucket, container or object) and every other
        failure (a ``DataSourceError``) name ``what``, the endpoint and the cause."""
        began = time.monotonic()
        at = f" at {self.endpoint}" if self.endpoint else ""
        try:
            return retry_call(fn, self.retry, what=self.redact(what), redact=self.redact)
        except _NothingThere as exc:
            error: OSError = FileNotFoundError(self.redact(str(exc)))
        except FileNotFoundError as exc:  # its text names no URL ("The specified bucket ...")
            text = f"cannot {what}{at}: {cause(exc)}"
            error = storage_error(text, exc, self.redact, FileNotFoundError)
        except Exception as exc:
            how = tries(exc, self.retry, time.monotonic() - began)
            error = storage_error(f"cannot {what}{at} {how}: {cause(exc)}", exc, self.redact)
        raise error  # outside the handler: no __context__ holding a credential

    def _list_item(self, item: str, extensions: tuple[str, ...]) -> list[FileEntry]:
        root = strip_protocol(self.fs, item)
        if self.is_local and os.path.isdir(root):
            return _some(_by_extension(_walk_local(root), extensions, item, root), item)
        if _GLOB_CHARS & set(item) and self._info(root) is None:  # an existing path is literal
            return _some(self._glob(root), item)
        found = self._find(root)  # one listing for a directory: no HEAD request
        if found:
            return _some(_by_extension(found, extensions, item, root), item)
        info = self._info(root)
        if info is None:
            raise _NothingThere(f"no such file, directory or prefix: {item}")
        if info.get("type") == "directory":
            return _some([], item)
        return [_entry(root, info)]

    def _info(self, root: str) -> dict[str, Any] | None:
        """What ``root`` is (fsspec ``info``); ``None`` only when the store answered that
        nothing is there. Unlike ``isdir``/``isfile``/``exists``, which answer ``False`` on any
        error, a failed request raises."""
        try:
            return dict(self.fs.info(root))
        except FileNotFoundError:
            return None

    def _glob(self, pattern: str) -> list[FileEntry]:
        found = self.fs.glob(pattern, detail=True)
        base = len(_glob_base(pattern))
        return [
            _entry(p, found[p])
            for p in sorted(found)
            if found[p].get("type") != "directory" and not _hidden(p[base:].lstrip("/"))
        ]

    def _find(self, root: str) -> list[FileEntry]:
        """The files below ``root``, hidden names skipped; none when ``root`` is a file (fsspec
        finds a file as itself, without its details) or nothing. fsspec's generic ``find``
        omits a directory it cannot list: ``_info`` then raises the error."""
        found = self.fs.find(root, detail=True)
        prefix = len(root.rstrip("/")) + 1
        below = (p for p in sorted(found) if len(p) > prefix and not _hidden(p[prefix:]))
        return [_entry(p, found[p]) for p in below]


class _NothingThere(FileNotFoundError):
    """A listing that succeeded and found nothing (its message names the path)."""


def _some(entries: list[FileEntry], item: str) -> list[FileEntry]:
    """``entries``, or ``FileNotFoundError`` when the listing found none."""
    if not entries:
        hint = "names starting with '.' or '_' are ignored"
        raise _NothingThere(f"no data files under {item} ({hint})")
    return entries


def _namespace(fs: Any, options: Mapping[str, Any], service: str) -> str:
    """Protocol, the service's endpoint (with the Azure account) and the endpoint-like
    options: which service paths belong to, so an emulator, a second account and the real
    service never share index-cache rows (no secrets)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    parts = [str(protocol)] + ([f"at={service}"] if service else [])
    nested = {**options.get("client_kwargs", {}), **options}
    parts += [f"{k}={nested[k]}" for k in _ENDPOINT_KEYS if nested.get(k) is not None]
    return " ".join(parts)


def _walk_local(root: str) -> list[FileEntry]:
    """Files below local directory ``root``, sorted, hidden names pruned; one stat per file.

    The same paths and version tags as fsspec's ``find`` + ``info`` (``mtime`` as a float),
    several times faster on directories of many thousands of files.
    """
    entries: list[FileEntry] = []
    pending = [root.rstrip("/") or "/"]
    while pending:
        directory = pending.pop()
        with os.scandir(directory) as listing:
            for item in listing:
                if item.name.startswith((".", "_")):
                    continue
                path = f"{directory.rstrip('/')}/{item.name}"
                if item.is_dir():
                    pending.append(path)
                    continue
                st = item.stat()
                mtime = str(st.st_mtime)
                stamp = f"{mtime}|{st.st_ctime}|{st.st_ino}"
                entries.append(FileEntry(path, int(st.st_size), mtime, stamp))
    entries.sort(key=lambda e: e.path)
    return entries


def _by_extension(
    entries: list[FileEntry], extensions: tuple[str, ...], item: str, root: str
) -> list[FileEntry]:
    """The entries ending in one of ``extensions`` when there are any (the rest logged)."""
    kept = [e for e in entries if e.path.lower().endswith(extensions)] if extensions else []
    if not kept or len(kept) == len(entries):
        return entries
    prefix = len(root.rstrip("/")) + 1
    skipped = [e.path[prefix:] for e in entries if not e.path.lower().endswith(extensions)]
    log.info(
        "%s: reading the %d %s files, skipping %d other file(s): %s",
        item,
        len(kept),
        "/".join(extensions),
        len(skipped),
        some_names(skipped),
    )
    return kept


def _glob_base(pattern: str) -> str:
    """The directory part of ``pattern`` before its first wildcard."""
    first = min(pattern.index(c) for c in _GLOB_CHARS if c in pattern)
    return pattern[:first].rpartition("/")[0]


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def _entry(path: str, info: Mapping[str, Any]) -> FileEntry:
    version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), "")
    stamp = version
    if version and "ino" in info and "created" in info:  # local: mtime, ctime, inode
        stamp = f"{version}|{info['created']}|{info['ino']}"
    return FileEntry(path=path, size=int(info.get("size") or 0), version=version, stamp=stamp)
