"""Tensor-parallel rules of the Llama family (Megatron style) over ``parallel.AXIS``.

Layout over N devices:

* ``q_proj [D, Hq, Dh]``, ``k_proj``/``v_proj [D, Hkv, Dh]`` and their biases: column parallel,
  split by head; ``o_proj [Hq, Dh, D]``: row parallel, split by head.
* ``gate_proj``/``up_proj [D, F]``: column parallel over F; ``down_proj [F, D]``: row parallel.
* ``embed_tokens [V, D]`` and ``lm_head [D, V]``: split over the vocabulary when N divides V,
  else replicated. Norm weights: replicated.
* The paged KV cache ``[Hkv, num_pages, page_size, Dh]`` (the layout of ``kernels/attention.py``)
  and the attention activations q, k, v, attn ``[T, H, Dh]``: split by head, like the projections
  that produce them.

**KV heads fewer than N** (GQA with N > Hkv, e.g. 2 KV heads on 4 devices): K/V projections and
the KV cache are *replicated*: every device holds all KV heads and writes them (the K/V
projection is computed N times, the cache costs Hkv heads per device instead of Hkv/N). This is
the choice vLLM makes (it replicates KV heads up to N); it needs N to be a multiple of Hkv so
that each device's query heads read whole KV heads. Any other split is a ValueError.

Invariants: ``check_split`` raises ValueError naming the numbers for an impossible split;
``param_spec`` knows every parameter by name and refuses an unknown one, so a new parameter
cannot silently stay replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tokenspeed_jax.parallel import AXIS, SWIGLU_SPECS, replicated, vocab_specs


def kv_heads_sharded(config: Any, size: int) -> bool:
    """Whether the KV heads are split over ``size`` devices (else replicated; module docstring)."""
    return config.num_key_value_heads % size == 0


def check_split(config: Any, size: int) -> None:
    """ValueError naming the numbers when ``config`` cannot be split ``size`` ways."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} must divide num_key_value_heads={kv_heads} (KV heads "
            f"split) or be a multiple of it (KV heads replicated)")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} must divide "
                         f"intermediate_size={config.intermediate_size}")


def param_spec(name: str, config: Any, size: int) -> PartitionSpec:
    """The partition spec of the parameter called ``name`` (its last path component)."""
    heads = PartitionSpec(None, AXIS, None)
    kv = heads if kv_heads_sharded(config, size) else PartitionSpec()
    kv_bias = PartitionSpec(AXIS, None) if kv_heads_sharded(config, size) else PartitionSpec()
    specs = {
        **vocab_specs(config.vocab_size, size),
        "q_proj": heads,
        "k_proj": kv,
        "v_proj": kv,
        "q_bias": PartitionSpec(AXIS, None),
        "k_bias": kv_bias,
        "v_bias": kv_bias,
        "o_proj": PartitionSpec(AXIS, None, None),
        **SWIGLU_SPECS,
        "weight": PartitionSpec(),  # RMSNorm scales
    }
    if name not in specs:
        raise ValueError(f"no tensor-parallel rule for Llama parameter {name!r}")
    return specs[name]


def kv_cache_spec(config: Any, size: int) -> PartitionSpec:
    """The split of one layer's ``[Hkv, num_pages, page_size, Dh]`` K or V pages over ``size``
    devices: by KV head where the heads divide, else replicated."""
    return PartitionSpec(AXIS, None, None, None) if kv_heads_sharded(config, size) else (
        PartitionSpec())


def kv_cache_sharding(config: Any, mesh: Mesh) -> NamedSharding:
    """Sharding of one layer's K or V pages (``kv_cache_spec``)."""
    return NamedSharding(mesh, kv_cache_spec(config, mesh.size))


def attention_value_shardings(config: Any, mesh: Mesh) -> dict[str, NamedSharding]:
    """Shardings of the attention hand-off values: q, attn ``[T, Hq, Dh]`` and k, v
    ``[T, Hkv, Dh]``, split by head like the projections that produce them."""
    heads = NamedSharding(mesh, PartitionSpec(None, AXIS, None))
    kv = heads if kv_heads_sharded(config, mesh.size) else replicated(mesh)
    return {"q": heads, "attn": heads, "k": kv, "v": kv}


def plan_value_shardings(config: Any, mesh: Mesh, cache_names: Sequence[str]
                         ) -> dict[str, NamedSharding]:
    """Plan value name -> sharding for the runner's plans: the attention hand-off values and
    every KV cache array in ``cache_names``."""
    return {**attention_value_shardings(config, mesh),
            **dict.fromkeys(cache_names, kv_cache_sharding(config, mesh))}
