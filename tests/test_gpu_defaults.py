"""What one GPU runs when nothing is set, run on a GPU: ``LLM`` and the HTTP server with their
defaults, against transformers' float32 greedy outputs (``tests/golden``).

On a GPU every fast path is on by default (``llama_forward.runner_settings``: the fused decode
kernel, stacked decode weights, inline prefill attention, two loaded copies of each decode
executable, the Pallas prefill kernel) and "auto" weights are bfloat16
(``loader.resolve_dtype``). test_model_runner.py runs that configuration on the CPU with its
kernels interpreted; this module runs it compiled, end to end.

* bfloat16 moves the logits: by up to 2.5% of the largest logit against the golden ones (measured
  on the CPU, on the golden prompts and answers), and the margin between the top two by as
  much. So a bfloat16 greedy output follows the golden one up to its first disagreement, which
  may only come at a near-tie: a golden top-two margin under ``BF16_NEAR_TIE`` times the largest
  logit the golden file records (``follow_golden``). Past it the two continue different texts
  and are not compared.
* In float32 the kernels and the matrix products compute in full precision (no TF32), so the
  same configuration with ``dtype="float32"`` gives the tiny golden greedy tokens exactly (their
  margins are at least 1e-2).
* Nothing compiles after start-up.

Skipped without a GPU; on a GPU machine: ``pytest -m gpu tests/test_gpu_defaults.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from serving import running_server

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.async_engine import AsyncEngine
from tokenspeed_jax.engine.startup import build_engine
from tokenspeed_jax.kernels.paged_attention_backend import FUSED, PALLAS
from tokenspeed_jax.server.app import ServerState
from tokenspeed_jax.server.launch import served_name

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")]

GOLDEN = Path(__file__).parent / "golden"
BF16_NEAR_TIE = 0.05  # twice the largest logit error measured in bfloat16 (module docstring)


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM()  # the embedded SmolLM2, every setting at its default


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((GOLDEN / "smollm2.json").read_text())


def near_tie(golden: dict) -> float:
    """The golden top-two margin under which bfloat16 may choose the other token."""
    return BF16_NEAR_TIE * max(golden["first_prompt_last_logits"]["top_values"])


def follow_golden(tokens: Sequence, expected: Sequence, margins: Sequence[float],
                  tie: float) -> None:
    """``tokens`` equal the golden greedy ones (``expected``) up to the first that differs, which
    must come where the golden top-two margin is under ``tie``; equal throughout, they are as
    many."""
    for step, (token, want, margin) in enumerate(zip(tokens, expected, margins)):
        if token != want:
            assert margin < tie, (f"step {step}: {token!r} instead of {want!r}, whose golden "
                                  f"margin {margin:.3f} is no near-tie (< {tie:.3f})")
            return
    assert len(tokens) == len(expected)


def assert_every_fast_path(runner, dtype) -> None:
    """``runner`` runs every GPU fast path, compiled (not interpreted), its layer weights and
    KV cache in ``dtype``."""
    settings = runner.forward.settings
    assert settings.decode_kernel.backend == FUSED and not settings.decode_kernel.interpret
    assert settings.prefill_kernel.backend == PALLAS and not settings.prefill_kernel.interpret
    assert settings.stack_decode_weights and runner.stacked_layers is not None
    assert settings.inline_prefill_attention and settings.alternate_decode_executables
    assert runner.pools["k_pages.0"].dtype == dtype
    layers = jax.tree_util.tree_leaves(runner.forward.layer_states)
    assert all(leaf.dtype == dtype for leaf in layers)


def test_llm_defaults_are_every_fast_path_in_bfloat16(smollm2):
    assert_every_fast_path(smollm2.runner, jnp.bfloat16)


def test_llm_defaults_follow_transformers_greedy_answers(smollm2, golden):
    """The four golden conversations in one batch: each answer follows the golden one to its
    first near-tie, with no compile after start-up."""
    prompts = golden["prompts"]
    params = [SamplingParams(max_tokens=len(p["generated_ids"]), temperature=0.0)
              for p in prompts]
    outs = smollm2.chat([p["messages"] for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt["prompt_ids"]
        follow_golden(out.token_ids, prompt["generated_ids"], prompt["greedy_margins"],
                      near_tie(golden))
    assert smollm2.stats()["runtime_compiles"] == 0


def test_float32_defaults_give_transformers_greedy_tokens_exactly():
    """tiny_llama with every default but the dtype: float32 through every GPU fast path gives
    transformers' greedy tokens for both golden prompts, token for token."""
    llm = LLM(GOLDEN / "tiny_llama", dtype="float32")
    tiny = np.load(GOLDEN / "tiny_llama.npz")
    assert_every_fast_path(llm.runner, jnp.float32)
    outs = llm.generate([tiny["prompt_ids"].tolist(), tiny["prompt_ids_2"].tolist()],
                        SamplingParams(max_tokens=len(tiny["greedy_ids"]), temperature=0.0))
    assert outs[0].token_ids == tiny["greedy_ids"].tolist()
    assert outs[1].token_ids == tiny["greedy_ids_2"].tolist()
    assert llm.stats()["runtime_compiles"] == 0


@pytest.fixture(scope="module")
def server():
    """The server as ``scripts/serve.py`` runs it without flags (on a free loopback port)."""
    config = EngineConfig()
    bundle = build_engine(config)
    engine = AsyncEngine(bundle.engine)
    engine.start()
    state = ServerState(served_name(config), engine, bundle.runner.stats)
    with running_server(state, config) as url:
        yield url, bundle
    engine.shutdown()


def test_server_defaults_follow_transformers_greedy_answers(server, golden):
    """The four golden conversations sent at once to the default server: each answer's tokens
    (their texts, from the log-probs) follow the golden ones to the first near-tie."""
    url, bundle = server
    assert httpx.get(url + "/health").status_code == 200
    assert_every_fast_path(bundle.runner, jnp.bfloat16)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompts = golden["prompts"]

    def answer(prompt: dict):
        return client.chat.completions.create(
            model=served_name(EngineConfig()), messages=prompt["messages"], temperature=0,
            max_tokens=len(prompt["generated_ids"]), logprobs=True)

    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(answer, prompts))
    tokenizer = bundle.loaded.tokenizer
    for prompt, response in zip(prompts, responses):
        assert response.usage.prompt_tokens == len(prompt["prompt_ids"])
        texts = [entry.token for entry in response.choices[0].logprobs.content]
        expected = [tokenizer.decode([token], skip_special_tokens=False)
                    for token in prompt["generated_ids"]]
        follow_golden(texts, expected, prompt["greedy_margins"], near_tie(golden))
    assert bundle.runner.stats()["runtime_compiles"] == 0
