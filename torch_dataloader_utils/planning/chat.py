"""Chat data: a column of conversations, the chat template that renders them, and what decides
their tokens.

``Tokenize(column, tokenizer, chat_template=...)`` holds a ``ChatFormat``: the template (the
tokenizer's own ``chat_template``, or a Jinja string), the role names mapped (ShareGPT's
``human``/``gpt`` to ``user``/``assistant``), the names of a message's role and content fields,
and the variables a template sees besides ``messages`` (a transformers tokenizer's special
tokens, ``bos_token`` and so on, as ``apply_chat_template`` passes them). The template compiles
as transformers compiles it: a sandboxed Jinja environment (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, transformers' ``tojson``, ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace``) where ``{% generation %}...{% endgeneration %}`` marks the assistant's text: a
render records each block's character span, the spans ``reading.chat`` turns into labels. No
tokenizer library is imported here (the tokenizer is read by duck typing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import pyarrow as pa
import pyarrow.types as pat
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["REASONING_FIELDS", "ChatFormat", "Spans", "check_roles", "compiled", "recording"]

# transformers' test for the markers (``render_jinja_template``).
_GENERATION = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
# A message's reasoning, under the names transformers fills from each other.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# (start, end) character spans of a render's generation blocks, in the order they closed.
Spans = list[tuple[int, int]]


@dataclass(frozen=True, kw_only=True)
class ChatFormat:
    """How a conversation column renders: ``template``, ``roles`` (a role's name in the data ->
    the name the template sees; others unchanged), the message fields holding the role and the
    content, the ``labels`` column made beside the tokens, and the template's ``variables``."""

    template: str
    roles: Mapping[str, str]
    role_field: str
    content_field: str
    labels: str
    variables: Mapping[str, Any]

    @classmethod
    def of(
        cls,
        tokenizer: object,
        chat_template: bool | str,
        *,
        roles: Mapping[str, str] | None,
        role_field: str,
        content_field: str,
        labels: str,
    ) -> ChatFormat:
        """The format ``Tokenize``'s chat arguments describe (checked)."""
        check_roles("Tokenize roles", roles)
        for key, value in (("role_field", role_field), ("content_field", content_field),
                           ("labels", labels)):  # fmt: skip
            if not isinstance(value, str) or not value:
                raise TypeError(f"Tokenize {key} must be a name, got {value!r}")
        if role_field == content_field:
            raise ValueError(f"Tokenize role_field and content_field are both {role_field!r}")
        variables = getattr(tokenizer, "special_tokens_map", None)
        chat = cls(
            template=_template(tokenizer, chat_template),
            roles=dict(roles or {}),
            role_field=role_field,
            content_field=content_field,
            labels=labels,
            variables=dict(variables) if isinstance(variables, Mapping) else {},
        )
        compiled(chat.template)  # a syntax error now, not in the workers
        return chat

    @property
    def definition(self) -> str:
        """What the fingerprint hashes besides the tokenizer: everything a render depends on."""
        return json.dumps(
            [self.template, sorted(self.roles.items()), self.role_field, self.content_field,
             sorted(self.variables.items())],
            default=str,
        )  # fmt: skip

    def check(self, schema: pa.Schema, column: str, where: str) -> None:
        """Raise unless ``column`` of ``schema`` (of ``where``) is a list of messages: structs
        with text role and content fields, and no column is already named as the labels."""
        kind = schema.field(column).type
        expected = (
            f"a conversation column: list<struct<{self.role_field}: string, "
            f"{self.content_field}: string>> (name other fields with role_field= / "
            f"content_field=)"
        )
        if not (pat.is_list(kind) or pat.is_large_list(kind)) or not pat.is_struct(kind.value_type):
            raise ValueError(
                f"Tokenize column {column!r} of {where} has type {kind}; a chat template needs "
                f"{expected}"
            )
        message = kind.value_type
        for name in (self.role_field, self.content_field):
            index = message.get_field_index(name)
            if index < 0:
                raise ValueError(
                    f"Tokenize column {column!r} of {where}: its messages have no field {name!r} "
                    f"(fields: {[f.name for f in message]}); a chat template needs {expected}"
                )
            if not _is_string(message.field(index).type):
                raise ValueError(
                    f"Tokenize column {column!r} of {where}: field {name!r} of its messages has "
                    f"type {message.field(index).type}; a chat template needs {expected}"
                )
        if self.labels in schema.names and self.labels != column:
            raise ValueError(
                f"Tokenize labels {self.labels!r} is already a column of {where}; name the "
                f"labels otherwise (Tokenize(..., labels=...)) or leave that column out (columns=)"
            )

    def delivered(self, schema: pa.Schema, column: str, output: str) -> pa.Schema:
        """``schema`` with ``column`` replaced, in its place, by the tokens (``list<int32>``)
        and the labels (``list<int64>``: what PyTorch's cross-entropy takes as targets)."""
        index = schema.get_field_index(column)
        schema = schema.set(index, pa.field(output, pa.list_(pa.int32()), nullable=False))
        labels = pa.field(self.labels, pa.list_(pa.int64()), nullable=False)
        return schema.insert(index + 1, labels)


def check_roles(name: str, roles: object) -> None:
    """Raise unless ``roles`` (the argument ``name``) is ``None`` or maps role names to role
    names."""
    if roles is not None and not (
        isinstance(roles, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in roles.items())
    ):
        raise TypeError(f"{name} must map role names to role names, got {roles!r:.200}")


def _is_string(kind: pa.DataType) -> bool:
    return bool(pat.is_string(kind) or pat.is_large_string(kind) or kind == pa.string_view())


def _template(tokenizer: object, chat_template: bool | str) -> str:
    """The template's text: ``chat_template`` itself, or (``True``) the tokenizer's."""
    if chat_template is True:
        template = _own_template(tokenizer)
    elif isinstance(chat_template, str):
        template = chat_template
    else:
        raise TypeError(
            f"Tokenize chat_template must be True (the tokenizer's template) or a template "
            f"string, got {chat_template!r:.80}"
        )
    if not _GENERATION.search(template):
        raise ValueError(
            "Tokenize's chat template has no {% generation %} block: labels need the assistant's "
            "text marked. Wrap what the assistant writes in each turn (its content and the end "
            "of its turn), e.g. {% if message['role'] == 'assistant' %}{% generation %}"
            "{{ message['content'] }}<|im_end|>{% endgeneration %}{% endif %}, as "
            "transformers' return_assistant_tokens_mask requires"
        )
    return template


def _own_template(tokenizer: object) -> str:
    """A transformers tokenizer's ``chat_template`` (of named ones, "default", as transformers)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default")
    if not isinstance(template, str):
        raise ValueError(
            f"Tokenize(..., chat_template=True) renders with the tokenizer's own chat template, "
            f"but {type(tokenizer).__name__} has none (a tokenizers.Tokenizer never does): pass "
            f"the template itself, chat_template='{{% for message in messages %}}...'"
        )
    return template


# ------------------------------------------------------------------ the template, as transformers

# The blocks rendered so far and the spans recorded, while a render records them.
_TRACKING: ContextVar[tuple[list[str], Spans] | None] = ContextVar("chat_spans", default=None)


class _GenerationSpans(jinja2.ext.Extension):
    """``{% generation %}``: records the span of its text in the render (transformers'
    ``AssistantTracker``: the start is the length of the blocks rendered before it closes)."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation", [], [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _generation(self, caller: Callable[[], str]) -> str:
        text = caller()
        tracking = _TRACKING.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
        return text


@contextmanager
def recording(blocks: list[str], spans: Spans) -> Iterator[None]:
    """Record the generation spans of a render whose blocks are appended to ``blocks``."""
    token = _TRACKING.set((blocks, spans))
    try:
        yield
    finally:
        _TRACKING.reset(token)


class _TemplateDict:
    """``dict`` in a template: builds dicts, and nothing else is reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` in a template, refusing underscored names (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}. Please rename the attribute."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    """``template`` compiled in the environment transformers' ``apply_chat_template`` uses (once
    per process)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationSpans, jinja2.ext.loopcontrols],
    )  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )  # fmt: skip
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(
            f"Tokenize's chat template does not compile: {exc.message} (line {exc.lineno})"
        ) from exc
