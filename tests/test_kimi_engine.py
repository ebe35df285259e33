"""Kimi-Linear behind ``LLM`` and the server: its runner under the scheduler, KDA state rows per
request, prefix caching through KDA checkpoints.

Expectations come from HF transformers' golden greedy tokens and the logits of each greedy step,
and from the hybrid reference generator (the model's plain forward, one unpadded prompt at a
time), never from the engine. The engine runs with a KV cache of 12 pages of 16 tokens, so
batched traffic forces preemption.

The reference generator compiles its forward for each prompt length (and cache length): the
prompts reuse a few lengths (5, 6, 37, 70, 100) wherever a test's point allows.

The engine compiles the inline prefill route alone (``inline_route_only``): the ordinary route
is taken only by a prefill chunk of one token past the start, and none of this module's steps
holds one. That is fixed, not a matter of timing: the engine runs decode steps ahead always
(``overlap_schedule="on"``; "auto" decides from measured step times, which would let the page
pressure of the preemption test, and so its chunk sizes, vary from run to run). A step that
needed the ordinary route would find no compiled plan and fail (``test_kimi_runner`` runs it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
from golden_checks import assert_steps_match_golden, log_softmax, step_logprobs
from test_llm import with_overlap
from test_server import running_server, scrape
from tiny_checkpoints import KIMI_VOCAB, inline_route_only, tiny_kimi

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.engine.async_engine import AsyncEngine
from tokenspeed_jax.server.app import ServerState
from tokenspeed_jax.server.metrics import COUNTERS, GAUGES

GOLDEN = Path(__file__).parent / "golden"
VOCAB = KIMI_VOCAB
OPTIONS = {
    "dtype": "float32",
    "prefill_graph_max_tokens": 128,
    "prefill_graph_capture_token_sizes": (128,),
    "prefill_graph_capture_batch_sizes": (4,),
    "decode_graph_capture_batch_sizes": (4,),
    "max_num_seqs": 4,
    "max_model_len": 192,
    "num_pages": 12,
    "page_size": 16,
    "prefix_granularity": 64,
    "strict_no_compile": True,
    "compile_progress": False,
}


ATOL = 2e-4  # fp32; chunked KDA and paged MLA only reorder float sums


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def logprobs(completion) -> np.ndarray:
    return np.array([lp.logprob for lp in completion.logprobs])


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    """The tiny Kimi checkpoint with a word-level tokenizer over its 256 ids (w0 .. w255)."""
    template = ("{% for m in messages %}w1 {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}w3{% endif %}")
    return tiny_kimi(tmp_path_factory.mktemp("tiny_kimi"), template)


@pytest.fixture(scope="module")
def llm(kimi_dir) -> LLM:
    """The module's engine: the inline prefill route alone, decode steps run ahead always
    (module docstring)."""
    with inline_route_only():
        return LLM(kimi_dir, **OPTIONS, overlap_schedule="on")


def random_prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def reference_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    completions = llm.reference.generate(prompts, [greedy(max_tokens)] * len(prompts))
    return [c.token_ids for c in completions]


def test_build_engine_serves_kimi_with_its_forward_and_a_state_pool(llm):
    from tokenspeed_jax.models.kimi_linear.forward import LatentForward

    assert isinstance(llm.runner.forward, LatentForward)
    # max_num_seqs live rows, as many checkpoint rows (prefix caching is on)
    assert llm.runner.num_state_slots == 2 * OPTIONS["max_num_seqs"]
    assert llm.engine.state_slots.num_live == OPTIONS["max_num_seqs"]


# 0: the in-step sampler's log-probability of the greedy token; 20: resampled from the head's logits
@pytest.mark.parametrize("top", [0, 20])
def test_greedy_steps_and_engine_logprobs_match_transformers(llm, top):
    data = np.load(GOLDEN / "tiny_kimi.npz")
    prompts = data["prompt_ids"].tolist()
    outs = llm.generate(prompts, greedy(data["greedy_ids"].shape[1], logprobs=top))
    assert [o.token_ids for o in outs] == data["greedy_ids"].tolist()
    for row, (out, logits) in enumerate(zip(outs, data["greedy_logits"], strict=True)):
        assert_steps_match_golden(step_logprobs(out), logits, label=f"prompt {row}")
    assert llm.stats()["runtime_compiles"] == 0


def test_mixed_lengths_batched_with_preemption_match_reference(llm):
    """Every request samples with a seed or has penalties (or both), so whichever is preempted
    and recomputed must keep its seed's draws and its penalty counts to give the reference
    generator's tokens."""
    prompts = random_prompts(1, 5, 37, 70, 100)
    params = [greedy(24, repetition_penalty=1.3, presence_penalty=0.5, logprobs=0),
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11,
                             ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=24, temperature=0.9, repetition_penalty=1.2,
                             presence_penalty=-0.5, seed=13, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=24, temperature=1.0, top_k=20, frequency_penalty=0.6,
                             seed=12, ignore_eos=True, logprobs=0)]
    before = llm.stats()
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    expected = llm.reference.generate(prompts, params)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    for out, want in zip(outs, expected):
        np.testing.assert_allclose(logprobs(out), logprobs(want), atol=ATOL)
    assert all(o.finish_reason == "length" for o in outs)
    assert stats["num_preemptions"] > before["num_preemptions"]  # 12 pages cannot hold all four
    assert stats["prefill_runs"] > before["prefill_runs"]
    assert stats["decode_runs"] > before["decode_runs"]
    assert stats["runtime_compiles"] == 0
    assert stats["state_slots_used"] == 0


def test_prefix_hit_restores_the_kda_checkpoint(llm):
    (prompt,) = random_prompts(2, 170)  # chunks 0..128 (checkpoint at 128) and 128..170
    params = greedy(8, logprobs=0)
    (miss,) = llm.generate([prompt], params)
    before = llm.stats()
    (hit,) = llm.generate([prompt], params)
    after = llm.stats()
    (expected,) = llm.reference.generate([prompt], [params])
    assert hit.token_ids == miss.token_ids == expected.token_ids
    # log-probabilities see a wrong KDA state even where the greedy tokens do not
    np.testing.assert_allclose(logprobs(hit), logprobs(expected), atol=ATOL)
    np.testing.assert_allclose(logprobs(miss), logprobs(expected), atol=ATOL)
    assert after["kda_checkpoint_hits"] == before["kda_checkpoint_hits"] + 1
    assert after["kda_state_restores"] == before["kda_state_restores"] + 1
    # the pages hold 160 cached tokens; the hit is cut back to the checkpoint at 128
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 128


def test_prefix_hit_without_a_checkpoint_is_cut_to_zero(llm):
    (base,) = random_prompts(3, 100)  # one chunk: its only checkpoint is at 64
    (other,) = random_prompts(4, 20)
    llm.generate([base], greedy(2))
    before = llm.stats()
    prompt = base[:50] + other  # shares 3 pages (48 tokens), which end before any checkpoint
    (out,) = llm.generate([prompt], greedy(6))
    after = llm.stats()
    assert out.token_ids == reference_tokens(llm, [prompt], 6)[0]
    assert after["prefix_hit_tokens"] == before["prefix_hit_tokens"]
    assert after["kda_checkpoint_hits"] == before["kda_checkpoint_hits"]


def test_abort_frees_the_state_slot(llm):
    engine = llm.engine
    (prompt,) = random_prompts(5, 20)
    engine.add_request("to-abort", prompt, greedy(50))
    engine.step()
    assert llm.stats()["state_slots_used"] == 1
    output = engine.abort("to-abort")
    assert output.finished and output.finish_reason == "abort"
    assert llm.stats()["state_slots_used"] == 0
    assert not engine.has_unfinished


def test_penalties_truncation_and_top_logprobs_match_reference(llm):
    """Requests that need the full sampler (resampled from the head's logits) beside a plain
    greedy one: tokens and top log-probabilities equal the reference generator's."""
    prompts = random_prompts(9, 6, 37, 5)
    params = [greedy(6, repetition_penalty=1.5, frequency_penalty=0.4),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, max_tokens=6),
              greedy(6, logprobs=3)]
    before = llm.stats()["resample_runs"]
    got = llm.generate(prompts, params)
    expected = llm.reference.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert llm.stats()["resample_runs"] > before
    # Top log-probabilities: the three best of log_softmax of the reference forward's logits.
    sequence = [*prompts[2], *got[2].token_ids]
    log_probs = log_softmax(llm.logits(sequence))
    for i, step in enumerate(got[2].logprobs):
        row = log_probs[len(prompts[2]) - 1 + i]
        best = np.argsort(-row)[:3]
        assert [token for token, _ in step.top] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in step.top], row[best], atol=2e-4)


def test_decode_steps_run_ahead_with_the_outputs_of_the_reference(llm):
    """With the overlap schedule on, each decode step is launched before the previous step's
    tokens reach the host (its tokens read from the token board): greedy tokens and log-probs
    equal the reference generator's, with a stop token ending one request early; seeded sampling
    equals the synchronous loop; every page and state row comes back."""
    engine = llm.engine
    prompts = random_prompts(11, 5, 37, 70)
    (first, *_) = reference_tokens(llm, prompts[:1], 12)
    params = [greedy(16, logprobs=0, stop_token_ids=[first[6]]),
              SamplingParams(max_tokens=16, temperature=0.9, seed=4)]

    def run() -> list:
        outs = [llm.generate(prompts, p) for p in params]
        assert engine.block_manager.num_used_pages == 0
        assert llm.stats()["state_slots_used"] == 0
        return outs

    synchronous, none = with_overlap(engine, "off", run)
    overlapped, ahead = with_overlap(engine, "on", run)
    assert none == 0 and ahead > 0
    expected = llm.reference.generate(prompts, [params[0]] * len(prompts))
    assert [o.token_ids for o in overlapped[0]] == [e.token_ids for e in expected]
    assert overlapped[0][0].finish_reason == "stop" and len(overlapped[0][0].token_ids) <= 7
    for out, want in zip(overlapped[0], expected):
        np.testing.assert_allclose(logprobs(out), logprobs(want), atol=ATOL)
    assert ([o.token_ids for o in overlapped[1]] == [o.token_ids for o in synchronous[1]])
    assert llm.stats()["runtime_compiles"] == 0


def test_a_request_taking_the_state_row_of_one_aborted_while_running_ahead_is_exact(llm):
    """A request aborted while a decode step runs ahead of it: that step still writes the freed
    state row and pages. The request that takes them next, and the requests that kept running,
    still give the reference generator's tokens."""
    engine = llm.engine
    prompts = random_prompts(13, 5, 6, 37, 6)
    ids = ["kept-0", "kept-1", "kept-2", "aborted"]
    collected = {rid: [] for rid in [*ids, "next"]}
    (following,) = random_prompts(14, 37)

    def run() -> None:
        for rid, prompt in zip(ids, prompts):  # max_num_seqs requests: every state row held
            engine.add_request(rid, prompt, greedy(10))
        while engine._ahead is None:
            for output in engine.step():
                collected[output.request_id] += output.new_token_ids
        engine.abort("aborted")
        engine.add_request("next", following, greedy(8))
        while engine.has_unfinished:
            for output in engine.step():
                collected[output.request_id] += output.new_token_ids

    with_overlap(engine, "on", run)
    expected = reference_tokens(llm, [*prompts[:3], following], 10)
    assert [collected[rid] for rid in ids[:3]] == expected[:3]
    assert collected["next"] == expected[3][:8]
    assert llm.stats()["state_slots_used"] == 0 and engine.block_manager.num_used_pages == 0


def test_server_answers_a_chat_request_and_exposes_the_kda_metrics(llm):
    """Last in the module: the server's engine thread takes over ``llm.engine``."""
    messages = [{"role": "user", "content": "w10 w11 w12 w13"}]
    prompt_ids = llm.tokenizer.encode(llm.chat_prompts(messages)[0])
    expected = llm.reference.generate([prompt_ids], [greedy(6)])[0]
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        with running_server(ServerState("tiny-kimi", engine, llm.runner.stats)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            response = client.chat.completions.create(
                model="tiny-kimi", messages=messages, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
            families = scrape(url)
    finally:
        engine.shutdown()
    assert set(llm.stats()) <= COUNTERS.keys() | GAUGES.keys()  # each one a counter or a gauge
    for kind, names in {
        "counter": ("tokenspeed_kda_checkpoints_written", "tokenspeed_kda_checkpoint_hits",
                    "tokenspeed_kda_state_restores", "tokenspeed_prefill_runs",
                    "tokenspeed_decode_runs"),
        "gauge": ("tokenspeed_state_slots_used", "tokenspeed_state_slots_capacity"),
    }.items():
        assert [families[name].type for name in names] == [kind] * len(names)
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens == len(prompt_ids)
