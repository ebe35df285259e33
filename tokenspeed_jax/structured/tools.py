"""Grammar specs for tool calls: a function's arguments, or a call object naming one of the tools.

The chat layer renders tools through the model's chat template and parses its tool-call format
(Hermes ``<tool_call>`` JSON, Llama 3 JSON); these helpers give the JSON part of a call a grammar,
so a ``required`` or named ``tool_choice`` always produces valid arguments.

Invariants:

* A tool is an OpenAI ``tools`` entry ``{"type": "function", "function": {"name", "parameters",
  "strict"}}``; anything else is a ``GrammarSpecError`` naming the field (``tools[2].function.name``).
* A function without ``parameters`` takes no arguments: its arguments are the empty object.
* ``tool_arguments_spec`` constrains the arguments object alone; ``tool_call_spec`` constrains
  ``{"name": <one of the tools' names>, "arguments": <that tool's arguments>}``, the object Hermes
  and Llama 3 templates ask the model to write, or with ``parallel`` a non-empty list of them.
* The function's ``strict`` flag carries over to the spec as for ``response_format``: unset means
  unsupported schema keywords are ignored, not that the schema is optional.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenspeed_jax.structured.specs import GrammarSpec, GrammarSpecError, json_schema_spec

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _function(tool: Any, field: str) -> tuple[str, dict | bool, bool]:
    """A tool's (name, parameters schema, strict), checked."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise GrammarSpecError(f"{field}.type", f"must be 'function', got {tool!r}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise GrammarSpecError(f"{field}.function", f"must be an object, got {function!r}")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise GrammarSpecError(
            f"{field}.function.name", f"must be 1-64 of [A-Za-z0-9_-], got {name!r}"
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = NO_ARGUMENTS
    if not isinstance(parameters, (dict, bool)):
        raise GrammarSpecError(
            f"{field}.function.parameters", f"must be a JSON schema object, got {parameters!r}"
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise GrammarSpecError(f"{field}.function.strict", f"must be a boolean, got {strict!r}")
    return name, parameters, bool(strict)


def tool_arguments_spec(tool: Any, field: str = "tool") -> GrammarSpec:
    """A spec for the arguments object of one tool (a named ``tool_choice``)."""
    _, parameters, strict = _function(tool, field)
    return json_schema_spec(parameters, f"{field}.function.parameters", strict=strict)


def check_tools(tools: Any, field: str = "tools") -> list[tuple[str, dict | bool, bool]]:
    """Each tool's (name, parameters schema, strict), checked: a non-empty list of functions
    with distinct names."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence) or not tools:
        raise GrammarSpecError(field, f"must be a non-empty list of tools, got {tools!r}")
    functions = [_function(tool, f"{field}[{i}]") for i, tool in enumerate(tools)]
    names = [name for name, _, _ in functions]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise GrammarSpecError(field, f"function names must be distinct; repeated: {repeated}")
    return functions


def tool_call_spec(tools: Sequence[Any], field: str = "tools", *,
                   parallel: bool = False) -> GrammarSpec:
    """A spec for ``{"name", "arguments"}`` calling any one of ``tools`` (``tool_choice:
    required``), or with ``parallel`` a non-empty list of such calls; strict when every tool
    is."""
    functions = check_tools(tools, field)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters, _ in functions
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel:
        schema = {"type": "array", "items": schema, "minItems": 1}
    return json_schema_spec(schema, field, strict=all(strict for _, _, strict in functions))
