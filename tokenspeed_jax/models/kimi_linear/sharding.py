"""Tensor-parallel rules of Kimi Linear over ``parallel.AXIS``.

* KDA layers, split by head: ``{q,k,v}_proj [D, H, K]``, ``f_b_proj``/``g_b_proj [K, H, K]``,
  ``dt_bias [H, K]``, ``A_log [H]``, the depthwise ``{q,k,v}_conv [H K, W]`` (head-major rows)
  and ``o_proj [H, K, D]`` (row parallel); ``low_proj [D, 2 K + H]`` (the low-rank ``f_a`` and
  ``g_a`` and the H columns of ``b`` side by side: every device computes every head's beta
  logits, a few columns) and ``o_norm`` are replicated. The state pool ``[P, H, V, K]`` is split
  by head, the conv pool ``[P, W - 1, 3 H K]`` over its channels, which are head-major (``[H,
  3, K]``), so each device holds its own heads' q, k and v windows.
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

Invariants: ``check_split`` raises ValueError naming the numbers for an impossible split;
``param_spec`` knows every parameter by name and refuses an unknown one, so a new parameter
cannot silently stay replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tokenspeed_jax.parallel import AXIS, SWIGLU_SPECS, head_spec, vocab_specs


def check_split(config: Any, size: int) -> None:
    """ValueError naming the numbers when ``config`` cannot be split ``size`` ways."""
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


def param_spec(name: str, config: Any, size: int) -> PartitionSpec:
    """The partition spec of the parameter called ``name`` (module docstring)."""
    by_head = PartitionSpec(None, AXIS, None)
    row = PartitionSpec(AXIS, None, None)
    specs = {
        **vocab_specs(config.vocab_size, size),
        # KDA (q_proj and o_proj also name the MLA projections, with the same layout)
        **dict.fromkeys(("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj"), by_head),
        **dict.fromkeys(("q_conv", "k_conv", "v_conv", "dt_bias"), PartitionSpec(AXIS, None)),
        "A_log": PartitionSpec(AXIS),
        "o_proj": row,
        # MLA
        "q_b_proj": by_head,
        "kv_b_proj": by_head,
        # MoE: experts split, router replicated; dense MLP and shared experts like Llama's
        **dict.fromkeys(("w1", "w2", "w3"), row),
        **SWIGLU_SPECS,
        **dict.fromkeys(("low_proj", "o_norm", "q_a_proj", "kv_a_proj", "gate",
                         "e_score_correction_bias", "weight"), PartitionSpec()),
    }
    if name not in specs:
        raise ValueError(f"no tensor-parallel rule for Kimi Linear parameter {name!r}")
    return specs[name]


def pool_spec(name: str) -> PartitionSpec:
    """The split of a runner pool: ``state.i [P, H, V, K]`` by head, ``conv.i [P, W - 1,
    3 H K]`` over its head-major channels, ``latent.j`` replicated (module docstring)."""
    kind = name.split(".")[0]
    specs = {"state": head_spec(4), "conv": head_spec(3, axis=2), "latent": PartitionSpec()}
    if kind not in specs:
        raise ValueError(f"no tensor-parallel rule for Kimi pool {name!r}")
    return specs[kind]


def pool_sharding(name: str, mesh: Mesh) -> NamedSharding:
    """Sharding of a runner pool on ``mesh`` (``pool_spec``)."""
    return NamedSharding(mesh, pool_spec(name))


def plan_value_shardings(config: Any, mesh: Mesh, pool_names: Sequence[str]
                         ) -> dict[str, NamedSharding]:
    """Plan value name -> sharding for the runner's plans: the per-head hand-off values (KDA q,
    k, v, g, gate ``[T, H, K]``, beta ``[T, H]``, o ``[T, H, V]``; MLA q_lat, attn
    ``[T, H, .]``) and every pool in ``pool_names``. The rest (hidden, latent rows) is
    replicated. ``config`` is not read: every family's rule takes it (``Family``)."""
    del config
    heads = NamedSharding(mesh, head_spec(3))
    return {**dict.fromkeys(("q", "k", "v", "g", "gate", "o", "q_lat", "attn"), heads),
            "beta": NamedSharding(mesh, head_spec(2)),
            **{name: pool_sharding(name, mesh) for name in pool_names}}
