"""Tool requests: what a chat request's ``tools`` and ``tool_choice`` ask for, and its messages
as the chat template takes them.

Invariants:

* ``tool_choice`` absent means ``auto`` with tools and ``none`` without. ``required`` or a named
  function without tools, a name no tool has, or any other value is a 400 naming ``tool_choice``;
  a bad tool is a 400 naming it (``tools[1].function.name``).
* ``none`` shows the tools to the model and returns its text as text; ``auto`` parses the
  model's own tool-call format (``tool_parsers``).
* ``required`` and a named function are enforced by a grammar over bare JSON: the model writes
  the list of calls (one call with ``parallel_tool_calls: false``) or the named function's
  arguments, and the ``tool_calls`` are built from that JSON. Bare JSON rather than the format's
  markers, because a marker such as ``<tool_call>`` is a special token in some vocabularies, which
  a grammar over text cannot write, and the JSON is all the answer needs.
* Tools and past calls reach the template as HF templates take them: ``tools=[...]`` in the jinja
  context, an assistant message's ``tool_calls`` with ``arguments`` as objects, a tool message's
  ``tool_call_id``. A template that ignores ``tools`` (its rendering does not change with them)
  gets the parser's instruction in the system message instead, and past calls written into the
  assistant's content in the parser's format.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import jinja2

from tokenspeed_jax.server.errors import APIError
from tokenspeed_jax.server.protocol import ChatCompletionRequest, ChatMessage
from tokenspeed_jax.server.tool_parsers import (
    ForcedCallParser,
    FunctionCall,
    HermesParser,
    Llama3Parser,
    OutputParser,
)
from tokenspeed_jax.structured.specs import GrammarSpec, GrammarSpecError
from tokenspeed_jax.structured.tools import check_tools, tool_arguments_spec, tool_call_spec
from tokenspeed_jax.tokenizer import Tokenizer

FormatParser = HermesParser | Llama3Parser


def _bad(message: str, param: str) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what it asks of them: ``choice`` is ``none``, ``auto``,
    ``required`` or ``function`` (then ``name`` is the function)."""

    tools: tuple[dict, ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    def grammar(self) -> GrammarSpec | None:
        """The constraint of a ``required`` or named choice."""
        if self.choice == "required":
            return tool_call_spec(self.tools, "tool_choice", parallel=self.parallel)
        if self.choice == "function":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            return tool_arguments_spec(tool, "tool_choice")
        return None

    def output_parser(self, parser: FormatParser) -> OutputParser | None:
        """What reads the calls out of the output; None when it stays text."""
        if self.choice == "auto":
            return parser
        if self.choice == "none":
            return None
        return ForcedCallParser(self.name)

    @property
    def limit(self) -> int | None:
        """The most calls one answer keeps."""
        return None if self.parallel else 1


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's ``ToolPlan``; None when it sends no tools (module docstring)."""
    choice = body.tool_choice
    if not body.tools:
        if choice in (None, "none", "auto"):
            return None
        raise _bad(f"{choice!r} asks for a tool call but the request sends no tools",
                   "tool_choice")
    try:
        names = [name for name, _, _ in check_tools(body.tools)]
    except GrammarSpecError as error:
        raise APIError(HTTPStatus.BAD_REQUEST, str(error), param=error.field) from error
    tools = tuple(body.tools)
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto", "required"):
        return ToolPlan(tools, choice or "auto", parallel=parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise _bad('must be "none", "auto", "required" or {"type": "function", "function": '
                   f'{{"name": ...}}}}, got {choice!r}', "tool_choice")
    if name not in names:
        raise _bad(f"names the function {name!r}, which is not among the tools {names}",
                   "tool_choice.function.name")
    return ToolPlan(tools, "function", name, parallel=parallel)


@functools.lru_cache(maxsize=8)
def template_takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders ``tools`` (its output changes with them)."""
    probe = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "probe", "parameters": {}}}
    try:
        return (tokenizer.apply_chat_template(probe, tools=[tool])
                != tokenizer.apply_chat_template(probe))
    except (ValueError, TypeError, jinja2.TemplateError):
        return False  # the template cannot render a plain user turn with tools at all


def _calls(message: ChatMessage, i: int) -> list[FunctionCall]:
    calls = []
    for j, call in enumerate(message.tool_calls or []):
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as error:
            raise _bad(f"the arguments of a tool call must be JSON text: {error}",
                       f"messages.{i}.tool_calls.{j}.function.arguments") from error
        if not isinstance(arguments, dict):
            raise _bad("the arguments of a tool call must be a JSON object",
                       f"messages.{i}.tool_calls.{j}.function.arguments")
        calls.append(FunctionCall(call.function.name, call.function.arguments))
    return calls


def template_messages(tokenizer: Tokenizer, body: ChatCompletionRequest,
                      parser: FormatParser) -> tuple[list[dict], dict[str, Any]]:
    """The request's messages as the chat template takes them, and the extra template context
    (``tools``) (module docstring)."""
    takes_tools = template_takes_tools(tokenizer)
    messages = []
    for i, message in enumerate(body.messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.role == "tool":
            if message.tool_call_id is None:
                raise _bad("a tool message needs the id of the call it answers",
                           f"messages.{i}.tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
        calls = _calls(message, i)
        if calls and takes_tools:
            entry["tool_calls"] = [
                {"id": wire.id, "type": "function",
                 "function": {"name": call.name, "arguments": json.loads(call.arguments)}}
                for wire, call in zip(message.tool_calls, calls)]
        elif calls:
            entry["content"] += parser.render_calls(calls)
        messages.append(entry)
    if not body.tools:
        return messages, {}
    if takes_tools:
        return messages, {"tools": list(body.tools)}
    instruction = parser.instruction(body.tools)
    if messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{instruction}"}
    else:
        messages.insert(0, {"role": "system", "content": instruction})
    return messages, {}
