"""Structured outputs through the server with the official ``openai`` client: ``response_format``
``json_schema`` / ``json_object`` and the vLLM-style ``guided_*`` fields constrain what the tiny
model writes. Each output is checked by an independent parser (``json``, ``jsonschema``, ``re``)
and must end because its grammar completed, not by length; a bad constraint is a 400 naming its
field; no request compiles anything while serving."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest
from serving import CONFIG, MODEL_NAME, openai_client, schema_replies, serving

from tokenspeed_jax.engine.startup import build_engine

HELLO = [{"role": "user", "content": "Describe a thing."}]
THING = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "round": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "round", "size"],
    "additionalProperties": False,
}
MAX_TOKENS = 400  # room for the whitespace the grammar lets a random model write


@pytest.fixture(scope="module")
def served():
    bundle = build_engine(CONFIG)
    with serving(bundle) as (url, _):
        yield openai_client(url), bundle


def chat(client, **fields):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=HELLO,
                                           max_tokens=MAX_TOKENS, **fields)
    (choice,) = reply.choices
    assert choice.finish_reason == "stop"  # the grammar completed the output
    return choice.message.content


def test_json_schema_outputs_validate_for_twenty_seeds(served):
    client, bundle = served
    texts = schema_replies(lambda **fields: chat(client, **fields), THING)
    for text in texts:
        jsonschema.validate(json.loads(text), THING)
    assert len(set(texts)) > 1  # sampled, not one answer
    assert bundle.runner.stats()["runtime_compiles"] == 0


def test_json_object_output_parses_to_an_object(served):
    client, _ = served
    for seed in range(3):
        text = chat(client, temperature=1.0, seed=seed, response_format={"type": "json_object"})
        assert isinstance(json.loads(text), dict)


def test_guided_choice_and_regex(served):
    client, _ = served
    choices = ["yes", "no", "not sure"]
    for seed in range(4):
        assert chat(client, temperature=1.0, seed=seed,
                    extra_body={"guided_choice": choices}) in choices
        text = chat(client, temperature=1.0, seed=seed,
                    extra_body={"guided_regex": r"[a-c]{2,5}-\d{3}"})
        assert re.fullmatch(r"[a-c]{2,5}-\d{3}", text)


def test_guided_completions_and_greedy_rows_beside_free_ones(served):
    """A constrained request batched with unconstrained ones: each keeps its own rule."""
    client, _ = served

    def complete(index: int):
        extra = {"guided_choice": ["alpha", "beta"]} if index % 2 else {}
        return client.completions.create(model=MODEL_NAME, prompt="the", max_tokens=12,
                                         temperature=0.0, extra_body=extra).choices[0]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(complete, range(6)))
    for index, choice in enumerate(results):
        if index % 2:
            assert choice.text in ("alpha", "beta") and choice.finish_reason == "stop"
    free = [choice.text for index, choice in enumerate(results) if not index % 2]
    assert free[0] == free[1] == free[2]  # greedy, unconstrained: one answer


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
     "guided_regex"),
])
def test_bad_constraints_are_a_400_naming_the_field(served, fields, param):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=4, **fields)
    body = raised.value.body
    assert body["param"].startswith(param), body
