"""Tensor-parallel rules of DeepSeek-V3 over ``parallel.AXIS``.

The layers are the shared latent attention (``models/mla.py``) and the shared MoE
(``models/moe.py``), the same modules as Kimi Linear's MLA layers, under the same parameter
names, so the family declares Kimi Linear's parameter rules (``kimi_linear.sharding``): the
attention split by head in its projections (``q_proj``/``q_b_proj``, ``kv_b_proj``, ``o_proj``)
with the low-rank down-projections and norms replicated; the routed experts split over the
experts with the router replicated; the dense MLP and the shared experts column/row parallel. The
latent cache ``[pages, page_size, R + r]`` is one head shared by every query head, so it is
replicated (its pools in ``family.cache_pools`` carry no split). Only the split check is
this family's own, over its config's names.

Invariants: ``check_split`` raises ValueError naming the numbers for a split the config cannot
take (heads, experts, dense and shared-expert widths), before any weight is placed.
"""

from __future__ import annotations

from tokenspeed_jax.models.deepseek_v3.config import DeepseekV3Config


def check_split(config: DeepseekV3Config, size: int) -> None:
    """ValueError naming the numbers when ``config`` cannot be split ``size`` ways."""
    dense = config.first_k_dense_replace > 0
    moe = config.first_k_dense_replace < config.num_hidden_layers
    shared_width = config.moe_intermediate_size * config.n_shared_experts
    for name, count, split in (("num_attention_heads", config.num_attention_heads, True),
                               ("intermediate_size", config.intermediate_size, dense),
                               ("n_routed_experts", config.n_routed_experts, moe),
                               ("moe_intermediate_size * n_shared_experts", shared_width, moe)):
        if split and count % size:
            raise ValueError(f"tensor_parallel_size={size} must divide {name}={count}")
