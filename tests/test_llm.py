"""The public API end to end: ``LLM`` on real checkpoints against transformers' golden outputs.

``LLM.generate`` runs the serving engine (compiled segmented plans); its tokens and its own
per-step log-probabilities are checked against transformers' and against the plain reference
generator, with runtime compiles forbidden. ``LLM.logits`` runs the reference forward, not the
engine: its tests pin that forward (the expectation of every engine test) to transformers.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from golden_checks import assert_steps_match_golden, step_logprobs

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.engine import PROBE_EVERY, Engine

GOLDEN = Path(__file__).parent / "golden"
TINY_FAMILIES = ["tiny_llama", "tiny_qwen3", "tiny_tied"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
# Small bucket sets keep the start-up compile short; strict mode makes any later compile an error.
ENGINE_OPTIONS = {
    "prefill_graph_max_tokens": 256,
    "prefill_graph_capture_token_sizes": (64, 256),
    "prefill_graph_capture_batch_sizes": (1, 4),
    "decode_graph_capture_batch_sizes": (1, 4),
    "max_num_seqs": 4,
    "max_model_len": 512,
    "num_pages": 160,
    "strict_no_compile": True,
    "compile_progress": False,
}
# The tiny families' steps hold at most two requests (their two golden prompts, 40 + 60 tokens):
# one bucket per route (max_num_seqs 2, or its 4 would be a second request bucket of prefill and
# decode), 8 executables rather than 18.
TINY_OPTIONS = {**ENGINE_OPTIONS, "prefill_graph_max_tokens": 128,
                "prefill_graph_capture_token_sizes": (128,), "max_num_seqs": 2,
                "prefill_graph_capture_batch_sizes": (2,), "decode_graph_capture_batch_sizes": (2,)}


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM(None, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def smollm2_golden() -> dict:
    return json.loads((GOLDEN / "smollm2.json").read_text())


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tiny(request) -> tuple[LLM, np.lib.npyio.NpzFile]:
    return LLM(GOLDEN / request.param, **TINY_OPTIONS), np.load(GOLDEN / f"{request.param}.npz")


def test_smollm2_greedy_answers_match_transformers(smollm2, smollm2_golden):
    prompts = smollm2_golden["prompts"]
    conversations = [p["messages"] for p in prompts]
    longest = max(len(p["generated_ids"]) for p in prompts)
    outs = smollm2.chat(conversations, SamplingParams(max_tokens=longest, temperature=0.0))
    assert sum(len(p["generated_ids"]) >= 30 for p in prompts) >= 3
    for golden, out in zip(prompts, outs):
        assert out.prompt_token_ids == golden["prompt_ids"]
        assert out.token_ids == golden["generated_ids"]
    assert smollm2.stats()["runtime_compiles"] == 0


def test_engine_matches_reference_generator(smollm2, smollm2_golden):
    prompts = [p["prompt_ids"] for p in smollm2_golden["prompts"]]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    engine = smollm2.generate(prompts, params)
    reference = smollm2.reference.generate(prompts, [params] * len(prompts))
    assert [o.token_ids for o in engine] == [o.token_ids for o in reference]
    assert [o.text for o in engine] == [o.text for o in reference]


def test_smollm2_knows_the_capital_of_france(smollm2):
    (out,) = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_smollm2_engine_top_logprobs_match_transformers(smollm2, smollm2_golden):
    """The engine's 20 best first tokens are transformers' 20 best logits, shifted by one
    log-partition (the golden holds those 20 logits, not the whole row)."""
    golden = smollm2_golden["first_prompt_last_logits"]
    (out,) = smollm2.generate([smollm2_golden["prompts"][0]["prompt_ids"]],
                              SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))
    (step,) = out.logprobs
    ids, values = zip(*step.top)
    assert list(ids[:5]) == golden["top_ids"][:5]
    assert set(ids) == set(golden["top_ids"])
    shift = np.array(values) - np.array([golden["top_values"][golden["top_ids"].index(i)]
                                         for i in ids])
    np.testing.assert_allclose(shift, shift[0], atol=2e-4)
    assert smollm2.stats()["runtime_compiles"] == 0


def test_smollm2_reference_logits_match_transformers(smollm2, smollm2_golden):
    golden = smollm2_golden["first_prompt_last_logits"]
    logits = smollm2.logits(smollm2_golden["prompts"][0]["prompt_ids"])[-1]
    assert logits.shape == (golden["vocab_size"],)
    top = np.argsort(-logits)[:5]
    np.testing.assert_array_equal(top, golden["top_ids"][:5])
    np.testing.assert_allclose(logits[golden["top_ids"]], golden["top_values"], rtol=2e-4,
                               atol=2e-4)


# 0: the in-step sampler's log-probability of the greedy token; 20: resampled from the head's logits
@pytest.mark.parametrize("top", [0, 20])
def test_tiny_greedy_steps_and_engine_logprobs_match_transformers(tiny, top):
    llm, golden = tiny
    outs = llm.generate([golden["prompt_ids"].tolist(), golden["prompt_ids_2"].tolist()],
                        SamplingParams(max_tokens=16, temperature=0.0, logprobs=top))
    for out, suffix in zip(outs, ("", "_2"), strict=True):
        assert out.token_ids == golden[f"greedy_ids{suffix}"].tolist()
        assert_steps_match_golden(step_logprobs(out), golden[f"greedy_logits{suffix}"],
                                  label=f"prompt_ids{suffix}")
    assert llm.stats()["runtime_compiles"] == 0


def test_tiny_reference_logits_match_transformers(tiny):
    llm, golden = tiny
    logits = llm.logits(golden["prompt_ids_2"].tolist())
    scale = np.abs(golden["logits_2"]).max()
    np.testing.assert_allclose(logits, golden["logits_2"], rtol=1e-4, atol=1e-4 * scale)


def test_seeded_sampling_is_reproducible_in_any_batch(smollm2):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = smollm2.generate("Once upon a time", params)[0]
    batched = smollm2.generate(["A longer, different prompt about cats", "Once upon a time"],
                               params)[1]
    assert alone.token_ids == batched.token_ids
    other_seed = smollm2.generate("Once upon a time", SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.95, seed=99))[0]
    assert other_seed.token_ids != alone.token_ids


def test_n_gives_distinct_seeded_samples(smollm2):
    outs = smollm2.generate("The weather today is",
                            SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3))
    assert len(outs) == 3
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stop_string_cuts_text_before_it(smollm2):
    prompt = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    (full,) = smollm2.chat(prompt, SamplingParams(max_tokens=30, temperature=0.0))
    stop = full.text[20:26]
    (cut,) = smollm2.chat(prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_max_tokens_ends_with_length(tiny):
    llm, golden = tiny
    (out,) = llm.generate(golden["prompt_ids"].tolist(),
                          SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    ([5, 10_000_000], "outside the vocabulary"),
    ([1] * 600, "context length"),
])
def test_bad_prompts_raise_clear_errors(tiny, prompt, message):
    llm, _ = tiny
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY)


def with_overlap(engine: Engine, setting: str, run: Callable[[], Any]) -> tuple[Any, int]:
    """``run()`` with ``engine.overlap_schedule`` set to ``setting`` (restored afterwards), and
    how many decode steps ran ahead meanwhile."""
    default, before = engine.overlap_schedule, engine.stats()["num_overlapped_steps"]
    engine.overlap_schedule = setting
    try:
        result = run()
    finally:
        engine.overlap_schedule = default
    return result, engine.stats()["num_overlapped_steps"] - before


def test_overlap_schedule_gives_the_outputs_of_the_synchronous_loop(smollm2, smollm2_golden):
    """Running each decode step ahead (launched before the previous step's tokens reach the
    host) changes nothing: stop tokens, stop strings, max_tokens and seeded sampling give the
    same outputs as launching each step after the last one's tokens, and every page comes back."""
    # twice max_num_seqs conversations: steps also run ahead while requests wait for a slot
    conversations = [p["messages"] for p in smollm2_golden["prompts"]] * 2
    chat = [SamplingParams(max_tokens=40, temperature=0.0),
            SamplingParams(max_tokens=7, temperature=0.0),
            SamplingParams(max_tokens=40, temperature=0.8, seed=5),
            SamplingParams(max_tokens=40, temperature=0.0, stop=[" the"])]
    engine = smollm2.engine

    def run() -> list:
        outs = [smollm2.chat(conversations, params) for params in chat]
        assert engine.block_manager.num_used_pages == 0
        return [[(o.token_ids, o.text, o.finish_reason) for o in group] for group in outs]

    synchronous, none = with_overlap(engine, "off", run)
    overlapped, overlapped_steps = with_overlap(engine, "on", run)
    assert none == 0 and overlapped_steps > 0
    assert overlapped == synchronous
    reasons = {reason for group in synchronous for _, _, reason in group}
    assert reasons == {"stop", "length"}
    assert smollm2.stats()["runtime_compiles"] == 0


def test_auto_overlap_runs_ahead_only_while_device_bound_and_probes_again():
    engine = Engine(None, None, num_pages=4, page_size=16, max_num_seqs=1,
                    max_num_batched_tokens=16, max_model_len=64, overlap_schedule="auto")
    assert not engine.device_bound  # nothing measured yet: the first decode step is a probe
    assert not any(engine._runs_ahead(launched_here=True) for _ in range(3 * PROBE_EVERY))
    engine.device_bound = True
    chain = [engine._runs_ahead(launched_here=False) for _ in range(PROBE_EVERY + 2)]
    # PROBE_EVERY - 1 steps run ahead; then the chain breaks until a step launched by the
    # engine itself (not ahead) can be the measured probe, after which it runs ahead again
    assert chain == [True] * (PROBE_EVERY - 1) + [False] * 3
    assert not engine._runs_ahead(launched_here=True)
    assert engine._runs_ahead(launched_here=False)
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig(overlap_schedule="sometimes")
