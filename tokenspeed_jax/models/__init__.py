"""Model families and checkpoint loading.

Each family lives in its own folder (``llama/``, ``kimi_linear/``) and declares itself in one
``Family`` (``family.py``); ``registry`` maps a checkpoint's ``model_type`` to its family. Layers
that several families use (``layers``, ``mla``, ``moe``) sit here beside the loader.

The loader (and with it gguf and orbax) is imported on first use of ``load_model`` /
``LoadedModel``, so importing a model definition stays cheap.
"""

from typing import Any

from tokenspeed_jax.models.llama import DenseKVCache, LlamaConfig, LlamaForCausalLM

__all__ = ["DenseKVCache", "LlamaConfig", "LlamaForCausalLM", "LoadedModel", "load_model"]


def __getattr__(name: str) -> Any:
    if name in ("LoadedModel", "load_model"):
        from tokenspeed_jax.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
