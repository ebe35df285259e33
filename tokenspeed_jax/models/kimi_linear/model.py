"""Kimi-Linear (KDA + MLA + MoE hybrid) as Flax NNX modules, loaded from its own checkpoints.

Layers are either KDA (linear attention with a recurrent state, ``kimi_linear.layers``) or MLA
(latent attention over a KV cache, ``mla``); the feed-forward is a dense SwiGLU for the first
``first_k_dense_replace`` layers and a sigmoid-routed MoE with shared experts after (``moe``).

Stage interface (packed tokens ``[T, ...]``, what the runner's plans call):

* ``embed(token_ids)`` / ``head(hidden)``;
* KDA layer: ``layer.kda_inputs`` -> ``kda_core`` -> ``layer.kda_outputs``, or ``layer.kda_block``
  for all three (``hidden, conv pool, state pool`` in and out, metadata ``KdaMeta``);
* MLA layer: ``layer.mla_inputs(hidden, positions) -> (q, latent)`` (NoPE: the positions are
  unused), attention over the latent cache by the caller, ``layer.mla_outputs(hidden, attn) ->
  hidden``.

``KimiLinearForCausalLM.__call__`` is the plain reference forward over a dense cache
(``KimiCache``), built from the same stage methods, with the pure-JAX KDA reference by default.

Invariants:

* The config is read from the checkpoint's config.json: ``linear_attn_config`` lists 1-indexed
  ``kda_layers`` and ``full_attn_layers`` that must partition the layers; MLA must be NoPE
  (``mla_use_nope: true``, or the key absent as in configs transformers writes, whose
  implementation has only that form) with as many KV heads as heads.
* The config.json may also be the one transformers' ``KimiLinearConfig`` writes (``layer_types``,
  ``linear_*`` and ``mlp_layer_types`` instead of ``linear_attn_config`` and
  ``first_k_dense_replace``), and its weights name a dense layer's MLP ``block_sparse_moe.``:
  ``checkpoint_name`` renames that to the checkpoint's ``mlp.`` before anything else reads it.
* ``hf_weight_map`` is the one place that converts checkpoint names and ``[out, in]`` layouts;
  per-expert tensors (``block_sparse_moe.experts.<e>.w{1,2,3}``) are stacked into ``[E, ...]``.
  The loader checks both directions (unused tensor, unfilled parameter) as for every family.
* Router weights, the correction bias, ``A_log`` and ``dt_bias`` stay float32 whatever the
  weight dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tokenspeed_jax.kernels.attention_ref import cache_causal_mask, masked_attention
from tokenspeed_jax.models import hf_checkpoint
from tokenspeed_jax.models.kimi_linear.layers import (
    KdaImpl,
    KdaMeta,
    KimiDeltaAttention,
)
from tokenspeed_jax.models.layers import CausalLMBase, RMSNorm
from tokenspeed_jax.models.mla import (
    MLAModelShape,
    MultiLatentAttention,
    latent_attention,
    mla_weight_entries,
)
from tokenspeed_jax.models.moe import KimiMoE, SwiGLU

MODEL_TYPE = "kimi_linear"
KDA, MLA = "kda", "mla"
NO_POSITION_LIMIT = 2**31 - 1  # positions are int32


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig(MLAModelShape):
    """Architecture hyper-parameters, as read from a Kimi-Linear config.json."""

    layer_types: tuple[str, ...]
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel_size: int = 4
    first_k_dense_replace: int = 1
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    model_type: str = MODEL_TYPE

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                KDA, MLA}:
            raise ValueError(f"layer_types={self.layer_types} must give 'kda' or 'mla' for each "
                             f"of num_hidden_layers={self.num_hidden_layers} layers")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in "
                             f"[0, {self.num_hidden_layers}]")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MLA)

    @property
    def max_position_embeddings(self) -> int:
        """No position table (NoPE MLA, KDA): the model itself sets no context limit."""
        return NO_POSITION_LIMIT

    @property
    def latent_dim(self) -> int:
        """Width of one MLA cache row: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> KimiLinearConfig:
        """Build from a checkpoint config.json dict (see the module invariants)."""
        if config.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type={config.get('model_type')!r} is not {MODEL_TYPE!r}")
        layers = int(config["num_hidden_layers"])
        types, linear = _layer_kinds(config, layers)
        use_nope = config.get("mla_use_nope", True)  # absent: transformers' NoPE-only form
        if MLA in types and use_nope is not True:
            raise ValueError(f"mla_use_nope={use_nope!r} is not supported: only NoPE MLA is "
                             "(mla_use_nope true or absent), rotary MLA is not")
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if kv_heads != heads:
            raise ValueError(f"MLA needs num_key_value_heads={kv_heads} == "
                             f"num_attention_heads={heads}")
        activation = config.get("moe_router_activation_func", "sigmoid")
        if activation != "sigmoid":
            raise ValueError(f"moe_router_activation_func={activation!r} is not supported")
        if int(config.get("moe_layer_freq", 1)) != 1:
            raise ValueError(f"moe_layer_freq={config['moe_layer_freq']} is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported")
        return cls(
            **MLAModelShape.fields_from_hf(config),
            layer_types=types,
            linear_num_heads=int(linear.get("num_heads", heads)),
            linear_head_dim=int(linear["head_dim"]),
            conv_kernel_size=int(linear.get("short_conv_kernel_size", 4)),
            first_k_dense_replace=_dense_layers(config),
            num_experts=int(config["num_experts"]),
            num_experts_per_token=int(config["num_experts_per_token"]),
            num_shared_experts=int(config.get("num_shared_experts", 1)),
            num_expert_group=int(config.get("num_expert_group", 1)),
            topk_group=int(config.get("topk_group", 1)),
            moe_renormalize=bool(config.get("moe_renormalize", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A checkpoint-format config.json dict that ``from_hf`` reads back to an equal config."""
        out = dataclasses.asdict(self)
        for key in ("layer_types", "linear_num_heads", "linear_head_dim", "conv_kernel_size"):
            del out[key]
        out.update(
            num_key_value_heads=self.num_attention_heads, mla_use_nope=True,
            linear_attn_config={
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "num_heads": self.linear_num_heads, "head_dim": self.linear_head_dim,
                "short_conv_kernel_size": self.conv_kernel_size})
        return out


# transformers' names for the layer kinds in ``layer_types`` and ``mlp_layer_types``
HF_LAYER_KINDS = {"linear_attention": KDA, "full_attention": MLA}
HF_DENSE, HF_SPARSE = "dense", "sparse"


def _layer_kinds(config: Mapping[str, Any], layers: int) -> tuple[tuple[str, ...], dict]:
    """Each layer's token mixer and the KDA shape (``linear_attn_config``'s keys), from either
    form of config.json: the checkpoint's own ``linear_attn_config`` (1-indexed ``kda_layers``
    and ``full_attn_layers``), or, when it is absent, the ``layer_types`` and ``linear_*`` keys
    that transformers' ``KimiLinearConfig`` writes."""
    linear = config.get("linear_attn_config")
    if linear is None and "layer_types" in config:
        names = list(config["layer_types"])
        if len(names) != layers or not set(names) <= set(HF_LAYER_KINDS):
            raise ValueError(f"layer_types={names} must give one of {sorted(HF_LAYER_KINDS)} "
                             f"for each of num_hidden_layers={layers} layers")
        kinds = tuple(HF_LAYER_KINDS[name] for name in names)
        return kinds, {"num_heads": config["linear_num_heads"],
                       "head_dim": config["linear_head_dim"],
                       "short_conv_kernel_size": config.get("linear_conv_kernel_dim", 4)}
    linear = linear or {}
    kda_layers = [int(i) for i in linear.get("kda_layers", ())]
    full_layers = [int(i) for i in linear.get("full_attn_layers", ())]
    if sorted(kda_layers + full_layers) != list(range(1, layers + 1)):
        raise ValueError(
            f"linear_attn_config kda_layers={kda_layers} and full_attn_layers={full_layers} "
            f"must partition the 1-indexed layers 1..{layers}")
    return tuple(MLA if i in full_layers else KDA for i in range(1, layers + 1)), linear


def _dense_layers(config: Mapping[str, Any]) -> int:
    """How many leading layers have a dense MLP: ``first_k_dense_replace``, or the leading
    ``dense`` entries of transformers' ``mlp_layer_types`` (every later one ``sparse``)."""
    if "first_k_dense_replace" in config or "mlp_layer_types" not in config:
        return int(config.get("first_k_dense_replace", 1))
    kinds = list(config["mlp_layer_types"])
    dense = next((i for i, kind in enumerate(kinds) if kind != HF_DENSE), len(kinds))
    if any(kind != HF_SPARSE for kind in kinds[dense:]):
        raise ValueError(f"mlp_layer_types={kinds} is not supported: dense layers, then only "
                         "sparse ones")
    return dense


class KimiDecoderLayer(nnx.Module):
    """One pre-norm layer: a KDA or MLA token mixer, then a dense or MoE feed-forward."""

    def __init__(self, config: KimiLinearConfig, index: int, *, dtype: Any, param_dtype: Any,
                 rngs: nnx.Rngs) -> None:
        d = config.hidden_size
        kw = {"dtype": dtype, "param_dtype": param_dtype}
        self.kind = config.layer_types[index]
        self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps, **kw)
        if self.kind == KDA:
            self.self_attn = KimiDeltaAttention(
                d, num_heads=config.linear_num_heads, head_dim=config.linear_head_dim,
                conv_size=config.conv_kernel_size, norm_eps=config.rms_norm_eps, rngs=rngs, **kw)
        else:
            self.self_attn = MultiLatentAttention.from_config(config, rngs=rngs, **kw)
        if index < config.first_k_dense_replace:
            self.mlp = SwiGLU(d, config.intermediate_size, rngs=rngs, **kw)
        else:
            self.mlp = KimiMoE(
                d, config.moe_intermediate_size, num_experts=config.num_experts,
                top_k=config.num_experts_per_token, num_groups=config.num_expert_group,
                topk_groups=config.topk_group, num_shared=config.num_shared_experts,
                renormalize=config.moe_renormalize, scaling=config.routed_scaling_factor,
                rngs=rngs, **kw)
        self.dtype = dtype

    def _feed_forward(self, hidden: jax.Array, mixed: jax.Array, mesh: Mesh | None,
                      live: jax.Array | None) -> jax.Array:
        hidden = hidden.astype(self.dtype) + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden), mesh=mesh, live=live)

    def kda_inputs(self, hidden: jax.Array, conv_pool: jax.Array, meta: KdaMeta, *,
                   decode: bool = False) -> tuple:
        """hidden [T, D] -> (q, k, v, g, beta, gate, conv pool); see ``KimiDeltaAttention``."""
        return self.self_attn.inputs(self.input_layernorm(hidden), conv_pool, meta,
                                     decode=decode)

    def kda_outputs(self, hidden: jax.Array, o: jax.Array, gate: jax.Array, *,
                    mesh: Mesh | None = None, live: jax.Array | None = None) -> jax.Array:
        """The layer's input residual, KDA output and gate -> the layer's output [T, D];
        ``live`` [T]: the real tokens (``moe.KimiMoE``)."""
        return self._feed_forward(hidden, self.self_attn.outputs(o, gate), mesh, live)

    def kda_block(self, hidden: jax.Array, conv_pool: jax.Array, state_pool: jax.Array,
                  meta: KdaMeta, *, impl: KdaImpl, decode: bool = False,
                  mesh: Mesh | None = None, live: jax.Array | None = None) -> tuple:
        """The whole KDA layer: (hidden, conv pool, state pool). ``mesh``: the weights are split
        over it (``parallel``); the Pallas kernels and the experts run per shard. ``live``
        [T]: the real tokens (``moe.KimiMoE``). A decode step may take the mixer's fused
        kernel (``KimiDeltaAttention.fuses_decode``)."""
        mixed, conv_pool, state_pool = self.self_attn(
            self.input_layernorm(hidden), conv_pool, state_pool, meta, impl=impl, decode=decode,
            mesh=mesh)
        return self._feed_forward(hidden, mixed, mesh, live), conv_pool, state_pool

    def mla_inputs(self, hidden: jax.Array, positions: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
        """hidden [..., D] -> (absorbed query [..., H, R + r], latent row [..., R + r]).
        ``positions`` is ignored: the attention is NoPE."""
        del positions
        return self.self_attn.inputs(self.input_layernorm(hidden))

    def mla_outputs(self, hidden: jax.Array, attn: jax.Array, *, mesh: Mesh | None = None,
                    live: jax.Array | None = None) -> jax.Array:
        """The layer's input residual and latent attention [..., H, R] -> output [..., D];
        ``live`` [...]: the real tokens (``moe.KimiMoE``)."""
        return self._feed_forward(hidden, self.self_attn.outputs(attn), mesh, live)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KimiCache:
    """Dense per-request caches of the plain forward: row b of each array is request b.

    ``latent``: one [B, S, R + r] array per MLA layer (slot p holds position p); ``conv``:
    [B, W - 1, 3 H K] and ``state``: [B, H, V, K] float32 per KDA layer (each state
    transposed, as in the kernels' pools).
    """

    latent: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]
    state: tuple[jax.Array, ...]

    @classmethod
    def create(cls, config: KimiLinearConfig, batch: int, max_len: int, dtype: Any) -> KimiCache:
        k = config.linear_head_dim
        conv = (batch, config.conv_kernel_size - 1, 3 * config.linear_num_heads * k)
        state = (batch, config.linear_num_heads, k, k)
        return cls(
            latent=tuple(jnp.zeros((batch, max_len, config.latent_dim), dtype)
                         for _ in config.mla_layers),
            conv=tuple(jnp.zeros(conv, dtype) for _ in config.kda_layers),
            state=tuple(jnp.zeros(state, jnp.float32) for _ in config.kda_layers),
        )


class KimiLinearForCausalLM(CausalLMBase):
    """Kimi-Linear causal LM; see the module docstring for the stage interface."""

    def __init__(self, config: KimiLinearConfig, *, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.config = config
        self.dtype = dtype
        self.attention_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        self.init_embedding(param_dtype, rngs)
        self.layers = nnx.List([
            KimiDecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            for i in range(config.num_hidden_layers)
        ])
        self.init_head(param_dtype, rngs)

    def __call__(self, token_ids: jax.Array, positions: jax.Array, cache: KimiCache, *,
                 kda_impl: KdaImpl = "reference") -> tuple[jax.Array, KimiCache]:
        """token_ids, positions int32 [B, T] (every token real, each row's positions contiguous
        from its cached length) -> (float32 logits [B, T, V], updated cache)."""
        batch, length = token_ids.shape
        meta = KdaMeta.dense(batch, length)
        latent, conv, state = list(cache.latent), list(cache.conv), list(cache.state)
        mask = cache_causal_mask(positions, latent[0].shape[1]) if latent else None
        rows = jnp.arange(batch)[:, None]
        hidden = self.embed(token_ids)
        kda_index = mla_index = 0
        for layer in self.layers:
            if layer.kind == KDA:
                i = kda_index
                packed, conv[i], state[i] = layer.kda_block(
                    hidden.reshape(batch * length, -1), conv[i], state[i], meta, impl=kda_impl,
                    decode=length == 1)
                hidden = packed.reshape(batch, length, -1)
                kda_index += 1
            else:
                j = mla_index
                q, row = layer.mla_inputs(hidden)
                latent[j] = latent[j].at[rows, positions].set(row.astype(latent[j].dtype))
                attn = latent_attention(masked_attention, q, latent[j],
                                        self.config.kv_lora_rank, mask,
                                        scale=self.attention_scale)
                hidden = layer.mla_outputs(hidden, attn)
                mla_index += 1
        return self.head(hidden), KimiCache(tuple(latent), tuple(conv), tuple(state))

    @staticmethod
    def hf_weight_map(config: KimiLinearConfig) -> dict[str, KimiWeight]:
        """Checkpoint tensor name -> where it goes in the NNX state and how its layout changes."""
        return kimi_weight_map(config)


KimiWeight = hf_checkpoint.WeightEntry


def _t(w: np.ndarray) -> np.ndarray:
    return np.transpose(w)


def _same(w: np.ndarray) -> np.ndarray:
    return w


def kimi_weight_map(config: KimiLinearConfig) -> dict[str, KimiWeight]:
    """See ``KimiLinearForCausalLM.hf_weight_map``."""
    d, vocab = config.hidden_size, config.vocab_size
    h, k, width = config.linear_num_heads, config.linear_head_dim, config.conv_kernel_size

    def heads_in(n: int, dh: int, inner: int):  # [n*dh, inner] -> [inner, n, dh]
        return lambda w: w.reshape(n, dh, inner).transpose(2, 0, 1)

    def heads_out(n: int, dh: int):  # [D, n*dh] -> [n, dh, D]
        return lambda w: w.reshape(d, n, dh).transpose(1, 2, 0)

    mapping = {
        "model.embed_tokens.weight": KimiWeight(("embed_tokens",), (vocab, d), _same),
        "model.norm.weight": KimiWeight(("norm", "weight"), (d,), _same),
    }
    if not config.tie_word_embeddings:
        mapping["lm_head.weight"] = KimiWeight(("lm_head",), (vocab, d), _t)
    for i, kind in enumerate(config.layer_types):
        hf, path = f"model.layers.{i}.", ("layers", i)
        attn, at = hf + "self_attn.", path + ("self_attn",)
        entries = {
            hf + "input_layernorm.weight": (path + ("input_layernorm", "weight"), (d,), _same),
            hf + "post_attention_layernorm.weight": (
                path + ("post_attention_layernorm", "weight"), (d,), _same),
        }
        if kind == KDA:
            for name in "qkv":
                entries[attn + f"{name}_proj.weight"] = (at + (f"{name}_proj",), (h * k, d),
                                                         heads_in(h, k, d))
                entries[attn + f"{name}_conv1d.weight"] = (
                    at + (f"{name}_conv",), (h * k, 1, width), lambda w: w[:, 0, :])
            entries.update({
                # f_a, g_a and b side by side in one parameter (``layers`` invariants)
                attn + "f_a_proj.weight": (at + ("low_proj",), (k, d), _t, np.s_[:, :k]),
                attn + "g_a_proj.weight": (at + ("low_proj",), (k, d), _t, np.s_[:, k:2 * k]),
                attn + "b_proj.weight": (at + ("low_proj",), (h, d), _t, np.s_[:, 2 * k:]),
                attn + "f_b_proj.weight": (at + ("f_b_proj",), (h * k, k), heads_in(h, k, k)),
                attn + "dt_bias": (at + ("dt_bias",), (h * k,), lambda w: w.reshape(h, k)),
                attn + "A_log": (at + ("A_log",), (1, 1, h, 1), lambda w: w.reshape(h)),
                attn + "g_b_proj.weight": (at + ("g_b_proj",), (h * k, k), heads_in(h, k, k)),
                attn + "o_norm.weight": (at + ("o_norm",), (k,), _same),
                attn + "o_proj.weight": (at + ("o_proj",), (d, h * k), heads_out(h, k)),
            })
        else:
            entries.update(mla_weight_entries(attn, at, config))
        if i < config.first_k_dense_replace:
            f, mlp, mp = config.intermediate_size, hf + "mlp.", path + ("mlp",)
        else:
            f, mlp, mp = config.moe_intermediate_size, hf + "block_sparse_moe.", path + ("mlp",)
            experts = config.num_experts
            entries.update({
                mlp + "gate.weight": (mp + ("gate",), (experts, d), _t),
                mlp + "gate.e_score_correction_bias": (mp + ("e_score_correction_bias",),
                                                       (experts,), _same),
            })
            for e in range(experts):
                for name, shape in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
                    mapping[mlp + f"experts.{e}.{name}.weight"] = KimiWeight(
                        mp + (name,), shape, _t, e)
            f, mlp, mp = f * config.num_shared_experts, mlp + "shared_experts.", mp + (
                "shared_experts",)
        entries.update({
            mlp + "gate_proj.weight": (mp + ("gate_proj",), (f, d), _t),
            mlp + "up_proj.weight": (mp + ("up_proj",), (f, d), _t),
            mlp + "down_proj.weight": (mp + ("down_proj",), (d, f), _t),
        })
        mapping.update({name: KimiWeight(*entry) for name, entry in entries.items()})
    return mapping


_HF_DENSE_MLP = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.((gate|up|down)_proj\.weight)")


def checkpoint_name(name: str, config: KimiLinearConfig) -> str:
    """``name`` as the checkpoint's own format spells it. transformers writes a dense layer's MLP
    under ``block_sparse_moe.`` (its save undoes its load's renaming of every ``block_sparse_moe.``
    to ``mlp.``), where the checkpoint has ``mlp.``; every other name is the same in both."""
    match = _HF_DENSE_MLP.fullmatch(name)
    if match and int(match[1]) < config.first_k_dense_replace:
        return f"model.layers.{match[1]}.mlp.{match[2]}"
    return name
