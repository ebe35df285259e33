"""DeepSeek-V3 checkpoints: the weight map from the published safetensors names, and loading.

Invariants:

* ``hf_weight_map`` is the one place that converts checkpoint names and ``[out, in]`` layouts;
  per-expert tensors (``mlp.experts.<e>.{gate,up,down}_proj``) are stacked into the ``[E, ...]``
  parameters ``w1`` / ``w3`` / ``w2``; the attention block's names and the ``rope_interleave``
  reordering are ``mla.mla_weight_entries``.
* Loading checks both directions, like the other families: a tensor nobody uses and a parameter
  the checkpoint never fills are errors naming the tensor. The one exception is the multi-token
  prediction layers, ``model.layers.<i>.`` for ``num_hidden_layers <= i < num_hidden_layers +
  num_nextn_predict_layers``: their tensors are skipped, with one log line saying how many.
* Router weights and the correction bias stay float32 whatever the weight dtype.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.models import hf_checkpoint
from tokenspeed_jax.models.deepseek_v3.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek_v3.model import DeepseekV3ForCausalLM
from tokenspeed_jax.models.hf_checkpoint import WeightEntry as Weight
from tokenspeed_jax.models.layers import SHAPE_ONLY
from tokenspeed_jax.models.mla import mla_weight_entries

logger = logging.getLogger(__name__)
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
EXPERT_PROJECTIONS = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def _swiglu_entries(prefix: str, path: tuple, hidden: int, inner: int) -> dict[str, Weight]:
    return {
        prefix + "gate_proj.weight": Weight(path + ("gate_proj",), (inner, hidden), np.transpose),
        prefix + "up_proj.weight": Weight(path + ("up_proj",), (inner, hidden), np.transpose),
        prefix + "down_proj.weight": Weight(path + ("down_proj",), (hidden, inner), np.transpose),
    }


def hf_weight_map(config: DeepseekV3Config) -> dict[str, Weight]:
    """Checkpoint tensor name -> where it goes in the NNX state and how its layout changes."""
    d, vocab = config.hidden_size, config.vocab_size
    mapping = {
        "model.embed_tokens.weight": Weight(("embed_tokens",), (vocab, d), np.asarray),
        "model.norm.weight": Weight(("norm", "weight"), (d,), np.asarray),
    }
    if not config.tie_word_embeddings:
        mapping["lm_head.weight"] = Weight(("lm_head",), (vocab, d), np.transpose)
    for i in range(config.num_hidden_layers):
        hf, path = f"model.layers.{i}.", ("layers", i)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            mapping[hf + norm + ".weight"] = Weight(path + (norm, "weight"), (d,), np.asarray)
        attention = mla_weight_entries(hf + "self_attn.", path + ("self_attn",), config,
                                       rope_interleave=config.rope_interleave)
        mapping.update({name: Weight(*entry) for name, entry in attention.items()})
        mlp, mp = hf + "mlp.", path + ("mlp",)
        if i < config.first_k_dense_replace:
            mapping.update(_swiglu_entries(mlp, mp, d, config.intermediate_size))
            continue
        experts, f = config.n_routed_experts, config.moe_intermediate_size
        mapping[mlp + "gate.weight"] = Weight(mp + ("gate",), (experts, d), np.transpose)
        mapping[mlp + "gate.e_score_correction_bias"] = Weight(
            mp + ("e_score_correction_bias",), (experts,), np.asarray)
        for e in range(experts):
            for name, param in EXPERT_PROJECTIONS:
                shape = (d, f) if name == "down_proj" else (f, d)
                mapping[mlp + f"experts.{e}.{name}.weight"] = Weight(
                    mp + (param,), shape, np.transpose, e)
        mapping.update(_swiglu_entries(mlp + "shared_experts.", mp + ("shared_experts",), d,
                                       f * config.n_shared_experts))
    return mapping


def is_mtp_tensor(name: str, config: DeepseekV3Config) -> bool:
    """A tensor of a multi-token prediction layer (module invariants)."""
    match = LAYER_NAME.match(name)
    return match is not None and (config.num_hidden_layers <= int(match.group(1))
                                  < config.num_hidden_layers + config.num_nextn_predict_layers)


def abstract_model(config: DeepseekV3Config, dtype: Any) -> DeepseekV3ForCausalLM:
    """The model's structure with ShapeDtypeStruct leaves; nothing allocated."""
    return nnx.eval_shape(
        lambda: DeepseekV3ForCausalLM(config, dtype=dtype, param_dtype=dtype, rngs=SHAPE_ONLY))


def build_model(config: DeepseekV3Config, tensors: Iterable[tuple[str, np.ndarray]], *,
                dtype: Any = jnp.float32, source: str = "checkpoint") -> DeepseekV3ForCausalLM:
    """Fill an abstract model from (checkpoint name, array) pairs; see the module invariants."""
    graphdef, state = nnx.split(abstract_model(config, dtype))
    skipped: list[str] = []

    def ignored(name: str) -> bool:
        if is_mtp_tensor(name, config):
            skipped.append(name)
            return True
        return name.endswith("rotary_emb.inv_freq")

    hf_checkpoint.fill_state(state, hf_weight_map(config), tensors, source=source,
                             model_type=config.model_type, ignored=ignored,
                             place=lambda path, value, dtype: jnp.asarray(value, dtype))
    if skipped:
        logger.info("%s: skipped %d tensors of %d multi-token prediction layer(s) "
                    "(num_nextn_predict_layers)", source, len(skipped),
                    config.num_nextn_predict_layers)
    return nnx.merge(graphdef, state)


def load_hf(path: str | os.PathLike, dtype: Any = jnp.float32
            ) -> tuple[DeepseekV3Config, DeepseekV3ForCausalLM]:
    """Config and model of a DeepSeek-V3 / Kimi-K2 HF directory, weights in ``dtype``."""
    root = Path(path)
    config_json = hf_checkpoint.read_json(root / "config.json")
    if not isinstance(config_json, dict):
        raise TypeError(f"{root / 'config.json'}: expected a JSON object")
    config = DeepseekV3Config.from_hf(config_json)
    model = build_model(config, hf_checkpoint.iter_hf_tensors(root), dtype=dtype,
                        source=str(root))
    return config, model
