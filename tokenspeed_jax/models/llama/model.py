"""Dense GQA decoder family (Llama 3, Qwen3, Qwen2, SmolLM2) as Flax NNX modules.

The forward is exposed as stages so the segmented-compile engine can run attention outside the
model: ``embed`` -> per layer ``attention_inputs`` / (attention) / ``attention_outputs`` ->
``head``; a kernel that rotates q and k itself takes ``unrotated_attention_inputs`` and the
layer-independent ``rotary_tables`` instead. ``LlamaForCausalLM.__call__`` is the plain
reference forward over a dense KV cache and is built from the same stage methods, so there is
one copy of the layer math.

Invariants:

* Stage methods take any leading token dims (``[T, ...]`` or ``[B, T, ...]``).
* RoPE uses HF's rotate-half layout: feature ``i`` pairs with ``i + Dh/2``.
* Weight layouts are written in the einsums: ``q_proj [D, Hq, Dh]``, ``o_proj [Hq, Dh, D]``,
  ``gate/up [D, F]``, ``down [F, D]``, ``embed_tokens [V, D]``, ``lm_head [D, V]``.
  ``hf_weight_map`` is the one place that converts HF names and ``[out, in]`` layouts to these.
* ``dtype`` is the compute dtype, ``param_dtype`` the stored weight dtype; norms, RoPE, softmax
  and logits are computed in float32; a float32 compute dtype means full float32 matmuls.
* Dense cache: a token at position p writes slot p of its row; a query at position p reads slots
  0..p; a position < 0 marks a padding token that writes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.kernels.attention_ref import cache_causal_mask, masked_attention
from tokenspeed_jax.kernels.rotary import rotary_tables, rotate
from tokenspeed_jax.models.hf_checkpoint import WeightEntry
from tokenspeed_jax.models.layers import CausalLMBase, RMSNorm, linear, normal_param

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

Transform = Callable[[np.ndarray], np.ndarray]


HFWeight = WeightEntry  # where one HF tensor goes: state path, HF shape, layout change


def _identity(x: np.ndarray) -> np.ndarray:
    return x


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters, as read from an HF config.json or GGUF metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type={self.model_type!r}; expected one of "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """Build from an HF config.json dict (old ``rope_scaling`` or new ``rope_parameters``)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type={model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if model_type == "llama" and config.get("attention_bias"):
            raise ValueError("llama attention_bias=True (bias on o_proj) is not supported")
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported")
        rope_parameters = dict(config.get("rope_parameters") or {})
        rope_theta = config.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or rope_parameters
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling_from_hf(scaling),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF-style config.json dict that ``from_hf`` reads back to an equal config."""
        out = dataclasses.asdict(self)
        del out["qk_norm"]
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **out["rope_scaling"]}
        return out


def rope_scaling_from_hf(scaling: Mapping[str, Any] | None) -> Llama3RopeScaling | None:
    """Parse an HF rope scaling dict; None / "default" mean plain RoPE."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: 'llama3'")
    return Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


@functools.lru_cache(maxsize=32)
def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """float64 [Dh/2]: the rotary angular frequency of each feature pair."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    # Wavelengths longer than the original context / low_freq_factor are slowed down by
    # `factor`; shorter than context / high_freq_factor are kept; in between, interpolate
    # linearly in (context / wavelength).
    context = scaling.original_max_position_embeddings
    periods_in_context = context * inv_freq / (2 * math.pi)
    blend = (periods_in_context - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blend = np.clip(blend, 0.0, 1.0)
    return (1.0 - blend) * inv_freq / scaling.factor + blend * inv_freq


class LlamaMLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = normal_param(rngs, (d, f), param_dtype)
        self.up_proj = normal_param(rngs, (d, f), param_dtype)
        self.down_proj = normal_param(rngs, (f, d), param_dtype)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = linear("...D,DF->...F", x, self.gate_proj, self.dtype)
        up = linear("...D,DF->...F", x, self.up_proj, self.dtype)
        return linear("...F,FD->...D", nnx.silu(gate) * up, self.down_proj, self.dtype)


class LlamaDecoderLayer(nnx.Module):
    """One pre-norm decoder layer, split around attention."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        d, dh = config.hidden_size, config.head_dim
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        norm = functools.partial(RMSNorm, eps=config.rms_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype)
        self.input_layernorm = norm(d)
        self.q_proj = normal_param(rngs, (d, hq, dh), param_dtype)
        self.k_proj = normal_param(rngs, (d, hkv, dh), param_dtype)
        self.v_proj = normal_param(rngs, (d, hkv, dh), param_dtype)
        self.o_proj = normal_param(rngs, (hq, dh, d), param_dtype)
        if config.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((hq, dh), param_dtype))
            self.k_bias = nnx.Param(jnp.zeros((hkv, dh), param_dtype))
            self.v_bias = nnx.Param(jnp.zeros((hkv, dh), param_dtype))
        if config.qk_norm:
            self.q_norm = norm(dh)
            self.k_norm = norm(dh)
        self.post_attention_layernorm = norm(d)
        self.mlp = LlamaMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.config = config
        self.dtype = dtype

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        out = linear("...D,DNH->...NH", x, getattr(self, f"{name}_proj"), self.dtype)
        if self.config.attention_bias:
            out = out + getattr(self, f"{name}_bias")[...].astype(self.dtype)
        return out

    def rotary_tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE tables (``kernels.rotary``) of ``positions [..., T]``, ``[..., T, Dh]`` float32:
        the same for every layer."""
        return rotary_tables(positions, rope_inv_freq(self.config.head_dim,
                                                      self.config.rope_theta,
                                                      self.config.rope_scaling))

    def unrotated_attention_inputs(
        self, hidden: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """hidden [..., T, D] -> q [..., T, Hq, Dh], k, v [..., T, Hkv, Dh], before RoPE (for a
        kernel that rotates q and k itself)."""
        x = self.input_layernorm(hidden)
        q, k, v = (self._project(x, name) for name in ("q", "k", "v"))
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attention_inputs(
        self, hidden: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """hidden [..., T, D], positions [..., T] -> q [..., T, Hq, Dh], k, v [..., T, Hkv, Dh]."""
        q, k, v = self.unrotated_attention_inputs(hidden)
        tables = self.rotary_tables(positions)
        return rotate(q, tables), rotate(k, tables), v

    def attention_outputs(self, hidden: jax.Array, attn: jax.Array) -> jax.Array:
        """hidden [..., T, D] (the layer's input residual), attn [..., T, Hq, Dh] -> [..., T, D]."""
        o = linear("...NH,NHD->...D", attn, self.o_proj, self.dtype)
        hidden = hidden.astype(self.dtype) + o
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """Per-layer dense K/V: ``k``, ``v`` are [L, B, S, Hkv, Dh]; slot p holds position p."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(cls, config: LlamaConfig, batch: int, max_len: int, dtype: Any) -> DenseKVCache:
        shape = (config.num_hidden_layers, batch, max_len, config.num_key_value_heads,
                 config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def _write_slots(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [B, S, ...] with new [B, T, ...] written at slots ``positions``; p < 0 is dropped."""
    num_slots = cache.shape[1]
    slots = jnp.where(positions >= 0, positions, num_slots)
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")


class LlamaForCausalLM(CausalLMBase):
    """Decoder-only causal LM; see the module docstring for the stage interface."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.attention_scale = 1.0 / math.sqrt(config.head_dim)
        self.init_embedding(param_dtype, rngs)
        self.layers = nnx.List([
            LlamaDecoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            for _ in range(config.num_hidden_layers)
        ])
        self.init_head(param_dtype, rngs)

    def __call__(
        self, token_ids: jax.Array, positions: jax.Array, cache: DenseKVCache
    ) -> tuple[jax.Array, DenseKVCache]:
        """token_ids, positions int32 [B, T] -> (float32 logits [B, T, V], updated cache)."""
        mask = cache_causal_mask(positions, cache.k.shape[2])
        hidden = self.embed(token_ids)
        k_cache, v_cache = cache.k, cache.v
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention_inputs(hidden, positions)
            k_cache = k_cache.at[i].set(_write_slots(k_cache[i], k, positions))
            v_cache = v_cache.at[i].set(_write_slots(v_cache[i], v, positions))
            attn = masked_attention(q, k_cache[i], v_cache[i], mask, scale=self.attention_scale)
            hidden = layer.attention_outputs(hidden, attn)
        return self.head(hidden), DenseKVCache(k=k_cache, v=v_cache)

    @staticmethod
    def hf_weight_map(config: LlamaConfig) -> dict[str, HFWeight]:
        """HF tensor name -> where it goes in the NNX state and how its layout changes."""
        d, dh, f, vocab = (config.hidden_size, config.head_dim, config.intermediate_size,
                           config.vocab_size)
        hq, hkv = config.num_attention_heads, config.num_key_value_heads

        def heads_in(num_heads: int) -> Transform:  # [N*Dh, D] -> [D, N, Dh]
            return lambda w: w.reshape(num_heads, dh, d).transpose(2, 0, 1)

        def heads_bias(num_heads: int) -> Transform:  # [N*Dh] -> [N, Dh]
            return lambda b: b.reshape(num_heads, dh)

        def heads_out(w: np.ndarray) -> np.ndarray:  # [D, Hq*Dh] -> [Hq, Dh, D]
            return w.reshape(d, hq, dh).transpose(1, 2, 0)

        mapping = {
            "model.embed_tokens.weight": HFWeight(("embed_tokens",), (vocab, d), _identity),
            "model.norm.weight": HFWeight(("norm", "weight"), (d,), _identity),
        }
        if not config.tie_word_embeddings:
            mapping["lm_head.weight"] = HFWeight(("lm_head",), (vocab, d), np.transpose)
        for i in range(config.num_hidden_layers):
            hf, path = f"model.layers.{i}.", ("layers", i)
            attn = hf + "self_attn."
            mapping.update({
                hf + "input_layernorm.weight": HFWeight(
                    path + ("input_layernorm", "weight"), (d,), _identity),
                hf + "post_attention_layernorm.weight": HFWeight(
                    path + ("post_attention_layernorm", "weight"), (d,), _identity),
                attn + "q_proj.weight": HFWeight(path + ("q_proj",), (hq * dh, d), heads_in(hq)),
                attn + "k_proj.weight": HFWeight(path + ("k_proj",), (hkv * dh, d), heads_in(hkv)),
                attn + "v_proj.weight": HFWeight(path + ("v_proj",), (hkv * dh, d), heads_in(hkv)),
                attn + "o_proj.weight": HFWeight(path + ("o_proj",), (d, hq * dh), heads_out),
                hf + "mlp.gate_proj.weight": HFWeight(path + ("mlp", "gate_proj"), (f, d),
                                                      np.transpose),
                hf + "mlp.up_proj.weight": HFWeight(path + ("mlp", "up_proj"), (f, d),
                                                    np.transpose),
                hf + "mlp.down_proj.weight": HFWeight(path + ("mlp", "down_proj"), (d, f),
                                                      np.transpose),
            })
            if config.attention_bias:
                for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
                    mapping[attn + f"{name}_proj.bias"] = HFWeight(
                        path + (f"{name}_bias",), (heads * dh,), heads_bias(heads))
            if config.qk_norm:
                for name in ("q_norm", "k_norm"):
                    mapping[attn + f"{name}.weight"] = HFWeight(
                        path + (name, "weight"), (dh,), _identity)
        return mapping
