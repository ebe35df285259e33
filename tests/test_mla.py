"""MLA's paged latent prefill attention against a per-token numpy computation (each query token
over its own request's latent rows 0..its position, the values being the first R features), its
memory, which must not grow with page-table rows x width (``max_model_len``), and the absorbed
form with rotary tables against expanded per-head attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.kernels.attention_ref import masked_attention
from tokenspeed_jax.kernels.rotary import rotary_tables
from tokenspeed_jax.models.mla import (
    LORA_NORM_EPS,
    MultiLatentAttention,
    latent_attention,
    paged_latent_prefill,
)

PAGE = 4
RANK, ROPE, HEADS = 8, 4, 3


def expected(q, pages, tables, token_request, positions, scale):
    flat = pages.reshape(-1, pages.shape[-1]).astype(np.float64)
    out = np.zeros((q.shape[0], HEADS, RANK))
    for t, (row, pos) in enumerate(zip(token_request, positions)):
        if row < 0 or pos < 0:
            continue
        keys = np.arange(pos + 1)
        rows = flat[tables[row][keys // PAGE] * PAGE + keys % PAGE]  # [pos + 1, R + r]
        scores = q[t].astype(np.float64) @ rows.T * scale  # [H, pos + 1]
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[t] = (weights / weights.sum(-1, keepdims=True)) @ rows[:, :RANK]
    return out


def test_prefill_reads_each_requests_own_rows_with_prefix_and_padding():
    rng = np.random.default_rng(0)
    pages = rng.standard_normal((20, PAGE, RANK + ROPE)).astype(np.float32)
    tables = rng.permutation(20)[:16].reshape(4, 4).astype(np.int32)  # row 3 belongs to nobody
    # request 0 extends a cached 5-token prefix; requests 1 and 2 start at 0; two padding tokens
    token_request = np.array([0] * 5 + [1] * 7 + [2] * 3 + [-1] * 2, np.int32)
    positions = np.r_[5:10, 0:7, 0:3, -1, -1].astype(np.int32)
    q = rng.standard_normal((len(positions), HEADS, RANK + ROPE)).astype(np.float32)
    scale = (RANK + ROPE) ** -0.5
    got = paged_latent_prefill(jnp.asarray(q), jnp.asarray(pages), jnp.asarray(tables),
                               jnp.asarray(token_request), jnp.asarray(positions), scale=scale,
                               kv_lora_rank=RANK)
    want = expected(q, pages, tables, token_request, positions, scale)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    assert not np.asarray(got)[-2:].any()


def temp_bytes(rows: int, width: int, tokens: int = 64) -> int:
    spec = jax.ShapeDtypeStruct
    compiled = jax.jit(paged_latent_prefill, static_argnames=("scale", "kv_lora_rank")).lower(
        spec((tokens, HEADS, RANK + ROPE), jnp.float32),
        spec((rows * width, PAGE, RANK + ROPE), jnp.float32),
        spec((rows, width), jnp.int32), spec((tokens,), jnp.int32), spec((tokens,), jnp.int32),
        scale=1.0, kv_lora_rank=RANK).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_prefill_memory_does_not_grow_with_rows_times_context():
    """Gathering every row's whole context (rows x width x page slots per query) would grow
    this 64x; the chunked loop over each row's live keys keeps it flat."""
    small, large = temp_bytes(rows=2, width=8), temp_bytes(rows=16, width=64)
    assert large < 2 * small


def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_rotary_absorbed_attention_equals_expanded_heads():
    """With rotary tables, the absorbed latent attention equals the textbook form: per-head keys
    ``[k_nope_h, rot(k_rot)]`` and values expanded from the latent, queries ``[q_nope_h,
    rot(q_rot_h)]``, causal softmax, output projection (numpy, float64)."""
    hidden, nope, rope, value, tokens = 16, 6, 4, 5, 7
    mla = MultiLatentAttention(hidden, num_heads=HEADS, q_lora_rank=None, kv_lora_rank=RANK,
                               qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=value,
                               dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).standard_normal((tokens, hidden)).astype(np.float32)
    inv_freq = 1.0 / 100.0 ** (np.arange(0, rope, 2) / rope)
    angles = np.arange(tokens)[:, None] * inv_freq  # [T, r / 2]
    scale = 0.3
    q, latent = mla.inputs(jnp.asarray(x), rotary_tables(jnp.arange(tokens), inv_freq))
    mask = np.tril(np.ones((tokens, tokens), bool))[None]
    attn = latent_attention(masked_attention, q[None], latent[None], RANK, jnp.asarray(mask),
                            scale=scale)[0]
    got = np.asarray(mla.outputs(attn))

    w = {name: np.asarray(getattr(mla, name)[...], np.float64)
         for name in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj")}
    x64 = x.astype(np.float64)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    q_full = np.einsum("TD,DHK->THK", x64, w["q_proj"])
    q_full[..., nope:] = rotate_half(q_full[..., nope:], cos, sin)
    kv = x64 @ w["kv_a_proj"]
    c = kv[:, :RANK] / np.sqrt(np.mean(kv[:, :RANK] ** 2, -1, keepdims=True) + LORA_NORM_EPS)
    k_rot = rotate_half(kv[:, None, RANK:], cos, sin)  # [T, 1, r]
    expanded = np.einsum("TR,RHK->THK", c, w["kv_b_proj"])
    keys = np.concatenate([expanded[..., :nope], np.repeat(k_rot, HEADS, axis=1)], axis=-1)
    scores = np.einsum("THK,SHK->HTS", q_full, keys) * scale
    scores = np.where(mask, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("HTS,SHV->THV", probs, expanded[..., nope:])
    want = np.einsum("THV,HVD->TD", out, w["o_proj"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
