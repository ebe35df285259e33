"""tokenspeed_jax: a JAX/XLA LLM inference engine built on a segmented ahead-of-time compile.

Public names: ``LLM`` (load a model, generate, chat, score), ``EngineConfig`` (its options, which
``LLM`` takes as keyword arguments), ``SamplingParams`` and ``Completion``.
Submodules are imported lazily so that ``import tokenspeed_jax`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "tokenspeed_jax.llm",
    "EngineConfig": "tokenspeed_jax.config",
    "SamplingParams": "tokenspeed_jax.sampling_params",
    "Completion": "tokenspeed_jax.outputs",
}

__all__ = ["LLM", "Completion", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenspeed_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
