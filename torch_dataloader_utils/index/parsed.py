"""Footers held serialized by the index and parsed when a reader needs one; a process keeps
a bounded number of bytes of them parsed.

A parsed footer takes several times its serialized bytes (Parquet, measured: 747 B parse into
7.5 KiB, 448 KB — 100 row groups of 40 columns — into 3.4 MiB), and the index holds every
file's. Kept once parsed, they grew with the files a process had read, outside the shuffle
budget: a mixture's first windows touch every file of every source, an epoch every file of the
dataset. Parsed again, a footer costs about 23 ns a serialized byte (17 µs a small one, 10 ms
the large one above), once per window that reads its file.

Readers raise the bound to a part of their stream's budget (``hold_parsed_footers``). Past it,
a footer parsed takes the place of one chosen at random: windows read their files over and
over in a cycle, which the least recently used would always have just let go of. The footer
just parsed is returned whatever the bound.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ..formats import FileFormat, FileMetadata

__all__ = ["SerializedMetadata", "hold_parsed_footers", "serialized"]

# Bytes a parsed footer takes, estimated from its serialized size (measured 8-10x).
_PARSED_PER_BYTE = 10


class _ParsedFooters:
    """The footers parsed in this process, within ``limit`` bytes (estimated), by the ``id``
    of their metadata (stable while held: an entry holds the metadata)."""

    def __init__(self) -> None:
        self.limit = 0
        self._lock = threading.Lock()
        self._held: dict[int, tuple[SerializedMetadata, Any, int]] = {}
        self._keys: list[int] = []  # the keys of ``_held``, for a choice at random
        self._bytes = 0
        self._random = random.Random(0)

    def footer(self, meta: SerializedMetadata) -> Any:
        """``meta``'s footer, parsed (again, if it was let go of)."""
        key = id(meta)
        held = self._held.get(key)
        if held is not None and held[0] is meta:
            return held[1]
        parsed = meta.parse()  # outside the lock: decoding threads parse in parallel
        cost = _PARSED_PER_BYTE * len(meta.footer_bytes)
        with self._lock:
            if key in self._held or cost > self.limit:
                return parsed
            while self._bytes + cost > self.limit:
                self._let_go(self._random.randrange(len(self._keys)))
            self._held[key] = (meta, parsed, cost)
            self._keys.append(key)
            self._bytes += cost
        return parsed

    def _let_go(self, slot: int) -> None:
        """Let go of the footer at ``_keys[slot]``."""
        key = self._keys[slot]
        self._keys[slot] = self._keys[-1]
        self._keys.pop()
        self._bytes -= self._held.pop(key)[2]

    def forget(self) -> None:
        """Hold nothing (a forked child starts without its parent's lock or footers)."""
        self._lock = threading.Lock()
        self._held.clear()
        self._keys.clear()
        self._bytes = 0


_PARSED = _ParsedFooters()
os.register_at_fork(after_in_child=_PARSED.forget)


def hold_parsed_footers(limit: int) -> None:
    """Keep up to ``limit`` bytes of parsed footers in this process (the bound only grows:
    the largest any reader of the process asked for)."""
    _PARSED.limit = max(_PARSED.limit, limit)


class SerializedMetadata(FileMetadata):
    """``FileMetadata`` whose ``footer`` is held as the format's bytes and parsed on use.

    Pickles with the bytes only, so handing an index to workers stays cheap.
    """

    footer_bytes: bytes

    def __init__(
        self,
        schema: pa.Schema,
        unit_rows: Sequence[int],
        unit_bytes: Sequence[int],
        footer: bytes,
        fmt: FileFormat,
    ) -> None:
        object.__setattr__(self, "schema", schema)
        object.__setattr__(self, "unit_rows", tuple(unit_rows))
        object.__setattr__(self, "unit_bytes", tuple(unit_bytes))
        object.__setattr__(self, "footer_bytes", footer)
        object.__setattr__(self, "_format", fmt)

    @property
    def footer(self) -> Any:
        return _PARSED.footer(self) if self.footer_bytes else None

    def parse(self) -> Any:
        """The footer parsed from its bytes."""
        fmt: FileFormat = self.__dict__["_format"]
        return fmt.load_footer(self.footer_bytes)


def serialized(meta: FileMetadata, fmt: FileFormat) -> FileMetadata:
    """``meta`` with its footer held as bytes (as is, if it has none or is so already)."""
    if isinstance(meta, SerializedMetadata) or meta.footer is None:
        return meta
    data = fmt.dump_footer(meta.footer)
    if not data:
        return meta
    return SerializedMetadata(meta.schema, meta.unit_rows, meta.unit_bytes, data, fmt)
