"""DeepSeek-V3 / Kimi-K2 causal LM as Flax NNX modules: MLA with RoPE on the rope part over a
latent cache, then a dense SwiGLU (the first ``first_k_dense_replace`` layers) or the sigmoid-routed
grouped top-k MoE with shared experts (``moe.KimiMoE``: the same router).

Stage interface (what a segmented runner calls, per layer, tokens packed ``[T, ...]``):

* ``embed(token_ids)`` / ``head(hidden)``; ``rope(positions)``, the tables of a step, computed once;
* ``layer.attention_inputs(hidden, rope) -> (q [T, H, R + r], latent row [T, R + r])``: the
  segment before the attention break;
* at the break, the caller stores the rows (``mla.write_latent`` into the layer's latent pages
  ``[num_pages, page_size, R + r]``) and attends (``mla.paged_latent_prefill`` /
  ``paged_latent_decode`` with ``model.scale``): one multi-query latent head, values = the first R
  features;
* ``layer.mla_outputs(hidden, attn [T, H, R]) -> hidden``: the segment after it (output
  projection, residual, feed-forward).

The same layer also speaks the latent forward's protocol (``models/kimi_linear/forward.py``):
``layer.kind == "mla"``, ``layer.mla_inputs(hidden, positions)`` (the tables computed from the
positions inside the segment), ``layer.mla_outputs(hidden, attn, mesh=...)``, and
``model.attention_scale``.

Three plain forwards are built from those stages and differ only in the cache they store into and
attend over: ``__call__`` (the reference: dense per-request caches ``[B, S, R + r]``, rows of a
batch padded with position -1), ``prefill`` (packed requests over paged latent caches, prefix pages
included) and ``decode`` (one token per request over paged caches).

Invariants: a token at position < 0 (or slot < 0 in the paged forms) is padding: it writes no
cache row, attends to nothing and changes no real token's output. Logits are float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tokenspeed_jax.kernels.attention_ref import cache_causal_mask, masked_attention
from tokenspeed_jax.models.deepseek_v3.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek_v3.rope import rope_tables, softmax_scale
from tokenspeed_jax.models.layers import CausalLMBase, RMSNorm
from tokenspeed_jax.models.mla import (
    MultiLatentAttention,
    latent_attention,
    paged_latent_decode,
    paged_latent_prefill,
    write_latent,
)
from tokenspeed_jax.models.moe import KimiMoE, SwiGLU

MLA_KIND = "mla"  # a segmented runner's name for a layer with latent attention at its break
Caches = tuple[jax.Array, ...]
Tables = tuple[jax.Array, jax.Array]


class DeepseekV3DecoderLayer(nnx.Module):
    """One pre-norm layer: latent attention, then a dense or MoE feed-forward."""

    kind = MLA_KIND

    def __init__(self, config: DeepseekV3Config, index: int, *, dtype: Any, param_dtype: Any,
                 rngs: nnx.Rngs) -> None:
        d = config.hidden_size
        kw = {"dtype": dtype, "param_dtype": param_dtype}
        self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps, **kw)
        self.self_attn = MultiLatentAttention.from_config(config, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps, **kw)
        if index < config.first_k_dense_replace:
            self.mlp = SwiGLU(d, config.intermediate_size, rngs=rngs, **kw)
        else:
            self.mlp = KimiMoE(d, config.moe_intermediate_size, **config.router_settings,
                               rngs=rngs, **kw)
        self.dtype = dtype
        self.config = config

    def attention_inputs(self, hidden: jax.Array, rope: Tables) -> tuple[jax.Array, jax.Array]:
        """hidden [..., T, D] -> (absorbed query [..., T, H, R + r], latent row [..., T, R + r]),
        the rope parts rotated at the tokens' positions (``rope``)."""
        return self.self_attn.inputs(self.input_layernorm(hidden), rope)

    def mla_inputs(self, hidden: jax.Array, positions: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
        """``attention_inputs`` with the rotary tables of ``positions [..., T]`` computed here
        (the segmented runner's form: it hands a layer the positions, not the tables)."""
        return self.attention_inputs(hidden, rope_tables(self.config, positions))

    def mla_outputs(self, hidden: jax.Array, attn: jax.Array, *, mesh: Mesh | None = None,
                    live: jax.Array | None = None) -> jax.Array:
        """The layer's input residual and latent attention [..., H, R] -> output [..., D].
        ``mesh``: the weights are split over it; the routed experts run per shard. ``live``
        [...]: the real tokens (``moe.KimiMoE``)."""
        hidden = hidden.astype(self.dtype) + self.self_attn.outputs(attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), mesh=mesh, live=live)


def dense_caches(config: DeepseekV3Config, batch: int, max_len: int, dtype: Any) -> Caches:
    """The reference forward's caches: one zeroed [B, S, R + r] per layer (slot p = position p)."""
    return tuple(jnp.zeros((batch, max_len, config.latent_dim), dtype)
                 for _ in range(config.num_hidden_layers))


class DenseLatentCache:
    """The reference forward's caches as a reference generator builds a model's dense cache:
    ``create(config, batch, max_len, dtype)`` (``dense_caches``)."""

    create = staticmethod(dense_caches)


def latent_pages(config: DeepseekV3Config, num_pages: int, page_size: int, dtype: Any) -> Caches:
    """The paged caches: one zeroed [num_pages, page_size, R + r] per layer."""
    return tuple(jnp.zeros((num_pages, page_size, config.latent_dim), dtype)
                 for _ in range(config.num_hidden_layers))


class DeepseekV3ForCausalLM(CausalLMBase):
    """DeepSeek-V3 causal LM; see the module docstring for the stage interface."""

    dense_cache_type = DenseLatentCache

    def __init__(self, config: DeepseekV3Config, *, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.config = config
        self.dtype = dtype
        self.scale = softmax_scale(config)
        self.init_embedding(param_dtype, rngs)
        self.layers = nnx.List([
            DeepseekV3DecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            for i in range(config.num_hidden_layers)
        ])
        self.init_head(param_dtype, rngs)

    @property
    def attention_scale(self) -> float:
        """The score scale of every layer's latent attention (``rope.softmax_scale``)."""
        return self.scale

    def rope(self, positions: jax.Array) -> Tables:
        """The rotary tables of ``positions [..., T]`` every layer uses (``rope.rope_tables``)."""
        return rope_tables(self.config, positions)

    def _forward(self, token_ids: jax.Array, positions: jax.Array, caches: Caches,
                 store: Callable[[jax.Array, jax.Array], jax.Array],
                 attend: Callable[[jax.Array, jax.Array], jax.Array]) -> tuple[jax.Array, Caches]:
        """Every layer: inputs, ``store(cache, rows)``, ``attend(q, cache)``, outputs."""
        hidden = self.embed(token_ids)
        rope = self.rope(positions)
        caches = list(caches)
        for i, layer in enumerate(self.layers):
            q, rows = layer.attention_inputs(hidden, rope)
            caches[i] = store(caches[i], rows)
            hidden = layer.mla_outputs(hidden, attend(q, caches[i]))
        return self.head(hidden), tuple(caches)

    def __call__(self, token_ids: jax.Array, positions: jax.Array,
                 caches: Caches) -> tuple[jax.Array, Caches]:
        """The reference forward. token_ids, positions int32 [B, T] (each row's real positions
        contiguous from its cached length, -1 for padding) -> (float32 logits [B, T, V], caches
        ``dense_caches``)."""
        num_slots = caches[0].shape[1]
        rows = jnp.arange(token_ids.shape[0])[:, None]
        slots = jnp.where(positions >= 0, positions, num_slots)  # padding: dropped below
        mask = cache_causal_mask(positions, num_slots)

        def store(cache: jax.Array, new: jax.Array) -> jax.Array:
            return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")

        attend = functools.partial(_dense_attention, mask=mask, scale=self.scale,
                                   kv_lora_rank=self.config.kv_lora_rank)
        return self._forward(token_ids, positions, caches, store, attend)

    def prefill(self, token_ids: jax.Array, positions: jax.Array, token_request: jax.Array,
                slot_mapping: jax.Array, pages: Caches,
                page_tables: jax.Array) -> tuple[jax.Array, Caches]:
        """Packed requests over paged latent caches. token_ids, positions, token_request (the
        page-table row of each token) and slot_mapping i32[T] (-1: padding); ``pages``
        (``latent_pages``); page_tables i32[N, W] -> (float32 logits [T, V], pages)."""
        attend = functools.partial(
            paged_latent_prefill, page_tables=page_tables, token_request=token_request,
            positions=positions, scale=self.scale, kv_lora_rank=self.config.kv_lora_rank)
        return self._forward(token_ids, positions, pages,
                             functools.partial(write_latent, slot_mapping=slot_mapping), attend)

    def decode(self, token_ids: jax.Array, positions: jax.Array, slot_mapping: jax.Array,
               pages: Caches, page_tables: jax.Array) -> tuple[jax.Array, Caches]:
        """One token per request (row n of ``page_tables``): i32[N] each (-1: padding row) ->
        (float32 logits [N, V], pages)."""
        attend = functools.partial(
            paged_latent_decode, page_tables=page_tables, positions=positions, scale=self.scale,
            kv_lora_rank=self.config.kv_lora_rank)
        return self._forward(token_ids, positions, pages,
                             functools.partial(write_latent, slot_mapping=slot_mapping), attend)


def _dense_attention(q: jax.Array, cache: jax.Array, *, mask: jax.Array, scale: float,
                     kv_lora_rank: int) -> jax.Array:
    return latent_attention(masked_attention, q, cache, kv_lora_rank, mask, scale=scale)
