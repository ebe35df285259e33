"""Tool-call parsers on hand-written model outputs of each format: the calls and content read from
the whole text, and a stream fed the same text in pieces reassembles to the same answer."""

from __future__ import annotations

import itertools
import json

import pytest

from tokenspeed_jax.server.tool_parsers import (
    CallStream,
    ForcedCallParser,
    FunctionCall,
    HermesParser,
    Llama3Parser,
    select_parser,
)

HERMES = HermesParser()
LLAMA3 = Llama3Parser()


def call(name: str, **arguments) -> FunctionCall:
    return FunctionCall(name, json.dumps(arguments))


def test_hermes_reads_calls_and_the_text_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    scan = HERMES.scan(text, final=True)
    assert scan.calls == (call("get_weather", city="Oslo"), call("get_time"))
    assert scan.content == "Let me check.\n\n"


def test_hermes_keeps_a_call_that_does_not_parse_as_text():
    text = 'a <tool_call>{"name": oops}</tool_call> b'
    assert HERMES.scan(text, final=True).content == text
    assert HERMES.scan(text, final=True).calls == ()


def test_hermes_reads_an_unclosed_call_at_the_end_and_arguments_given_as_json_text():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
    assert HERMES.scan(text, final=True).calls == (call("f", x=1),)
    assert HERMES.scan(text, final=False) == HERMES.scan("", final=False)  # still open


def test_hermes_holds_back_a_partial_marker_until_it_is_known():
    assert HERMES.scan("Hi <tool_", final=False).content == "Hi "
    assert HERMES.scan("Hi <tool_", final=True).content == "Hi <tool_"
    assert HERMES.scan("Hi <b>", final=False).content == "Hi <b>"


def test_llama3_reads_a_bare_json_answer_with_or_without_the_python_tag():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert LLAMA3.scan(text, final=True).calls == (call("get_weather", city="Oslo"),)
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}'
    assert LLAMA3.scan(two, final=True).calls == (call("a"), call("b", n=2))
    assert LLAMA3.scan(two, final=True).content == ""


@pytest.mark.parametrize("text", ["The answer is 4.", '{"city": "Oslo"}',
                                  '{"name": "a", "parameters": {}} and more'])
def test_llama3_leaves_anything_but_calls_as_text(text):
    scan = LLAMA3.scan(text, final=True)
    assert scan.calls == () and scan.content == text


def test_forced_parsers_read_the_grammar_output():
    named = ForcedCallParser("get_weather")
    assert named.scan('{"city": "Oslo"}', final=True).calls == (
        FunctionCall("get_weather", '{"city": "Oslo"}'),)
    required = ForcedCallParser()
    listed = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": 2}}]'
    assert required.scan(listed, final=True).calls == (call("a"), call("b", n=2))
    assert required.scan('{"name": "a", "arguments": {}}', final=True).calls == (call("a"),)
    assert required.scan('[{"name": "a", "argu', final=True).content == '[{"name": "a", "argu'


def replay(parser, text: str, cuts: list[int], limit: int | None = None):
    """Feed ``text`` cut at ``cuts``; the content and calls the stream's deltas add up to."""
    ids = (f"call_{i}" for i in itertools.count())
    stream = CallStream(parser, lambda: next(ids), limit)
    bounds = [0, *cuts, len(text)]
    content, calls = "", {}
    for start, end in itertools.pairwise(bounds):
        piece, deltas = stream.feed(text[start:end], final=end == len(text))
        content += piece
        for delta in deltas:
            if "id" in delta:  # the first piece of a call names it
                assert delta["index"] == len(calls) and delta["type"] == "function"
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content, tuple(FunctionCall(name, arguments) for name, arguments in calls.values())


STREAMED = [
    (HERMES, ('Sure.<tool_call>{"name": "a", "arguments": {"q": "x<y"}}</tool_call>'
             '<tool_call>{"name": "b", "arguments": {}}</tool_call>')),
    (HERMES, "no calls here, just <b>text</b>"),
    (LLAMA3, '{"name": "a", "parameters": {"q": 1}}'),
    (ForcedCallParser("a"), '{"q": [1, 2]}'),
    (ForcedCallParser(), '[{"name": "a", "arguments": {"q": 1}}]'),
]


@pytest.mark.parametrize("parser, text", STREAMED)
def test_a_stream_cut_anywhere_reassembles_to_the_whole_answer(parser, text):
    whole = parser.scan(text, final=True)
    for step in (1, 3, 7):
        content, calls = replay(parser, text, list(range(step, len(text), step)))
        assert calls == whole.calls
        assert content == (whole.content if whole.content.strip() else "")


def test_a_stream_keeps_only_the_first_call_when_parallel_calls_are_off():
    text = STREAMED[0][1]
    _, calls = replay(HERMES, text, list(range(2, len(text), 2)), limit=1)
    assert calls == (FunctionCall("a", '{"q": "x<y"}'),)


@pytest.mark.parametrize("name, template, expected", [
    ("auto", "{% for tool in tools %}<tool_call>{% endfor %}", "hermes"),
    ("auto", "{{- '<|python_tag|>' }}{% if message.role == 'ipython' %}", "llama3"),
    ("auto", "<|im_start|>{{ message['role'] }}", "hermes"),
    ("auto", None, "hermes"),
    ("llama3", "<tool_call>", "llama3"),
])
def test_the_parser_is_chosen_by_name_or_from_the_template(name, template, expected):
    assert select_parser(name, template).name == expected
