"""Files that pyarrow can open (or refuses) but whose careless reading kills the process.

Each dangerous case runs in a subprocess, so a regression shows as a failed test with the
signal that killed the child, not as a dead test run.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from torch_dataloader_utils.formats import get_format
from torch_dataloader_utils.formats.base import read_at
from torch_dataloader_utils.formats.ipc_footer import IpcFooter, _Table, read_footer

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout. Fails naming the signal if it died."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"child exited with {done.returncode}:\n{done.stderr}"
    return done.stdout


def _union_table() -> pa.Table:
    union = pa.UnionArray.from_dense(
        pa.array([0, 1, 0], type=pa.int8()),
        pa.array([0, 0, 1], type=pa.int32()),
        [pa.array([1, 2]), pa.array(["a"])],
    )
    return pa.table({"id": pa.array([0, 1, 2]), "u": union})


def _write_ipc(path: Path, batches: list[pa.RecordBatch], **options: object) -> Path:
    with (
        pa.OSFile(str(path), "wb") as sink,
        pyarrow.ipc.new_file(
            sink, batches[0].schema, options=pyarrow.ipc.IpcWriteOptions(**options)
        ) as writer,
    ):
        for batch in batches:
            writer.write_batch(batch)
    return path


@pytest.mark.slow
def test_union_columns_with_an_empty_batch_do_not_crash(tmp_path: Path):
    batch = _union_table().to_batches()[0]
    path = _write_ipc(tmp_path / "union.arrow", [batch, batch.slice(0, 0), batch])
    out = _run(f"""
        from torch_dataloader_utils import StructuredDataset
        for output in ("arrow", "numpy", "torch"):
            dataset = StructuredDataset({str(path)!r}, format="arrow", output=output)
            print(sum(len(b["id"]) if output != "arrow" else b.num_rows for b in dataset))
        meta = dataset._index.files[0].metadata
        print(meta.unit_rows, sum(meta.unit_bytes))
    """)
    counts, units = out.splitlines()[:3], out.splitlines()[3]
    assert counts == ["6", "6", "6"]
    assert units.startswith("(3, 0, 3) ") and int(units.split()[-1]) < path.stat().st_size


def _kms_client() -> type:
    import pyarrow.parquet.encryption as pe

    class InMemoryKms(pe.KmsClient):  # type: ignore[misc]
        """Wraps keys by prefixing the master key: enough to write a test file."""

        def __init__(self, config: pe.KmsConnectionConfig) -> None:
            super().__init__()
            self.keys = {k: v.encode() for k, v in config.custom_kms_conf.items()}

        def wrap_key(self, key_bytes: bytes, master_key_identifier: str) -> bytes:
            return base64.b64encode(self.keys[master_key_identifier] + key_bytes)

        def unwrap_key(self, wrapped_key: bytes, master_key_identifier: str) -> bytes:
            return base64.b64decode(wrapped_key)[len(self.keys[master_key_identifier]) :]

    return InMemoryKms


def _write_encrypted(path: Path, *, plaintext_footer: bool) -> Path:
    pe = pytest.importorskip("pyarrow.parquet.encryption")
    keys = {"footer": "0123456789012345", "col": "1234567890123450"}
    factory = pe.CryptoFactory(_kms_client())
    config = pe.EncryptionConfiguration(
        footer_key="footer", column_keys={"col": ["secret"]},
        plaintext_footer=plaintext_footer, double_wrapping=False,
    )  # fmt: skip
    properties = factory.file_encryption_properties(
        pe.KmsConnectionConfig(custom_kms_conf=keys), config
    )
    table = pa.table({"id": [1, 2, 3], "secret": [4, 5, 6]})
    with pq.ParquetWriter(str(path), table.schema, encryption_properties=properties) as writer:
        writer.write_table(table)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("plaintext_footer", [True, False])
def test_encrypted_parquet_is_a_data_source_error(tmp_path: Path, plaintext_footer: bool):
    path = _write_encrypted(tmp_path / "secret.parquet", plaintext_footer=plaintext_footer)
    out = _run(f"""
        from torch_dataloader_utils import DataSourceError, StructuredDataset
        try:
            StructuredDataset({str(path)!r})
        except DataSourceError as exc:
            print(exc)
    """)
    assert f"cannot read {path} as parquet" in out
    assert ("modular encryption" if plaintext_footer else "encrypted metadata") in out


# ---------------------------------------------------------------------------- IPC footer


def record_batches(read: Callable[[int, int], bytes], size: int) -> list[tuple[int, int]]:
    """``(rows, bytes on storage)`` of each record batch, from the footer and headers only."""
    return read_footer(read, size).units()


def _blocks(path: Path) -> list[tuple[int, int]]:
    data = path.read_bytes()
    return record_batches(lambda at, n: data[at : at + n], len(data))


@pytest.mark.parametrize("options", [{}, {"use_legacy_format": True}, {"compression": "zstd"}])
def test_ipc_units_are_read_from_headers_only(tmp_path: Path, options: dict):
    table = pa.table({"x": pa.array(range(1000), pa.int64())})
    path = _write_ipc(tmp_path / "a.arrow", table.to_batches(max_chunksize=300), **options)
    blocks = _blocks(path)
    assert [rows for rows, _ in blocks] == [300, 300, 300, 100]
    assert sum(size for _, size in blocks) < path.stat().st_size
    if options.get("compression"):
        assert blocks[0][1] < 300 * 8  # bytes on storage, not decoded bytes
    meta = get_format("arrow").read_metadata(pa.OSFile(str(path)))
    assert meta.unit_rows == (300, 300, 300, 100) and meta.unit_bytes == tuple(s for _, s in blocks)


def _corrupt(data: bytes, at: int, value: bytes) -> bytes:
    return data[:at] + value + data[at + len(value) :]


def test_corrupt_ipc_footers_are_value_errors(tmp_path: Path):
    table = pa.table({"x": pa.array(range(100), pa.int64())})
    good = _write_ipc(tmp_path / "a.arrow", table.to_batches(max_chunksize=30)).read_bytes()
    length = int.from_bytes(good[-10:-6], "little")
    footer_at = len(good) - 10 - length
    cases = {
        "no ARROW1 magic": good[:-1] + b"X",
        "does not fit": _corrupt(good, len(good) - 10, (10**6).to_bytes(4, "little")),
        "corrupt Arrow IPC footer": _corrupt(good, footer_at, b"\xff\xff\xff\x7f"),
        "short": good[:9],
    }
    for match, data in cases.items():
        with pytest.raises(ValueError, match=match if match != "short" else "no ARROW1"):
            record_batches(lambda at, n, d=data: d[at : at + n], len(data))
    # Every single flipped byte of the footer: a ValueError or the right answer, never a crash.
    expected = record_batches(lambda at, n: good[at : at + n], len(good))
    for i in range(footer_at, len(good)):
        data = _corrupt(good, i, bytes([good[i] ^ 0xFF]))
        try:
            got = record_batches(lambda at, n, d=data: d[at : at + n], len(data))
        except ValueError:
            continue
        assert len(got) == len(expected) or got == []  # pyarrow's count is checked by the caller


def test_block_that_is_not_a_record_batch_or_lies_outside(tmp_path: Path):
    table = pa.table({"x": pa.array(range(10), pa.int64())})
    good = _write_ipc(tmp_path / "a.arrow", table.to_batches()).read_bytes()
    length = int.from_bytes(good[-10:-6], "little")
    footer = good[len(good) - 10 - length : len(good) - 10]
    block_at = len(good) - 10 - length + _Table.root(footer).vector(3)[0]
    # The first block pointed at offset 8, the schema message just past the leading magic.
    moved = _corrupt(good, block_at, (8).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="not a record batch"):
        record_batches(lambda at, n: moved[at : at + n], len(moved))
    far = _corrupt(good, block_at, (len(good)).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="outside the file"):
        record_batches(lambda at, n: far[at : at + n], len(far))


def test_read_at_needs_every_byte(tmp_path: Path):
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    assert read_at(pa.OSFile(str(path)), 2, 3) == b"234"
    with open(path, "rb") as plain:
        assert read_at(plain, 8, 2) == b"89"
        with pytest.raises(ValueError, match="file ends before byte 12"):
            read_at(plain, 8, 4)


def test_block_count_must_agree_with_pyarrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = _write_ipc(tmp_path / "a.arrow", pa.table({"x": [1, 2]}).to_batches())
    monkeypatch.setattr(IpcFooter, "units", lambda self: [])
    with pytest.raises(ValueError, match="lists 0 record batches where pyarrow finds 1"):
        get_format("arrow").read_metadata(pa.OSFile(str(path)))


def test_signed_plaintext_footer_is_recognised_without_touching_columns():
    from types import SimpleNamespace

    from torch_dataloader_utils.formats.parquet import _refuse_encrypted

    tail = (1116).to_bytes(4, "little") + b"PAR1"
    source = pa.BufferReader(b"\0" * 100 + tail)
    _refuse_encrypted(source, SimpleNamespace(serialized_size=1116))  # plain: accepted
    with pytest.raises(ValueError, match="Parquet modular encryption"):
        _refuse_encrypted(source, SimpleNamespace(serialized_size=1088))


def test_negative_row_count_and_absent_fields(tmp_path: Path):
    import struct

    good = _write_ipc(tmp_path / "a.arrow", pa.table({"x": [1, 2]}).to_batches()).read_bytes()
    length = int.from_bytes(good[-10:-6], "little")
    footer = _Table.root(good[len(good) - 10 - length : len(good) - 10])
    offset = struct.unpack_from("<q", footer.buf, footer.vector(3)[0])[0]
    header = _Table.root(good[offset + 8 :]).table(2)
    assert header is not None
    at = offset + 8 + header._field(0)  # type: ignore[operator]
    bad = _corrupt(good, at, (-2).to_bytes(8, "little", signed=True))
    with pytest.raises(ValueError, match=r"record batch 0 has no valid row count \(-2\)"):
        record_batches(lambda at, n: bad[at : at + n], len(bad))
    # A table whose vtable lists no fields: absent vectors are empty, absent scalars default.
    empty = _Table.root(struct.pack("<IHHi", 8, 4, 4, 4))
    assert empty.vector(3) == (0, 0) and empty.scalar(0, "<q", 7) == 7 and empty.table(2) is None


def test_formats_without_footers_store_none():
    arrow = get_format("arrow")
    assert arrow.dump_footer(None) == b"" and arrow.load_footer(b"") is None
