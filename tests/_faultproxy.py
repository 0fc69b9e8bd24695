"""A fault-injecting HTTP reverse proxy on 127.0.0.1, in front of the moto S3 server.

Each request gets a number (0, 1, 2, ... in arrival order) and ``schedule(number, method, path)``
names what happens to it:

- ``"ok"``: forwarded to the upstream server, the response relayed unchanged;
- ``"503"``: an S3 ``ServiceUnavailable`` error response (``SlowDown`` with ``"slowdown"``);
- ``"reset"``: the connection is closed with a TCP reset before any response;
- ``"truncate"``: the upstream response's headers and half its body, then a reset;
- ``"stall"``: nothing for ``stall_seconds``, then a reset (a client read timeout).

The proxy counts what it did in ``faults`` so tests can prove faults were injected.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

__all__ = ["FaultProxy", "every", "on_key"]

Schedule = Callable[[int, str, str], str]

_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>{message}</Message><RequestId>tdu-fault</RequestId></Error>"
)


def every(n: int, faults: list[str], *, methods: tuple[str, ...] = ("GET",)) -> Schedule:
    """Every ``n``-th request of ``methods`` gets the next fault of ``faults``, cyclically."""
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def schedule(number: int, method: str, path: str) -> str:
        if method not in methods:
            return "ok"
        with lock:
            seen["n"] += 1
            count = seen["n"]
        if count % n:
            return "ok"
        return faults[(count // n - 1) % len(faults)]

    return schedule


def on_key(key: str, fault: str) -> Schedule:
    """``fault`` for every request whose path ends with ``key``; everything else passes."""
    return lambda number, method, path: fault if path.split("?")[0].endswith(key) else "ok"


class FaultProxy:
    """``with FaultProxy(upstream, schedule) as proxy:`` then use ``proxy.endpoint``."""

    def __init__(self, upstream: str, schedule: Schedule, *, stall_seconds: float = 2.0) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.schedule = schedule
        self.stall_seconds = stall_seconds
        self.faults: Counter[str] = Counter()
        self._number = 0
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _next(self, method: str, path: str) -> str:
        with self._lock:
            number, self._number = self._number, self._number + 1
        action = self.schedule(number, method, path)
        if action != "ok":
            with self._lock:
                self.faults[action] += 1
        return action

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                action = proxy._next(self.command, self.path)
                if action == "reset":
                    return self._reset()
                if action == "stall":
                    time.sleep(proxy.stall_seconds)
                    return self._reset()
                if action in ("503", "slowdown"):
                    return self._error(action)
                status, reason, headers, payload = self._forward(body)
                if action == "truncate" and len(payload) > 1:
                    return self._send(
                        status, reason, headers, payload[: len(payload) // 2], cut=True
                    )
                return self._send(status, reason, headers, payload)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

            def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    response = conn.getresponse()
                    payload = response.read()
                    return response.status, response.reason, response.getheaders(), payload
                finally:
                    conn.close()

            def _send(
                self,
                status: int,
                reason: str,
                headers: list[tuple[str, str]],
                payload: bytes,
                *,
                declared: int | None = None,
            ) -> None:
                """The response; with ``declared`` longer than ``payload``, cut off by a reset."""
                self.send_response(status, reason)
                for name, value in headers:
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                length = len(payload) if declared is None else declared
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)
                self.wfile.flush()
                if declared is not None:
                    self._reset()

            def _error(self, action: str) -> None:
                code, message = (
                    ("SlowDown", "Please reduce your request rate.")
                    if action == "slowdown"
                    else ("ServiceUnavailable", "Service is unable to handle request.")
                )
                body = _ERROR_XML.format(code=code, message=message).encode()
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _reset(self) -> None:
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

        return Handler
