"""The Llama family (Llama 3, Qwen2, Qwen3, SmolLM2): the model (``model``), its GGUF reader
(``gguf``), its tensor-parallel rules (``sharding``) and its declaration (``family.FAMILY``).

Importing the package gives the model's public names and nothing heavier; the registry imports
the declaration.
"""

from tokenspeed_jax.models.llama.model import (
    SUPPORTED_MODEL_TYPES,
    DenseKVCache,
    HFWeight,
    Llama3RopeScaling,
    LlamaConfig,
    LlamaForCausalLM,
    rope_inv_freq,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "DenseKVCache", "HFWeight", "Llama3RopeScaling",
           "LlamaConfig", "LlamaForCausalLM", "rope_inv_freq"]
