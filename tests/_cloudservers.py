"""Three object stores for tests, all on 127.0.0.1: S3 (moto, ``_s3server``), GCS
(``gcp-storage-emulator`` from PyPI) and Azure Blob (Azurite from npm, installed by
``make install`` into ``.tools/azurite``).

The GCS and Azure emulators run as processes of their own, started once per session on a free
port (they report the port they bound) and stopped by their PID. ``store`` is parametrised over
the three backends and gives each test a fresh bucket / container. Nothing reaches a real
cloud endpoint: gcsfs gets ``token="anon"`` and the emulator's ``endpoint_url``, adlfs a
connection string naming Azurite, and gcsfs's gRPC bucket probe (which would stall 60 s per call
against an emulator) is switched off before gcsfs is imported.
"""

from __future__ import annotations

import io
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _emulator import Emulator
from _s3server import S3Env

# Read by gcsfs when it is imported: no gRPC probe of the bucket type.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "BACKENDS",
    "Store",
    "azure_options",
    "azurite_fixture",
    "gcs_emulator_fixture",
    "gcs_options",
    "store_fixture",
]

AZURITE = Path(__file__).resolve().parents[1] / ".tools/azurite/node_modules/.bin/azurite-blob"
# Azurite's well-known development account (published with Azurite; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_GCS_MAIN = """
import sys, time
from gcp_storage_emulator.server import create_server
server = create_server("127.0.0.1", 0, in_memory=True)
server.start()
while server._api._httpd is None:
    time.sleep(0.01)
print("listening on http://127.0.0.1:%d" % server._api._httpd.server_address[1], flush=True)
sys.stdin.read()  # until the test session closes our stdin or stops us
"""


def gcs_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """gcsfs options for ``endpoint``: anonymous, never Google's token endpoint."""
    return {"token": "anon", "project": "tdu-test", "endpoint_url": endpoint, **extra}


def azure_options(endpoint: str, key: str = AZURITE_KEY) -> dict[str, Any]:
    """adlfs options for the Azurite ``endpoint`` (``http://127.0.0.1:<port>``)."""
    blob = f"{endpoint}/{AZURITE_ACCOUNT}"
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
        f"BlobEndpoint={blob};"
    )
    return {"connection_string": connection}


@dataclass
class Store:
    """One test's bucket on one backend: URLs, options, and a filesystem of the test's own."""

    name: str
    scheme: str
    bucket: str
    endpoint: str
    options: dict[str, Any] = field(default_factory=dict)
    _fs: Any = None

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def fs(self) -> Any:
        """A filesystem of the test's own (not the one the library builds)."""
        import fsspec

        if self._fs is None:
            self._fs = fsspec.filesystem(self.scheme, skip_instance_cache=True, **self.options)
        self._fs.invalidate_cache()
        return self._fs

    def put_bytes(self, key: str, data: bytes) -> None:
        self.fs().pipe_file(self.url(key), data)

    def put_table(self, key: str, table: pa.Table, **write_kwargs: Any) -> None:
        buffer = io.BytesIO()
        pq.write_table(table, buffer, **write_kwargs)
        self.put_bytes(key, buffer.getvalue())

    def with_endpoint(self, endpoint: str) -> dict[str, Any]:
        """This store's options pointing at ``endpoint`` instead (a proxy in front of it)."""
        return _OPTIONS[self.name](endpoint)


def _s3_options(endpoint: str) -> dict[str, Any]:
    from _s3server import storage_options

    return storage_options(endpoint, retries={"max_attempts": 1, "mode": "standard"})


_OPTIONS = {"s3": _s3_options, "gcs": gcs_options, "azure": azure_options}
BACKENDS = [
    pytest.param("s3", marks=pytest.mark.s3),
    pytest.param("gcs", marks=pytest.mark.gcs),
    pytest.param("azure", marks=pytest.mark.azure),
]


@pytest.fixture(scope="session", name="gcs_emulator")
def gcs_emulator_fixture() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of gcp-storage-emulator, in memory, for the session."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    emulator = Emulator([sys.executable, "-c", _GCS_MAIN], "gcp-storage-emulator")
    try:
        yield emulator.endpoint
    finally:
        emulator.stop()


@pytest.fixture(scope="session", name="azurite")
def azurite_fixture() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of Azurite's blob service, in memory, for the session."""
    pytest.importorskip("adlfs")
    if not AZURITE.exists():
        pytest.skip(f"Azurite is not installed at {AZURITE}: run `make install`")
    command = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", "0"]
    command += ["--inMemoryPersistence", "--skipApiVersionCheck", "--loose", "--silent"]
    emulator = Emulator([*command, "--disableTelemetry"], "Azurite")
    try:
        yield emulator.endpoint
    finally:
        emulator.stop()


@pytest.fixture(name="store", params=BACKENDS)
def store_fixture(request: pytest.FixtureRequest) -> Iterator[Store]:
    """An empty bucket (container) of its own on S3, GCS or Azure."""
    name: str = request.param
    if name == "s3":
        s3: S3Env = request.getfixturevalue("s3")
        yield Store("s3", "s3", s3.bucket, s3.endpoint, s3.options)
        return
    endpoint = request.getfixturevalue("gcs_emulator" if name == "gcs" else "azurite")
    scheme = "gs" if name == "gcs" else "abfs"
    store = Store(name, scheme, f"tdu-{uuid.uuid4().hex[:12]}", endpoint, _OPTIONS[name](endpoint))
    store.fs().mkdir(store.bucket)
    yield store
