"""Multi-head latent attention (MLA) with a latent KV cache, NoPE (Kimi-Linear) or with RoPE on
the rope part (DeepSeek-V3).

Per token the cache holds one latent row ``[R + r]``: the normalised compressed KV
(``kv_a_layernorm(c)``, R = kv_lora_rank) followed by the shared key part of width
r = qk_rope_head_dim. Without rotary tables (``inputs(x)``, Kimi-Linear's ``mla_use_nope``) the
key part is stored and used unrotated; with them (``inputs(x, rope)``) the query's rope part and
the key part are rotated (rotate-half layout, ``kernels.rotary``) at their own positions before the
key part is stored, so cached rows never need the position again. Attention runs in the absorbed
form:

    q_lat[h]  = q_nope[h] @ W_uk[h]^T              (W_uk: the key half of kv_b_proj, [R, H, n])
    score     = (q_lat . c + q_rot . k_rot) * scale  (scale: the caller's; (n + r) ** -0.5 plain)
    out[h]    = (softmax(score) @ c) @ W_uv[h]      (W_uv: the value half, [R, H, v])

which equals expanding the latents into per-head K/V (what the reference does) up to float
rounding, and makes the cache one multi-query head: ``q [T, H, R + r]`` against ``kv [S, 1, R + r]``,
with the values being the first R features of the same rows. Decode (``latent_attention``) and
prefill (``paged_latent_prefill``) therefore reuse plain attention functions with V = K and drop
the last r output features.

Weight layouts: ``q_proj [D, H, n + r]`` or ``q_a_proj [D, Q]``, ``q_a_layernorm [Q]``,
``q_b_proj [Q, H, n + r]``; ``kv_a_proj [D, R + r]``, ``kv_a_layernorm [R]``,
``kv_b_proj [R, H, n + v]``; ``o_proj [H, v, D]``. The low-rank norms use eps 1e-6 (the reference
builds them without the config's eps). ``mla_weight_entries`` maps the checkpoint's tensors
(``self_attn.q_a_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ... in ``[out, in]`` layout) onto
these; with ``rope_interleave`` (checkpoints whose rope features come in adjacent pairs
``(x0, x1), (x2, x3), ...``) it reorders the rope outputs of the query projection and of
``kv_a_proj`` to evens then odds, so the rotate-half rotation here is the pairwise rotation the
checkpoint was trained with (scores are unchanged: query and key are reordered alike).

The paged latent cache of one layer is ``[num_pages, page_size, R + r]``; slot ``s`` is page
``s // page_size``, row ``s % page_size``. A slot < 0 (padding) writes nothing and a padding query
(request or position < 0) reads nothing and gets zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.kernels.attention_ref import masked_attention
from tokenspeed_jax.kernels.paged_prefill_attention import ragged_paged_prefill_attention_reference
from tokenspeed_jax.kernels.rotary import rotate
from tokenspeed_jax.models.layers import RMSNorm, linear, normal_param

LORA_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class MLAModelShape:
    """The hyper-parameters every MLA + MoE family's config.json shares (named as there): the
    family configs extend it with their own."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @staticmethod
    def fields_from_hf(config: Any) -> dict[str, Any]:
        """These fields read from a config.json dict (``q_lora_rank`` absent or null: None)."""
        q_lora = config.get("q_lora_rank")
        names = [f.name for f in dataclasses.fields(MLAModelShape) if f.name != "q_lora_rank"]
        return {**{name: int(config[name]) for name in names},
                "q_lora_rank": None if q_lora is None else int(q_lora)}


class MultiLatentAttention(nnx.Module):
    """Projections around the latent attention; the attention itself is the caller's."""

    def __init__(
        self,
        hidden: int,
        *,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ) -> None:
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = normal_param(rngs, (hidden, num_heads, qk_dim), param_dtype)
        else:
            self.q_a_proj = normal_param(rngs, (hidden, q_lora_rank), param_dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=LORA_NORM_EPS, dtype=dtype,
                                         param_dtype=param_dtype)
            self.q_b_proj = normal_param(rngs, (q_lora_rank, num_heads, qk_dim), param_dtype)
        self.kv_a_proj = normal_param(rngs, (hidden, kv_lora_rank + qk_rope_head_dim), param_dtype)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=LORA_NORM_EPS, dtype=dtype,
                                      param_dtype=param_dtype)
        self.kv_b_proj = normal_param(rngs, (kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim),
                                 param_dtype)
        self.o_proj = normal_param(rngs, (num_heads, v_head_dim, hidden), param_dtype)
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim = qk_nope_head_dim
        self.dtype = dtype
        self.scale = qk_dim ** -0.5

    @classmethod
    def from_config(cls, config: Any, *, dtype: Any, param_dtype: Any,
                    rngs: nnx.Rngs) -> MultiLatentAttention:
        """Sized by a model config's ``hidden_size``, ``num_attention_heads``, ``q_lora_rank``,
        ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim`` (the names
        of the checkpoints' config.json)."""
        return cls(config.hidden_size, num_heads=config.num_attention_heads,
                   q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                   qk_nope_head_dim=config.qk_nope_head_dim,
                   qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                   dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def inputs(self, x: jax.Array, rope: tuple[jax.Array, jax.Array] | None = None
               ) -> tuple[jax.Array, jax.Array]:
        """Normed hidden [..., T, D] -> (absorbed query [..., T, H, R + r], latent row
        [..., T, R + r]). ``rope``: the (cos, sin) tables ``[..., T, r]`` of the tokens' positions
        (``kernels.rotary.rotary_tables``) rotate the query's and the key's rope parts; None
        leaves both unrotated (NoPE)."""
        if self.q_lora_rank is None:
            q = linear("...D,DHK->...HK", x, self.q_proj, self.dtype)
        else:
            q_low = self.q_a_layernorm(linear("...D,DQ->...Q", x, self.q_a_proj, self.dtype))
            q = linear("...Q,QHK->...HK", q_low, self.q_b_proj, self.dtype)
        q_nope, q_rot = q[..., :self.nope_dim], q[..., self.nope_dim:]
        w_uk = self.kv_b_proj[...][..., :self.nope_dim]
        q_lat = linear("...HN,RHN->...HR", q_nope, w_uk, self.dtype)
        kv = linear("...D,DL->...L", x, self.kv_a_proj, self.dtype)
        k_rot = kv[..., self.kv_lora_rank:]
        if rope is not None:
            q_rot = rotate(q_rot, rope)
            k_rot = rotate(k_rot[..., None, :], rope)[..., 0, :]
        latent = jnp.concatenate([self.kv_a_layernorm(kv[..., :self.kv_lora_rank]), k_rot], -1)
        return jnp.concatenate([q_lat, q_rot], axis=-1), latent

    def outputs(self, attn: jax.Array) -> jax.Array:
        """Latent attention output [..., H, R] -> [..., D]."""
        w_uv = self.kv_b_proj[...][..., self.nope_dim:]
        out = linear("...HR,RHV->...HV", attn, w_uv, self.dtype)
        return linear("...HV,HVD->...D", out, self.o_proj, self.dtype)


def deinterleave(n: int) -> np.ndarray:
    """i32[n]: the even features, then the odd ones (adjacent pairs -> rotate-half pairs)."""
    return np.r_[np.arange(0, n, 2), np.arange(1, n, 2)].astype(np.int32)


def mla_weight_entries(
    prefix: str, path: tuple[str | int, ...], config: Any, *, rope_interleave: bool = False
) -> dict[str, tuple[tuple[str | int, ...], tuple[int, ...], Any]]:
    """Checkpoint name -> (state path, checkpoint shape, layout change) of one attention block:
    names under ``prefix`` (e.g. ``model.layers.3.self_attn.``), paths under ``path``; the sizes
    are ``config``'s (``MultiLatentAttention.from_config``)."""
    d, heads, q_lora_rank = config.hidden_size, config.num_attention_heads, config.q_lora_rank
    rank, rope, nope = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim
    qk, kv_dim, v_head_dim = nope + rope, nope + config.v_head_dim, config.v_head_dim
    rope_order = deinterleave(rope) if rope_interleave else np.arange(rope)
    q_order = np.r_[np.arange(nope), nope + rope_order]
    kv_order = np.r_[np.arange(rank), rank + rope_order]

    def query(inner: int):  # [H * (n + r), inner] -> [inner, H, n + r], rope part reordered
        return lambda w: w.reshape(heads, qk, inner)[:, q_order].transpose(2, 0, 1)

    entries = {}
    if q_lora_rank is None:
        entries[prefix + "q_proj.weight"] = (path + ("q_proj",), (heads * qk, d), query(d))
    else:
        entries.update({
            prefix + "q_a_proj.weight": (path + ("q_a_proj",), (q_lora_rank, d), np.transpose),
            prefix + "q_a_layernorm.weight": (path + ("q_a_layernorm", "weight"), (q_lora_rank,),
                                              np.asarray),
            prefix + "q_b_proj.weight": (path + ("q_b_proj",), (heads * qk, q_lora_rank),
                                         query(q_lora_rank)),
        })
    entries.update({
        prefix + "kv_a_proj_with_mqa.weight": (path + ("kv_a_proj",), (rank + rope, d),
                                               lambda w: w[kv_order].T),
        prefix + "kv_a_layernorm.weight": (path + ("kv_a_layernorm", "weight"), (rank,),
                                           np.asarray),
        prefix + "kv_b_proj.weight": (path + ("kv_b_proj",), (heads * kv_dim, rank),
                                      lambda w: w.reshape(heads, kv_dim, rank).transpose(2, 0, 1)),
        prefix + "o_proj.weight": (path + ("o_proj",), (d, heads * v_head_dim),
                                   lambda w: w.reshape(d, heads, v_head_dim).transpose(1, 2, 0)),
    })
    return entries


def latent_attention(
    attend: Any, q: jax.Array, kv_pages: jax.Array, kv_lora_rank: int, *args: Any, **kwargs: Any
) -> jax.Array:
    """Run an attention function with K = V = the latent rows (one head); keep R features.

    ``attend(q, k, v, *args, **kwargs)`` is any of the paged or masked attention functions; the
    latent rows ``kv_pages [..., R + r]`` get a singleton head axis before the last.
    """
    kv = kv_pages[..., None, :]
    return attend(q, kv, kv, *args, **kwargs)[..., :kv_lora_rank]


def write_latent(
    pages: jax.Array,  # [num_pages, page_size, R + r]
    rows: jax.Array,  # [T, R + r]
    slot_mapping: jax.Array,  # i32[T]; < 0 writes nothing
) -> jax.Array:
    """``pages`` with each token's latent row stored at its slot (page * page_size + row)."""
    num_slots = pages.shape[0] * pages.shape[1]
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)
    flat = pages.reshape(num_slots, pages.shape[-1])
    return flat.at[slots].set(rows.astype(pages.dtype), mode="drop").reshape(pages.shape)


def _context(pages: jax.Array, page_tables: jax.Array) -> jax.Array:
    """Each request's latent rows in position order: [N, W * page_size, R + r]."""
    ctx = jnp.take(pages, page_tables, axis=0, mode="clip")
    return ctx.reshape(page_tables.shape[0], -1, pages.shape[-1])


def paged_latent_prefill(
    q: jax.Array,  # [T, H, R + r]
    pages: jax.Array,  # [num_pages, page_size, R + r], this step's rows already written
    page_tables: jax.Array,  # i32[N, W]
    token_request: jax.Array,  # i32[T]; < 0 = padding token
    positions: jax.Array,  # i32[T]; < 0 = padding token
    *,
    scale: float,
    kv_lora_rank: int,
) -> jax.Array:  # [T, H, R]
    """Causal latent attention of packed requests over their pages (prefix pages included); a
    padding token gets zeros.

    The latent cache is one key/value head, so this is the paged prefill attention's plain-JAX
    path (``ragged_paged_prefill_attention_reference``) with V = K: one page-table row at a time,
    its keys in chunks up to its live keys. Work and memory follow the live context, never
    rows x ``max_model_len``."""
    kv = pages[None]  # [1, num_pages, page_size, R + r]: the head axis first
    return ragged_paged_prefill_attention_reference(
        q, kv, kv, page_tables, token_request, positions, scale=scale)[..., :kv_lora_rank]


def paged_latent_decode(
    q: jax.Array,  # [N, H, R + r]: one query per request
    pages: jax.Array,  # [num_pages, page_size, R + r]
    page_tables: jax.Array,  # i32[N, W]
    positions: jax.Array,  # i32[N]; < 0 = padding row
    *,
    scale: float,
    kv_lora_rank: int,
) -> jax.Array:  # [N, H, R]
    """Each request's single query over its own pages, positions 0..its position."""
    ctx = _context(pages, page_tables)
    slots = jnp.arange(ctx.shape[1], dtype=jnp.int32)
    mask = (slots[None, :] <= positions[:, None]) & (positions[:, None] >= 0)
    return latent_attention(masked_attention, q[:, None], ctx, kv_lora_rank, mask[:, None, :],
                            scale=scale)[:, 0]
