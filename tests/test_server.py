"""The OpenAI-compatible server, end to end: a real uvicorn server on loopback, real clients.

The server runs the tiny HF checkpoint on the real model runner with a deliberately small KV cache
(24 pages of 8 tokens), so concurrent traffic forces preemption. Expected outputs come from
the plain dense-cache reference generator, never from the server.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import numpy as np
import openai
import pytest
from serving import CONFIG, MODEL_DIR, MODEL_NAME, Reference, greedy, running_server

from tokenspeed_jax.engine.engine import AsyncEngine, build_engine
from tokenspeed_jax.server.app import ServerState


@pytest.fixture(scope="module")
def server():
    bundle = build_engine(CONFIG)
    engine = AsyncEngine(bundle.engine)
    engine.start()
    state = ServerState(MODEL_NAME, engine, bundle.runner.stats)
    with running_server(state) as url:
        yield url, bundle.engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL_DIR)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server[0] + "/health").status_code == 200


def test_chat_completion_matches_llm_chat(client, reference):
    messages = [{"role": "user", "content": "hello there"}]
    expected = reference.chat(messages, greedy(10, ignore_eos=True))[0]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
    assert response.usage.completion_tokens == 10


def test_streamed_completion_equals_reference_with_usage(client, reference):
    prompt = "the quick brown fox"
    expected = reference.generate(prompt, greedy(12, ignore_eos=True))[0]
    stream = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(reference.tokenizer.encode(prompt))


def test_stop_string_across_tokens_cuts_the_text(client, reference):
    prompt = [5, 17, 99, 23]
    full = reference.generate([prompt], greedy(20, ignore_eos=True))[0]
    stop = full.text[5:9]  # spans token boundaries in general; cut at its first occurrence
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].text == full.text[: full.text.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_n_samples_greedy_and_seeded(client, reference):
    prompt = [3, 4, 5, 6, 7]
    expected = reference.generate([prompt], greedy(8, ignore_eos=True))[0].text
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, n=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert [c.text for c in response.choices] == [expected] * 3

    def seeded():
        return [c.text for c in client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=1.0, n=2, seed=7,
            extra_body={"ignore_eos": True}).choices]

    assert seeded() == seeded()


def test_32_concurrent_mixed_requests_match_llm_generate_under_preemption(server, reference):
    url, _ = server
    rng = np.random.default_rng(0)
    vocab = reference.tokenizer.vocab_size
    prompts = [rng.integers(3, vocab, rng.integers(2, 50)).tolist() for _ in range(32)]
    max_tokens = [int(rng.integers(1, 24)) for _ in range(32)]
    expected = [reference.generate([p], greedy(m, ignore_eos=True))[0].text
                for p, m in zip(prompts, max_tokens)]
    preemptions_before = metric(url, "tokenspeed_num_preemptions")

    async def one(http: httpx.AsyncClient, prompt, limit, stream):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": limit, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        if not stream:
            response = await http.post("/v1/completions", json=body)
            return response.json()["choices"][0]["text"]
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def everything():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(one(http, p, m, i % 2 == 0)
                                          for i, (p, m) in enumerate(zip(prompts, max_tokens))))

    assert asyncio.run(everything()) == expected
    assert metric(url, "tokenspeed_num_preemptions") > preemptions_before
    assert metric(url, "tokenspeed_kv_pages_used") == 0


def test_disconnect_mid_stream_frees_pages(server):
    """A client leaving mid-stream aborts its request while decode steps run ahead of it. The
    prompt is short and the output as long as the context allows, so the engine, which does not
    wait for the client, is still decoding when the client leaves."""
    url, engine = server
    body = {"model": MODEL_NAME, "prompt": list(range(3, 8)), "max_tokens": 91,
            "ignore_eos": True, "stream": True}
    overlapped_before = metric(url, "tokenspeed_engine_overlapped_steps")
    with httpx.Client(base_url=url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events)  # the prompt's token
        next(events)  # the first decode step's: the next step was launched before it came
        assert metric(url, "tokenspeed_kv_pages_used") > 0
    deadline = time.monotonic() + 20
    while metric(url, "tokenspeed_kv_pages_used") > 0 or engine.num_running:
        assert time.monotonic() < deadline, "aborted request kept its pages"
        time.sleep(0.05)
    assert 'finish_reason="abort"' in httpx.get(url + "/metrics").text
    assert metric(url, "tokenspeed_engine_overlapped_steps") > overlapped_before
    assert metric(url, "tokenspeed_engine_decode_device_bound") in (0.0, 1.0)


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, None),
        ({"model": MODEL_NAME, "prompt": "hi", "bogus": 1}, 400, "bogus", None),
        ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
        ({"model": MODEL_NAME, "prompt": list(range(3, 200))}, 400, "prompt",
         "context_length_exceeded"),
        ({"model": "no-such-model", "prompt": "hi"}, 404, "model", "model_not_found"),
    ],
)
def test_bad_requests_get_errors_while_others_continue(server, reference, body, status, param,
                                                        code):
    url, _ = server
    prompt = [9, 8, 7, 6]
    expected = reference.generate([prompt], greedy(30, ignore_eos=True))[0].text

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            good = asyncio.create_task(http.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 30, "temperature": 0,
                "ignore_eos": True}))
            await asyncio.sleep(0.05)
            kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            bad = await http.post("/v1/completions", **kwargs)
            return bad, await good

    bad, good = asyncio.run(scenario())
    assert bad.status_code == status
    error = bad.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"] == expected


def test_prefix_cache_hit_gives_the_same_tokens(server, reference):
    url, _ = server
    prompt = list(range(40, 75))
    expected = reference.generate([prompt], greedy(6, ignore_eos=True))[0].text
    hits_before = metric(url, "tokenspeed_prefix_cache_hit_tokens")
    texts = []
    for _ in range(2):
        response = httpx.post(url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}, timeout=60)
        texts.append(response.json()["choices"][0]["text"])
    assert metric(url, "tokenspeed_prefix_cache_hit_tokens") - hits_before >= 32
    assert texts == [expected, expected]


def test_metrics_count_requests_and_latencies(server):
    url, _ = server
    text = httpx.get(url + "/metrics").text
    for name in ("tokenspeed_requests_total", "tokenspeed_time_to_first_token_seconds_count",
                 "tokenspeed_time_per_output_token_seconds_count",
                 "tokenspeed_e2e_request_latency_seconds_count", "tokenspeed_runtime_compiles",
                 "tokenspeed_padding_waste", "tokenspeed_num_requests_waiting"):
        assert re.search(rf"^{name}", text, re.MULTILINE), name
    finished = sum(float(v) for v in re.findall(r"^tokenspeed_requests_total\{.*\} (\S+)$", text,
                                                re.MULTILINE))
    count = float(re.search(r"^tokenspeed_e2e_request_latency_seconds_count (\S+)$", text,
                            re.MULTILINE).group(1))
    assert finished == count > 0


def test_starting_server_answers_503():
    with running_server(ServerState(MODEL_NAME)) as url:
        assert httpx.get(url + "/health").status_code == 503
        response = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
