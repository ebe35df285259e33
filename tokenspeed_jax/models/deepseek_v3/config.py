"""DeepSeek-V3 architecture settings, read from a checkpoint's config.json.

Invariants:

* ``model_type`` is ``deepseek_v3`` or ``kimi_k2`` (Kimi-K2 checkpoints declare their own type for
  the same backbone); anything the forward does not implement is a ValueError naming the key and
  its value, never a silent approximation: KV heads other than the attention heads, biases on the
  attention projections, a router other than sigmoid scores with ``noaux_tc`` grouped top-k, MoE
  layers other than every layer from ``first_k_dense_replace`` on, an activation other than SiLU,
  quantized weights, rope types other than plain and yarn, partial rotary.
* A key the config.json leaves out takes transformers' ``DeepseekV3Config`` default, so a config
  means the same model here and there.
* Rope settings are read from ``rope_parameters`` (transformers >= 5) or the older top-level
  ``rope_theta`` with ``rope_scaling`` (the published checkpoints); both give equal configs.
  ``to_hf`` writes a dict ``from_hf`` reads back to an equal config.
* ``num_nextn_predict_layers`` (multi-token prediction) is kept only so the loader can skip those
  layers' tensors; the model never builds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tokenspeed_jax.models.mla import MLAModelShape

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
DEFAULT_ROPE_THETA = 10000.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """Yarn rope scaling (``"rope_type": "yarn"``), field names as in the checkpoint."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(MLAModelShape):
    """Architecture hyper-parameters, named as in a DeepSeek-V3 config.json."""

    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    model_type: str = MODEL_TYPES[0]

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not one of {MODEL_TYPES}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in "
                             f"[0, {self.num_hidden_layers}]")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.n_shared_experts < 1:
            raise ValueError(f"n_shared_experts={self.n_shared_experts} is not supported "
                             f"(at least one shared expert)")
        per_group = self.n_routed_experts // max(self.n_group, 1)
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.n_routed_experts} must be a multiple of "
                             f"n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if not 1 <= self.num_experts_per_tok <= per_group * self.topk_group:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                             f"{per_group * self.topk_group}] (the experts of topk_group groups)")
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers={self.num_nextn_predict_layers} < 0")

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache row: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def router_settings(self) -> dict[str, Any]:
        """The routed experts' settings under ``moe.KimiMoE``'s argument names (the same router:
        sigmoid scores, corrected choice, grouped top-k, renormalised and scaled weights)."""
        return {"num_experts": self.n_routed_experts, "top_k": self.num_experts_per_tok,
                "num_groups": self.n_group, "topk_groups": self.topk_group,
                "num_shared": self.n_shared_experts, "renormalize": self.norm_topk_prob,
                "scaling": self.routed_scaling_factor}

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DeepseekV3Config:
        """Build from a checkpoint config.json dict (see the module invariants)."""
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not one of {MODEL_TYPES}")
        _check_supported(config)
        return cls(
            **MLAModelShape.fields_from_hf(config),
            n_routed_experts=int(config["n_routed_experts"]),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            n_shared_experts=int(config.get("n_shared_experts", 1) or 0),
            n_group=int(config.get("n_group", 8)),
            topk_group=int(config.get("topk_group", 4)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
            first_k_dense_replace=int(config.get("first_k_dense_replace", 3)),
            num_nextn_predict_layers=int(config.get("num_nextn_predict_layers") or 0),
            rope_theta=_rope_theta(config),
            rope_scaling=_yarn_from_hf(config),
            rope_interleave=bool(config.get("rope_interleave", True)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            model_type=model_type,
        )

    def to_hf(self) -> dict[str, Any]:
        """A checkpoint-format config.json dict that ``from_hf`` reads back to an equal config."""
        out = dataclasses.asdict(self)
        out["num_key_value_heads"] = self.num_attention_heads
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"type": "yarn", **out["rope_scaling"]}
        return out


def _check_supported(config: Mapping[str, Any]) -> None:
    """Refuse the settings the forward does not implement (module invariants)."""
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    expected = {
        "num_key_value_heads": (kv_heads, heads),
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "scoring_func": (config.get("scoring_func", "sigmoid"), "sigmoid"),
        "topk_method": (config.get("topk_method", "noaux_tc"), "noaux_tc"),
        "moe_layer_freq": (config.get("moe_layer_freq", 1), 1),
        "attention_bias": (bool(config.get("attention_bias", False)), False),
    }
    for key, (value, supported) in expected.items():
        if value != supported:
            raise ValueError(f"{key}={value!r} is not supported (only {supported!r})")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"quantization_config (quant_method={method!r}) is not supported; "
                         f"load a checkpoint with unquantized weights")


def _rope_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def _rope_theta(config: Mapping[str, Any]) -> float:
    return float(config.get("rope_theta") or _rope_dict(config).get("rope_theta")
                 or DEFAULT_ROPE_THETA)


def _yarn_from_hf(config: Mapping[str, Any]) -> YarnScaling | None:
    """The yarn settings of a config, None for plain rope; other rope types are refused."""
    params = _rope_dict(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: 'default', 'yarn'")
    original = int(params.get("original_max_position_embeddings")
                   or config["max_position_embeddings"])
    factor = params.get("factor") or int(config["max_position_embeddings"]) / original
    optional = {key: float(params[key]) for key in ("mscale", "mscale_all_dim", "attention_factor")
                if params.get(key) is not None}
    return YarnScaling(
        factor=float(factor), original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)), **optional)
