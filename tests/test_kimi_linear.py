"""Kimi-Linear model numerics against HF transformers' KimiLinearForCausalLM (golden files from
``scripts/golden_kimi.py``), and the plain forward's cache contract: prefill then decode equals one
long prefill. Also the config and checkpoint checks of the loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.models.kimi_linear import (
    KimiCache,
    KimiLinearConfig,
    KimiLinearForCausalLM,
)
from tokenspeed_jax.models.loader import load_checkpoint
from tokenspeed_jax.models.moe import KimiMoE

GOLDEN = Path(__file__).parent / "golden"
NAMES = ("tiny_kimi", "tiny_kimi_qlora", "tiny_kimi_hf")  # _hf: saved by transformers itself
ATOL = 2e-4  # fp32 end to end; chunked KDA and absorbed MLA only reorder float sums


def jitted_forward(model: KimiLinearForCausalLM):
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, token_ids, positions, cache):
        return nnx.merge(graphdef, state)(token_ids, positions, cache)

    return lambda *args: forward(state, *args)


@pytest.fixture(scope="module", params=NAMES)
def golden(request):
    checkpoint = load_checkpoint(GOLDEN / request.param, dtype="float32")
    data = dict(np.load(GOLDEN / f"{request.param}.npz"))
    return checkpoint, data, jitted_forward(checkpoint.model)


def positions_from(start: int, batch: int, length: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))


def prefill_prompt(golden) -> tuple[jax.Array, KimiCache]:
    """The golden prompt's logits and the cache after it (96 slots)."""
    checkpoint, data, forward = golden
    ids = jnp.asarray(data["prompt_ids"])
    batch, length = ids.shape
    cache = KimiCache.create(checkpoint.config, batch, 96, jnp.float32)
    return forward(ids, positions_from(0, batch, length), cache)


def test_prompt_logits_match_transformers(golden):
    _, data, _ = golden
    logits, _ = prefill_prompt(golden)
    np.testing.assert_allclose(np.asarray(logits), data["logits"], atol=ATOL, rtol=0)


def test_greedy_continuation_matches_transformers(golden):
    _, data, forward = golden
    batch, length = data["prompt_ids"].shape
    logits, cache = prefill_prompt(golden)
    tokens = []
    for step in range(data["greedy_ids"].shape[1]):
        next_ids = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        tokens.append(np.asarray(next_ids[:, 0]))
        logits, cache = forward(next_ids, positions_from(length + step, batch, 1), cache)
    np.testing.assert_array_equal(np.stack(tokens, axis=1), data["greedy_ids"])


def test_prefill_then_decode_equals_one_long_prefill(golden):
    checkpoint, data, forward = golden
    ids = jnp.asarray(data["prompt_ids"])
    batch, length = ids.shape
    split = length - 3
    cache = KimiCache.create(checkpoint.config, batch, 96, jnp.float32)
    full, full_cache = forward(ids, positions_from(0, batch, length), cache)
    logits, cache = forward(ids[:, :split], positions_from(0, batch, split), cache)
    steps = [logits]
    for t in range(split, length):
        logits, cache = forward(ids[:, t:t + 1], positions_from(t, batch, 1), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(full), atol=ATOL)
    for mine, whole in zip(jax.tree_util.tree_leaves(cache),
                           jax.tree_util.tree_leaves(full_cache)):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(whole), atol=ATOL)


def test_config_reads_one_indexed_layer_lists():
    raw = json.loads((GOLDEN / "tiny_kimi" / "config.json").read_text())
    config = KimiLinearConfig.from_hf(raw)
    assert config.mla_layers == (2, 5)
    assert config.kda_layers == (0, 1, 3, 4, 6)
    assert KimiLinearConfig.from_hf(config.to_hf()) == config


def test_checkpoint_saved_by_transformers_loads_and_matches_its_logits():
    """``tiny_kimi_hf`` is what transformers' own ``save_pretrained`` writes: a config.json with
    ``layer_types`` and ``mlp_layer_types`` (no ``linear_attn_config``, ``first_k_dense_replace``
    or ``mla_use_nope``) and the dense layer's MLP under ``block_sparse_moe.``."""
    raw = json.loads((GOLDEN / "tiny_kimi_hf" / "config.json").read_text())
    assert not {"linear_attn_config", "first_k_dense_replace", "mla_use_nope"} & set(raw)
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi_hf", dtype="float32")
    assert checkpoint.config.layer_types == ("kda", "mla", "kda", "mla")
    assert checkpoint.config.first_k_dense_replace == 1
    data = np.load(GOLDEN / "tiny_kimi_hf.npz")
    logits, _ = prefill_prompt((checkpoint, data, jitted_forward(checkpoint.model)))
    error = np.abs(np.asarray(logits) - data["logits"]).max() / np.abs(data["logits"]).max()
    assert error < 1e-4


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention",
                      "full_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}, "mlp_layer_types"),
])
def test_transformers_config_rejects_unsupported_layer_kinds(change, message):
    raw = {**json.loads((GOLDEN / "tiny_kimi_hf" / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=message):
        KimiLinearConfig.from_hf(raw)


def test_config_without_mla_use_nope_is_the_nope_config():
    """A config.json that transformers' KimiLinearForCausalLM writes has no ``mla_use_nope``: its
    MLA has only the NoPE form."""
    raw = json.loads((GOLDEN / "tiny_kimi" / "config.json").read_text())
    assert raw["mla_use_nope"] is True
    without = {key: value for key, value in raw.items() if key != "mla_use_nope"}
    assert KimiLinearConfig.from_hf(without) == KimiLinearConfig.from_hf(raw)


@pytest.mark.parametrize("change, message", [
    ({"mla_use_nope": False}, "mla_use_nope=False is not supported"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3], "head_dim": 16}},
     "partition"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
])
def test_config_rejects_unsupported_variants(change, message):
    raw = {**json.loads((GOLDEN / "tiny_kimi" / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=message):
        KimiLinearConfig.from_hf(raw)


@pytest.mark.parametrize("name", [
    "model.layers.1.block_sparse_moe.experts.3.w2.weight",  # a row of a stacked parameter
    "model.layers.3.self_attn.b_proj.weight",  # the columns of low_proj after f_a and g_a
])
def test_checkpoint_with_a_missing_tensor_is_rejected(tmp_path, name):
    from safetensors.numpy import load_file, save_file

    shutil.copy(GOLDEN / "tiny_kimi" / "config.json", tmp_path / "config.json")
    tensors = load_file(GOLDEN / "tiny_kimi" / "model.safetensors")
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_checkpoint(tmp_path, dtype="float32")


def test_low_rank_gate_weights_are_stored_side_by_side():
    from safetensors.numpy import load_file

    tensors = load_file(GOLDEN / "tiny_kimi" / "model.safetensors")
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    low_proj = np.asarray(checkpoint.model.layers[3].self_attn.low_proj[...])
    prefix = "model.layers.3.self_attn."
    want = np.concatenate(
        [tensors[prefix + f"{name}_proj.weight"].T for name in ("f_a", "g_a", "b")], axis=1)
    np.testing.assert_array_equal(low_proj, want.astype(np.float32))


def test_grouped_router_picks_only_from_the_best_group():
    moe = KimiMoE(4, 2, num_experts=8, top_k=2, num_groups=2, topk_groups=1, num_shared=1,
                  renormalize=True, scaling=2.0, dtype=jnp.float32, param_dtype=jnp.float32,
                  rngs=nnx.Rngs(0))
    # Logits chosen by hand: expert 0 is the best single expert, but group 1 (experts 4-7) has
    # the best pair, so the top-2 come from group 1; the bias moves expert 6 above expert 5.
    logits = np.array([[3.0, -3.0, -3.0, -3.0, 2.0, 1.9, 1.8, -3.0]], np.float32)
    moe.gate[...] = jnp.eye(4, 8).at[0].set(logits[0])
    moe.e_score_correction_bias[...] = jnp.zeros(8).at[6].set(0.2)
    experts, weights = moe.route(jnp.array([[1.0, 0.0, 0.0, 0.0]]))
    assert sorted(np.asarray(experts)[0].tolist()) == [4, 6]
    scores = 1 / (1 + np.exp(-logits[0, [4, 6]]))
    expected = 2.0 * scores / scores.sum()
    order = np.argsort(np.asarray(experts)[0])
    np.testing.assert_allclose(np.asarray(weights)[0][order], expected, rtol=1e-6)
