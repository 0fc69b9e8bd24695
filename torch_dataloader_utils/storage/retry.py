"""Retrying transient object-storage failures with bounded exponential backoff and full jitter.

Transient: HTTP 5xx, throttling (``SlowDown``, ``Throttling``, 429), refused and reset
connections, broken pipes, timeouts and truncated bodies, as botocore, aiohttp, gcsfs,
google-auth and azure-core raise them. Everything else (missing object, 401/403, a host name
that does not resolve, a bad range) fails at once. An error is told by its type, errno and HTTP
status first (the first exception of its chain that has one decides); only when none has, by
words of its own text, the paths and URLs it names left out (``s3://b/timeout/x`` is no
timeout). This is the only layer that retries: the SDKs' own retries are switched off
(``base.compat.no_sdk_retries``).

Time bound: ``attempts`` tries, and no new try once ``deadline`` seconds have passed since the
first, so one call gives up after at most ``deadline`` plus one try's own timeout (the SDK's
connect/read timeouts). The policy is a frozen value passed around, never a global; its defaults
(6 attempts, 0.1 s doubling to 5 s, 120 s) can be changed per process with
``TDU_RETRY_ATTEMPTS``, ``TDU_RETRY_BASE_DELAY``, ``TDU_RETRY_MAX_DELAY`` and
``TDU_RETRY_DEADLINE`` (read when a dataset is built).
"""

from __future__ import annotations

import errno
import os
import random
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..base.log import log
from ..base.stages import RETRIES, count
from .backends import cause, chain, http_status

__all__ = [
    "DEFAULT_RETRY",
    "RetryPolicy",
    "is_transient",
    "policy_from_env",
    "retry_call",
    "tries",
]

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
    "internal server error",
)
# A 5xx status in a message: "(503)" (botocore), "HTTP 500", "status code: 502".
_STATUS_TEXT = re.compile(r"\(50[0234]\)|\b(?:http|status|code)\W*(?:code\W*)?50[0234]\b")
# What a message names rather than says: quoted strings and anything with a "/" (paths, URLs).
_NAMES = re.compile(r"'[^']*'|\"[^\"]*\"|\S*/\S*")
# Exception classes (by name) of the SDKs that mean a request failed on its way or mid-answer.
_TRANSIENT_TYPES = frozenset(
    {
        "ServiceRequestError",  # azure-core: no answer (connection, DNS timeouts)
        "ServiceResponseError",  # azure-core: the answer broke off
        "TransportError",  # google-auth: the token endpoint did not answer
        "ClientPayloadError",  # aiohttp: a body cut short
        "ServerDisconnectedError",
    }
)
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """``attempts`` tries in all, none begun after ``deadline`` seconds; waits
    ``min(max_delay, base_delay * 2**n)`` scaled by jitter."""

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    deadline: float = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if min(self.base_delay, self.max_delay, self.deadline) < 0:
            raise ValueError("base_delay, max_delay and deadline must be non-negative")

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
            deadline=float(os.environ.get("TDU_RETRY_DEADLINE", DEFAULT_RETRY.deadline)),
        )
    except ValueError as exc:
        raise ValueError(
            f"invalid TDU_RETRY_* environment setting: {exc}; expected TDU_RETRY_ATTEMPTS a "
            f"positive int and TDU_RETRY_BASE_DELAY/MAX_DELAY/DEADLINE seconds >= 0"
        ) from None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is worth retrying: decided by the
    first exception of the chain whose type, errno or HTTP status says, else by the words of
    their own texts (never by a path they name). ``exc`` itself a ``FileNotFoundError``,
    ``PermissionError``, ... is never retried, whatever it was raised from."""
    links = list(chain(exc))
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    for link in links:
        if isinstance(link, socket.gaierror) and link.errno == socket.EAI_NONAME:
            return False  # a host name that does not exist (botocore calls it a connect error)
    for link in links:
        known = _by_structure(link)
        if known is not None:
            return known
    return any(_by_words(link) for link in links)


def _by_structure(exc: BaseException) -> bool | None:
    """Transient or not by type, errno and HTTP status; ``None`` when none of them says."""
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, (TimeoutError, socket.timeout, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if type(exc).__name__ in _TRANSIENT_TYPES:
        return True
    status = http_status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    return None


def _by_words(exc: BaseException) -> bool:
    """Whether the class name or the message of ``exc``, without the names (paths, URLs,
    quoted strings) it holds, says transient."""
    own = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    text = f"{type(exc).__name__} {_NAMES.sub(' ', own)}".lower()
    return any(word in text for word in _TRANSIENT_WORDS) or bool(_STATUS_TEXT.search(text))


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy = DEFAULT_RETRY,
    *,
    what: str = "a storage call",
    sleep: Callable[[float], None] = time.sleep,
    redact: Callable[[str], str] = str,
) -> T:
    """``fn()``, retried on transient errors; the last error propagates when attempts run out
    or the next try would begin after ``policy.deadline`` seconds.

    Each retry is logged (WARNING, logger ``torch_dataloader_utils``) with ``what`` was tried,
    the error and the attempt, passed through ``redact`` (credentials scrubbed).
    """
    failures, start = 0, time.monotonic()
    while True:
        try:
            return fn()
        except Exception as exc:
            failures += 1
            delay = policy.delay(failures)
            late = time.monotonic() - start + delay > policy.deadline
            if failures >= policy.attempts or late or not is_transient(exc):
                raise
            log.warning(
                "%s",
                redact(
                    f"{what} failed ({cause(exc)}); "
                    f"attempt {failures + 1} of {policy.attempts} in {delay:.2f} s"
                ),
            )
            count(RETRIES)
            sleep(delay)


def tries(exc: BaseException, policy: RetryPolicy, seconds: float) -> str:
    """How a call that raised ``exc`` after ``seconds`` was retried, for its error message."""
    if not is_transient(exc):
        return "(not retried: the error is not transient)"
    if seconds + policy.max_delay < policy.deadline:
        return f"after {policy.attempts} attempts (set TDU_RETRY_ATTEMPTS to retry longer)"
    return f"after {seconds:.0f} s of retries (set TDU_RETRY_DEADLINE to retry longer)"
