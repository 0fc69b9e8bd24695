"""The dataset index as values: the listed files, their footers and fingerprints, and the splits
cut from them (``index.build`` makes one). An index travels to workers and other ranks, which
never read a footer again.

Files are named in states relative to the dataset's *root*, the deepest directory holding them
all, so a copy of the files elsewhere (another node, a local copy of an S3 prefix) has the same
names; with content fingerprints (``index.footers``) a checkpoint resumes on it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import xxhash

from ..base.row_bytes import converted_row_bytes
from ..formats import FileMetadata
from .splits import Split

__all__ = ["MAX_FILE_GROUPS", "DatasetIndex", "IndexedFile", "digest"]

# The unit starts of a split of one unit (read-only: shared).
_ONE_UNIT = np.zeros(1, dtype=np.int64)
_ONE_UNIT.flags.writeable = False
# A state names at most this many groups of files, so its size does not grow with the file count.
MAX_FILE_GROUPS = 256


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
        return digest(f"{f.name}\0{f.fingerprint}" for f in self.files)

    def file_groups(self, groups: int = MAX_FILE_GROUPS, *, size: int = 0) -> list[list[object]]:
        """``[first name, last name, count, digest]`` for up to ``groups`` file runs (or runs of
        ``size`` files: how a stored state grouped them)."""
        size = size or self.group_size(groups)
        if size not in self._file_groups:
            runs = [self.files[i : i + size] for i in range(0, len(self.files), size)]
            self._file_groups[size] = tuple(
                (run[0].name, run[-1].name, len(run), digest(f.fingerprint for f in run))
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

    def locate_row(self, split: int, row: int) -> tuple[str, int, int]:
        """Row ``row`` of split ``split`` as ``(file display path, unit, row of the file)``,
        for errors about one row."""
        s = self.splits[split]
        file_row = s.row_offset + row
        ends = np.cumsum(self.files[s.file].metadata.unit_rows)
        unit = int(np.searchsorted(ends, file_row, side="right"))
        return self.files[s.file].display, unit, file_row

    def describe(self, split: int) -> str:
        """``path rows [a, b)`` of split ``split``, as messages and states name it."""
        s = self.splits[split]
        return f"{self.files[s.file].display} rows [{s.row_offset}, {s.row_offset + s.row_length})"


def digest(parts: object) -> str:
    """A content address of ``parts`` (xxh64 of their text, each closed by a separator)."""
    h = xxhash.xxh64()
    for part in parts:  # type: ignore[attr-defined]
        h.update(str(part).encode())
        h.update(b"\x1f")
    return h.hexdigest()
