"""Tensor parallelism: the device mesh and the sharding rule of every weight and cache array.

One mesh axis, ``"tp"``, over the first ``tensor_parallel_size`` devices; jax's SPMD partitioner
(GSPMD) does the rest: every segment and break is compiled with the shardings named here, and XLA
inserts the collectives (one all-reduce after each row-parallel projection). Layout of a Llama
family model over N devices (Megatron style):

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

Invariants: ``make_mesh(1)`` is None and nothing is sharded (single-device programs unchanged);
``make_mesh`` and ``check_llama`` raise ValueError naming the values for an impossible split;
``llama_param_spec`` knows every Llama parameter by name and refuses an unknown one, so a new
parameter cannot silently stay replicated. Pallas kernels cannot be partitioned by XLA: a stage
that calls one must run it per shard through ``jax.shard_map`` over ``AXIS`` (the Llama family's
attention is plain JAX and is partitioned by XLA).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "tp"


def make_mesh(tensor_parallel_size: int, devices: Sequence[Any] | None = None) -> Mesh | None:
    """A one-axis mesh over the first ``tensor_parallel_size`` devices; None for size 1."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} exceeds the {len(devices)} "
            f"{devices[0].platform} device(s) jax sees (on the CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count=N before jax is imported)")
    if tensor_parallel_size == 1:
        return None
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.size


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def kv_heads_sharded(config: Any, size: int) -> bool:
    """Whether the KV heads are split over ``size`` devices (else replicated; module docstring)."""
    return config.num_key_value_heads % size == 0


def check_llama(config: Any, size: int) -> None:
    """ValueError naming the numbers when a Llama-family ``config`` cannot be split ``size`` ways."""
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


def llama_param_spec(name: str, config: Any, size: int) -> PartitionSpec:
    """The partition spec of the Llama parameter called ``name`` (its last path component)."""
    heads = PartitionSpec(None, AXIS, None)
    kv = heads if kv_heads_sharded(config, size) else PartitionSpec()
    vocab = config.vocab_size % size == 0
    specs = {
        "embed_tokens": PartitionSpec(AXIS, None) if vocab else PartitionSpec(),
        "lm_head": PartitionSpec(None, AXIS) if vocab else PartitionSpec(),
        "q_proj": heads,
        "k_proj": kv,
        "v_proj": kv,
        "q_bias": PartitionSpec(AXIS, None),
        "k_bias": PartitionSpec(AXIS, None) if kv_heads_sharded(config, size)
        else PartitionSpec(),
        "o_proj": PartitionSpec(AXIS, None, None),
        "gate_proj": PartitionSpec(None, AXIS),
        "up_proj": PartitionSpec(None, AXIS),
        "down_proj": PartitionSpec(AXIS, None),
        "weight": PartitionSpec(),  # RMSNorm scales
    }
    specs["v_bias"] = specs["k_bias"]
    if name not in specs:
        raise ValueError(f"no tensor-parallel rule for Llama parameter {name!r}")
    return specs[name]


def _param_name(path: Sequence[Any]) -> str:
    """The last string key of a state path (``('layers', 0, 'q_proj', 'value')`` -> q_proj)."""
    keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
    names = [k for k in keys if isinstance(k, str) and k != "value"]
    if not names:
        raise ValueError(f"state path {path} names no parameter")
    return names[-1]


def llama_param_sharding(path: Sequence[Any], config: Any, mesh: Mesh) -> NamedSharding:
    """The NamedSharding of the parameter at ``path`` (a loader path or a state tree path)."""
    return NamedSharding(mesh, llama_param_spec(_param_name(path), config, mesh.size))


def llama_state_shardings(state: Any, config: Any, mesh: Mesh) -> Any:
    """A tree like ``state`` (an NNX state of the model or of one layer) of NamedShardings."""
    check_llama(config, mesh.size)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: llama_param_sharding(path, config, mesh), state)


def kv_cache_sharding(config: Any, mesh: Mesh) -> NamedSharding:
    """Sharding of one layer's ``[Hkv, num_pages, page_size, Dh]`` K or V pages."""
    if kv_heads_sharded(config, mesh.size):
        return NamedSharding(mesh, PartitionSpec(AXIS, None, None, None))
    return replicated(mesh)


def kv_cache_shards(config: Any, size: int) -> int:
    """How many devices the KV cache is split over: each device holds 1/this of it."""
    return size if kv_heads_sharded(config, size) else 1


def attention_value_shardings(config: Any, mesh: Mesh) -> dict[str, NamedSharding]:
    """Shardings of the attention hand-off values: q, attn ``[T, Hq, Dh]`` and k, v
    ``[T, Hkv, Dh]``, split by head like the projections that produce them."""
    heads = NamedSharding(mesh, PartitionSpec(None, AXIS, None))
    kv = heads if kv_heads_sharded(config, mesh.size) else replicated(mesh)
    return {"q": heads, "attn": heads, "k": kv, "v": kv}


def place_model(model: Any, mesh: Mesh) -> None:
    """Move ``model``'s weights onto their shardings in place (a no-op for weights already
    there, e.g. loaded with this mesh). Only the Llama family has rules so far."""
    from flax import nnx

    from tokenspeed_jax.models.llama import LlamaConfig

    if not isinstance(model.config, LlamaConfig):
        raise TypeError(f"tensor_parallel_size={mesh.size}: tensor parallelism supports the "
                         f"Llama family; {type(model.config).__name__} has no sharding rules yet")
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, llama_state_shardings(state, model.config, mesh)))


def plan_value_shardings(config: Any, mesh: Mesh, cache_names: Sequence[str]
                         ) -> dict[str, NamedSharding]:
    """Plan value name -> sharding for a Llama runner's plans: the attention hand-off values and
    every KV cache array in ``cache_names``."""
    return {**attention_value_shardings(config, mesh),
            **dict.fromkeys(cache_names, kv_cache_sharding(config, mesh))}
