"""Credentials kept out of every text the library produces: which values are secret, and the
spellings in which a message may hold them.

Secret: the string values of ``storage_options`` keys that name a credential (at any depth),
the account key and shared access signature inside an Azure connection string, the password of
a URL (``scheme://user:password@host``) and the values of a URL query that name a credential
(a SAS token's ``sig``). A backend's filesystem may add the ones it read from the environment
(``storage.backends.credentials``).

A secret is replaced by ``***`` in each spelling in which an SDK or a URL carries it: as it is,
percent-encoded (``/`` kept or not, upper- or lower-case hex, ``+`` for spaces) and in base64
(standard and URL-safe, with or without padding). ``exception_texts`` is every text an exception
carries, to tell whether one may be chained to an error of ours.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, quote_plus, unquote, urlsplit

__all__ = ["Redactor", "exception_texts", "secret_values", "url_secrets"]

# storage_options keys (at any depth) whose values are credentials.
_SECRET_WORDS = (
    "key",
    "secret",
    "token",
    "password",
    "credential",
    "sas",
    "signature",
    "connection_string",
    "sig",
)
# The parts of an Azure connection string that are credentials.
_CONNECTION_SECRETS = ("accountkey", "sharedaccesssignature")
_SHORTEST = 4  # shorter values would scrub ordinary words


def secret_values(options: Mapping[str, Any]) -> tuple[str, ...]:
    """String values of credential-like keys in ``options``, at any depth, longest first."""
    found: set[str] = set()
    for key, value in options.items():
        if isinstance(value, Mapping):
            found.update(secret_values(value))
        elif isinstance(value, str) and _is_secret_key(str(key)):
            found.update(_with_parts(value))
    return _longest_first(found)


def url_secrets(url: str) -> tuple[str, ...]:
    """The password and the credential-like query values of ``url``."""
    parts = urlsplit(url)
    password = parts.password or ""
    return _longest_first({password, unquote(password), *_query_secrets(parts.query)})


@dataclass(frozen=True)
class Redactor:
    """Replaces each of ``secrets`` by ``***`` in every spelling; ``redactor(text)``."""

    secrets: tuple[str, ...] = ()
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spelled = {s for secret in self.secrets for s in _spellings(secret)}
        pattern = "|".join(re.escape(s) for s in _longest_first(spelled))
        object.__setattr__(self, "_pattern", re.compile(pattern) if pattern else None)

    def __call__(self, text: str) -> str:
        return text if self._pattern is None else self._pattern.sub("***", text)

    def plus(self, secrets: Iterable[str]) -> Redactor:
        """This redactor with ``secrets`` added."""
        return Redactor(_longest_first({*self.secrets, *secrets}))


def exception_texts(exc: BaseException) -> Iterator[str]:
    """``str``, ``repr`` and notes of ``exc`` and of every exception reachable from it (causes,
    contexts, exceptions among the args, members of a group), each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        link = todo.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        yield from (str(link), repr(link), *map(str, getattr(link, "__notes__", ())))
        todo += [e for e in (link.__cause__, link.__context__) if e is not None]
        todo += [a for a in link.args if isinstance(a, BaseException)]
        todo += getattr(link, "exceptions", ())


def _is_secret_key(key: str) -> bool:
    return any(word in key.lower() for word in _SECRET_WORDS)


def _with_parts(value: str) -> set[str]:
    """``value`` and, for a connection string, its credential parts (``AccountKey=...``)."""
    found = {value}
    for part in value.split(";"):
        name, _, secret = part.partition("=")
        if name.strip().lower() in _CONNECTION_SECRETS:
            found.add(secret.strip())
            found.update(_query_secrets(secret.strip()))
    return found


def _query_secrets(query: str) -> set[str]:
    """The values of credential-like keys of a URL query (a SAS ``sig``), as written and
    decoded (``+`` stays ``+``: in a SAS it is base64, not a space)."""
    found: set[str] = set()
    for pair in query.split("&"):
        key, _, value = pair.partition("=")
        if _is_secret_key(unquote(key)):
            found.update({value, unquote(value)})
    return found


def _spellings(secret: str) -> set[str]:
    """``secret`` as it is, percent-encoded and in base64."""
    encoded = {quote(secret, safe=""), quote(secret), quote_plus(secret)}
    encoded |= {re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), e) for e in encoded}
    raw = secret.encode()
    b64 = {base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()}
    b64 |= {b.rstrip("=") for b in b64}
    return {secret, *encoded, *b64}


def _longest_first(values: Iterable[str]) -> tuple[str, ...]:
    kept = {v for v in values if len(v) >= _SHORTEST}
    return tuple(sorted(kept, key=lambda v: (-len(v), v)))
