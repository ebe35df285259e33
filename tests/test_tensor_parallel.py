"""Tensor parallelism: at tp=2 and 4 the engine gives transformers' greedy tokens and, at every
step, log-probabilities equal to log_softmax of transformers' logits; nothing compiles at runtime.

The main test process sees one device, so the sharded runs happen in subprocesses that set
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax is imported: this file run as a
script is that worker (``python tests/test_tensor_parallel.py <mode> ...``; it prints one JSON
line). The expectations are the HF goldens of ``tests/golden`` (greedy tokens and the logits of
each greedy step, see ``golden_checks``); tiny Llama and Qwen3 have 4 query heads and 2 KV heads,
so tp=4 exercises replicated KV heads and tp=2 split ones.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from golden_checks import assert_steps_match_golden, step_logprobs

GOLDEN = Path(__file__).parent / "golden"
MODELS = ("tiny_llama", "tiny_qwen3")
SIZES = (2, 4)
SUFFIXES = ("", "_2")  # the goldens' two prompts: prompt_ids (40 tokens) and prompt_ids_2 (60)
ENGINE = {  # a few small buckets keep each start-up compile to seconds
    "strict_no_compile": True, "compile_progress": False, "dtype": "float32",
    "max_model_len": 80, "num_pages": 24, "page_size": 8, "max_num_seqs": 2,
    "prefill_graph_max_tokens": 16, "prefill_graph_capture_token_sizes": (16,),
    "prefill_graph_capture_batch_sizes": (1,), "prefill_graph_max_bs": 1,
    "decode_graph_capture_batch_sizes": (2,), "decode_graph_max_bs": 2,
    "chunked_prefill_size": 16,
}


# ----------------------------------------------------------------------------- the worker


def _generate(model: str, tp: int, **options) -> dict:
    """The golden prompts' greedy steps with their 20 best log-probabilities (``step_logprobs``)
    and ``LLM.logits`` (the reference forward over the sharded weights) of the first prompt."""
    from tokenspeed_jax import LLM, SamplingParams

    golden = np.load(GOLDEN / f"{model}.npz")
    llm = LLM(str(GOLDEN / model), tensor_parallel_size=tp, **{**ENGINE, **options})
    completions = llm.generate([golden[f"prompt_ids{s}"].tolist() for s in SUFFIXES],
                               SamplingParams(temperature=0.0, max_tokens=16, logprobs=20,
                                              ignore_eos=True))
    layer = llm.model.layers[0]
    result = {
        "steps": [step_logprobs(c) for c in completions],
        "logits": llm.logits(golden["prompt_ids"].tolist()).tolist(),
        "runtime_compiles": llm.stats()["runtime_compiles"],
        "loaded": llm.compile_summary.num_loaded,
        "compiled": llm.compile_summary.num_compiled,
        "q_proj_devices": len(layer.q_proj[...].sharding.device_set),
        "q_proj_shard": list(layer.q_proj[...].addressable_shards[0].data.shape),
        "k_pages_shard": list(llm.runner.pools["k_pages.0"].addressable_shards[0].data.shape),
    }
    llm.runner.guard.disarm()
    return result


def _orbax_roundtrip(model: str, tp: int) -> dict:
    """Save the tp=1 weights with orbax, restore them sharded over ``tp`` devices."""
    import jax
    from flax import nnx

    from tokenspeed_jax.models.loader import load_checkpoint
    from tokenspeed_jax.models.orbax_checkpoint import save_orbax
    from tokenspeed_jax.parallel import make_mesh

    hf = load_checkpoint(GOLDEN / model, dtype="float32")
    with tempfile.TemporaryDirectory() as directory:
        save_orbax(hf.model, directory)
        restored = load_checkpoint(directory, dtype="float32", mesh=make_mesh(tp)).model
    expected = jax.tree_util.tree_leaves(nnx.state(hf.model))
    leaves = jax.tree_util.tree_leaves(nnx.state(restored))
    q_proj = restored.layers[0].q_proj[...]
    return {"equal": all(np.array_equal(a, b) for a, b in zip(expected, leaves)),
            "q_proj_devices": len(q_proj.sharding.device_set),
            "q_proj_shard": list(q_proj.addressable_shards[0].data.shape)}


def _worker(mode: str, args: list[str]) -> dict:
    if mode == "models":  # args: an empty executable cache directory, which the runs fill
        return {model: {tp: _generate(model, tp, compile_cache_dir=args[0]) for tp in SIZES}
                for model in MODELS} | {"orbax": _orbax_roundtrip("tiny_llama", 4)}
    if mode == "cache":
        return _generate("tiny_llama", int(args[0]), compile_cache_dir=args[1])
    raise ValueError(f"unknown worker mode {mode!r}")


def run_worker(*args: str) -> dict:
    """Run this file as a 4-device worker; its JSON result."""
    from parallel_checks import run_on_cpu_devices

    return run_on_cpu_devices(__file__, *args, timeout=900)


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """The executable cache the ``models`` worker fills, tiny_llama at tp=2 first."""
    return tmp_path_factory.mktemp("executables")


@pytest.fixture(scope="module")
def runs(cache_dir) -> dict:
    return run_worker("models", str(cache_dir))


@pytest.mark.parametrize("model", MODELS)
def test_sharded_engines_give_the_transformers_tokens_and_logprobs(runs, model):
    golden = np.load(GOLDEN / f"{model}.npz")
    for tp in ("2", "4"):
        for steps, suffix in zip(runs[model][tp]["steps"], SUFFIXES, strict=True):
            label = f"tp={tp} prompt_ids{suffix}"
            assert steps["token_ids"] == golden[f"greedy_ids{suffix}"].tolist(), label
            assert_steps_match_golden(steps, golden[f"greedy_logits{suffix}"], label=label)
        # LLM.logits: the reference forward over the same sharded weights
        np.testing.assert_allclose(runs[model][tp]["logits"], golden["logits"], atol=1e-4,
                                   err_msg=f"tp={tp}")


@pytest.mark.parametrize("model", MODELS)
def test_sharded_runs_compile_nothing_at_runtime(runs, model):
    for tp in ("2", "4"):
        assert runs[model][tp]["runtime_compiles"] == 0, f"tp={tp}"


def test_weights_and_kv_cache_are_split_by_head(runs):
    # tiny_llama: 4 query heads, 2 KV heads, head_dim 16, hidden 64.
    two, four = (runs["tiny_llama"][tp] for tp in ("2", "4"))
    assert [two["q_proj_devices"], four["q_proj_devices"]] == [2, 4]
    assert two["q_proj_shard"] == [64, 2, 16]
    assert four["q_proj_shard"] == [64, 1, 16]
    # pages [Hkv, num_pages, page_size, Dh]: split over 2 devices, replicated over 4 (Hkv=2 < 4)
    assert two["k_pages_shard"] == [1, 24, 8, 16]
    assert four["k_pages_shard"] == [2, 24, 8, 16]


def test_orbax_restores_straight_into_the_sharding(runs):
    assert runs["orbax"] == {"equal": True, "q_proj_devices": 4, "q_proj_shard": [64, 1, 16]}


def test_sharded_executables_are_cached_across_processes(runs, cache_dir):
    """The ``models`` worker's first start (tiny_llama, tp=2) compiled into an empty cache; a
    second process starting the same engine loads every executable and compiles nothing."""
    first = runs["tiny_llama"]["2"]
    second = run_worker("cache", "2", str(cache_dir))
    assert first["compiled"] > 0 and first["loaded"] == 0
    assert second["compiled"] == 0 and second["loaded"] == first["compiled"]
    assert second["steps"] == first["steps"]
    assert second["runtime_compiles"] == 0


# ----------------------------------------------------------------------------- errors


def test_more_devices_than_present_is_an_error():
    from tokenspeed_jax.parallel import make_mesh

    with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds the 1 cpu device"):
        make_mesh(2)
    assert make_mesh(1) is None


def test_engine_config_rejects_nonpositive_tp():
    from tokenspeed_jax.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "message"), [
    (4, 2, 3, "must divide num_attention_heads=4"),
    (12, 4, 6, "num_key_value_heads=4"),
    (8, 8, 8, "must divide intermediate_size=12"),
])
def test_head_counts_that_do_not_split_are_errors(heads, kv_heads, tp, message):
    from tokenspeed_jax.models.llama import LlamaConfig
    from tokenspeed_jax.models.llama.sharding import check_split

    config = LlamaConfig(vocab_size=32, hidden_size=heads * 4, intermediate_size=12,
                         num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=4)
    with pytest.raises(ValueError, match=message):
        check_split(config, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_llama_parameter_has_a_rule_that_splits_evenly(tp):
    from flax import nnx
    from parallel_checks import splits_by_name

    from tokenspeed_jax.models.llama import LlamaConfig
    from tokenspeed_jax.models.llama.sharding import param_spec
    from tokenspeed_jax.models.loader import abstract_model

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, qk_norm=True,
                         attention_bias=True, model_type="qwen2")
    state = nnx.state(abstract_model(config, "float32"))
    split = splits_by_name(state, lambda name: param_spec(name, config, tp), tp)
    kv_split = tp == 2  # 2 KV heads: split 2 ways, replicated 4 ways
    assert split == {"embed_tokens": True, "lm_head": True, "q_proj": True, "q_bias": True,
                     "o_proj": True, "gate_proj": True, "up_proj": True, "down_proj": True,
                     "k_proj": kv_split, "v_proj": kv_split, "k_bias": kv_split,
                     "v_bias": kv_split, "weight": False}
    with pytest.raises(ValueError, match="no tensor-parallel rule for Llama parameter 'rotary'"):
        param_spec("rotary", config, tp)


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], sys.argv[2:])))
