"""Tool calling through the server with the official ``openai`` client, on the tiny model behind a
chat template that renders ``tools`` and past ``tool_calls`` as HF templates do.

A named or ``required`` ``tool_choice`` is enforced by a grammar, so the sampled calls' arguments
validate (``jsonschema``) against their tool's parameters; ``auto`` parses the calls the model
writes in the Hermes or Llama 3 format (the tiny model writes one under a ``guided_regex``, since
it never chooses to call a tool by itself); a stream reassembles to the non-streamed answer of
the same seed; a conversation holding the assistant's calls and the tool's answer renders as the
template renders it by hand.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest
from serving import CONFIG, MODEL_DIR, MODEL_NAME, running_server

from tokenspeed_jax.engine.async_engine import AsyncEngine
from tokenspeed_jax.engine.startup import build_engine
from tokenspeed_jax.models.loader import load_model
from tokenspeed_jax.server.app import ServerState
from tokenspeed_jax.tokenizer import Tokenizer

# A Hermes-style template with tools support, kept short for the tiny model's context.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n{% for tool in tools %}"
    "{{ tool.function.name }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{{ message.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "Weather?"}]
SERVED = dataclasses.replace(CONFIG, max_model_len=256, num_pages=48)
HERMES_CALL = (r'<tool_call>\{"name": "weather", "arguments": '
               r'\{"city": "(Oslo|Lima)", "days": [1-7]\}\}</tool_call>')


@pytest.fixture(scope="module")
def engine():
    loaded = load_model(MODEL_DIR)
    plain = loaded.tokenizer
    tokenizer = Tokenizer(plain.backend, chat_template=TEMPLATE, bos_token=plain.bos_token,
                          eos_token=plain.eos_token, eos_token_ids=plain.eos_token_ids)
    bundle = build_engine(SERVED, dataclasses.replace(loaded, tokenizer=tokenizer))
    engine = AsyncEngine(bundle.engine)
    engine.start()
    yield ServerState(MODEL_NAME, engine, bundle.runner.stats), tokenizer
    engine.shutdown()


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def served(engine):
    state, tokenizer = engine
    with running_server(state, SERVED) as url:
        yield client_of(url), tokenizer


def ask(client, messages=ASK, **fields):
    return client.chat.completions.create(**{"model": MODEL_NAME, "messages": messages,
                                             "tools": TOOLS, "max_tokens": 200, **fields})


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


def test_a_named_tool_choice_returns_a_valid_call_of_that_function(served):
    client, _ = served
    for seed in range(4):
        reply = ask(client, seed=seed, temperature=1.0,
                    tool_choice={"type": "function", "function": {"name": "weather"}})
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "weather"
        check_call(call)


def test_required_returns_valid_calls_of_the_tools(served):
    client, _ = served
    names = set()
    for seed in range(4):
        for parallel in (True, False):
            (choice,) = ask(client, seed=seed, temperature=1.0, tool_choice="required",
                            parallel_tool_calls=parallel).choices
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls
            assert len(calls) >= 1 if parallel else len(calls) == 1
            for call in calls:
                check_call(call)
                names.add(call.function.name)
    assert names <= {"weather", "clock"}


def test_auto_parses_the_call_the_model_writes(served):
    client, _ = served
    reply = ask(client, seed=3, temperature=1.0, tool_choice="auto",
                extra_body={"guided_regex": HERMES_CALL})
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather"
    assert check_call(call)["city"] in ("Oslo", "Lima")
    # the same request with tool_choice "none" returns the very text the call was read from
    text = ask(client, seed=3, temperature=1.0, tool_choice="none",
               extra_body={"guided_regex": HERMES_CALL}).choices[0].message.content
    assert text == ('<tool_call>{"name": "weather", "arguments": '
                    f"{call.function.arguments}}}</tool_call>")


def test_auto_keeps_the_text_before_a_call(served):
    client, _ = served
    (choice,) = ask(client, seed=2, temperature=1.0,
                    extra_body={"guided_regex": "Checking[.]{1,3} " + HERMES_CALL}).choices
    assert choice.finish_reason == "tool_calls"
    assert re.fullmatch(r"Checking\.{1,3} ", choice.message.content)
    assert [c.function.name for c in choice.message.tool_calls] == ["weather"]


def test_the_llama3_parser_reads_a_bare_json_answer(engine):
    state, _ = engine
    with running_server(state, dataclasses.replace(SERVED, tool_call_parser="llama3")) as url:
        (choice,) = ask(client_of(url), seed=4, temperature=1.0, extra_body={
            "guided_regex": r'\{"name": "clock", "parameters": \{"utc": (true|false)\}\}'}
        ).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "clock" and isinstance(check_call(call)["utc"], bool)


def reassemble(chunks):
    """The content, calls and finish reason a stream adds up to."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.function.arguments == ""
                calls[piece.index] = (piece.function.name, "")
            name, arguments = calls[piece.index]
            calls[piece.index] = (name, arguments + (piece.function.arguments or ""))
        finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


@pytest.mark.parametrize("fields", [
    {"tool_choice": {"type": "function", "function": {"name": "weather"}}},
    {"tool_choice": "required"},
    {"tool_choice": "auto", "extra_body": {"guided_regex": HERMES_CALL}},
], ids=["named", "required", "auto"])
def test_a_streamed_call_reassembles_to_the_same_call(served, fields):
    client, _ = served
    whole = ask(client, seed=7, temperature=1.0, **fields).choices[0]
    content, calls, finish = reassemble(ask(client, seed=7, temperature=1.0, stream=True,
                                            **fields))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content == "" and finish == whole.finish_reason == "tool_calls"


def test_a_conversation_with_calls_and_tool_answers_goes_back_in(served):
    client, tokenizer = served
    reply = ask(client, seed=1, temperature=1.0,
                tool_choice={"type": "function", "function": {"name": "weather"}})
    assistant = reply.choices[0].message.model_dump()
    (call,) = assistant["tool_calls"]
    messages = ASK + [assistant, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    again = ask(client, messages, temperature=0.0, max_tokens=2)
    by_hand = tokenizer.apply_chat_template(
        ASK + [{"role": "assistant", "content": None, "tool_calls": [
                   {"id": call["id"], "type": "function", "function": {
                       "name": "weather", "arguments": json.loads(call["function"]["arguments"])}}]},
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}],
        tools=TOOLS)
    assert '<tool_call>{"name": "weather", "arguments": {"city": ' in by_hand
    assert again.usage.prompt_tokens == len(tokenizer.encode(by_hand))


def test_a_tool_choice_grammar_cannot_be_combined_with_another(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, tool_choice="required", response_format={"type": "json_object"})
    assert raised.value.body["param"] == "tool_choice"
