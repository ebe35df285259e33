"""The DeepSeek-V3 family (``model_type`` ``deepseek_v3``, and ``kimi_k2``: the same backbone).

One module per job: ``config`` (the config.json and what is refused), ``rope`` (plain / yarn
rotary tables and the softmax scale), ``model`` (the layers, the stage interface and the plain
forwards over dense or paged latent caches), ``weights`` (checkpoint names and loading),
``sharding`` (the tensor-parallel split check) and ``family`` (the declaration the registry
serves: the latent forward, ``models/kimi_linear/forward.py``, with no recurrent state).

What a runner needs from the family: the cache is one latent page pool per layer,
``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` in the cache dtype (``latent_pages``),
slots addressed like the paged KV cache; every layer has the same break, the latent attention
between ``attention_inputs`` and ``mla_outputs``; the plain forwards compute a step's rotary
tables once (``rope``) for every layer, the segmented runner's ``mla_inputs(hidden, positions)``
in each layer's segment.
"""

from tokenspeed_jax.models.deepseek_v3.config import MODEL_TYPES, DeepseekV3Config, YarnScaling
from tokenspeed_jax.models.deepseek_v3.model import (
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    dense_caches,
    latent_pages,
)
from tokenspeed_jax.models.deepseek_v3.weights import build_model, hf_weight_map, load_hf

__all__ = [
    "MODEL_TYPES",
    "DeepseekV3Config",
    "DeepseekV3DecoderLayer",
    "DeepseekV3ForCausalLM",
    "YarnScaling",
    "build_model",
    "dense_caches",
    "hf_weight_map",
    "latent_pages",
    "load_hf",
]
