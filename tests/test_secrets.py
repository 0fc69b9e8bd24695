"""Which values are credentials and how they are scrubbed (``storage.secrets``), and how an
SDK's error is told in words (``storage.backends.cause``). No server: the exceptions are built
as the SDKs build them.
"""

from __future__ import annotations

import base64
import errno
import socket

from torch_dataloader_utils.storage.backends import cause, http_status
from torch_dataloader_utils.storage.retry import is_transient
from torch_dataloader_utils.storage.secrets import Redactor, secret_values, url_secrets

TOKEN = "ya29.a0SECRET/tok+en=%41"


def test_every_spelling_of_a_secret_is_scrubbed():
    redact = Redactor(secret_values({"token": TOKEN}))
    b64 = base64.b64encode(TOKEN.encode()).decode()
    texts = {
        f"raw {TOKEN} end": "raw *** end",
        "q access_token=ya29.a0SECRET%2Ftok%2Ben%3D%2541&x=1": "q access_token=***&x=1",
        "lower ya29.a0SECRET%2ftok%2ben%3d%2541.": "lower ***.",
        "path ya29.a0SECRET/tok%2Ben%3D%2541": "path ***",
        f"basic {b64}|{b64.rstrip('=')}": "basic ***|***",
        f"urlsafe {base64.urlsafe_b64encode(TOKEN.encode()).decode()}": "urlsafe ***",
    }
    for text, expected in texts.items():
        assert redact(text) == expected


def test_credentials_in_options_connection_strings_and_urls():
    connection = (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=a2V5/K+ey==;"
        "SharedAccessSignature=sv=2020&sig=Si/g+n%3D"
    )
    found = secret_values({"connection_string": connection, "client_kwargs": {"sas": "sv&sig=1"}})
    assert {connection, "a2V5/K+ey==", "Si/g+n="} <= set(found)
    assert "acct" not in found and "2020" not in found  # the account and version are not secret
    assert url_secrets("abfs://c@acct.dfs.core.windows.net/p?sv=2020&sig=ab%2Bcd") == (
        "ab%2Bcd",
        "ab+cd",
    )
    assert url_secrets("s3://user:pa%2Fss@bucket/key") == ("pa%2Fss", "pa/ss")
    assert Redactor().plus(["abc"])("abc") == "abc"  # shorter than 4: never scrubbed
    assert Redactor(("x/y+z",)).plus(["other"])("x%2Fy%2Bz other") == "*** ***"


class _Http(Exception):
    def __init__(self, message: str, **attrs: object) -> None:
        super().__init__(message)
        self.__dict__.update(attrs)


def _raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


def test_causes_in_words():
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed")
    connector = _raised_from(_Http("Cannot connect to host", host="127.0.0.1", port=9), refused)
    connector.errno = errno.ECONNREFUSED  # aiohttp's ClientConnectorError is an OSError
    azure = _raised_from(type("ServiceRequestError", (Exception,), {})("no answer"), connector)
    assert cause(azure) == "cannot connect to 127.0.0.1:9 (connection refused)"
    assert is_transient(azure)
    assert cause(_Http("denied", status_code=403)).startswith("access denied (403): ")
    assert cause(_Http("Invalid Credentials, 401", code=401)).startswith("not authenticated (401)")
    assert cause(OSError("Forbidden: b/bkt/o\nAccess denied")) == (
        "access denied (403): OSError: Forbidden: b/bkt/o"
    )
    assert http_status(_Http("x", response={"ResponseMetadata": {"HTTPStatusCode": 503}})) == 503
    dns = _raised_from(OSError("Could not connect to the endpoint URL"), socket.gaierror(-2, "x"))
    assert cause(dns) == "cannot resolve the host name (DNS)"
    assert not is_transient(dns)  # a host name that does not exist
    assert cause(_raised_from(RuntimeError("x"), TimeoutError())) == "timed out"
    assert cause(ValueError("line one\nline two")) == "ValueError: line one"
