"""What a user sees when object storage is not right, on S3, GCS and Azure alike.

A failed listing is never "no such file": 401, 403, 5xx, a refused connection, a host name that
does not resolve and a failed token refresh are each a ``DataSourceError`` naming the URL, the
endpoint and the cause, raised within seconds; the command line answers with one line and exit
status 2. Credentials with ``/``, ``+``, ``=`` and ``%`` in them appear in no message, log line
or CLI output in any spelling (raw, percent-encoded, base64), even when the server echoes the
request (URL and headers) into its error. Transient faults (5xx, resets, truncated bodies) are
retried to an epoch equal to a clean one.

Every server here is on 127.0.0.1: a small HTTP server that answers every request with one
status, a closed port, the emulators of ``_cloudservers``; DNS is answered by a stub.
"""

from __future__ import annotations

import base64
import errno
import http.server
import json
import logging
import os
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import _harness
import fsspec
import pyarrow as pa
import pytest
from _cloudservers import (  # noqa: F401
    AZURITE_ACCOUNT,
    BACKENDS,
    Store,
    azure_options,
    azurite_fixture,
    gcs_emulator_fixture,
    gcs_options,
    store_fixture,
)
from _data import write_dataset
from _faultproxy import FaultProxy, every
from _s3server import s3_fixture, s3_server_fixture  # noqa: F401

from torch_dataloader_utils import DataSourceError, StructuredDataset
from torch_dataloader_utils.base.compat import strip_protocol
from torch_dataloader_utils.cli import main
from torch_dataloader_utils.storage.filesystem import Storage
from torch_dataloader_utils.storage.retry import RetryPolicy, is_transient, retry_call

# Credentials with the characters that encodings change.
TOKEN = "ya29.a0SECRET/tok+en=%41z"
KEY_ID = "AKIA/TDU+KEY=%2F0"
SECRET = "s3cr/et+value=%3Dq"
SAS = "sv=2020-08-04&ss=b&sig=SiG/nat+ure=%2Bx"
SECRETS = (TOKEN, KEY_ID, SECRET, "SiG/nat+ure=%2Bx")
BOUND_SECONDS = 15  # 6 attempts with 0.1 s doubling waits: ~3 s; generous for a loaded machine


def _spellings(secret: str) -> list[str]:
    b64 = base64.b64encode(secret.encode()).decode()
    return [secret, quote(secret, safe=""), quote(secret), quote_plus(secret), b64, b64.rstrip("=")]


def _assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            for spelled in _spellings(secret):
                assert spelled not in text, (secret, spelled, text[:2000])


class _Answering:
    """An HTTP server on 127.0.0.1 answering every request with ``status`` and an error that
    echoes the request line and headers (as a careless proxy or SDK might)."""

    def __init__(self, status: int) -> None:
        self.requests = 0
        answering = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                answering.requests += 1
                echo = f"{self.command} {self.path} {dict(self.headers)}"
                if self.path.startswith(("/storage/", "/download/")):
                    body = json.dumps({"error": {"code": status, "message": echo}}).encode()
                else:
                    code = {401: "AuthenticationFailed", 403: "AccessDenied"}.get(status, "Err")
                    text = f"<Error><Code>{code}</Code><Message>{echo}</Message></Error>"
                    body = text.replace("&", "&amp;").encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PUT = do_POST = _any

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _secret_options(backend: str, endpoint: str) -> dict[str, Any]:
    """Options for ``backend`` at ``endpoint`` carrying the test's credentials."""
    if backend == "s3":
        config = {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}
        return {"key": KEY_ID, "secret": SECRET, "endpoint_url": endpoint, "config_kwargs": config}
    if backend == "gcs":
        from google.oauth2.credentials import Credentials

        return gcs_options(endpoint, token=Credentials(token=TOKEN))
    blob = f"{endpoint}/{AZURITE_ACCOUNT}"
    return {"connection_string": f"BlobEndpoint={blob};SharedAccessSignature={SAS}"}


_URLS = {"s3": "s3://bkt/train/", "gcs": "gs://bkt/train/", "azure": "abfs://cont/train/"}


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TDU_CACHE_DIR", str(tmp_path / "index-cache"))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def answering(request: pytest.FixtureRequest) -> Iterator[_Answering]:
    server = _Answering(request.param)
    yield server
    server.close()


def _fail(url: str, options: dict[str, Any]) -> tuple[DataSourceError, float, str]:
    """The error building a dataset over ``url`` raises, seconds taken, the full traceback."""
    began = time.monotonic()
    with pytest.raises(DataSourceError) as info:
        StructuredDataset(url, storage_options=options)
    seconds = time.monotonic() - began
    return info.value, seconds, "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("answering", "words", "attempts"),
    [
        (403, "access denied (403)", 1),
        (401, "not authenticated (401)", 1),
        (503, "HTTP 503", 6),
    ],
    indirect=["answering"],
)
def test_an_answer_of_401_403_or_5xx_is_a_data_source_error(
    backend: str,
    answering: _Answering,
    words: str,
    attempts: int,
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.DEBUG, logger="torch_dataloader_utils")
    url = _URLS[backend]
    error, seconds, trace = _fail(url, _secret_options(backend, answering.endpoint))
    message = str(error)
    at = answering.endpoint + (f"/{AZURITE_ACCOUNT}/" if backend == "azure" else "")
    assert f"cannot list {url} at {at} " in message, message
    assert words in message and "\n" not in message
    assert seconds < BOUND_SECONDS
    ours = [r.getMessage() for r in caplog.records if r.name == "torch_dataloader_utils"]
    retries = [m for m in ours if "attempt " in m]
    assert len(retries) == attempts - 1  # only the 5xx is retried, by one layer:
    assert answering.requests <= 3 * attempts  # the SDK's own retries are off
    _assert_no_secret(message, trace, *ours)
    if attempts > 1:
        assert "attempt 6 of 6" in retries[-1] and "after 6 attempts" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_connection_is_an_error_within_seconds(backend: str):
    endpoint = _closed_port()
    error, seconds, _ = _fail(_URLS[backend], _secret_options(backend, endpoint))
    port = endpoint.rsplit(":", 1)[1]
    assert f"cannot connect to 127.0.0.1:{port} (connection refused)" in str(error), error
    assert _URLS[backend] in str(error) and "after 6 attempts" in str(error)
    assert seconds < BOUND_SECONDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_host_name_that_does_not_resolve_fails_at_once(
    backend: str, monkeypatch: pytest.MonkeyPatch
):
    real = socket.getaddrinfo

    def stub(host: Any, *args: Any, **kwargs: Any) -> Any:  # no DNS query leaves the machine
        if str(host).endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", stub)
    endpoint = "http://storage.tdu-test.invalid:8080"
    error, seconds, _ = _fail(_URLS[backend], _secret_options(backend, endpoint))
    assert "cannot resolve the host name" in str(error) and endpoint in str(error), error
    assert seconds < BOUND_SECONDS


@pytest.mark.gcs
def test_a_failed_token_refresh_is_an_error_naming_the_url(gcs_emulator: str):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    account = {
        "type": "service_account",
        "client_email": "tdu@tdu-test.iam.gserviceaccount.com",
        "private_key": pem,
        "private_key_id": "tdu0key/+=",
        "token_uri": f"{_closed_port()}/token",  # the refresh is refused, on loopback
        "project_id": "tdu-test",
    }
    options = gcs_options(gcs_emulator, token=account)
    error, seconds, trace = _fail("gs://bkt/train/", options)
    assert "gs://bkt/train/" in str(error) and "cannot get credentials" in str(error), error
    assert "TransportError" in str(error)
    assert seconds < BOUND_SECONDS
    assert pem.splitlines()[1] not in trace  # a line of the private key


@pytest.mark.azure
def test_a_wrong_azure_key_is_access_denied(azurite: str):
    wrong = base64.b64encode(b"not/the+key=" * 4).decode()
    options = azure_options(azurite, key=wrong)
    error, seconds, trace = _fail("abfs://cont/train/", options)
    assert "abfs://cont/train/" in str(error) and azurite in str(error)
    assert "access denied (403)" in str(error), error
    assert wrong not in trace and seconds < BOUND_SECONDS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("answering", [403], indirect=True)
def test_the_cli_answers_one_line_and_exit_2(
    backend: str, answering: _Answering, capsys: pytest.CaptureFixture[str]
):
    options = _secret_options(backend, answering.endpoint)
    if backend == "gcs":
        options["token"] = "anon"
    words = [f"{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in options.items()]
    argv = ["plan", _URLS[backend]] + [a for w in words for a in ("--storage-option", w)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("torch_dataloader_utils plan: error: cannot list ")
    assert "access denied (403)" in err
    _assert_no_secret(err)


@pytest.mark.parametrize("store", [b for b in BACKENDS if b.values[0] != "s3"], indirect=True)
def test_epoch_under_transient_faults_equals_the_clean_epoch(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # S3: tests/test_faults.py
    monkeypatch.setenv("TDU_RETRY_BASE_DELAY", "0.01")
    for path in write_dataset(tmp_path / "src", (90, 60, 110), row_group_size=10):
        store.put_bytes(f"data/{Path(path).name}", Path(path).read_bytes())
    case: dict[str, Any] = {"path": store.url("data"), "batch_size": 16, "split_bytes": 1}
    clean = _harness.run_epoch({**case, "storage_options": store.options})
    faults = every(3, ["503", "reset", "truncate"], methods=("GET", "HEAD"))
    with FaultProxy(store.endpoint, faults) as proxy:
        options = store.with_endpoint(proxy.endpoint)
        faulty = _harness.run_epoch({**case, "storage_options": options, "shuffle": False})
    assert faulty == clean
    assert sum(proxy.faults.values()) >= 4, proxy.faults


def _message(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The message of the storage error ``fn(*args, **kwargs)`` raises."""
    with pytest.raises((FileNotFoundError, DataSourceError)) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _read(storage: Storage, path: str) -> bytes:
    return storage.remote(path).get(0, 8)


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_every_missing_thing_is_named_by_its_url(store: Store):
    store.put_table("data/a.parquet", pa.table({"id": [1, 2]}))
    storage = Storage(store.url(""), store.options)
    missing = f"{store.scheme}://tdu-missing-{store.bucket}/train/"
    for url in (missing, missing + "a.parquet", store.url("nope/"), store.url("nope.parquet")):
        assert url in _message(StructuredDataset, url, storage_options=store.options)
    for url in (missing + "a.parquet", store.url("data/b.parquet")):
        path = strip_protocol(storage.fs, url)
        assert url in _message(storage.remote, path), url
        storage._sizes[path] = 8  # listed, then removed: the read names it
        assert url in _message(_read, storage, path), url


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("answering", [403], indirect=True)
def test_a_denied_open_or_read_names_the_url(backend: str, answering: _Answering):
    storage = Storage(_URLS[backend], _secret_options(backend, answering.endpoint))
    url = _URLS[backend] + "a.parquet"
    path = strip_protocol(storage.fs, url)
    opened = _message(storage.remote, path)
    storage._sizes[path] = 8
    read = _message(_read, storage, path)
    assert url in opened and "access denied (403)" in opened, opened
    assert url in read and "access denied (403)" in read, read


def test_local_and_memory_errors_name_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    write_dataset(tmp_path / "data", (4,))
    memory = f"memory://tdu-{uuid.uuid4().hex}"
    for url in (str(tmp_path / "nope"), f"{memory}/train/", f"{memory}/a.parquet"):
        assert url in _message(StructuredDataset, url)
    storage = Storage(memory)
    path = strip_protocol(storage.fs, f"{memory}/a.parquet")
    assert f"cannot open memory://{path}" in _message(storage.remote, path)  # memory:///tdu-
    missing = str(tmp_path / "data" / "gone.parquet")
    assert missing in _message(Storage(missing).open, missing)

    def denied(path: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "scandir", denied)
    root = str(tmp_path / "data")
    message = _message(StructuredDataset, root)
    assert f"cannot list {root}" in message and "Permission denied" in message, message


class _Status(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


def _wrapping(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(
    "error",
    [
        ValueError("invalid range for s3://bucket/timeout/file.parquet"),
        OSError(errno.EINVAL, "Invalid argument", "s3://bucket/data/ 500 rows.parquet"),
        RuntimeError("cannot read 'gs://bkt/connection reset/a.parquet'"),
        _wrapping(RuntimeError("s3://bucket/timeout/a.parquet"), FileNotFoundError("gone")),
        _wrapping(RuntimeError("s3://bucket/ 503/a.parquet"), PermissionError("denied")),
        _wrapping(OSError("reading bkt/timeout/k timed out"), _Status(404)),
    ],
    ids=repr,
)
def test_a_path_in_a_permanent_error_is_not_read_as_transient(error: BaseException):
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        retry_call(failing, RetryPolicy(attempts=5, base_delay=0))
    assert calls == [1]


@pytest.mark.parametrize(
    "error",
    [
        OSError("An error occurred (503) when calling the GetObject operation"),
        RuntimeError("HTTP 500: s3://bucket/key"),
        RuntimeError("500 Internal Server Error for url 'http://127.0.0.1:9/bkt/o'"),
        ValueError("Read timed out. (read timeout=5) on s3://bucket/a.parquet"),
        _wrapping(RuntimeError("s3://bucket/timeout/a.parquet"), _Status(503)),
        _wrapping(FileNotFoundError("s3://b/k"), ConnectionResetError(104, "reset")),
    ],
    ids=repr,
)
def test_transient_errors_are_still_told_by_their_own_words(error: BaseException):
    assert is_transient(error) == (not isinstance(error, FileNotFoundError))


def _reachable(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception reachable from it: causes, contexts, exceptions in args."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        link = todo.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        todo += [e for e in (link.__cause__, link.__context__) if e is not None]
        todo += [a for a in link.args if isinstance(a, BaseException)]


def _texts(error: BaseException) -> list[str]:
    """str and repr of every reachable exception, its args and notes."""
    return [
        text
        for link in _reachable(error)
        for text in (str(link), repr(link), repr(link.args), *getattr(link, "__notes__", ()))
    ]


def _caught(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("answering", [403], indirect=True)
def test_no_secret_is_reachable_from_a_storage_error(backend: str, answering: _Answering):
    # The server echoes each request's headers (credentials) into its error.
    options = _secret_options(backend, answering.endpoint)
    listing = _caught(StructuredDataset, _URLS[backend], storage_options=options)
    storage = Storage(_URLS[backend], options)
    path = strip_protocol(storage.fs, _URLS[backend] + "a.parquet")
    opening = _caught(storage.remote, path)
    storage._sizes[path] = 8
    reading = _caught(_read, storage, path)
    for error in (listing, opening, reading):
        assert isinstance(error, DataSourceError), repr(error)
        _assert_no_secret(*_texts(error))


def test_no_secret_is_reachable_when_the_sdk_names_it(monkeypatch: pytest.MonkeyPatch):
    options = {"token": TOKEN}

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"token {TOKEN} is malformed")

    with monkeypatch.context() as patched:
        patched.setattr(fsspec.core, "url_to_fs", refuse)
        setup = _caught(Storage, "memory://tdu-secret/", options)
    storage = Storage("memory://tdu-secret/", options)

    def fail(*args: Any, **kwargs: Any) -> Any:
        error = RuntimeError("the listing failed")
        error.add_note(f"Authorization: Bearer {TOKEN}")
        raise error

    monkeypatch.setattr(storage.fs, "find", fail)
    monkeypatch.setattr(storage.fs, "size", fail)
    listing = _caught(storage.list_files, "memory://tdu-secret/train/")
    opening = _caught(storage.remote, "/tdu-secret/a.parquet")
    assert isinstance(setup, ValueError) and "memory://tdu-secret/" in str(setup)
    for error in (listing, opening):
        assert isinstance(error, DataSourceError) and "RuntimeError" in str(error), error
    for error in (setup, listing, opening):
        _assert_no_secret(*_texts(error))
