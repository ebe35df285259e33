"""The OpenAI surface on a real model: the embedded SmolLM2-135M-Instruct served over HTTP and
driven with the official ``openai`` client, as a user's first structured-output and tool-call
requests would be.

What is checked is independent of the engine: ``json`` and ``jsonschema`` judge every
constrained output; the plain reference generator (dense cache, no scheduler, no compiled
plans) gives the expected text for ``logit_bias``; SmolLM2's template does not render tools,
so a named ``tool_choice`` must still return a call that validates, produced by the grammar
alone. Nothing compiles while serving.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from serving import openai_client, running_server, schema_replies

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.async_engine import AsyncEngine
from tokenspeed_jax.engine.startup import build_engine
from tokenspeed_jax.reference import ReferenceGenerator
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.server.app import ServerState

NAME = "smollm2"
CONFIG = EngineConfig(
    model=None,
    served_model_name=NAME,
    max_model_len=512,
    num_pages=160,
    max_num_seqs=8,
    prefill_graph_max_tokens=128,
    prefill_graph_capture_token_sizes=(128,),  # one bucket per route: the surface is the point
    prefill_graph_capture_batch_sizes=(8,),
    decode_graph_capture_batch_sizes=(8,),
    compile_progress=False,
    strict_no_compile=True,
)
ASK = [{"role": "user", "content": "Describe a fruit as JSON."}]
FRUIT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "yellow"]},
        "ripe": {"type": "boolean"},
    },
    "required": ["name", "color", "ripe"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def served():
    bundle = build_engine(CONFIG)
    engine = AsyncEngine(bundle.engine)
    engine.start()
    try:
        with running_server(ServerState(NAME, engine, bundle.runner.stats), CONFIG) as url:
            yield openai_client(url), bundle
    finally:
        engine.shutdown()


def chat(client, **fields):
    fields = {"max_tokens": MAX_TOKENS, "messages": ASK, **fields}
    return client.chat.completions.create(model=NAME, **fields).choices[0]


def test_json_schema_outputs_validate_for_twenty_seeds(served):
    client, bundle = served
    choices = schema_replies(lambda **fields: chat(client, **fields), FRUIT)
    for choice in choices:
        assert choice.finish_reason == "stop"  # the grammar completed the object
        jsonschema.validate(json.loads(choice.message.content), FRUIT)
    assert len({c.message.content for c in choices}) > 1  # sampled, not one answer
    assert bundle.runner.stats()["runtime_compiles"] == 0


def test_json_object_output_parses_to_an_object(served):
    client, _ = served
    person = [{"role": "user", "content": "Write Alice, aged 30, as a JSON object with the keys "
                                          "name and age."}]
    choice = chat(client, messages=person, temperature=0, response_format={"type": "json_object"})
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_a_named_tool_choice_returns_a_valid_call(served):
    client, _ = served
    for seed in range(3):
        choice = chat(client, temperature=1.0, seed=seed, tools=[WEATHER],
                      tool_choice={"type": "function", "function": {"name": "weather"}})
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])


@pytest.fixture(scope="module")
def reference(served):
    _, bundle = served
    loaded = bundle.loaded
    return ReferenceGenerator(loaded.model, loaded.tokenizer), loaded.tokenizer


def test_logit_bias_forces_and_forbids_tokens(served, reference):
    client, _ = served
    generator, tokenizer = reference
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(ASK, add_generation_prompt=True))
    greedy = generator.generate([prompt_ids], [SamplingParams(max_tokens=4, temperature=0.0,
                                                              ignore_eos=True)])[0]
    first = greedy.token_ids[0]
    forbidden = chat(client, temperature=0, max_tokens=1, logit_bias={str(first): -100},
                     logprobs=True)
    assert forbidden.logprobs.content[0].token != tokenizer.decode([first])
    forced_id = tokenizer.encode(" banana")[0]
    forced = chat(client, temperature=1.0, seed=0, max_tokens=3, logprobs=True,
                  logit_bias={str(forced_id): 100}, extra_body={"ignore_eos": True})
    assert [t.token for t in forced.logprobs.content] == [tokenizer.decode([forced_id])] * 3
