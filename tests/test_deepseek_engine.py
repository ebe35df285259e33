"""DeepSeek-V3 behind ``LLM``: the runner over the latent forward (every layer MLA with
RoPE, no recurrent state) under the scheduler, with prefix caching over the latent pages.

Expectations come from HF transformers' goldens (``scripts/golden_deepseek_v3.py``: greedy tokens,
the logits of each greedy step, the prompts' logits), for both tiny checkpoints (yarn rope on
interleaved features with q-LoRA; plain rope without), never from the engine itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from golden_checks import assert_steps_match_golden, step_logprobs
from test_kimi_engine import OPTIONS as KIMI_OPTIONS

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.models.kimi_linear.forward import LatentForward

GOLDEN = Path(__file__).parent / "golden"
NAMES = ("tiny_deepseek_v3", "tiny_deepseek_v3_plain")
NUM_PROMPTS = 3
# Kimi's small buckets; more pages: no preemption here, only the goldens
OPTIONS = {**KIMI_OPTIONS, "num_pages": 32, "max_model_len": 128}
MAX_REL_ERR = 1e-4  # fp32 end to end; paged absorbed MLA and grouped experts only reorder sums


@pytest.fixture(scope="module", params=NAMES)
def served(request) -> tuple[LLM, dict]:
    golden = dict(np.load(GOLDEN / f"{request.param}.npz"))
    return LLM(GOLDEN / request.param, **OPTIONS), golden


def prompt(golden: dict, i: int) -> list[int]:
    return golden[f"prompt_ids_{i}"].tolist()


def greedy(golden: dict, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=golden["greedy_ids_0"].shape[0], temperature=0.0,
                          ignore_eos=True, **extra)


def assert_matches_golden(out, golden: dict, i: int) -> None:
    assert out.token_ids == golden[f"greedy_ids_{i}"].tolist(), f"prompt {i}"
    assert_steps_match_golden(step_logprobs(out), golden[f"greedy_logits_{i}"],
                              label=f"prompt {i}")


def test_served_by_the_latent_forward_without_state_rows(served):
    llm, _ = served
    assert isinstance(llm.runner.forward, LatentForward)
    assert llm.runner.state_pools == () and llm.runner.restore_plan is None
    assert llm.engine.state_slots is None
    layers = llm.model.config.num_hidden_layers
    assert list(llm.runner.pools) == [f"latent.{i}" for i in range(layers)]


@pytest.mark.parametrize("top", [0, 5])
def test_each_prompt_alone_matches_transformers(served, top):
    llm, golden = served
    for i in range(NUM_PROMPTS):
        (out,) = llm.generate([prompt(golden, i)], greedy(golden, logprobs=top))
        assert_matches_golden(out, golden, i)
    assert llm.stats()["runtime_compiles"] == 0


def test_prompts_batched_with_another_match_transformers(served):
    """The golden prompts in one batch beside a prompt of other tokens: each keeps its tokens
    and its per-step log-probabilities."""
    llm, golden = served
    other = np.random.default_rng(0).integers(3, 300, 40).tolist()
    outs = llm.generate([prompt(golden, 0), other, prompt(golden, 1), prompt(golden, 2)],
                        greedy(golden, logprobs=0))
    for i, out in zip(range(NUM_PROMPTS), (outs[0], *outs[2:])):
        assert_matches_golden(out, golden, i)
    stats = llm.stats()
    assert stats["decode_runs"] > 0 and stats["runtime_compiles"] == 0


def test_prefix_cache_hit_gives_the_same_tokens(served):
    """The 65-token prompt again: its first four pages come from the prefix cache, and the
    tokens and log-probabilities are still transformers'."""
    llm, golden = served
    llm.generate([prompt(golden, 1)], greedy(golden))
    before = llm.stats()["prefix_hit_tokens"]
    (hit,) = llm.generate([prompt(golden, 1)], greedy(golden, logprobs=0))
    assert llm.stats()["prefix_hit_tokens"] - before == 64
    assert_matches_golden(hit, golden, 1)


def test_reference_logits_match_transformers(served):
    """``LLM.logits`` (the plain forward over the model's dense latent cache)."""
    llm, golden = served
    for i in range(NUM_PROMPTS):
        logits, want = llm.logits(prompt(golden, i)), golden[f"logits_{i}"]
        assert np.abs(logits - want).max() / np.abs(want).max() < MAX_REL_ERR, f"prompt {i}"
