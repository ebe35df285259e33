"""Tensor parallelism for DeepSeek-V3: the attention split by head, the routed experts by expert,
the latent pages replicated (``models/deepseek_v3/sharding.py``).

As in ``test_tensor_parallel_kimi.py`` (whose engine options this reuses), the sharded run happens
in a subprocess that sees 4 CPU devices: this file run as a script is that worker and prints one
JSON line. Expectations: HF transformers' greedy tokens and the logits of each greedy step in
``tests/golden/tiny_deepseek_v3.npz`` (4 heads, 8 experts) at tp=2; at tp=4 the 2-head
``tiny_deepseek_v3_plain`` is an error naming its head count.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from golden_checks import assert_steps_match_golden, step_logprobs

GOLDEN = Path(__file__).parent / "golden"
NUM_PROMPTS = 3


def _worker() -> dict:
    from test_tensor_parallel_kimi import ENGINE

    from tokenspeed_jax import LLM, SamplingParams

    data = np.load(GOLDEN / "tiny_deepseek_v3.npz")
    llm = LLM(str(GOLDEN / "tiny_deepseek_v3"), tensor_parallel_size=2, **ENGINE)
    prompts = [data[f"prompt_ids_{i}"].tolist() for i in range(NUM_PROMPTS)]
    completions = llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=data["greedy_ids_0"].shape[0], logprobs=5, ignore_eos=True))
    layer = llm.model.layers[1]
    stats = llm.stats()
    result = {
        "steps": [step_logprobs(c) for c in completions],
        "runtime_compiles": stats["runtime_compiles"],
        "routes": {r: stats[f"{r}_runs"] for r in ("prefill", "decode", "eager")},
        "shards": {name: list(array.addressable_shards[0].data.shape) for name, array in (
            ("latent", llm.runner.pools["latent.1"]), ("w1", layer.mlp.w1[...]),
            ("q_b_proj", layer.self_attn.q_b_proj[...]),
            ("kv_a_proj", layer.self_attn.kv_a_proj[...]))},
    }
    llm.runner.guard.disarm()
    try:
        LLM(str(GOLDEN / "tiny_deepseek_v3_plain"), tensor_parallel_size=4, **ENGINE)
    except ValueError as error:
        result["tp4_error"] = str(error)
    return result


@pytest.fixture(scope="module")
def deepseek() -> dict:
    from parallel_checks import run_on_cpu_devices

    return run_on_cpu_devices(__file__, timeout=900)


def test_tp2_gives_the_transformers_tokens_and_logprobs(deepseek):
    data = np.load(GOLDEN / "tiny_deepseek_v3.npz")
    for i, steps in enumerate(deepseek["steps"]):
        assert steps["token_ids"] == data[f"greedy_ids_{i}"].tolist(), f"prompt {i}"
        assert_steps_match_golden(steps, data[f"greedy_logits_{i}"], label=f"prompt {i}")
    assert len(deepseek["steps"]) == NUM_PROMPTS


def test_tp2_takes_the_compiled_routes_and_compiles_nothing(deepseek):
    routes = deepseek["routes"]
    assert routes["prefill"] > 0 and routes["decode"] > 0 and routes["eager"] == 0
    assert deepseek["runtime_compiles"] == 0


def test_tp2_splits_heads_and_experts_and_replicates_the_latent_pages(deepseek):
    # q_b_proj [q_lora_rank, H, n + r], w1 [E, D, F], kv_a_proj [D, R + r], latent [P, page, R + r]
    assert deepseek["shards"] == {"q_b_proj": [24, 2, 24], "w1": [4, 64, 24],
                                  "kv_a_proj": [64, 32], "latent": [12, 16, 32]}


def test_heads_that_do_not_split_are_an_error(deepseek):
    assert "tensor_parallel_size=4 must divide num_attention_heads=2" in deepseek["tp4_error"]


@pytest.mark.parametrize("tp", [2, 4])
def test_every_parameter_has_a_rule_that_splits_evenly(tp):
    from flax import nnx
    from parallel_checks import splits_by_name

    from tokenspeed_jax.models.loader import abstract_model, read_config

    family, config = read_config(GOLDEN / "tiny_deepseek_v3")
    family.check_split(config, tp)
    state = nnx.state(abstract_model(config, "float32"))
    split = splits_by_name(state, lambda name: family.param_spec(name, config, tp), tp)
    replicated = {"q_a_proj", "kv_a_proj", "gate", "e_score_correction_bias", "weight"}
    assert {n for n, s in split.items() if not s} == replicated


if __name__ == "__main__":
    print(json.dumps(_worker()))
