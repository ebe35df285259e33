"""Plain masked attention with grouped-query heads: the reference every attention kernel matches.

Invariants:

* Query head ``h`` reads key/value head ``h // (Hq // Hkv)`` (the GQA grouping HF checkpoints use).
* Scores, softmax and the weighted sum run in full float32 (no TF32 on GPUs); the output has the query's dtype.
* A query row whose mask is all false (a padding token) gets exactly zeros, never NaN, so it can
  flow through later layers without poisoning real rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST  # a reference is float32 on every backend (no TF32)


def masked_attention(
    q: jax.Array,  # [B, T, Hq, Dh]
    k: jax.Array,  # [B, S, Hkv, Dh]
    v: jax.Array,  # [B, S, Hkv, Dh]
    mask: jax.Array,  # bool [B, T, S]; true where query t may read slot s
    *,
    scale: float,
) -> jax.Array:  # [B, T, Hq, Dh]
    """Softmax attention of every query over the key slots its mask allows."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    out_dtype = q.dtype
    num_kv_heads = k.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    group = num_q_heads // num_kv_heads
    q = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k.astype(jnp.float32), precision=HIGHEST) * scale
    visible = mask[:, None, None, :, :]
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(visible, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights, v.astype(jnp.float32), precision=HIGHEST)
    return out.reshape(batch, num_tokens, num_q_heads, head_dim).astype(out_dtype)


def cache_causal_mask(positions: jax.Array, num_slots: int) -> jax.Array:
    """bool [B, T, S]: a query at position p sees slots 0..p of its row; p < 0 sees nothing."""
    slots = jnp.arange(num_slots, dtype=positions.dtype)
    return (slots[None, None, :] <= positions[:, :, None]) & (positions[:, :, None] >= 0)
