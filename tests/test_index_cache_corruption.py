"""A corrupt index cache is never trusted: every stored field flipped in turn, and raw bytes of
the SQLite file, and each time a fresh epoch delivers every row once, a checkpoint saved before
the corruption resumes exactly, the corruption is logged and the entry rewritten."""

from __future__ import annotations

import logging
import re
import sqlite3
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness
import pytest
from _data import write_dataset

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.formats import get_format
from torch_dataloader_utils.index import build as _build
from torch_dataloader_utils.index import cache as _cache

ROWS = (60, 50, 70, 40)  # row groups of 9: 26 row groups, 9 flips to 8, 6 to 7 ...
CACHE_FILE = "index-v4.sqlite"
# Columns whose flip moves the row where no listing looks for it (another key): the file's entry
# is gone, so it is read again; the stray row is never used.
UNREACHABLE = {("files", "namespace"), ("files", "path"), ("files", "format")}


@dataclass(frozen=True)
class Flip:
    """One corruption: a field of a row set to ``value`` (or ``offset`` of the file XOR 0xFF)."""

    label: str
    table: str = ""
    column: str = ""
    rowid: int = 0
    value: object = None
    offset: int = -1


def _flip_char(c: str) -> str:
    """Another character of the same class: a digit stays a digit, a hex letter a hex letter."""
    if c in "0123456789abcdef":
        return f"{int(c, 16) ^ 1:x}"
    return chr(ord(c) ^ 1)


def _text_positions(text: str) -> list[int]:
    """The first and last character of every number and every hex run, and of the text."""
    places = {0, len(text) - 1}
    for run in re.finditer(r"\d+|[0-9a-f]{8,}", text):
        places.update((run.start(), run.end() - 1))
    return sorted(p for p in places if p >= 0)


def _flips_of(value: object) -> Iterator[tuple[str, object]]:
    if isinstance(value, int):
        digits = str(value)
        for at in sorted({0, len(digits) - 1}):
            yield f"digit {at}", int(digits[:at] + _flip_char(digits[at]) + digits[at + 1 :])
    elif isinstance(value, str):
        for at in _text_positions(value):
            yield f"char {at}", value[:at] + _flip_char(value[at]) + value[at + 1 :]
    elif isinstance(value, bytes):
        for at in sorted(
            {0, len(value) // 4, len(value) // 2, 3 * len(value) // 4, len(value) - 1}
        ):
            flipped = bytearray(value)
            flipped[at] ^= 0x01
            yield f"bit of byte {at}", bytes(flipped)


def field_flips(db: Path) -> list[Flip]:
    """Every corruption of a stored field: each byte class of every number, hex digest, text
    and blob of every row of every table."""
    flips = []
    with sqlite3.connect(db) as con:
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            columns = [c[1] for c in con.execute(f"PRAGMA table_info({table})")]
            for rowid, *values in con.execute(f"SELECT rowid, * FROM {table}"):
                for column, value in zip(columns, values, strict=True):
                    for what, flipped in _flips_of(value):
                        label = f"{table}.{column} row {rowid} {what}"
                        flips.append(Flip(label, table, column, rowid, flipped))
    con.close()
    return flips


def byte_flips(db: Path) -> list[Flip]:
    """Raw bytes of the SQLite file: its header, the middle of each page, the last byte."""
    data = db.read_bytes()
    page = int.from_bytes(data[16:18], "big")
    header = [0, 16, 18, 21, 28, 44, 56, 96, 100, 105]
    middles = [p + page // 2 for p in range(0, len(data), page)]
    return [Flip(f"file byte {at}", offset=at) for at in [*header, *middles, len(data) - 1]]


class Sweep:
    """A dataset, its index cache when it was right, an epoch and a checkpoint taken then."""

    def __init__(self, root: Path, fmt: str, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.case = {"path": str(root), "format": fmt, "batch_size": 16, "shuffle": True}
        self.db = cache / CACHE_FILE
        self.reads: list[str] = []
        original = _build._read_metadata

        def counting(storage, fmt, entry):  # type: ignore[no-untyped-def]
            self.reads.append(Path(entry.path).name)
            return original(storage, fmt, entry)

        monkeypatch.setattr(_build, "_read_metadata", counting)
        self.index = StructuredDataset(str(root), format=fmt)._index
        self.full = _harness.run_epoch(self.case)
        self.state, _ = _harness.checkpoint_after(self.case, 5)
        self.pristine = self.db.read_bytes()
        self.fmt = get_format(fmt)

    def corrupt(self, flip: Flip) -> bool:
        """The pristine cache with ``flip`` applied; False if the flip cannot be stored (another
        row's key)."""
        for leftover in self.db.parent.glob(f"{CACHE_FILE}*"):
            leftover.unlink()
        if flip.offset >= 0:
            data = bytearray(self.pristine)
            data[flip.offset] ^= 0xFF
            self.db.write_bytes(bytes(data))
            return True
        self.db.write_bytes(self.pristine)
        con = sqlite3.connect(self.db)
        try:
            with con:
                sql = f"UPDATE {flip.table} SET {flip.column} = ? WHERE rowid = ?"
                con.execute(sql, (flip.value, flip.rowid))
        except sqlite3.IntegrityError:
            return False
        finally:
            con.close()
        return True

    def build(self, caplog: pytest.LogCaptureFixture, **case: Any) -> tuple[Any, list[str]]:
        """``make_loader(case)`` and what it logged or warned (WARNING and above)."""
        caplog.clear()
        self.reads.clear()
        self.monkeypatch.setattr(_cache, "_warned", type(_cache._warned)())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            made = _harness.make_loader({**self.case, **case})
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        return made, said + [str(w.message) for w in caught]

    def same_index(self, index: Any) -> bool:
        """Every fact the cache supplies equals what the files say."""
        pairs = zip(index.files, self.index.files, strict=True)
        return index.splits == self.index.splits and all(
            (f.path, f.fingerprint, f.metadata.unit_rows, f.metadata.unit_bytes)
            == (g.path, g.fingerprint, g.metadata.unit_rows, g.metadata.unit_bytes)
            and f.metadata.schema.equals(g.metadata.schema, check_metadata=True)
            and self.fmt.dump_footer(f.metadata.footer) == self.fmt.dump_footer(g.metadata.footer)
            for f, g in pairs
        )

    def check(self, flip: Flip, caplog: pytest.LogCaptureFixture, rows: bool) -> list[str]:
        """What went wrong with ``flip`` applied (empty: nothing)."""
        if not self.corrupt(flip):
            return []
        problems = []
        try:
            (loader, dataset), said = self.build(caplog)
            if not self.same_index(dataset._index):
                problems.append("index differs from the files")
            epoch = _harness.take(loader) if rows else self.full
            if sorted(_harness.ids(epoch)) != list(range(sum(ROWS))):
                problems.append("rows lost or repeated")
            elif epoch != self.full:
                problems.append("epoch differs")
        except Exception as exc:
            return [f"{type(exc).__name__}: {exc}"]
        # A raw byte may lie where SQLite never looks: only a changed field must be logged.
        touched = flip.offset < 0 and (flip.table, flip.column) not in UNREACHABLE
        if touched and not said:
            problems.append(f"not logged (read from storage: {self.reads})")
        (_, dataset), said = self.build(caplog)
        if said or self.reads:
            problems.append(f"not rewritten: {said} {self.reads}")
        if rows and self.corrupt(flip):
            loader, _ = self.build(caplog)[0]
            try:
                loader.load_state_dict(self.state)
                if _harness.take(loader) != self.full[5:]:
                    problems.append("resume differs")
            except Exception as exc:
                problems.append(f"resume: {type(exc).__name__}: {exc}")
        return problems


@pytest.fixture
def sweep(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sweep:
    """Over Parquet (row groups) unless the test asks for ``arrow`` (record batches)."""
    fmt = getattr(request, "param", "parquet")
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TDU_INDEX_CACHE", raising=False)
    write_dataset(tmp_path / "data", ROWS, row_group_size=9, format=fmt)
    return Sweep(tmp_path / "data", fmt, tmp_path / "cache", monkeypatch)


def _failures(sweep: Sweep, flips: list[Flip], caplog: Any, every: int) -> dict[str, list[str]]:
    found = {}
    with caplog.at_level(logging.WARNING, logger="torch_dataloader_utils"):
        for i, flip in enumerate(flips):
            problems = sweep.check(flip, caplog, rows=i % every == 0)
            if problems:
                found[flip.label] = problems
    return found


def _summary(failures: dict[str, list[str]], tried: int) -> str:
    """How many corruptions went wrong, by kind (silent: wrong and not logged), the first few."""
    kinds: dict[str, int] = {}
    for problems in failures.values():
        named = {p.split(":")[0].split(" (")[0] for p in problems}
        if "not logged" in named and named - {"not logged", "not rewritten"}:
            named.add("silently wrong")
        for kind in named:
            kinds[kind] = kinds.get(kind, 0) + 1
    first = "; ".join(f"{k}: {v}" for k, v in list(failures.items())[:8])
    return f"{len(failures)} of {tried} corruptions went wrong {kinds}; {first}"


@pytest.mark.parametrize("sweep", ["parquet", "arrow"], indirect=True)
def test_every_stored_field_flipped_is_detected_and_rewritten(
    sweep: Sweep, caplog: pytest.LogCaptureFixture
):
    flips = field_flips(sweep.db)
    assert {(f.table, f.column) for f in flips} == {
        *(("files", c) for c in ("namespace", "path", "format", "size", "version")),
        *(("files", c) for c in ("entry", "footer", "checksum")),
        ("schemas", "digest"),
        ("schemas", "schema"),
    }
    assert len(flips) > 200
    failures = _failures(sweep, flips, caplog, every=7)
    assert failures == {}, _summary(failures, len(flips))


def test_raw_bytes_of_the_cache_file_flipped_never_fail_a_build(
    sweep: Sweep, caplog: pytest.LogCaptureFixture
):
    flips = byte_flips(sweep.db)
    failures = _failures(sweep, flips, caplog, every=1)
    assert failures == {}, _summary(failures, len(flips))
