"""The Llama family's declaration: Llama 3, Qwen2, Qwen3 and SmolLM2, from HF directories and
GGUF files, served with its forward in segments (``forward.py``) over a paged K/V cache.

Invariants: a page holds K and V ``[page_size, Hkv, Dh]`` per layer; the checkpoint tensors
allowed to go unused are rotary ``inv_freq`` buffers and, with tied embeddings, a redundant
``lm_head.weight``.
"""

from __future__ import annotations

from typing import Any

from tokenspeed_jax.models.cache_spec import PAGE, CachePool
from tokenspeed_jax.models.family import Family, GGUFReader
from tokenspeed_jax.models.llama import gguf, sharding
from tokenspeed_jax.models.llama.model import SUPPORTED_MODEL_TYPES, LlamaConfig, LlamaForCausalLM


def ignored_tensor(name: str, config: LlamaConfig) -> bool:
    """Checkpoint tensors that may be present but carry nothing the model needs."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"


def cache_pools(config: LlamaConfig, page_size: int, dtype: Any, state_dtype: Any,
                devices: int) -> list[CachePool]:
    """K and V pages per layer, ``[Hkv, pages, page_size, Dh]`` each (all the K pools, then
    all the V pools), split by KV head over ``devices`` where the heads divide."""
    del state_dtype  # no recurrent state
    unit = (config.num_key_value_heads, page_size, config.head_dim)
    spec = sharding.kv_cache_spec(config, devices)
    return [CachePool(f"{kind}_pages.{i}", PAGE, unit, dtype, count_axis=1, spec=spec)
            for kind in ("k", "v") for i in range(config.num_hidden_layers)]


FAMILY = Family(
    name="llama",
    model_types=SUPPORTED_MODEL_TYPES,
    config_from_hf=LlamaConfig.from_hf,
    model_class=LlamaForCausalLM,
    weight_map=LlamaForCausalLM.hf_weight_map,
    ignored_tensor=ignored_tensor,
    check_split=sharding.check_split,
    param_spec=sharding.param_spec,
    cache_pools=cache_pools,
    plan_value_shardings=sharding.plan_value_shardings,
    forward="tokenspeed_jax.models.llama.forward:LlamaForward",
    reference="tokenspeed_jax.reference:ReferenceGenerator",
    gguf=GGUFReader(config=gguf.config_from_gguf, tensors=gguf.iter_gguf_tensors),
)
