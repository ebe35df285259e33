"""DeepSeek-V3's declaration (``model_type`` ``deepseek_v3`` and ``kimi_k2``): MLA with RoPE + MoE
from HF directories, served with the latent forward (``kimi_linear/forward.py``: every layer an MLA
layer, no recurrent state) with a paged latent cache.

Invariants: a page holds one latent row ``[page_size, kv_lora_rank + qk_rope_head_dim]`` per
layer; there are no state rows; the checkpoint tensors allowed to go unused are rotary
``inv_freq`` buffers and the multi-token prediction layers' (``weights.is_mtp_tensor``), whose
skipping is logged once when the config is read; the reference generator is the plain one over the
model's own dense latent cache (``model.DenseLatentCache``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenspeed_jax.models.cache_spec import PAGE, CachePool
from tokenspeed_jax.models.deepseek_v3 import sharding
from tokenspeed_jax.models.deepseek_v3.config import MODEL_TYPES, DeepseekV3Config
from tokenspeed_jax.models.deepseek_v3.model import DeepseekV3ForCausalLM
from tokenspeed_jax.models.deepseek_v3.weights import hf_weight_map, is_mtp_tensor
from tokenspeed_jax.models.family import Family
from tokenspeed_jax.models.kimi_linear import sharding as latent_sharding

logger = logging.getLogger(__name__)


def config_from_hf(config: Mapping[str, Any]) -> DeepseekV3Config:
    """``DeepseekV3Config.from_hf``, with a log line when multi-token prediction layers will be
    skipped."""
    built = DeepseekV3Config.from_hf(config)
    if built.num_nextn_predict_layers:
        logger.info("skipping the %d multi-token prediction layer(s) (num_nextn_predict_layers): "
                    "their tensors are not loaded", built.num_nextn_predict_layers)
    return built


def ignored_tensor(name: str, config: DeepseekV3Config) -> bool:
    """Checkpoint tensors that may be present but carry nothing the model needs."""
    return name.endswith("rotary_emb.inv_freq") or is_mtp_tensor(name, config)


def cache_pools(config: DeepseekV3Config, page_size: int, dtype: Any, state_dtype: Any,
                devices: int) -> list[CachePool]:
    """Per layer its latent pages ``[pages, page_size, latent_dim]``, replicated; no state."""
    del state_dtype, devices
    return [CachePool(f"latent.{i}", PAGE, (page_size, config.latent_dim), dtype)
            for i in range(config.num_hidden_layers)]


FAMILY = Family(
    name="deepseek_v3",
    model_types=MODEL_TYPES,
    config_from_hf=config_from_hf,
    model_class=DeepseekV3ForCausalLM,
    weight_map=hf_weight_map,
    ignored_tensor=ignored_tensor,
    check_split=sharding.check_split,
    # the same latent attention and MoE modules as Kimi Linear's MLA layers (``sharding``)
    param_spec=latent_sharding.param_spec,
    cache_pools=cache_pools,
    plan_value_shardings=latent_sharding.plan_value_shardings,
    forward="tokenspeed_jax.models.kimi_linear.forward:LatentForward",
    reference="tokenspeed_jax.reference:ReferenceGenerator",
)
