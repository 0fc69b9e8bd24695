"""Retrying transient object-storage failures with bounded exponential backoff and full jitter.

Transient: HTTP 5xx, throttling (``SlowDown``, ``Throttling``, 429), connection resets, broken
pipes, timeouts and truncated bodies. Everything else (missing object, access denied, a bad
range) fails at once. The policy is a frozen value passed around, never a global; its defaults
can be changed per process with ``TDU_RETRY_ATTEMPTS``, ``TDU_RETRY_BASE_DELAY`` and
``TDU_RETRY_MAX_DELAY`` (read when a dataset is built).
"""

from __future__ import annotations

import errno
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ._log import log

__all__ = ["DEFAULT_RETRY", "RetryPolicy", "is_transient", "policy_from_env", "retry_call"]

T = TypeVar("T")

_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EAGAIN,
        errno.EREMOTEIO,  # s3fs maps InternalError/ServiceUnavailable-like codes here
        errno.EBUSY,
    }
)
# Words in an exception's class name or text that mark a retryable failure, as S3, GCS and
# Azure spell them (botocore, aiohttp and s3fs wrap the same events in different classes).
_TRANSIENT_WORDS = (
    "slowdown",
    "slow down",
    "throttl",
    "too many requests",
    "reduce your request rate",
    "serviceunavailable",
    "service unavailable",
    "internalerror",
    "internal error",
    "bad gateway",
    "gateway timeout",
    "requesttimeout",
    "timeout",
    "timed out",
    "connection reset",
    "connection aborted",
    "connectionerror",
    "connection was closed",
    "server disconnected",
    "remote end closed",
    "broken pipe",
    "incompleteread",
    "incomplete read",
    "payloaderror",
    "response ended prematurely",
    "not enough data",
    "endpointconnectionerror",
    "could not connect",
    "responseparsererror",
    " 500",
    " 502",
    " 503",
    " 504",
    "(500)",
    "(502)",
    "(503)",
    "(504)",
)
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """``attempts`` tries in all; waits ``min(max_delay, base_delay * 2**n)`` scaled by jitter."""

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("base_delay and max_delay must be non-negative")

    def delay(self, failures: int) -> float:
        """Full-jitter delay before retry number ``failures`` (1-based)."""
        ceiling = min(self.max_delay, self.base_delay * 2 ** (failures - 1))
        return random.uniform(0.0, ceiling)


DEFAULT_RETRY = RetryPolicy()


def policy_from_env() -> RetryPolicy:
    """``DEFAULT_RETRY`` with any ``TDU_RETRY_*`` environment overrides applied."""
    try:
        return RetryPolicy(
            attempts=int(os.environ.get("TDU_RETRY_ATTEMPTS", DEFAULT_RETRY.attempts)),
            base_delay=float(os.environ.get("TDU_RETRY_BASE_DELAY", DEFAULT_RETRY.base_delay)),
            max_delay=float(os.environ.get("TDU_RETRY_MAX_DELAY", DEFAULT_RETRY.max_delay)),
        )
    except ValueError as exc:
        raise ValueError(
            f"invalid TDU_RETRY_* environment setting: {exc}; expected TDU_RETRY_ATTEMPTS a "
            f"positive int and TDU_RETRY_BASE_DELAY/TDU_RETRY_MAX_DELAY seconds >= 0"
        ) from None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is worth retrying."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _transient_here(current):
            return True
        if isinstance(current, _PERMANENT_TYPES):
            return False
        current = current.__cause__ or current.__context__
    return False


def _transient_here(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, (TimeoutError, socket.timeout, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    status = _http_status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in _TRANSIENT_WORDS)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status botocore/aiohttp attached to ``exc``, if any."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and status >= 400 else None


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy = DEFAULT_RETRY,
    *,
    what: str = "a storage call",
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()``, retried on transient errors; the last error propagates when attempts run out.

    Each retry is logged (WARNING, logger ``torch_dataloader_utils``) with ``what`` was tried,
    the error and the attempt.
    """
    failures = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            failures += 1
            if failures >= policy.attempts or not is_transient(exc):
                raise
            delay = policy.delay(failures)
            log.warning(
                "%s failed (%s: %s); attempt %d of %d in %.2f s",
                what, type(exc).__name__, exc, failures + 1, policy.attempts, delay,
            )  # fmt: skip
            sleep(delay)
