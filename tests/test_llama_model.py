"""LlamaForCausalLM numerics: a numpy re-derivation of the HF math, HF golden logits, and the
dense-cache contract (prefill+decode == long prefill, padding changes nothing)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.kernels.attention_ref import masked_attention
from tokenspeed_jax.models.llama import (
    DenseKVCache,
    Llama3RopeScaling,
    LlamaConfig,
    LlamaForCausalLM,
    rope_inv_freq,
)
from tokenspeed_jax.models.loader import build_model, load_checkpoint

GOLDEN = Path(__file__).parent / "golden"

TINY = LlamaConfig(
    vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=Llama3RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0,
                                   original_max_position_embeddings=16),
)
VARIANTS = {
    "llama3": TINY,
    "qwen3": dataclasses.replace(TINY, qk_norm=True, model_type="qwen3", rope_scaling=None),
    "qwen2": dataclasses.replace(TINY, attention_bias=True, model_type="qwen2",
                                 rope_scaling=None),
    "tied": dataclasses.replace(TINY, tie_word_embeddings=True, rope_scaling=None,
                                num_key_value_heads=4),
}


def random_hf_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors under HF names and HF layouts ([out, in] Linear weights)."""
    rng = np.random.default_rng(seed)
    d, f, dh = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads

    def w(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(config.vocab_size, d, scale=1.0),
           "model.norm.weight": 1 + w(d, scale=0.1)}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = w(config.vocab_size, d)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + w(d, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + w(d, scale=0.1),
            p + "self_attn.q_proj.weight": w(hq * dh, d),
            p + "self_attn.k_proj.weight": w(hkv * dh, d),
            p + "self_attn.v_proj.weight": w(hkv * dh, d),
            p + "self_attn.o_proj.weight": w(d, hq * dh),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        }
        if config.attention_bias:
            for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
                out[p + f"self_attn.{name}_proj.bias"] = w(heads * dh)
        if config.qk_norm:
            out[p + "self_attn.q_norm.weight"] = 1 + w(dh, scale=0.1)
            out[p + "self_attn.k_norm.weight"] = 1 + w(dh, scale=0.1)
    return out


def llama3_inv_freq_hf_style(head_dim: int, theta: float, s: Llama3RopeScaling) -> np.ndarray:
    """Llama 3 scaling written the way HF states it: by wavelength bands."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * out / s.factor + smooth * out
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, out)


def numpy_forward(config: LlamaConfig, w: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """float64 logits [T, V] for one unpadded sequence at positions 0..T-1 (HF math)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    dh, hq, hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    t = len(ids)

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps) * weight

    if config.rope_scaling is None:
        inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dh, 2) / dh)
    else:
        inv_freq = llama3_inv_freq_hf_style(dh, config.rope_theta, config.rope_scaling)
    angles = np.arange(t)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]

    def rope(x: np.ndarray) -> np.ndarray:
        rotate_half = np.concatenate([-x[..., dh // 2:], x[..., : dh // 2]], -1)
        return x * cos + rotate_half * sin

    x = w["model.embed_tokens.weight"][ids]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        proj = {}
        for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
            y = h @ w[p + f"self_attn.{name}_proj.weight"].T
            if config.attention_bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.reshape(t, heads, dh)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if config.qk_norm:
            q = rms(q, w[p + "self_attn.q_norm.weight"])
            k = rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        attn = np.zeros_like(q)
        causal = np.tril(np.ones((t, t), bool))
        for head in range(hq):
            kv = head // (hq // hkv)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(dh)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn[:, head] = probs @ v[:, kv]
        x = x + attn.reshape(t, hq * dh) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T


@nnx.jit
def forward(model: LlamaForCausalLM, ids: jax.Array, positions: jax.Array, cache: DenseKVCache):
    return model(ids, positions, cache)


def run_prefill(model: LlamaForCausalLM, ids: np.ndarray, max_len: int = 32) -> np.ndarray:
    cache = DenseKVCache.create(model.config, 1, max_len, jnp.float32)
    positions = np.arange(len(ids), dtype=np.int32)[None]
    logits, _ = forward(model, jnp.asarray(ids[None], jnp.int32), jnp.asarray(positions), cache)
    return np.asarray(logits[0])


def test_llama3_rope_frequencies_by_hand():
    scaling = Llama3RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0,
                                original_max_position_embeddings=40)
    # head_dim 6, theta 100: base frequencies 1, 100**(-1/3), 100**(-2/3), wavelengths
    # 6.28 (< 40/2: kept), 29.16 (between 20 and 40: blended), 135.4 (> 40: divided by 4).
    f1 = 100 ** (-1 / 3)
    blend = (40 / (2 * math.pi / f1) - 1.0) / (2.0 - 1.0)
    expected = [1.0, (1 - blend) * f1 / 4 + blend * f1, 100 ** (-2 / 3) / 4]
    np.testing.assert_allclose(rope_inv_freq(6, 100.0, scaling), expected, rtol=1e-12)
    np.testing.assert_allclose(rope_inv_freq(6, 100.0, None), [1.0, f1, 100 ** (-2 / 3)])


def test_llama3_rope_frequencies_match_band_formula():
    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(rope_inv_freq(128, 500000.0, scaling),
                               llama3_inv_freq_hf_style(128, 500000.0, scaling), rtol=1e-12)


def test_gqa_attention_matches_repeated_kv_and_zeroes_masked_rows():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 3, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    v = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    mask = np.array([[[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]], bool)
    out = np.asarray(masked_attention(q, k, v, mask, scale=0.5))
    for head in range(4):
        kv = head // 2
        for t in range(2):
            s = np.where(mask[0, t], q[0, t, head] @ k[0, :, kv].T * 0.5, -np.inf)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[0, t, head], (p / p.sum()) @ v[0, :, kv],
                                           rtol=1e-5, atol=1e-6)
    assert np.all(out[0, 2] == 0.0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_numpy_reference(variant: str):
    config = VARIANTS[variant]
    weights = random_hf_weights(config)
    model = build_model(config, weights.items())
    ids = np.array([3, 17, 5, 40, 2, 9, 33, 11, 0, 47], np.int32)
    np.testing.assert_allclose(run_prefill(model, ids), numpy_forward(config, weights, ids),
                               rtol=2e-4, atol=2e-4)


def test_prefill_then_decode_equals_long_prefill():
    model = build_model(TINY, random_hf_weights(TINY).items())
    ids = np.array([[3, 17, 5, 40, 2, 9, 33, 11]], np.int32)
    full, _ = forward(model, ids, np.arange(8, dtype=np.int32)[None],
                      DenseKVCache.create(TINY, 1, 16, jnp.float32))
    cache = DenseKVCache.create(TINY, 1, 16, jnp.float32)
    logits, cache = forward(model, ids[:, :5], np.arange(5, dtype=np.int32)[None], cache)
    steps = [logits]
    for p in range(5, 8):
        logits, cache = forward(model, ids[:, p:p + 1], np.array([[p]], np.int32), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_padded_tokens_change_nothing():
    model = build_model(TINY, random_hf_weights(TINY).items())
    a = np.array([3, 17, 5, 40, 2], np.int32)
    b = np.array([9, 33, 11], np.int32)
    alone_a, cache_a = forward(model, a[None], np.arange(5, dtype=np.int32)[None],
                               DenseKVCache.create(TINY, 1, 8, jnp.float32))
    alone_b, cache_b = forward(model, b[None], np.arange(3, dtype=np.int32)[None],
                               DenseKVCache.create(TINY, 1, 8, jnp.float32))
    ids = np.array([a, [9, 33, 11, 7, 7]], np.int32)
    positions = np.array([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]], np.int32)
    logits, cache = forward(model, ids, positions, DenseKVCache.create(TINY, 2, 8, jnp.float32))
    np.testing.assert_allclose(logits[0], alone_a[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[1, :3], alone_b[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.k[:, 1], cache_b.k[:, 0])
    np.testing.assert_array_equal(cache.v[:, 0], cache_a.v[:, 0])
    assert np.all(np.asarray(cache.k[:, 1, 3:]) == 0.0)


def test_stage_methods_take_unbatched_tokens():
    model = build_model(TINY, random_hf_weights(TINY).items())
    ids = np.array([3, 17, 5], np.int32)
    hidden = model.embed(ids)
    q, k, v = model.layers[0].attention_inputs(hidden, np.arange(3, dtype=np.int32))
    assert hidden.shape == (3, 32)
    assert (q.shape, k.shape, v.shape) == ((3, 4, 8), (3, 2, 8), (3, 2, 8))
    assert model.attention_scale == pytest.approx(1 / math.sqrt(8))
    assert model.head(hidden).dtype == jnp.float32


def test_bfloat16_params_and_compute_track_float32():
    weights = random_hf_weights(TINY)
    ids = np.array([3, 17, 5, 40, 2, 9], np.int32)
    exact = run_prefill(build_model(TINY, weights.items()), ids)
    model = build_model(TINY, weights.items(), dtype=jnp.bfloat16)
    assert model.layers[0].q_proj[...].dtype == jnp.bfloat16
    cache = DenseKVCache.create(TINY, 1, 8, jnp.bfloat16)
    logits, _ = forward(model, ids[None], np.arange(6, dtype=np.int32)[None], cache)
    assert logits.dtype == jnp.float32
    scale = np.abs(exact).max()
    assert np.abs(np.asarray(logits[0]) - exact).max() < 0.05 * scale


def test_config_from_hf_rejects_unknown_architectures_and_rope_types():
    base = json.loads((GOLDEN / "tiny_llama" / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type='mistral'"):
        LlamaConfig.from_hf(base | {"model_type": "mistral"})
    with pytest.raises(ValueError, match="'yarn'"):
        LlamaConfig.from_hf(base | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3", "tiny_tied"])
def test_logits_match_hf_golden(name: str):
    golden = np.load(GOLDEN / f"{name}.npz")
    model = load_checkpoint(GOLDEN / name, dtype="float32").model
    for suffix in ("", "_2"):
        ids = golden[f"prompt_ids{suffix}"]
        expected = golden[f"logits{suffix}"]
        logits = run_prefill(model, ids, max_len=64)
        rel = np.abs(logits - expected).max() / np.abs(expected).max()
        print(f"{name}{suffix}: max relative error {rel:.2e}")
        assert rel < 1e-4
        np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))
