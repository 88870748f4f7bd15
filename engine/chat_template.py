"""Chat templates: untrusted Jinja code from a checkpoint, rendered in an immutable sandbox.

The helpers Hugging Face templates expect (`raise_exception`, `tojson`, `strftime_now`,
`namespace`, `{% generation %}`) are provided; any unsafe attribute access is an error, not a
silent empty string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils

from engine.errors import BatonError


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}…{% endgeneration %}` marks assistant text; we just render it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True
        )
        return body


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing at once on an unsafe attribute instead of returning an
    undefined that renders as empty text (so a probing template is an error, not a no-op)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed"
        )


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as Hugging Face's does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; HF templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; rendering errors become BatonError with the template's message."""

    def __init__(self, source: str) -> None:
        env = _StrictSandbox(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _TemplateNamespace
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise BatonError(
                f"chat template is invalid (line {exc.lineno}): {exc.message}"
            ) from None

    def render(self, variables: Mapping[str, Any]) -> str:
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.SecurityError as exc:
            raise BatonError(f"chat template tried an unsafe operation: {exc}") from None
        except jinja2.TemplateError as exc:
            raise BatonError(f"chat template failed: {exc.message}") from None
        except Exception as exc:  # a template is arbitrary code: any failure is the template's
            raise BatonError(f"chat template failed: {type(exc).__name__}: {exc}") from None
