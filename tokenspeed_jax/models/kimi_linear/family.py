"""Kimi Linear's declaration: KDA + MLA + MoE from HF directories, served with its forward in
segments (``forward.py``) with a paged latent cache and a pool of recurrent KDA state rows.

Invariants: a page holds one latent row ``[page_size, kv_lora_rank + qk_rope_head_dim]`` per MLA
layer; a state row holds, per KDA layer, the recurrent state ``[H, K, K]`` (in the state dtype)
and the conv window ``[W - 1, 3 H K]`` (in the model's dtype); the only checkpoint tensors
allowed to go unused are rotary ``inv_freq`` buffers.
"""

from __future__ import annotations

from typing import Any

from tokenspeed_jax.models.cache_spec import PAGE, SLOT, CachePool
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


def cache_pools(config: KimiLinearConfig, page_size: int, dtype: Any, state_dtype: Any,
                devices: int) -> list[CachePool]:
    """In layer order: per MLA layer its latent pages ``[pages, page_size, latent_dim]``
    (replicated); per KDA layer its recurrent-state rows ``[rows, H, K, K]`` (in
    ``state_dtype``) and conv-window rows ``[rows, W - 1, 3 H K]``, split by head
    (``sharding.pool_spec``, whatever the device count)."""
    del devices
    h, k = config.linear_num_heads, config.linear_head_dim
    pools = []
    for i in range(config.num_hidden_layers):
        if i in config.kda_layers:
            pools += [CachePool(f"state.{i}", SLOT, (h, k, k), state_dtype,
                                spec=sharding.pool_spec("state")),
                      CachePool(f"conv.{i}", SLOT, (config.conv_kernel_size - 1, 3 * h * k),
                                dtype, spec=sharding.pool_spec("conv"))]
        else:
            pools.append(CachePool(f"latent.{i}", PAGE, (page_size, config.latent_dim), dtype))
    return pools


FAMILY = Family(
    name="kimi_linear",
    model_types=(MODEL_TYPE,),
    config_from_hf=KimiLinearConfig.from_hf,
    model_class=KimiLinearForCausalLM,
    weight_map=KimiLinearForCausalLM.hf_weight_map,
    ignored_tensor=ignored_tensor,
    check_split=sharding.check_split,
    param_spec=sharding.param_spec,
    cache_pools=cache_pools,
    plan_value_shardings=sharding.plan_value_shardings,
    has_recurrent_state=True,
    forward="tokenspeed_jax.models.kimi_linear.forward:LatentForward",
    reference="tokenspeed_jax.hybrid_reference:HybridReferenceGenerator",
    checkpoint_name=checkpoint_name,
)
