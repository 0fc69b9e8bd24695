"""What differs between object stores (S3, GCS, Azure): where a filesystem sends its requests,
the credentials it read on its own, and what one of its errors means, in a few words.

Nothing here does I/O: each function reads attributes of an fsspec filesystem or of an
exception (and the exceptions it was raised from).

- ``endpoint(fs)``: the service a filesystem talks to, e.g. ``http://127.0.0.1:4443`` (GCS
  with ``endpoint_url`` or ``STORAGE_EMULATOR_HOST``), ``https://acct.blob.core.windows.net/``
  (Azure: the account is part of it), the S3 ``endpoint_url``; ``""`` for local files.
- ``credentials(fs)``: secrets an SDK took from the environment (``AZURE_STORAGE_KEY``, ...).
- ``cause(exc)``: ``"access denied (403)"``, ``"cannot connect to 127.0.0.1:9 (connection
  refused)"``, ``"timed out"``, ... for messages.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from typing import Any

__all__ = ["cause", "chain", "credentials", "endpoint", "http_status", "without_sdk_retries"]

# Filesystem attributes that hold a credential (adlfs; gcsfs keeps its token in `credentials`).
_CREDENTIAL_ATTRS = ("account_key", "sas_token", "connection_string", "client_secret", "token")
_STATUS_WORDS = {401: "not authenticated (401)", 403: "access denied (403)", 404: "not found (404)"}
# Messages of SDKs that carry no status attribute (gcsfs raises OSError("Forbidden: ...")).
_STATUS_PREFIXES = {"forbidden": 403, "unauthorized": 401}
_LONGEST_CAUSE = 300
# Where credential providers raise from: their failures name the credentials, not the store.
_AUTH_MODULES = ("google.auth", "google.oauth2", "azure.identity")


def without_sdk_retries(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for a filesystem of ``protocol`` whose SDK makes no retries of its own where
    the user set none: botocore ``max_attempts: 1`` (s3fs's, gcsfs's and the Azure SDK's are
    switched off on the filesystem: ``base.compat.no_sdk_retries``)."""
    if protocol not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    return {**options, "config_kwargs": config}


def endpoint(fs: Any) -> str:
    """The URL of the service ``fs`` sends requests to, ``""`` when it has none."""
    client = getattr(fs, "service_client", None)  # Azure: the account URL (less a SAS query)
    if client is not None:
        return str(getattr(client, "url", "") or "").partition("?")[0]
    base = getattr(fs, "base", None)  # GCS: "<location>/storage/v1/"
    if isinstance(base, str) and base.endswith("/storage/v1/"):
        return base[: -len("/storage/v1/")]
    for owner in (fs, getattr(fs, "client_kwargs", None) or {}):  # S3
        url = owner.get("endpoint_url") if isinstance(owner, dict) else None
        url = url or getattr(owner, "endpoint_url", None)
        if isinstance(url, str) and url:
            return url
    return ""


def credentials(fs: Any) -> tuple[str, ...]:
    """String credentials the filesystem holds (also those it read from the environment)."""
    found = (getattr(fs, name, None) for name in _CREDENTIAL_ATTRS)
    held = getattr(getattr(fs, "credentials", None), "credentials", None)  # gcsfs
    token = getattr(held, "token", None)
    return tuple(v for v in (*found, token) if isinstance(v, str) and v)


def cause(exc: BaseException) -> str:
    """What went wrong, in a few words and one line, from ``exc`` and what it was raised from."""
    links = list(chain(exc))
    if type(exc).__module__.startswith(_AUTH_MODULES):
        return f"cannot get credentials: {_first_line(exc)}"
    status = next((s for s in map(http_status, links) if s is not None), None)
    if status is not None:
        return f"{_STATUS_WORDS.get(status, f'HTTP {status}')}: {_first_line(exc)}"
    for link in links:
        connection = _connection_failure(link)
        if connection:
            return connection
    return _first_line(exc)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an SDK attached to ``exc`` (botocore, aiohttp, gcsfs, azure-core)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    for name in ("status", "status_code", "code"):
        status = getattr(exc, name, None)
        if isinstance(status, int) and 400 <= status < 600:
            return status
    if type(exc) is OSError:  # gcsfs: OSError("Forbidden: <path>\n<message>")
        head = str(exc).split(":", 1)[0].strip().lower()
        return _STATUS_PREFIXES.get(head)
    return None


def _connection_failure(exc: BaseException) -> str:
    """``"cannot connect to host:port (...)"`` or ``"timed out"``, ``""`` when not one."""
    where = _host_port(exc)
    if isinstance(exc, socket.gaierror) or type(exc).__name__ == "ClientConnectorDNSError":
        return f"cannot resolve the host name{where} (DNS)"
    if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
        return f"cannot connect{where or ' to the endpoint'} (connection refused)"
    if isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower():
        return f"timed out{where}"
    return ""


def _host_port(exc: BaseException) -> str:
    host, port = getattr(exc, "host", None), getattr(exc, "port", None)
    return f" to {host}:{port}" if host else ""


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n", 1)[0].split()) or "(no message)"
    if len(text) > _LONGEST_CAUSE:
        text = text[: _LONGEST_CAUSE - 3] + "..."
    module = type(exc).__module__.split(".")[0]
    name = type(exc).__name__ if module == "builtins" else f"{module}.{type(exc).__name__}"
    return f"{name}: {text}"
