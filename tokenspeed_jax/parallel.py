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

Layout of Kimi Linear (``kimi_param_spec``):

* KDA layers, split by head: ``{q,k,v}_proj [D, H, K]``, ``f_b_proj``/``g_b_proj [K, H, K]``,
  ``dt_bias [H, K]``, ``A_log [H]``, ``b_proj [D, H]``, the depthwise ``{q,k,v}_conv [H K, W]``
  (head-major rows) and ``o_proj [H, K, D]`` (row parallel); the low-rank ``f_a_proj``,
  ``g_a_proj`` and ``o_norm`` are replicated. The state pool ``[P, H, V, K]`` is split by head,
  the conv pool ``[P, W - 1, 3 H K]`` over its channels, which are head-major (``[H, 3, K]``), so
  each device holds its own heads' q, k and v windows.
* MLA layers, split by head: ``q_proj``/``q_b_proj [., H, n + r]``, ``kv_b_proj [R, H, n + v]``,
  ``o_proj [H, v, D]``; ``q_a_proj``, ``kv_a_proj`` and the low-rank norms are replicated. The
  latent cache ``[pages, page_size, R + r]`` is one head shared by every query head, so it is
  *replicated*: each device writes the same rows and reads them for its own heads (no collective
  in attention; the cache costs its full size on each device, as in MLA serving engines).
* MoE, expert parallel: ``w1``/``w3 [E, D, F]`` and ``w2 [E, F, D]`` split over the experts; the
  router (``gate``, ``e_score_correction_bias``) is replicated, so every device makes the same
  routing choice, runs the token-expert pairs of its own experts and one all-reduce sums them
  (``moe.KimiMoE``, under ``jax.shard_map``). Shared experts and the dense MLP are column/row
  parallel like the Llama MLP.

Invariants: ``make_mesh(1)`` is None and nothing is sharded (single-device programs unchanged);
``make_mesh``, ``check_llama`` and ``check_kimi`` raise ValueError naming the values for an
impossible split; ``llama_param_spec`` and ``kimi_param_spec`` know every parameter by name and
refuse an unknown one, so a new parameter cannot silently stay replicated. Pallas kernels cannot
be partitioned by XLA: a stage that calls one runs it per shard through ``jax.shard_map`` over
``AXIS`` with the specs of ``head_spec`` (the KDA kernels, the Pallas paged decode and prefill
attention).
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
    """How many devices the KV cache is split over: each device holds 1/this of it (a Kimi
    Linear latent cache is replicated)."""
    if is_kimi(config):
        return 1
    return size if kv_heads_sharded(config, size) else 1


def attention_value_shardings(config: Any, mesh: Mesh) -> dict[str, NamedSharding]:
    """Shardings of the attention hand-off values: q, attn ``[T, Hq, Dh]`` and k, v
    ``[T, Hkv, Dh]``, split by head like the projections that produce them."""
    heads = NamedSharding(mesh, PartitionSpec(None, AXIS, None))
    kv = heads if kv_heads_sharded(config, mesh.size) else replicated(mesh)
    return {"q": heads, "attn": heads, "k": kv, "v": kv}


def is_kimi(config: Any) -> bool:
    return getattr(config, "model_type", None) == "kimi_linear"


def head_spec(ndim: int, axis: int = 1) -> PartitionSpec:
    """A spec splitting dimension ``axis`` of an ``ndim``-d array over ``AXIS`` (the head axis of
    ``[T, H, ...]`` activations by default)."""
    return PartitionSpec(*(AXIS if i == axis else None for i in range(ndim)))


def check_kimi(config: Any, size: int) -> None:
    """ValueError naming the numbers when a Kimi Linear ``config`` cannot be split ``size`` ways."""
    counts = {"num_attention_heads": config.num_attention_heads,
              "linear_num_heads": config.linear_num_heads}
    if config.first_k_dense_replace:
        counts["intermediate_size"] = config.intermediate_size
    if config.first_k_dense_replace < config.num_hidden_layers:
        counts["num_experts"] = config.num_experts
        counts["moe_intermediate_size * num_shared_experts"] = (
            config.moe_intermediate_size * config.num_shared_experts)
    for name, count in counts.items():
        if count % size:
            raise ValueError(f"tensor_parallel_size={size} must divide {name}={count}")


def check_model(config: Any, size: int) -> None:
    """``check_kimi`` or ``check_llama``, by the model family of ``config``."""
    (check_kimi if is_kimi(config) else check_llama)(config, size)


def kimi_param_spec(name: str, config: Any, size: int) -> PartitionSpec:
    """The partition spec of the Kimi Linear parameter called ``name`` (module docstring)."""
    vocab = config.vocab_size % size == 0
    by_head = PartitionSpec(None, AXIS, None)
    row = PartitionSpec(AXIS, None, None)
    specs = {
        "embed_tokens": PartitionSpec(AXIS, None) if vocab else PartitionSpec(),
        "lm_head": PartitionSpec(None, AXIS) if vocab else PartitionSpec(),
        # KDA (q_proj and o_proj also name the MLA projections, with the same layout)
        **dict.fromkeys(("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj"), by_head),
        **dict.fromkeys(("q_conv", "k_conv", "v_conv", "dt_bias"), PartitionSpec(AXIS, None)),
        "A_log": PartitionSpec(AXIS),
        "b_proj": PartitionSpec(None, AXIS),
        "o_proj": row,
        # MLA
        "q_b_proj": by_head,
        "kv_b_proj": by_head,
        # MoE: experts split, router replicated; dense MLP and shared experts like Llama's
        **dict.fromkeys(("w1", "w2", "w3"), row),
        "gate_proj": PartitionSpec(None, AXIS),
        "up_proj": PartitionSpec(None, AXIS),
        "down_proj": PartitionSpec(AXIS, None),
        **dict.fromkeys(("f_a_proj", "g_a_proj", "o_norm", "q_a_proj", "kv_a_proj", "gate",
                         "e_score_correction_bias", "weight"), PartitionSpec()),
    }
    if name not in specs:
        raise ValueError(f"no tensor-parallel rule for Kimi Linear parameter {name!r}")
    return specs[name]


def param_sharding(path: Sequence[Any], config: Any, mesh: Mesh) -> NamedSharding:
    """The NamedSharding of the parameter at ``path`` of a model of either family."""
    rule = kimi_param_spec if is_kimi(config) else llama_param_spec
    return NamedSharding(mesh, rule(_param_name(path), config, mesh.size))


def place_param(path: Sequence[Any], value: Any, dtype: Any, *, config: Any,
                mesh: Mesh | None) -> jax.Array:
    """A loaded parameter as a device array of ``dtype``: on the default device without a
    mesh, else straight from the host onto its tensor-parallel sharding. A dtype change is
    made on the host: on the device it would compile a conversion per weight shape at every
    start."""
    sharding = None if mesh is None else param_sharding(path, config, mesh)
    return jax.device_put(np.asarray(value).astype(dtype, copy=False), sharding)


def place_model(model: Any, mesh: Mesh) -> None:
    """Move ``model``'s weights onto their shardings in place (a no-op for weights already
    there, e.g. loaded with this mesh)."""
    from flax import nnx

    check_model(model.config, mesh.size)
    state = nnx.state(model)
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, _: param_sharding(path, model.config, mesh), state)
    nnx.update(model, jax.device_put(state, shardings))


def kimi_pool_sharding(name: str, mesh: Mesh) -> NamedSharding:
    """Sharding of a Kimi runner pool: ``state.i [P, H, V, K]`` by head, ``conv.i [P, W - 1,
    3 H K]`` over its head-major channels, ``latent.j`` replicated (module docstring)."""
    kind = name.split(".")[0]
    specs = {"state": head_spec(4), "conv": head_spec(3, axis=2), "latent": PartitionSpec()}
    if kind not in specs:
        raise ValueError(f"no tensor-parallel rule for Kimi pool {name!r}")
    return NamedSharding(mesh, specs[kind])


def kimi_plan_value_shardings(mesh: Mesh, pool_names: Sequence[str]
                              ) -> dict[str, NamedSharding]:
    """Plan value name -> sharding for a Kimi runner's plans: the per-head hand-off values
    (KDA q, k, v, g, gate ``[T, H, K]``, beta ``[T, H]``, o ``[T, H, V]``; MLA q_lat, attn
    ``[T, H, .]``) and every pool in ``pool_names``. The rest (hidden, latent rows) is
    replicated."""
    heads = NamedSharding(mesh, head_spec(3))
    return {**dict.fromkeys(("q", "k", "v", "g", "gate", "o", "q_lat", "attn"), heads),
            "beta": NamedSharding(mesh, head_spec(2)),
            **{name: kimi_pool_sharding(name, mesh) for name in pool_names}}


def plan_value_shardings(config: Any, mesh: Mesh, cache_names: Sequence[str]
                         ) -> dict[str, NamedSharding]:
    """Plan value name -> sharding for a Llama runner's plans: the attention hand-off values and
    every KV cache array in ``cache_names``."""
    return {**attention_value_shardings(config, mesh),
            **dict.fromkeys(cache_names, kv_cache_sharding(config, mesh))}
