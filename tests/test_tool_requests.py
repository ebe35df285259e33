"""What a chat request's tools ask for and how its messages reach the chat template: the tiny
model's own template ignores ``tools``, so the tools become an instruction in the system message
and past calls are written into the assistant's content in the parser's format; a template that
renders tools gets them, and the calls, as HF templates take them."""

from __future__ import annotations

import json

import pytest

from tokenspeed_jax.server.errors import APIError
from tokenspeed_jax.server.protocol import ChatCompletionRequest
from tokenspeed_jax.server.tool_parsers import HermesParser, Llama3Parser
from tokenspeed_jax.server.tool_requests import template_messages, template_takes_tools, tool_plan
from tokenspeed_jax.structured.specs import GrammarSpec
from tokenspeed_jax.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_hf_dir("tests/golden/tiny_llama")


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="tiny", **{"messages": HISTORY, "tools": [WEATHER],
                                                  **fields})


def test_a_template_without_tools_gets_the_instruction_and_calls_in_the_format(tokenizer):
    assert not template_takes_tools(tokenizer)
    for parser, written in [
        (HermesParser(), ('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}'
                         "</tool_call>")),
        (Llama3Parser(), '{"name": "weather", "parameters": {"city": "Oslo"}}'),
    ]:
        messages, context = template_messages(tokenizer, request(), parser)
        assert context == {}
        assert messages == [
            {"role": "system", "content": parser.instruction([WEATHER])},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": written},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        assert json.dumps(WEATHER["function"]) in messages[0]["content"]


def test_the_instruction_joins_a_system_message_the_client_sent(tokenizer):
    body = request(messages=[{"role": "system", "content": "Be brief."}, HISTORY[0]])
    messages, _ = template_messages(tokenizer, body, HermesParser())
    assert messages[0] == {"role": "system",
                           "content": "Be brief.\n\n" + HermesParser().instruction([WEATHER])}


def test_a_template_with_tools_gets_them_and_the_calls_as_objects(tokenizer):
    with_tools = Tokenizer(tokenizer.backend, chat_template="{{ tools | length }}{{ messages }}")
    assert template_takes_tools(with_tools)
    messages, context = template_messages(with_tools, request(), HermesParser())
    assert context == {"tools": [WEATHER]}
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}


def test_tool_choice_sets_the_grammar_and_the_parser():
    assert tool_plan(request(tools=None)) is None
    assert tool_plan(request()).choice == "auto" and tool_plan(request()).grammar() is None
    named = tool_plan(request(tool_choice={"type": "function", "function": {"name": "weather"}}))
    assert named.grammar() == GrammarSpec("json_schema", json.dumps(
        WEATHER["function"]["parameters"]), "tool_choice", strict=False)
    required = json.loads(tool_plan(request(tool_choice="required")).grammar().source)
    assert required["type"] == "array" and required["minItems"] == 1
    single = tool_plan(request(tool_choice="required", parallel_tool_calls=False))
    assert json.loads(single.grammar().source)["properties"]["name"] == {"const": "weather"}
    assert single.limit == 1 and tool_plan(request()).limit is None


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": "weather"}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "clock"}}},
     "tool_choice.function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "weather", "parameters": 3}}]},
     "tools[0].function.parameters"),
])
def test_bad_tool_requests_name_their_field(fields, param):
    with pytest.raises(APIError) as raised:
        tool_plan(request(**fields))
    assert raised.value.param == param and param in raised.value.message
