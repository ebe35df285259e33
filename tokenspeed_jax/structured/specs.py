"""Grammar specs: what a request asks its output to match, read from the fields clients send.

A ``GrammarSpec`` is the one description every constraint becomes before it is compiled: a kind
(``json_schema``, ``regex``, ``choice`` or ``grammar``), its source text, and the request field it
came from. ``spec_from_request`` reads the fields of a chat or completions request body:

* OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
* vLLM-style extras: ``guided_json`` (a schema, as an object or JSON text), ``guided_regex``,
  ``guided_choice`` (a list of strings), ``guided_grammar`` (Lark or GBNF text), and
  ``structured_outputs`` with one of ``json``, ``regex``, ``choice``, ``grammar`` or
  ``json_object: true`` (plus ``disable_any_whitespace``).

Invariants:

* A request carries at most one constraint; two (``response_format`` json and ``guided_regex``,
  or two keys of ``structured_outputs``) are an error naming both fields.
* Bad input raises ``GrammarSpecError`` (a ``ValueError``) whose ``field`` is the dotted path of
  the offending field (``response_format.json_schema.schema``), so a server can answer 400 with
  that ``param``. Absent and ``None`` fields mean "not set".
* ``source`` is JSON text for a JSON schema (always an object; ``true`` becomes ``{}``) or a
  choice list, in the order the client wrote it: the order of a schema's ``properties`` is the
  order the output writes them, so it is part of the constraint. Equality and hashing ignore
  ``field``, so one schema sent through different fields shares one compiled grammar.
* ``strict`` (json_schema only) is the schema's ``strict`` flag: the schema is enforced either
  way, as vLLM and SGLang do; with ``strict`` a keyword the grammar library does not implement is
  an error, without it such keywords are ignored. OpenAI's ``json_schema`` defaults to
  ``strict: false``; every other way of sending a schema is strict.
* ``compact`` (json kinds only) allows no whitespace between JSON tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]

# The top-level request fields ``spec_from_request`` reads.
GRAMMAR_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
# The schema json_object asks for: any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarSpecError(ValueError):
    """An invalid or unsupported output constraint; ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint, ready to compile (module docstring)."""

    kind: GrammarKind
    source: str
    field: str = field(compare=False)
    strict: bool = True
    compact: bool = False


def json_schema_spec(
    schema: Any, field: str, *, strict: bool = True, compact: bool = False
) -> GrammarSpec:
    """A spec for a JSON schema given as an object, a boolean or JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarSpecError(field, f"is not valid JSON: {e}") from None
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarSpecError(field, "the schema false allows no output")
    if not isinstance(schema, dict):
        raise GrammarSpecError(
            field, f"a JSON schema must be an object or a boolean, got {type(schema).__name__}"
        )
    return GrammarSpec("json_schema", json.dumps(schema), field, strict=strict, compact=compact)


def _text_spec(kind: GrammarKind, value: Any, field: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise GrammarSpecError(field, f"must be a non-empty string, got {value!r}")
    return GrammarSpec(kind, value, field)


def _choice_spec(value: Any, field: str) -> GrammarSpec:
    if not isinstance(value, list) or not value:
        raise GrammarSpecError(field, f"must be a non-empty list of strings, got {value!r}")
    bad = [choice for choice in value if not isinstance(choice, str)]
    if bad:
        raise GrammarSpecError(field, f"choices must be strings, got {bad!r}")
    return GrammarSpec("choice", json.dumps(value), field)


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise GrammarSpecError(field, f"must be a boolean, got {value!r}")
    return value


def _mapping(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise GrammarSpecError(field, f"must be an object, got {value!r}")
    return value


def spec_from_response_format(response_format: Any) -> GrammarSpec | None:
    """The constraint of OpenAI's ``response_format``; None for ``text`` or when absent."""
    if response_format is None:
        return None
    response_format = _mapping(response_format, "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_spec(ANY_JSON_OBJECT, "response_format")
    if kind == "json_schema":
        field = "response_format.json_schema"
        body = _mapping(response_format.get("json_schema"), field)
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarSpecError(f"{field}.name", f"must be a string, got {name!r}")
        strict = body.get("strict")
        schema = body.get("schema")
        return json_schema_spec(
            ANY_JSON_OBJECT if schema is None else schema,
            f"{field}.schema",
            strict=False if strict is None else _bool(strict, f"{field}.strict"),
        )
    raise GrammarSpecError(
        "response_format.type",
        f"must be 'text', 'json_object' or 'json_schema', got {kind!r}",
    )


# structured_outputs keys that each give the constraint, and the keys that only tune it.
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_OPTIONS = ("disable_any_whitespace",)


def spec_from_structured_outputs(value: Any) -> GrammarSpec | None:
    """The constraint of a vLLM-style ``structured_outputs`` object; None when it sets none."""
    if value is None:
        return None
    value = _mapping(value, "structured_outputs")
    unknown = sorted(set(value) - set(_STRUCTURED_KINDS) - set(_STRUCTURED_OPTIONS))
    if unknown:
        raise GrammarSpecError(
            f"structured_outputs.{unknown[0]}",
            f"is not supported; supported keys: {list(_STRUCTURED_KINDS + _STRUCTURED_OPTIONS)}",
        )
    given = [key for key in _STRUCTURED_KINDS if value.get(key) not in (None, False)]
    if len(given) > 1:
        raise GrammarSpecError(
            f"structured_outputs.{given[1]}",
            f"only one constraint per request; structured_outputs.{given[0]} is also set",
        )
    whitespace = value.get("disable_any_whitespace")
    compact = whitespace is not None and _bool(
        whitespace, "structured_outputs.disable_any_whitespace"
    )
    if not given:
        return None
    key = given[0]
    field = f"structured_outputs.{key}"
    if key == "json":
        return json_schema_spec(value[key], field, compact=compact)
    if key == "json_object":
        _bool(value[key], field)
        return json_schema_spec(ANY_JSON_OBJECT, field, compact=compact)
    if key == "choice":
        return _choice_spec(value[key], field)
    return _text_spec(key, value[key], field)


def spec_from_request(fields: Mapping[str, Any]) -> GrammarSpec | None:
    """The one constraint a request body sets through any of ``GRAMMAR_FIELDS``, or None."""
    specs = [
        spec
        for spec in (
            spec_from_response_format(fields.get("response_format")),
            _optional(fields, "guided_json", lambda v, f: json_schema_spec(v, f)),
            _optional(fields, "guided_regex", lambda v, f: _text_spec("regex", v, f)),
            _optional(fields, "guided_choice", _choice_spec),
            _optional(fields, "guided_grammar", lambda v, f: _text_spec("grammar", v, f)),
            spec_from_structured_outputs(fields.get("structured_outputs")),
        )
        if spec is not None
    ]
    if len(specs) > 1:
        raise GrammarSpecError(
            specs[1].field, f"only one constraint per request; {specs[0].field} is also set"
        )
    return specs[0] if specs else None


def _optional(fields: Mapping[str, Any], name: str, make: Any) -> GrammarSpec | None:
    value = fields.get(name)
    return None if value is None else make(value, name)
