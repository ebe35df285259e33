"""Request fields -> GrammarSpec: every way clients send a constraint, and the errors that name
the field of a bad one."""

from __future__ import annotations

import json

import pytest

from tokenspeed_jax.structured.specs import GrammarSpec, GrammarSpecError, spec_from_request
from tokenspeed_jax.structured.tools import tool_arguments_spec, tool_call_spec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CANONICAL = json.dumps(SCHEMA)
ANY_OBJECT = '{"type": "object"}'


@pytest.mark.parametrize(
    "fields, want",
    [
        ({}, None),
        ({"response_format": None, "guided_json": None}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}},
         GrammarSpec("json_schema", ANY_OBJECT, "response_format")),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
         GrammarSpec("json_schema", CANONICAL, "response_format.json_schema.schema")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
         GrammarSpec("json_schema", CANONICAL, "x", strict=False)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
         GrammarSpec("json_schema", ANY_OBJECT, "x", strict=False)),
        ({"guided_json": SCHEMA}, GrammarSpec("json_schema", CANONICAL, "guided_json")),
        ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec("json_schema", CANONICAL, "x")),
        ({"guided_json": True}, GrammarSpec("json_schema", "{}", "x")),
        ({"guided_regex": r"\d+"}, GrammarSpec("regex", r"\d+", "guided_regex")),
        ({"guided_choice": ["a", "b"]}, GrammarSpec("choice", '["a", "b"]', "guided_choice")),
        ({"guided_grammar": "start: /a+/"}, GrammarSpec("grammar", "start: /a+/", "x")),
        ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec("json_schema", CANONICAL, "x")),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         GrammarSpec("json_schema", CANONICAL, "x", compact=True)),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_schema", ANY_OBJECT, "x")),
        ({"structured_outputs": {"regex": "a|b", "json_object": False}},
         GrammarSpec("regex", "a|b", "x")),
        ({"structured_outputs": {"choice": ["x"]}}, GrammarSpec("choice", '["x"]', "x")),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, GrammarSpec("grammar", 'start: "x"', "x")),
        ({"structured_outputs": {}}, None),
    ],
)
def test_request_fields_give_their_spec(fields, want):
    assert spec_from_request(fields) == want


def test_the_spec_names_the_field_it_came_from():
    spec = spec_from_request({"structured_outputs": {"choice": ["x"]}})
    assert spec.field == "structured_outputs.choice"


def test_one_schema_through_two_fields_is_one_spec_and_key_order_matters():
    first = spec_from_request({"guided_json": SCHEMA})
    second = spec_from_request({"structured_outputs": {"json": json.dumps(SCHEMA)}})
    assert first == second and hash(first) == hash(second)
    properties = {"b": {"type": "string"}, "a": {"type": "integer"}}
    reordered = {"type": "object", "properties": dict(reversed(properties.items()))}
    assert spec_from_request({"guided_json": {"type": "object", "properties": properties}}) != (
        spec_from_request({"guided_json": reordered}))


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
         "must be an object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
         "response_format.json_schema.schema", "must be an object or a boolean, got list"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "y"}}},
         "response_format.json_schema.strict", "must be a boolean"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": 3}}},
         "response_format.json_schema.name", "must be a string"),
        ({"guided_json": "{not json"}, "guided_json", "is not valid JSON"),
        ({"guided_json": False}, "guided_json", "allows no output"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice", r"choices must be strings, got \[1\]"),
        ({"guided_grammar": 5}, "guided_grammar", "non-empty string"),
        ({"structured_outputs": ["json"]}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
         "is not supported"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex",
         "structured_outputs.json is also set"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object",
         "must be a boolean"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}},
         "structured_outputs.disable_any_whitespace", "must be a boolean"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "response_format is also set"),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
         "structured_outputs.regex", "guided_choice is also set"),
    ],
)
def test_bad_constraints_name_their_field(fields, field, message):
    with pytest.raises(GrammarSpecError, match=message) as raised:
        spec_from_request(fields)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ")
    assert isinstance(raised.value, ValueError)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
        "strict": True,
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}


def test_tool_arguments_spec_is_the_parameters_schema():
    spec = tool_arguments_spec(WEATHER, "tools[0]")
    assert spec == GrammarSpec("json_schema", json.dumps(WEATHER["function"]["parameters"]), "x")
    assert spec.field == "tools[0].function.parameters"
    no_arguments = json.loads(tool_arguments_spec(CLOCK).source)
    assert no_arguments == {"type": "object", "properties": {}, "additionalProperties": False}
    assert not tool_arguments_spec(CLOCK).strict


def test_tool_call_spec_names_one_of_the_tools():
    schema = json.loads(tool_call_spec([WEATHER, CLOCK]).source)
    calls = schema["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"const": "get_weather"}, {"const": "now"}]
    assert calls[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert all(c["required"] == ["name", "arguments"] for c in calls)
    single = json.loads(tool_call_spec([WEATHER]).source)
    assert single == calls[0] and tool_call_spec([WEATHER]).strict


@pytest.mark.parametrize(
    "tools, field, message",
    [
        ([], "tools", "non-empty list"),
        ([{"type": "code_interpreter"}], "tools[0].type", "must be 'function'"),
        ([CLOCK, {"type": "function"}], "tools[1].function", "must be an object"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name",
         "1-64 of"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}],
         "tools[0].function.parameters", "must be a JSON schema object"),
        ([{"type": "function", "function": {"name": "f", "strict": 1}}],
         "tools[0].function.strict", "must be a boolean"),
        ([CLOCK, CLOCK], "tools", r"repeated: \['now'\]"),
    ],
)
def test_bad_tools_name_their_field(tools, field, message):
    with pytest.raises(GrammarSpecError, match=message) as raised:
        tool_call_spec(tools)
    assert raised.value.field == field
