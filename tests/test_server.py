"""The OpenAI-compatible server, end to end: a real uvicorn server on loopback, real clients.

The server runs the tiny HF checkpoint on the real model runner with a deliberately small KV cache
(24 pages of 8 tokens), so concurrent traffic forces preemption. Expected outputs come from
the plain dense-cache reference generator, never from the server.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from serving import CONFIG, MODEL_DIR, MODEL_NAME, Reference, greedy, running_server

from tokenspeed_jax import SamplingParams
from tokenspeed_jax.engine.async_engine import AsyncEngine
from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.engine.startup import build_engine
from tokenspeed_jax.server.app import ServerState
from tokenspeed_jax.tokenizer import Tokenizer


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


def scrape(url: str) -> dict[str, Metric]:
    """/metrics parsed: the metric families by name (a counter's without its ``_total``)."""
    response = httpx.get(url + "/metrics")
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def metric(url: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` on /metrics."""
    values = [sample.value for family in scrape(url).values() for sample in family.samples
              if sample.name == name and not sample.labels]
    assert len(values) == 1, f"{name} missing from /metrics"
    return values[0]


def total(family: Metric) -> float:
    """A counter family's value, summed over its labels (0 before any sample)."""
    return sum(s.value for s in family.samples if s.name == family.name + "_total")


def observations(family: Metric) -> float:
    """A histogram family's count of observations."""
    count, = (s.value for s in family.samples if s.name == family.name + "_count")
    return count


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

    seeded = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=1.0, n=2, seed=7,
        extra_body={"ignore_eos": True})
    # the j-th of n samples draws with seed + j
    assert [c.text for c in sorted(seeded.choices, key=lambda c: c.index)] == [
        reference.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=7 + j,
                                                    ignore_eos=True))[0].text
        for j in range(2)]


# What the concurrent requests ask for, in turn: greedy, seeded sampling, penalties, or both.
MIXED_SETTINGS = (
    {"temperature": 0.0},
    {"temperature": 0.9, "top_p": 0.95, "seed": 100},
    {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
    {"temperature": 0.8, "top_k": 30, "presence_penalty": 0.6, "seed": 200},
)


def test_32_concurrent_mixed_requests_match_the_reference_under_preemption(server, reference):
    """Preempted requests recompute their prompt and output and go on with the same seeded draws
    and penalty counts: every request's text is the reference generator's."""
    url, _ = server
    rng = np.random.default_rng(0)
    vocab = reference.tokenizer.vocab_size
    prompts = [rng.integers(3, vocab, rng.integers(2, 50)).tolist() for _ in range(32)]
    max_tokens = [int(rng.integers(1, 24)) for _ in range(32)]
    settings = [{**MIXED_SETTINGS[i % len(MIXED_SETTINGS)], "max_tokens": m, "ignore_eos": True}
                for i, m in enumerate(max_tokens)]
    expected = [reference.generate([p], SamplingParams(**s))[0].text
                for p, s in zip(prompts, settings)]
    preemptions_before = metric(url, "tokenspeed_num_preemptions_total")

    async def one(http: httpx.AsyncClient, prompt, request_settings, stream):
        body = {"model": MODEL_NAME, "prompt": prompt, **request_settings, "stream": stream}
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
            return await asyncio.gather(*(one(http, p, s, stream=i < 16)
                                          for i, (p, s) in enumerate(zip(prompts, settings))))

    assert asyncio.run(everything()) == expected
    assert metric(url, "tokenspeed_num_preemptions_total") > preemptions_before
    assert metric(url, "tokenspeed_kv_pages_used") == 0


def finished(url: str, reason: str) -> float:
    """How many requests have finished with ``reason``, per /metrics."""
    return sum(sample.value for sample in scrape(url)["tokenspeed_requests"].samples
               if sample.name == "tokenspeed_requests_total"
               and sample.labels == {"finish_reason": reason})


def test_disconnect_mid_stream_frees_pages(server):
    """A client leaving mid-stream aborts its request while decode steps run ahead of it. The
    prompt is short and the output as long as the context allows, so the engine, which does not
    wait for the client, is still decoding when the client leaves."""
    url, engine = server
    body = {"model": MODEL_NAME, "prompt": list(range(3, 8)), "max_tokens": 91,
            "ignore_eos": True, "stream": True}
    overlapped_before = metric(url, "tokenspeed_engine_overlapped_steps_total")
    aborted_before = finished(url, "abort")
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
    assert finished(url, "abort") == aborted_before + 1
    assert metric(url, "tokenspeed_engine_overlapped_steps_total") > overlapped_before


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
    hits_before = metric(url, "tokenspeed_prefix_cache_hit_tokens_total")
    texts = []
    for _ in range(2):
        response = httpx.post(url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}, timeout=60)
        texts.append(response.json()["choices"][0]["text"])
    assert metric(url, "tokenspeed_prefix_cache_hit_tokens_total") - hits_before >= 32
    assert texts == [expected, expected]


# What /metrics exposes, by type (counters without their _total), for every model family.
DENSE_COUNTERS = {
    "tokenspeed_requests", "tokenspeed_prompt_tokens", "tokenspeed_generation_tokens",
    "tokenspeed_engine_steps", "tokenspeed_engine_overlapped_steps", "tokenspeed_num_preemptions",
    "tokenspeed_prefix_cache_query_tokens", "tokenspeed_prefix_cache_hit_tokens",
    "tokenspeed_kda_checkpoints_written", "tokenspeed_kda_checkpoint_hits",
    "tokenspeed_prefill_runs", "tokenspeed_ordinary_runs", "tokenspeed_decode_runs",
    "tokenspeed_eager_runs", "tokenspeed_chunked_prefill_splits", "tokenspeed_request_splits",
    "tokenspeed_decode_splits", "tokenspeed_mixed_splits", "tokenspeed_real_tokens",
    "tokenspeed_padded_tokens", "tokenspeed_kda_state_restores", "tokenspeed_resample_runs",
    "tokenspeed_runtime_compiles", "tokenspeed_eager_compiles",
}
DENSE_GAUGES = {
    "tokenspeed_ready", "tokenspeed_num_requests_running", "tokenspeed_num_requests_waiting",
    "tokenspeed_kv_pages_used", "tokenspeed_kv_pages_capacity", "tokenspeed_kv_cache_usage_ratio",
    "tokenspeed_prefix_cache_hit_rate", "tokenspeed_engine_decode_device_bound",
    "tokenspeed_state_slots_used", "tokenspeed_state_slots_capacity",
    "tokenspeed_padding_waste", "tokenspeed_buckets_ready", "tokenspeed_buckets_capacity",
    "tokenspeed_plans_untuned",
}
HISTOGRAMS = {
    "tokenspeed_time_to_first_token_seconds", "tokenspeed_time_per_output_token_seconds",
    "tokenspeed_e2e_request_latency_seconds",
}


def test_metrics_counts_are_counters_that_grow_and_levels_are_gauges(server):
    url, _ = server
    before = scrape(url)
    response = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": [11, 12, 13], "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200
    after = scrape(url)
    by_type: dict[str, set[str]] = {}
    for name, family in after.items():
        if not name.endswith("_created"):  # prometheus_client's creation times of its own metrics
            by_type.setdefault(family.type, set()).add(name)
    assert by_type == {"counter": DENSE_COUNTERS, "gauge": DENSE_GAUGES, "histogram": HISTOGRAMS}
    for name in DENSE_COUNTERS:
        assert total(after[name]) >= total(before[name]), name
    for name in ("tokenspeed_requests", "tokenspeed_prompt_tokens", "tokenspeed_generation_tokens",
                 "tokenspeed_engine_steps", "tokenspeed_real_tokens"):
        assert total(after[name]) > total(before[name]), name
    for name in HISTOGRAMS:  # the request had a first token and more after it
        assert observations(after[name]) > observations(before[name]), name
    assert (observations(after["tokenspeed_e2e_request_latency_seconds"])
            == total(after["tokenspeed_requests"]))
    assert after["tokenspeed_ready"].samples[0].value == 1
    # tokens (32, 64), prefill requests (4, 8), decode (8,): too few rungs to defer any
    assert (after["tokenspeed_buckets_ready"].samples[0].value
            == after["tokenspeed_buckets_capacity"].samples[0].value == 5)


def test_starting_server_answers_503_and_is_not_ready():
    with running_server(ServerState(MODEL_NAME)) as url:
        assert metric(url, "tokenspeed_ready") == 0
        assert httpx.get(url + "/health").status_code == 503
        response = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"


class LostDeviceRunner:
    """A runner whose device is gone: every launch fails, and so the engine loop dies."""

    def launch(self, batch):
        raise RuntimeError("the device is gone")


def test_ready_drops_to_0_when_the_engine_loop_dies():
    engine = AsyncEngine(Engine(LostDeviceRunner(), Tokenizer.from_hf_dir(MODEL_DIR),
                                num_pages=4, page_size=8, max_num_seqs=1,
                                max_num_batched_tokens=32, max_model_len=32))
    engine.start()
    with running_server(ServerState(MODEL_NAME, engine)) as url:
        assert metric(url, "tokenspeed_ready") == 1
        response = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
        assert metric(url, "tokenspeed_ready") == 0
        assert httpx.get(url + "/health").status_code == 503
