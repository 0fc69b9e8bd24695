"""A real S3 endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1, a free port, fake keys.

Import the fixtures into a test module (``from _s3server import s3_fixture, s3_server_fixture``).
The server runs in a process of its own (``_emulator``), started once per session; ``s3`` resets
its state and creates a fresh bucket for each test. Traffic never leaves the loopback interface:
the credentials are fakes passed explicitly, the instance-metadata lookup is disabled and proxies
are bypassed for 127.0.0.1.
"""

from __future__ import annotations

import io
import os
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _emulator import Emulator

__all__ = ["FAKE_KEY", "FAKE_SECRET", "S3Env", "s3_fixture", "s3_server_fixture", "storage_options"]

FAKE_KEY = "AKIAFAKETDU0KEY12345"
FAKE_SECRET = "fAkE/SeCrEt+tdu0000000000000000000000042"
BUCKET = "tdu-test"
_ENV = {
    "AWS_ACCESS_KEY_ID": FAKE_KEY,
    "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
_UNSET = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
)


@dataclass
class S3Env:
    """One test's view of the server: endpoint, bucket and ready-made storage options."""

    endpoint: str
    bucket: str = BUCKET
    options: dict[str, Any] = field(default_factory=dict)
    _fs: Any = None

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def fs(self) -> Any:
        """An s3fs filesystem of the test's own (not the one the library caches)."""
        import s3fs

        if self._fs is None:
            self._fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)
        self._fs.invalidate_cache()
        return self._fs

    def put_table(self, key: str, table: pa.Table, **write_kwargs: Any) -> None:
        """Write ``table`` as Parquet to ``s3://bucket/key``."""
        buffer = io.BytesIO()
        pq.write_table(table, buffer, **write_kwargs)
        self.put_bytes(key, buffer.getvalue())

    def put_bytes(self, key: str, data: bytes) -> None:
        self.fs().pipe_file(self.url(key), data)


def storage_options(endpoint: str, **config: Any) -> dict[str, Any]:
    """Options for ``endpoint`` with botocore's retries and timeouts kept small for tests."""
    return {
        "key": FAKE_KEY,
        "secret": FAKE_SECRET,
        "endpoint_url": endpoint,
        "config_kwargs": {
            "retries": {"max_attempts": 2, "mode": "standard"},
            "connect_timeout": 2,
            "read_timeout": 5,
            **config,
        },
    }


# moto in a process of its own: its requests are served on the other core, neither under the
# test process's GIL nor under coverage's tracer (test_resume_at_random_checkpoints[s3-*], 12
# examples each, with --cov: 25 + 23 s -> 16 + 18 s).
_MOTO_MAIN = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("listening on http://%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # until the test session closes our stdin or stops us
"""


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a moto S3 server running for the whole session."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _ENV.items():
            mp.setenv(name, value)
        for name in _UNSET:
            mp.delenv(name, raising=False)
        server = Emulator([sys.executable, "-c", _MOTO_MAIN], "moto")
        try:
            yield server.endpoint
        finally:
            server.stop()


@pytest.fixture(name="s3")
def s3_fixture(s3_server: str) -> Iterator[S3Env]:
    """A reset server with an empty bucket ``tdu-test``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    opener.open(urllib.request.Request(f"{s3_server}/moto-api/reset", method="POST")).close()
    env = S3Env(s3_server, options=storage_options(s3_server))
    env.fs().mkdir(BUCKET)
    yield env
    assert os.environ.get("AWS_ACCESS_KEY_ID") == FAKE_KEY  # never a real key
