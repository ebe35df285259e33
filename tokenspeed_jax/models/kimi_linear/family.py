"""Kimi Linear's declaration: KDA + MLA + MoE from HF directories, served by ``KimiRunner``
with a paged latent cache and a pool of recurrent KDA state rows.

Invariants: a page holds one latent row ``[page_size, kv_lora_rank + qk_rope_head_dim]`` per MLA
layer; a state row holds, per KDA layer, the recurrent state ``[H, K, K]`` (in the state dtype)
and the conv window ``[W - 1, 3 H K]`` (in the model's dtype); the only checkpoint tensors
allowed to go unused are rotary ``inv_freq`` buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenspeed_jax.models.family import Family
from tokenspeed_jax.models.kimi_linear import sharding
from tokenspeed_jax.models.kimi_linear.model import (
    MODEL_TYPE,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    checkpoint_name,
)


def ignored_tensor(name: str, config: KimiLinearConfig) -> bool:
    """Checkpoint tensors that may be present but carry nothing the model needs."""
    del config
    return name.endswith("rotary_emb.inv_freq")


def kv_page_bytes(config: KimiLinearConfig, page_size: int, dtype: Any) -> int:
    """Bytes of one page over all MLA layers: one latent row [page_size, latent_dim] each."""
    return page_size * config.latent_dim * len(config.mla_layers) * np.dtype(dtype).itemsize


def state_slot_bytes(config: KimiLinearConfig, dtype: Any, state_dtype: Any) -> int:
    """Bytes of one KDA state-pool row over all KDA layers: the recurrent state (in
    ``state_dtype``) and the conv window (in the model's ``dtype``)."""
    h, k = config.linear_num_heads, config.linear_head_dim
    conv = (config.conv_kernel_size - 1) * 3 * h * k * np.dtype(dtype).itemsize
    return (h * k * k * np.dtype(state_dtype).itemsize + conv) * len(config.kda_layers)


FAMILY = Family(
    name="kimi_linear",
    model_types=(MODEL_TYPE,),
    config_from_hf=KimiLinearConfig.from_hf,
    model_class=KimiLinearForCausalLM,
    weight_map=KimiLinearForCausalLM.hf_weight_map,
    ignored_tensor=ignored_tensor,
    check_split=sharding.check_split,
    param_spec=sharding.param_spec,
    kv_page_bytes=kv_page_bytes,
    kv_cache_shards=sharding.kv_cache_shards,
    runner="tokenspeed_jax.engine.kimi_runner:KimiRunner",
    reference="tokenspeed_jax.hybrid_reference:HybridReferenceGenerator",
    state_slot_bytes=state_slot_bytes,
    checkpoint_name=checkpoint_name,
)
