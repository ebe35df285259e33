"""Tool calls in a model's output: its tool-call format read back into OpenAI function calls.

A parser knows one format: how to describe tools to a model whose chat template cannot
(``instruction``), how to write past calls into such a template's history (``render_calls``), and
how to read calls out of generated text (``scan``). ``select_parser`` picks the format for
``--tool-call-parser`` (``auto`` reads the chat template's text). ``ForcedCallParser`` reads the
bare JSON a grammar forces for ``tool_choice`` ``required`` or a named function. ``CallStream``
turns successive scans into the deltas of a stream.

Invariants:

* ``scan(text, final)`` is a pure function of the text so far. Until ``final`` it withholds what
  may still become part of a call (a partial ``<tool_call>`` marker, an unfinished call, a JSON
  output still being written), so its ``content`` only grows as text arrives, and the
  ``calls`` it returns are complete and never change: a stream is the difference between scans,
  and the scan of the whole text is the non-streamed answer.
* Text that looks like a call but does not parse as one (bad JSON, no ``name``) stays content,
  verbatim; nothing is dropped.
* A call's ``arguments`` are JSON text of an object: the model's arguments re-serialised for the
  formats, the grammar's output as written for a forced named call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenspeed_jax.config import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Scan:
    """What a text holds so far: its content, its complete calls, and the call being written
    when its name is already known (``open_name``, with the arguments text written so far)."""

    content: str
    calls: tuple[FunctionCall, ...] = ()
    open_name: str | None = None
    open_arguments: str = ""


class OutputParser(Protocol):
    def scan(self, text: str, final: bool) -> Scan: ...


def _call(value: Any, arguments_key: str) -> FunctionCall | None:
    """The call a parsed JSON value names, or None when it is not ``{"name", arguments_key}``."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return FunctionCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (may grow into it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _describe(tools: Sequence[dict]) -> str:
    return "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text between
    (Hermes, Qwen)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def instruction(self, tools: Sequence[dict]) -> str:
        return (f"You can call these functions:\n<tools>\n{_describe(tools)}\n</tools>\n"
                f'To call one, write {self.OPEN}{{"name": <function name>, "arguments": '
                f"<arguments object>}}{self.CLOSE}")

    def render_calls(self, calls: Sequence[FunctionCall]) -> str:
        return "".join(f'{self.OPEN}{{"name": {json.dumps(c.name)}, "arguments": '
                       f"{c.arguments}}}{self.CLOSE}" for c in calls)

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[FunctionCall] = []
        position = 0
        while True:
            start = text.find(self.OPEN, position)
            if start < 0:
                rest = text[position:]
                held = 0 if final else _held_prefix(rest, self.OPEN)
                content.append(rest[:len(rest) - held])
                break
            content.append(text[position:start])
            body_start = start + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            if end < 0 and not final:
                break  # a call still being written
            body = text[body_start:] if end < 0 else text[body_start:end]
            position = len(text) if end < 0 else end + len(self.CLOSE)
            call = _parse_json(body, "arguments")
            if call is None:
                content.append(text[start:position])
            else:
                calls.append(call)
        return Scan("".join(content), tuple(calls))


class Llama3Parser:
    """An answer that is only ``{"name": ..., "parameters": {...}}`` (several joined by ``;``),
    optionally after ``<|python_tag|>`` (Llama 3.1 and later, JSON tool calling)."""

    name = "llama3"
    TAG = "<|python_tag|>"

    def instruction(self, tools: Sequence[dict]) -> str:
        return (f"You can call these functions:\n{_describe(tools)}\nTo call one, answer with "
                f'only {{"name": <function name>, "parameters": <arguments object>}}')

    def render_calls(self, calls: Sequence[FunctionCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}'
                         for c in calls)

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        may_call = body.startswith("{") or self.TAG.startswith(body)
        if not may_call:
            return Scan(text)
        if not final:
            return Scan("")
        calls = _parse_json_sequence(body, "parameters")
        return Scan("", calls) if calls else Scan(text)


def _parse_json(text: str, arguments_key: str) -> FunctionCall | None:
    try:
        return _call(json.loads(text), arguments_key)
    except json.JSONDecodeError:
        return None


def _parse_json_sequence(text: str, arguments_key: str) -> tuple[FunctionCall, ...]:
    """The calls of JSON objects separated by ``;`` or whitespace; () unless all of ``text``
    is such calls."""
    decoder = json.JSONDecoder()
    calls = []
    position = 0
    while True:
        position = len(text) - len(text[position:].lstrip().lstrip(";").lstrip())
        if position == len(text):
            return tuple(calls)
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return ()
        call = _call(value, arguments_key)
        if call is None:
            return ()
        calls.append(call)


@dataclass(frozen=True)
class ForcedCallParser:
    """The bare JSON a tool-call grammar forces: the arguments object of ``function``, or
    (``function`` None) a list of ``{"name", "arguments"}`` calls, or one such call."""

    function: str | None = None

    def scan(self, text: str, final: bool) -> Scan:
        if self.function is not None:
            if final:
                return Scan("", (FunctionCall(self.function, text),))
            return Scan("", open_name=self.function, open_arguments=text)
        if not final:
            return Scan("")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return Scan(text)  # cut short (max_tokens) before the grammar completed
        calls = [_call(item, "arguments") for item in
                 (value if isinstance(value, list) else [value])]
        return Scan("", tuple(calls)) if calls and None not in calls else Scan(text)


PARSERS = {parser.name: parser for parser in (HermesParser(), Llama3Parser())}
assert set(PARSERS) | {"auto"} == set(TOOL_CALL_PARSERS)
# Text of a chat template that marks the Llama 3 JSON format.
LLAMA3_TEMPLATE_MARKS = ("<|python_tag|>", "ipython")


def select_parser(name: str, chat_template: str | None) -> HermesParser | Llama3Parser:
    """The parser ``name`` (an ``EngineConfig.tool_call_parser``); ``auto`` reads the chat
    template: ``<tool_call>`` means Hermes, Llama 3's ``ipython`` marks mean Llama 3, and
    Hermes otherwise (it is also what the instruction for a template without tools asks for)."""
    if name != "auto":
        return PARSERS[name]
    template = chat_template or ""
    if HermesParser.OPEN not in template and any(m in template for m in LLAMA3_TEMPLATE_MARKS):
        return PARSERS["llama3"]
    return PARSERS["hermes"]


@dataclass
class CallStream:
    """One choice's stream: each ``feed`` returns the content and tool-call deltas the text
    added (OpenAI's ``delta.tool_calls`` entries: index, id, type and name first, then argument
    fragments). ``limit`` keeps at most that many calls (``parallel_tool_calls: false``)."""

    parser: OutputParser
    new_id: Any
    limit: int | None = None
    text: str = ""
    sent_content: int = 0
    ids: list[str] = field(default_factory=list)
    sent_arguments: int = 0  # of the open call, whose header is ids[-1] when it is open
    open: bool = False

    def feed(self, new_text: str, final: bool) -> tuple[str, list[dict]]:
        self.text += new_text
        scan = self.parser.scan(self.text, final)
        content = ""
        if scan.content.strip():
            content, self.sent_content = scan.content[self.sent_content:], len(scan.content)
        deltas: list[dict] = []
        for call in scan.calls[:self.limit][len(self.ids) - self.open:]:
            if not self.open:
                deltas.append(self._header(call.name))
            deltas.append(self._arguments(call.arguments))
            self.open = False
        if scan.open_name is not None and (self.limit is None or len(self.ids) < self.limit):
            if not self.open:
                deltas.append(self._header(scan.open_name))
                self.open = True
            if len(scan.open_arguments) > self.sent_arguments:
                deltas.append(self._arguments(scan.open_arguments))
        return content, [d for d in deltas if d is not None]

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _header(self, name: str) -> dict:
        self.ids.append(self.new_id())
        self.sent_arguments = 0
        return {"index": len(self.ids) - 1, "id": self.ids[-1], "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _arguments(self, arguments: str) -> dict | None:
        fragment, self.sent_arguments = arguments[self.sent_arguments:], len(arguments)
        if not fragment:
            return None
        return {"index": len(self.ids) - 1, "function": {"arguments": fragment}}
