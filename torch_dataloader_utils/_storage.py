"""Where files live: listing through fsspec, opening them for pyarrow, naming them in messages."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from ._errors import DataSourceError

__all__ = ["FileEntry", "Storage"]

_GLOB_CHARS = frozenset("*?[")
# What identifies one version of an object, by filesystem: S3/GCS ETag, then mtime-like fields.
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "created")


@dataclass(frozen=True)
class FileEntry:
    """A listed file: its path in the filesystem, size and a version tag (ETag or mtime)."""

    path: str
    size: int
    version: str


class Storage:
    """One fsspec filesystem, built from the first path's protocol and ``storage_options``.

    Pickles by rebuilding the filesystem from its options, so it is safe to hand to forked or
    spawned DataLoader workers. ``storage_options`` never appear in messages or states.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.fs, _ = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def display(self, path: str) -> str:
        """The path as users wrote it: plain for local files, ``protocol://`` otherwise."""
        return path if self.is_local else str(self.fs.unstrip_protocol(path))

    def list_files(self, paths: str | Sequence[str]) -> list[FileEntry]:
        """Files named by ``paths``: each a file, directory (recursive), prefix or glob.

        Within each item files are sorted; items keep their order. Names starting with ``.`` or
        ``_`` below a directory or in a glob are skipped. A file named twice is an error.
        """
        items = [paths] if isinstance(paths, str) else list(paths)
        if not items:
            raise ValueError("path is empty: pass a file, directory, glob or a list of them")
        entries: dict[str, FileEntry] = {}
        for item in items:
            for entry in self._list_item(item):
                if entry.path in entries:
                    raise ValueError(f"{self.display(entry.path)} is named twice in path")
                entries[entry.path] = entry
        return list(entries.values())

    def open(self, path: str) -> Any:
        """A pyarrow-readable handle: memory map for local files, fsspec file otherwise."""
        try:
            if self.is_local:
                return pa.memory_map(path)
            return self.fs.open(path, "rb")
        except (OSError, ValueError) as exc:
            raise DataSourceError(f"cannot open {self.display(path)}: {exc}") from exc

    def _list_item(self, item: str) -> list[FileEntry]:
        root = self.fs._strip_protocol(item)
        if _GLOB_CHARS & set(item):
            found = self.fs.glob(root, detail=True)
            infos = {p: i for p, i in found.items() if i.get("type") != "directory"}
            infos = {p: i for p, i in infos.items() if not _hidden(posixpath.basename(p))}
        elif self.fs.isdir(root):
            found = self.fs.find(root, detail=True)
            infos = {p: i for p, i in found.items() if not _hidden(posixpath.relpath(p, root))}
        elif self.fs.isfile(root):
            infos = {root: self.fs.info(root)}
        else:
            raise FileNotFoundError(f"no such file, directory or prefix: {item}")
        if not infos:
            raise FileNotFoundError(
                f"no data files under {item} (names starting with '.' or '_' are ignored)"
            )
        return [_entry(p, infos[p]) for p in sorted(infos)]


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def _entry(path: str, info: Mapping[str, Any]) -> FileEntry:
    version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), "")
    return FileEntry(path=path, size=int(info.get("size") or 0), version=version)
