"""The request fields OpenAI's API defines, as the official ``openai`` client sends them.

The field list comes from the installed ``openai`` package's own request types, so a field the
API gains and this server does not accept fails here. Each field is served, refused with a 400
naming it, or ignored; expected texts come from the reference generator, never the server.
"""

from __future__ import annotations

import logging
import typing

import numpy as np
import openai
import pytest
from openai.types import completion_create_params as completion_types
from openai.types.chat import completion_create_params as chat_types
from serving import CONFIG, MODEL_DIR, MODEL_NAME, Reference, greedy, openai_client, serving

from tokenspeed_jax.engine.startup import build_engine
from tokenspeed_jax.server.protocol import ChatCompletionRequest, CompletionRequest

PROMPT = [11, 42, 7, 90]
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client():
    with serving(build_engine(CONFIG)) as (url, _):
        yield openai_client(url)


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL_DIR)


def openai_fields(types) -> set[str]:
    return set(typing.get_type_hints(types.CompletionCreateParamsStreaming)) | set(
        typing.get_type_hints(types.CompletionCreateParamsNonStreaming))


@pytest.mark.parametrize("ours, types", [(ChatCompletionRequest, chat_types),
                                         (CompletionRequest, completion_types)])
def test_every_openai_request_field_is_accepted(ours, types):
    official = openai_fields(types)
    assert "messages" in official or "prompt" in official  # the reference was read
    assert set(ours.model_fields) - ours.ENGINE_EXTRAS == official
    assert set(ours.IGNORED) <= official


def refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as raised:
        call()
    return raised.value.body


def distinct_texts(reference) -> dict[int, str]:
    """The tokens whose text no other token has (byte tokens of the tiny vocabulary share one
    replacement character), by id: from a text, such a token is known."""
    texts = [reference.tokenizer.decode([t]) for t in range(reference.tokenizer.vocab_size)]
    return {t: text for t, text in enumerate(texts) if text and texts.count(text) == 1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_of_100_forces_a_token(client, reference, temperature):
    least_likely = np.argsort(reference.log_probs(PROMPT)[-1])
    token = next(int(t) for t in least_likely if t in distinct_texts(reference))
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=temperature, seed=3,
        logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert response.choices[0].text == reference.tokenizer.decode([token] * 6)


def test_logit_bias_of_minus_100_forbids_a_token(client, reference):
    """Greedy: banning the argmax yields the reference's second-best token. Sampled: the 20
    likeliest first tokens banned, none of 16 samples is one of them (told apart by text)."""
    order = np.argsort(-reference.log_probs(PROMPT)[-1])
    decode = reference.tokenizer.decode
    banned = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0,
        logit_bias={str(order[0]): -100})
    assert banned.choices[0].text == decode([int(order[1])])
    sampled, unbiased = (client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=1.0, n=16, seed=5,
        logit_bias=bias) for bias in ({str(t): -100 for t in order[:20]}, None))
    texts = {distinct_texts(reference).get(int(t)) for t in order[:20]} - {None}
    assert any(c.text in texts for c in unbiased.choices)  # the ban has something to remove
    assert not any(c.text in texts for c in sampled.choices)


def test_logit_bias_outside_the_vocabulary_is_refused(client):
    body = refusal(lambda: client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, logit_bias={"100000": 5}))
    assert body["param"] == "logit_bias"
    body = refusal(lambda: client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, logit_bias={"5": 101}))
    assert body["param"] == "logit_bias"


def test_chat_stream_ends_with_a_usage_chunk(client, reference):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_completion_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    expected = reference.chat(HELLO, greedy(7, ignore_eos=True))[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        expected.text
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_a_dumped_assistant_message_goes_back_in(client, reference):
    messages = list(HELLO)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    dumped = reply.choices[0].message.model_dump()
    assert {"refusal", "tool_calls", "annotations", "audio", "function_call"} <= set(dumped)
    messages += [dumped, {"role": "user", "content": "and then?"}]
    again = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert again.choices[0].message.content == \
        reference.chat(plain, greedy(5, ignore_eos=True))[0].text


def test_meaningless_and_informational_fields_change_nothing(client, reference, caplog):
    expected = reference.chat(HELLO, greedy(4, ignore_eos=True))[0].text
    with caplog.at_level(logging.INFO, logger="tokenspeed_jax.server.app"):
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=HELLO, max_tokens=4, temperature=0, store=True,
            service_tier="auto", metadata={"k": "v"}, user="u1", reasoning_effort="low",
            prediction={"type": "content", "content": "x"}, parallel_tool_calls=False,
            modalities=["text"], response_format={"type": "text"}, tool_choice="none",
            safety_identifier="s", verbosity="low", top_p=None, n=None,
            extra_body={"ignore_eos": True})
    assert response.choices[0].message.content == expected
    noted = " ".join(r.getMessage() for r in caplog.records)
    assert "'store'" in noted and "'service_tier'" in noted


def test_top_logprobs_on_chat_match_the_reference(client, reference):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    expected = reference.chat(HELLO, greedy(3, ignore_eos=True))[0]
    steps = reference.log_probs(expected.prompt_token_ids + expected.token_ids[:-1])[
        len(expected.prompt_token_ids) - 1:]
    top = np.argsort(-steps, axis=-1)[:, :3]
    got = response.choices[0].logprobs.content
    decode = reference.tokenizer.decode
    assert [[t.token for t in g.top_logprobs] for g in got] == \
        [[decode([int(t)]) for t in row] for row in top]
    np.testing.assert_allclose([[t.logprob for t in g.top_logprobs] for g in got],
                               np.take_along_axis(steps, top, -1), atol=1e-4)


def test_max_completion_tokens_and_max_tokens(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_completion_tokens=3, max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3
    body = refusal(lambda: client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_completion_tokens=3, max_tokens=4))
    assert body["param"] == "max_completion_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_completion(client, reference, stream):
    prompt = "the quick brown"
    expected = reference.generate(prompt, greedy(5, ignore_eos=True))[0].text
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5,
                                         temperature=0, echo=True, stream=stream,
                                         extra_body={"ignore_eos": True})
    chunks = list(response) if stream else [response]
    assert "".join(c.choices[0].text for c in chunks) == prompt + expected


def test_each_request_logs_one_line_when_it_finishes(client, caplog):
    with caplog.at_level(logging.INFO, logger="tokenspeed_jax.server.app"):
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3,
                                             temperature=0, n=2, extra_body={"ignore_eos": True})
    lines = [r.getMessage() for r in caplog.records if "finished" in r.getMessage()]
    assert sorted(line.split()[1] for line in lines) == [f"{response.id}-0", f"{response.id}-1"]
    for line in lines:
        assert f"{len(PROMPT)} prompt tokens, 3 output tokens, TTFT " in line
        assert line.endswith("finish reason length")


def test_unknown_field_is_a_400_naming_it(client):
    body = refusal(lambda: client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=2, extra_body={"frobnicate": 1}))
    assert body["param"] == "frobnicate" and "frobnicate" in body["message"]


TOOL_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CHAT_REFUSED = [
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("tools[0].function.name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tool_choice.function.name", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function",
                                                   "function": {"name": "g"}}}),
    ("functions", {"functions": [{"name": "f"}]}),
    ("function_call", {"function_call": "auto"}),
    ("web_search_options", {"web_search_options": {}}),
    ("messages.0.content.1", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, IMAGE]}]}),
    ("messages.1.tool_calls.0.function.arguments", {"messages": HELLO + [
        {"role": "assistant", "content": None,
         "tool_calls": [{**TOOL_CALL, "function": {"name": "f", "arguments": "{x"}}]}]}),
    ("messages.1.tool_call_id", {"messages": HELLO + [{"role": "tool", "content": "x"}]}),
]


@pytest.mark.parametrize("param, fields", CHAT_REFUSED, ids=[c[0] for c in CHAT_REFUSED])
def test_unsupported_chat_fields_are_a_400_naming_them(client, param, fields):
    body = refusal(lambda: client.chat.completions.create(
        **{"model": MODEL_NAME, "messages": HELLO, "max_tokens": 2, **fields}))
    assert body["param"] == param and param in body["message"]


COMPLETION_REFUSED = [
    ("suffix", {"suffix": " and the end"}),
    ("best_of", {"best_of": 3}),
    ("echo", {"echo": True, "logprobs": 1}),
    ("stream_options", {"stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize("param, fields", COMPLETION_REFUSED,
                         ids=[c[0] for c in COMPLETION_REFUSED])
def test_unsupported_completion_fields_are_a_400_naming_them(client, param, fields):
    body = refusal(lambda: client.completions.create(
        **{"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, **fields}))
    assert body["param"] == param and param in body["message"]
