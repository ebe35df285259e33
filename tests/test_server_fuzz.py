"""Random JSON at both generation endpoints: never a 5xx, the server stays healthy, no compile.

A sweep first sets every field of a valid request, one at a time, to every number at the edges
of what the engine's arrays hold (int32, uint64, float32, non-finite). Random bodies then come
from three strategies: any JSON value; an object with the endpoints' own field names
holding any JSON value; and a small valid request with fields replaced by random values (most
bugs hide one field away from a valid request). Bodies are sent as Python's JSON encoder writes
them, so non-finite numbers arrive as ``NaN`` / ``Infinity``. Examples are bounded and
derandomized, so a CI run is the same run every time.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import CONFIG, MODEL_NAME, serving

from tokenspeed_jax.engine.startup import build_engine

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "logprobs",
          "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "ignore_eos", "stream", "stream_options", "add_generation_prompt", "user", "role",
          "content", "logit_bias", "response_format", "tools", "tool_choice", "modalities",
          "audio", "echo", "suffix", "best_of", "metadata", "tool_calls", "refusal"]

# any code point, lone surrogates included (JSON's \\udXXX escapes can carry them)
texts = st.text(st.characters(exclude_categories=()), max_size=20)
# numbers at the edges of what the engine's arrays hold (int32, uint64, float32)
EDGES = [-2**63, -2**31 - 1, -2, -1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, 2**64 + 1,
         1e-46, 1e-30, 0.5, 3.5e38, 1e39, float("inf"), -float("inf"), float("nan")]
edges = st.sampled_from(EDGES)
scalars = (st.none() | st.booleans() | st.floats() | texts | edges
           | st.integers(min_value=-2**70, max_value=2**70) | st.sampled_from(FIELDS))
json_values = st.recursive(
    scalars, lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | texts, children, max_size=4),
    max_leaves=12)
named_objects = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
VALID = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "the quick", "max_tokens": 3},
    "/v1/chat/completions": {"model": MODEL_NAME, "max_tokens": 3,
                             "messages": [{"role": "user", "content": "hi"}]},
}


@st.composite
def mutated(draw, path: str) -> dict:
    body = dict(VALID[path])
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2)):
        body[name] = draw(json_values)
    return body


def bodies(path: str):
    return mutated(path) | named_objects | json_values


@pytest.fixture(scope="module")
def served():
    bundle = build_engine(CONFIG)
    with serving(bundle) as (url, _), httpx.Client(base_url=url, timeout=120) as http:
        yield http, bundle.runner


def post(http: httpx.Client, path: str, body) -> None:
    """POST ``body``; assert it is served or refused in the OpenAI error shape, never a 5xx."""
    response = http.post(path, content=json.dumps(body).encode("utf-8", "surrogatepass"),
                         headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", sorted(VALID))
def test_every_field_at_every_edge_number_never_gets_a_5xx(served, path):
    http, runner = served
    for name in FIELDS:
        for value in EDGES:
            post(http, path, {**VALID[path], name: value})
    assert http.get("/health").status_code == 200
    assert runner.stats()["runtime_compiles"] == 0


@pytest.mark.parametrize("path", sorted(VALID))
def test_random_json_never_gets_a_5xx(served, path):
    http, runner = served

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def post_random(body) -> None:
        post(http, path, body)

    post_random()
    assert http.get("/health").status_code == 200
    assert runner.stats()["runtime_compiles"] == 0
